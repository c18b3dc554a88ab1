"""The KDA kernels ``vxc::kda_prefill`` / ``vxc::kda_step``: the torch twin (chunked prefill, recurrent step)
against a naive fp64 recurrence written here from the math and against transformers 5.24's own KDA
functions; prefill continuation and step chains; Triton against the twin (Triton's CPU interpreter here,
compiled on CUDA); the operator declaration's regions.

Triton on CPU needs TRITON_INTERPRET=1 before triton's kernels are decorated. This module sets it when it
is imported first; when another module imported the kernels without it, the Triton cases run in a fresh
process instead (tests/triton_support.py).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.triton_support import triton_case as triton_case_for  # noqa: E402

from vxc.codegen import kernels  # noqa: E402
from vxc.codegen.kernels.triton_common import INTERPRETED  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = torch.cuda.is_available() or INTERPRETED
ops = torch.ops.vxc


def inputs(T, H, D, seed=0, dtype=torch.float32, device="cpu", state_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale)  # noqa: E731
    q, k, v = r(T, H, D), r(T, H, D), r(T, H, D)
    f, b = r(T, H * D), r(T, H)
    A_log = torch.empty(H).uniform_(math.log(0.05), math.log(2.0), generator=g)
    dt_bias = r(H * D, scale=0.5)
    S0 = r(H, D, D, scale=state_scale)
    cast = lambda x: x.to(dtype).to(device)  # noqa: E731
    return [cast(x) for x in (q, k, v, f, b)] + [A_log.to(device), dt_bias.to(device), S0.to(device)]


def naive(q, k, v, f, b, A_log, dt_bias, S0, scale, eps=1e-6):
    """The recurrence, one token and one head at a time, in fp64."""
    q, k, v, f, b, A_log, dt_bias, S = (x.double() for x in (q, k, v, f, b, A_log, dt_bias, S0))
    S = S.clone()
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            x = f[t, h * D:(h + 1) * D] + dt_bias[h * D:(h + 1) * D]
            sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
            decay = torch.exp(-torch.exp(A_log[h]) * sp)  # one per key channel
            beta = 1 / (1 + torch.exp(-b[t, h]))
            qn = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + eps) * scale
            kn = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + eps)
            S[h] = decay[:, None] * S[h]
            u = beta * (v[t, h] - S[h].T @ kn)
            S[h] = S[h] + torch.outer(kn, u)
            out[t, h] = S[h].T @ qn
    return out, S


TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_twin_prefill_against_naive(chunk):
    T, H, D = 37, 3, 12
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=1)
    want, want_S = naive(q, k, v, f, b, A, dtb, S0, D ** -0.5)
    S = S0.clone()
    got = ops.kda_prefill(q, k, v, f, b, A, dtb, S, D ** -0.5, 1e-6, chunk)
    torch.testing.assert_close(got.double(), want, **TOL)
    torch.testing.assert_close(S.double(), want_S, **TOL)


def test_twin_step_chain_and_continuation():
    T, H, D = 23, 2, 10
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=2)
    S_full = S0.clone()
    full = ops.kda_prefill(q, k, v, f, b, A, dtb, S_full, D ** -0.5, 1e-6, 8)
    S = S0.clone()
    head = ops.kda_prefill(q[:9], k[:9], v[:9], f[:9], b[:9], A, dtb, S, D ** -0.5, 1e-6, 8)
    tail = [ops.kda_step(q[t], k[t], v[t], f[t], b[t], A, dtb, S, D ** -0.5, 1e-6) for t in range(9, T)]
    torch.testing.assert_close(torch.cat([head, torch.stack(tail)]), full, **TOL)
    torch.testing.assert_close(S, S_full, **TOL)


def test_twin_against_transformers_kda():
    """transformers' own chunked and recurrent KDA functions (the reference vxc is judged against)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention, recurrent_kimi_delta_attention,
    )

    T, H, D = 70, 2, 16
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=3)
    x = (f + dtb).reshape(T, H, D)
    g = -torch.exp(A)[:, None] * torch.where(x > 20, x, torch.log(1 + torch.exp(x)))
    beta = torch.sigmoid(b)
    ref_chunk, ref_S = chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
                                                  initial_state=S0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    S = S0.clone()
    got = ops.kda_prefill(q, k, v, f, b, A, dtb, S, D ** -0.5, 1e-6, 64)
    torch.testing.assert_close(got, ref_chunk[0], **TOL)
    torch.testing.assert_close(S, ref_S[0], **TOL)
    ref_step, ref_S1 = recurrent_kimi_delta_attention(q[None, :1], k[None, :1], v[None, :1], g[None, :1], beta[None, :1],
                                                      initial_state=S0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    S = S0.clone()
    got = ops.kda_step(q[0], k[0], v[0], f[0], b[0], A, dtb, S, D ** -0.5, 1e-6)
    torch.testing.assert_close(got, ref_step[0, 0], **TOL)
    torch.testing.assert_close(S, ref_S1[0], **TOL)


def _heads_alone(impls):
    """Tensor parallel: a rank holding heads [1, 3) of 4 passes their q, k, v, forget logits (H·D, head-major),
    beta logits, A_log, dt_bias and state rows: a prefill then a step give the whole run's output and state of
    those heads."""
    T, H, D, lo, hi = 7, 4, 8, 1, 3
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=7)
    mine = [q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], f[:, lo * D:hi * D], b[:, lo:hi], A[lo:hi], dtb[lo * D:hi * D],
            S0[lo:hi]]
    for impl in impls:
        outs, states = [], []
        for q_, k_, v_, f_, b_, A_, dtb_, S_ in ((q, k, v, f, b, A, dtb, S0), mine):
            x = [t.contiguous().to(DEVICE) for t in (q_, k_, v_, f_, b_, A_, dtb_)]
            state = S_.clone().contiguous().to(DEVICE)
            with kernels.backend(impl):
                o = ops.kda_prefill(*[t[:-1] for t in x[:5]], *x[5:], state, D ** -0.5, 1e-6, 4)
                o1 = ops.kda_step(*[t[-1] for t in x[:5]], *x[5:], state, D ** -0.5, 1e-6)
            outs.append(torch.cat([o, o1[None]]).cpu())
            states.append(state.cpu())
        torch.testing.assert_close(outs[1], outs[0][:, lo:hi], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(states[1], states[0][lo:hi], rtol=1e-6, atol=1e-6)


def test_a_run_of_heads_alone():
    from vxc.codegen.kernels import native

    _heads_alone(["torch"] + (["native"] if native.available() else []))


def test_fakes_and_schema():
    from torch.library import opcheck

    T, H, D = 5, 2, 6
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=4)
    checks = ("test_schema", "test_faketensor")
    opcheck(ops.kda_prefill.default, (q, k, v, f, b, A, dtb, S0.clone(), D ** -0.5, 1e-6, 4), test_utils=checks)
    opcheck(ops.kda_step.default, (q[0], k[0], v[0], f[0], b[0], A, dtb, S0.clone(), D ** -0.5, 1e-6), test_utils=checks)


def test_bad_shapes_are_refused():
    q, k, v, f, b, A, dtb, S0 = inputs(4, 2, 6, seed=5)
    with pytest.raises(ValueError, match="state"):
        ops.kda_prefill(q, k, v, f, b, A, dtb, S0[:, :5], 6 ** -0.5, 1e-6, 4)


def test_declaration_regions():
    """Declared state: the matrix [H, D, D] fixed fp32, three conv histories [H·D, k] in the compute dtype."""
    from vxc.ir.operators import OPERATORS

    a = {"d_model": 40, "heads": 3, "head_dim": 12, "conv_kernel": 4}
    got = [(r.name, r.kind, r.shape(a), r.precision, r.growth) for r in OPERATORS["kda"].regions]
    assert got == [("delta", "recurrent", (3, 12, 12), "f32", "fixed"), ("conv_q", "conv_history", (36, 4), "compute", "fixed"),
                   ("conv_k", "conv_history", (36, 4), "compute", "fixed"), ("conv_v", "conv_history", (36, 4), "compute", "fixed")]


# ------------------------------------------------------------------------------------------------ Triton

triton_case = triton_case_for(TRITON_HERE)


@triton_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(19, 3, 12), (6, 2, 40)])  # D = 40: two value blocks, a padded key block
def test_triton_triton_prefill_and_step(shape, dtype):
    T, H, D = shape
    q, k, v, f, b, A, dtb, S0 = inputs(T, H, D, seed=6, dtype=dtype, device=DEVICE)
    S_tw, S_tr = S0.clone(), S0.clone()
    want = ops.kda_prefill(*[x.cpu() for x in (q, k, v, f, b, A, dtb)], S_tw_cpu := S0.cpu().clone(), D ** -0.5, 1e-6, 8)
    with kernels.backend("triton"):
        got = ops.kda_prefill(q, k, v, f, b, A, dtb, S_tr, D ** -0.5, 1e-6, 8)
        got1 = ops.kda_step(q[0], k[0], v[0], f[0], b[0], A, dtb, S_tw, D ** -0.5, 1e-6)
    tol = TOL if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    assert got.dtype == dtype and S_tr.dtype == torch.float32
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    torch.testing.assert_close(S_tr.cpu(), S_tw_cpu, **TOL)
    S1 = S0.cpu().clone()
    want1 = ops.kda_step(*[x.cpu() for x in (q[0], k[0], v[0], f[0], b[0], A, dtb)], S1, D ** -0.5, 1e-6)
    torch.testing.assert_close(got1.cpu().float(), want1.float(), **tol)
    torch.testing.assert_close(S_tw.cpu(), S1, **TOL)


@triton_case
def test_triton_a_run_of_heads_alone():
    _heads_alone(["triton"])
