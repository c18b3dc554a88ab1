"""The MLA kernels ``vxc::mla_prefill`` (expanded over the cached latent rows) and ``vxc::mla_decode``
(absorbed: attention directly on the latent rows): against a naive fp64 expanded attention written here
with transformers 5.24's own rotary functions; absorbed == expanded; the latent rows' contents and
order per declared rotary layout; Triton against the twin (interpreter on CPU, compiled on CUDA); the
operator declaration's region and rules.
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
from vxc.codegen.kernels import mla as M  # noqa: E402,F401  (registers the ops)
from vxc.codegen.kernels.triton_common import INTERPRETED  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = torch.cuda.is_available() or INTERPRETED
ops = torch.ops.vxc

# R latent rank, P rope dims, N nope dims, V value dims; H heads; S cache rows
H, R, P, N, V, S = 3, 20, 6, 10, 14, 48
SCALE = 0.29
LAYOUTS = [("half", "in_place"), ("interleaved", "in_place"), ("interleaved", "split"), ("none", "in_place")]


def tables(n, base=100.0):
    inv = 1.0 / base ** (torch.arange(0, P, 2).float() / P)
    fr = torch.outer(torch.arange(n).float(), inv)
    return fr.cos(), fr.sin()


def data(T, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, N + P, generator=g)
    kv = torch.randn(T, R + P, generator=g)
    w = 1 + 0.3 * torch.randn(R, generator=g)
    wkvb = 0.3 * torch.randn(H * (N + V), R, generator=g)
    cast = lambda x: x.to(dtype).to(device)  # noqa: E731
    return cast(q), cast(kv), cast(w), cast(wkvb)


def call(op, q, kv, w, wkvb, cache, start, layout, out_order):
    cos, sin = tables(S)
    rope = layout != "none"
    T = q.shape[0]
    c, s = (cos[start:start + T].to(q.device), sin[start:start + T].to(q.device)) if rope else (None, None)
    return op(q, kv, w, 1e-6, wkvb, c, s, cache, start, SCALE, N, layout == "interleaved", out_order == "split")


def naive(q, kv, w, wkvb, layout):
    """Expanded MLA over all positions 0..T-1 in fp64, rotating with transformers' DeepSeek-V3 functions."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

    q, kv, w, wkvb = (x.double() for x in (q, kv, w, wkvb))
    T = q.shape[0]
    c = kv[:, :R]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    k_pe = kv[:, R:]
    q_nope, q_pe = q[..., :N], q[..., N:]
    if layout != "none":
        cos, sin = (torch.cat([x, x], -1)[:T].double()[None] for x in tables(S))  # [1, T, P]
        fn = apply_rotary_pos_emb_interleave if layout == "interleaved" else apply_rotary_pos_emb
        qr, kr = fn(q_pe.transpose(0, 1)[None], k_pe[None, None], cos, sin)  # [1, H, T, P], [1, 1, T, P]
        q_pe, k_pe = qr[0].transpose(0, 1), kr[0, 0]
    out = torch.zeros(T, H, V, dtype=torch.float64)
    W = wkvb.reshape(H, N + V, R)
    for h in range(H):
        k_nope = c @ W[h, :N].T  # [T, N]
        v = c @ W[h, N:].T
        logits = (q_nope[:, h] @ k_nope.T + q_pe[:, h] @ k_pe.T) * SCALE
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        out[:, h] = logits.softmax(-1) @ v
    return out, torch.cat([c, k_pe], -1)


TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,out_order", LAYOUTS)
def test_expanded_and_absorbed_against_naive(layout, out_order):
    """Prefill 0..12 then 13..30 (expanded, reading the rows of the first call), and the same with the
    absorbed kernel for the second call and token by token: all equal the naive expanded attention."""
    T, k = 31, 13
    q, kv, w, wkvb = data(T, seed=1)
    if out_order == "split" or layout != "interleaved":
        want, want_rows = naive(q, kv, w, wkvb, layout)
    else:  # in-place interleaved: same scores as split, rows hold each pair where it was
        want, split_rows = naive(q, kv, w, wkvb, layout)
        pe = split_rows[:, R:]
        want_rows = torch.cat([split_rows[:, :R], torch.stack([pe[:, :P // 2], pe[:, P // 2:]], -1).flatten(-2)], -1)
    for second in (ops.mla_prefill, ops.mla_decode):
        cache = torch.zeros(S, R + P)
        a = call(ops.mla_prefill, q[:k], kv[:k], w, wkvb, cache, 0, layout, out_order)
        b = call(second, q[k:], kv[k:], w, wkvb, cache, k, layout, out_order)
        torch.testing.assert_close(torch.cat([a, b]).double(), want, **TOL)
        torch.testing.assert_close(cache[:T].double(), want_rows, **TOL)
        assert not cache[T:].any()
    cache = torch.zeros(S, R + P)
    steps = [call(ops.mla_decode, q[t:t + 1], kv[t:t + 1], w, wkvb, cache, t, layout, out_order) for t in range(T)]
    torch.testing.assert_close(torch.cat(steps).double(), want, **TOL)


def test_absorbed_equals_expanded_on_the_same_rows():
    """One decode token after a long prefix: absorbed and expanded read the same latent rows."""
    q, kv, w, wkvb = data(40, seed=2)
    outs = []
    for op in (ops.mla_prefill, ops.mla_decode):
        cache = torch.zeros(S, R + P)
        call(ops.mla_prefill, q[:39], kv[:39], w, wkvb, cache, 0, "interleaved", "split")
        outs.append(call(op, q[39:], kv[39:], w, wkvb, cache, 39, "interleaved", "split"))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def _heads_alone(impls):
    """Tensor parallel: a rank holding heads [1, 3) of 3 passes q's heads and kv_b's rows of them (head-major: per
    head k_nope then v). After a prefill of 8 rows, a prefill and an absorbed decode of one more token: each impl
    gives the whole run's output of those heads (the absorbed query and output per held head) and the same latent
    rows."""
    lo, hi, k = 1, 3, 8
    q, kv, w, wkvb = data(k + 1, seed=6)
    mine = (q[:, lo:hi].contiguous(), wkvb[lo * (N + V):hi * (N + V)])
    for impl in impls:
        for second in (ops.mla_prefill, ops.mla_decode):
            outs, caches = [], []
            for qq, ww in ((q, wkvb), mine):
                cache = torch.zeros(S, R + P, device=DEVICE)
                qq, kv_, w_, ww = (x.to(DEVICE) for x in (qq, kv, w, ww))
                with kernels.backend(impl):
                    call(ops.mla_prefill, qq[:k], kv_[:k], w_, ww, cache, 0, "interleaved", "split")
                    outs.append(call(second, qq[k:], kv_[k:], w_, ww, cache, k, "interleaved", "split").cpu())
                caches.append(cache.cpu())
            assert torch.equal(caches[1], caches[0]), impl
            torch.testing.assert_close(outs[1], outs[0][:, lo:hi], rtol=1e-6, atol=1e-6)


def test_a_run_of_heads_alone():
    from vxc.codegen.kernels import native

    _heads_alone(["torch"] + (["native"] if native.available() else []))


def test_fakes_and_schema():
    from torch.library import opcheck

    q, kv, w, wkvb = data(5, seed=3)
    cos, sin = tables(5)
    checks = ("test_schema", "test_faketensor")
    for op in (ops.mla_prefill, ops.mla_decode):
        opcheck(op.default, (q, kv, w, 1e-6, wkvb, cos, sin, torch.zeros(S, R + P), 0, SCALE, N, True, True), test_utils=checks)


def test_bad_shapes_are_refused():
    q, kv, w, wkvb = data(5, seed=4)
    with pytest.raises(ValueError, match="latent rows"):
        ops.mla_prefill(q, kv, w, 1e-6, wkvb, None, None, torch.zeros(S, R + P + 1), 0, SCALE, N, False, False)
    with pytest.raises(ValueError, match="do not fit"):
        ops.mla_decode(q, kv, w, 1e-6, wkvb, None, None, torch.zeros(S, R + P), S - 2, SCALE, N, False, False)


def test_declaration_region_and_rules():
    from vxc.ir.module import Op
    from vxc.ir.operators import OPERATORS
    from vxc.passes.findings import Finding
    from vxc.passes.verify import _check_op

    decl = OPERATORS["mla"]
    a = {"d_model": 7168, "heads": 128, "q_lora": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "norm_eps": 1e-6, "scale": 192 ** -0.5, "rotary_dim": 64,
         "rotary_base": 10000.0, "rotary_layout": "interleaved", "rope_type": "default", "rotary_output": "split"}
    assert [(r.name, r.kind, r.shape(a), r.growth) for r in decl.regions] == [("latent", "latent_rows", (576,), "per_token")]
    for bad, message in (({"rotary_layout": "none"}, "rotary_layout must be none exactly when rotary_dim is 0"),
                         ({"rope_mscale_all_dim": 1.0, "rope_factor": 40.0}, "with rope_mscale_all_dim declared")):
        out: list[Finding] = []
        _check_op(Op("mla", {**a, **bad}), "mixer", 0, out)
        assert [f.code for f in out] == ["inconsistent-attributes"] and message in out[0].message


# ------------------------------------------------------------------------------------------------ Triton

triton_case = triton_case_for(TRITON_HERE)


@triton_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,out_order", LAYOUTS)
def test_triton_triton_against_twin(layout, out_order, dtype):
    T, k = 37, 21  # the absorbed kernel walks 16-row blocks: several, the last partial
    q, kv, w, wkvb = data(T, seed=5, dtype=dtype)
    tol = TOL if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    ref_cache = torch.zeros(S, R + P, dtype=dtype)
    ref = torch.cat([call(ops.mla_prefill, q[:k], kv[:k], w, wkvb, ref_cache, 0, layout, out_order),
                     call(ops.mla_prefill, q[k:], kv[k:], w, wkvb, ref_cache, k, layout, out_order)])
    dev = [x.to(DEVICE) for x in (q, kv, w, wkvb)]
    for second in (ops.mla_prefill, ops.mla_decode):
        cache = torch.zeros(S, R + P, dtype=dtype, device=DEVICE)
        with kernels.backend("triton"):
            a = call(ops.mla_prefill, dev[0][:k], dev[1][:k], dev[2], dev[3], cache, 0, layout, out_order)
            b = call(second, dev[0][k:], dev[1][k:], dev[2], dev[3], cache, k, layout, out_order)
        got = torch.cat([a, b]).cpu()
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref.float(), **tol)
        torch.testing.assert_close(cache.cpu().float(), ref_cache.float(), **tol)


@triton_case
def test_triton_a_run_of_heads_alone():
    _heads_alone(["triton"])
