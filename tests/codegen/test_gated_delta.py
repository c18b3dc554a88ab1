"""The gated-delta kernels (``vxc/codegen/kernels/delta.py``): ``vxc::gated_delta_prefill`` (chunked, WY form),
``vxc::gated_delta_step`` (recurrent) and ``vxc::sigmoid_gate_mul``.

(a) the torch twins against a plain sequential oracle written here from the math (fp64, loops over heads
    and tokens), and against transformers 5.24's own ``torch_chunk_gated_delta_rule`` /
    ``torch_recurrent_gated_delta_rule``;
(b) prefill-then-steps equals one prefill, on the twin;
(c) the Triton kernels under ``TRITON_INTERPRET=1`` (a subprocess, so the interpreter mode is set before
    anything decorates a kernel) against the twins, at awkward shapes that need several chunks and
    several value blocks, in fp32 (tight) and bf16 (loose).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vxc.codegen import kernels  # noqa: F401  (registers torch.ops.vxc.*)

REPO = Path(__file__).resolve().parents[2]
ops = torch.ops.vxc


# ------------------------------------------------------------------ the oracle (independent of vxc)


def oracle(q, k, v, a, b, A_log, dt_bias, S0, scale, eps=1e-6):
    """The gated delta rule token by token, head by head, in fp64.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; a, b [T, Hv]; S0 [Hv, Dk, Dv]. Value head h reads key head h // (Hv/Hk).
    Returns (o [T, Hv, Dv], final state).
    """
    q, k, v, a, b, A_log, dt_bias, S = (x.double() for x in (q, k, v, a, b, A_log, dt_bias, S0))
    S = S.clone()
    T, Hk, _ = q.shape
    Hv = v.shape[1]
    out = torch.zeros(T, Hv, v.shape[2], dtype=torch.float64)
    for t in range(T):
        for h in range(Hv):
            kh = h // (Hv // Hk)
            qt = q[t, kh] / torch.sqrt((q[t, kh] ** 2).sum() + eps) * scale
            kt = k[t, kh] / torch.sqrt((k[t, kh] ** 2).sum() + eps)
            g = -math.exp(float(A_log[h])) * math.log1p(math.exp(float(a[t, h] + dt_bias[h])))
            beta = 1.0 / (1.0 + math.exp(-float(b[t, h])))
            S[h] = S[h] * math.exp(g)
            u = beta * (v[t, h] - S[h].T @ kt)
            S[h] = S[h] + torch.outer(kt, u)
            out[t, h] = S[h].T @ qt
    return out, S


def inputs(T, Hk, Hv, Dk, Dv, seed=0, dtype=torch.float32, state_scale=0.3):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    A_log = torch.empty(Hv).uniform_(math.log(0.05), math.log(16.0), generator=g).to(dtype)
    return dict(q=r(T, Hk, Dk), k=r(T, Hk, Dk), v=r(T, Hv, Dv), a=r(T, Hv, scale=1.5), b=r(T, Hv, scale=2.0),
                A_log=A_log, dt_bias=r(Hv, scale=0.5)), r(Hv, Dk, Dv, scale=state_scale).float()


def prefill(x, state, chunk=64):
    Dk = x["q"].shape[-1]
    return ops.gated_delta_prefill(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], state,
                                   Dk ** -0.5, 1e-6, chunk)


def step(x, t, state):
    Dk = x["q"].shape[-1]
    return ops.gated_delta_step(x["q"][t], x["k"][t], x["v"][t], x["a"][t], x["b"][t], x["A_log"], x["dt_bias"], state,
                                Dk ** -0.5, 1e-6)


SHAPES = [  # (T, Hk, Hv, Dk, Dv, chunk)
    (150, 3, 6, 12, 10, 64),  # three chunks, the last partial; Hv = 2 Hk
    (64, 2, 2, 9, 14, 64),  # exactly one chunk; Hv = Hk; Dk < Dv
    (37, 1, 3, 16, 8, 16),  # small chunks: three full, one of 5
    (1, 2, 4, 8, 6, 64),  # a single token through the chunked path
]


@pytest.mark.parametrize("T,Hk,Hv,Dk,Dv,chunk", SHAPES)
def test_twins_match_sequential_oracle(T, Hk, Hv, Dk, Dv, chunk):
    x, S0 = inputs(T, Hk, Hv, Dk, Dv, seed=T)
    want_o, want_S = oracle(**x, S0=S0, scale=Dk ** -0.5)
    S = S0.clone()
    o = prefill(x, S, chunk)
    assert o.dtype == torch.float32 and o.shape == (T, Hv, Dv) and S.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(S.double(), want_S, rtol=1e-5, atol=2e-6)
    S = S0.clone()
    o = torch.stack([step(x, t, S) for t in range(T)])
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(S.double(), want_S, rtol=1e-5, atol=2e-6)


def test_prefill_then_steps_equals_one_prefill():
    x, S0 = inputs(130, 2, 6, 12, 10, seed=7)
    S_full = S0.clone()
    full = prefill(x, S_full)
    S = S0.clone()
    first = {n: t[:70] for n, t in x.items() if t.dim() >= 2}
    rows = [prefill({**x, **first}, S)]
    rows += [step(x, t, S)[None] for t in range(70, 130)]
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(S, S_full, rtol=1e-5, atol=2e-6)


def test_twin_matches_transformers_rules():
    """transformers 5.24's torch fallbacks (the reference the miniatures are judged against) agree."""
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    x, S0 = inputs(150, 3, 6, 12, 10, seed=3)
    g = -x["A_log"].exp() * F.softplus(x["a"] + x["dt_bias"])
    beta = x["b"].sigmoid()
    kw = dict(g=g[None], beta=beta[None], initial_state=S0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_S = M.torch_chunk_gated_delta_rule(x["q"][None], x["k"][None], x["v"][None], chunk_size=64, **kw)
    S = S0.clone()
    o = prefill(x, S)
    torch.testing.assert_close(o, ref_o[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(S, ref_S[0], rtol=1e-5, atol=2e-6)
    kw["beta"], kw["g"] = beta[:1][None], g[:1][None]
    ref_o, ref_S = M.torch_recurrent_gated_delta_rule(x["q"][:1][None], x["k"][:1][None], x["v"][:1][None], **kw)
    S = S0.clone()
    torch.testing.assert_close(step(x, 0, S), ref_o[0, 0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(S, ref_S[0], rtol=1e-6, atol=1e-7)


def test_state_stays_fp32_with_bf16_inputs():
    x, S0 = inputs(70, 2, 4, 12, 10, seed=5, dtype=torch.bfloat16)
    want_o, want_S = oracle(**x, S0=S0, scale=12 ** -0.5)
    S = S0.clone()
    o = prefill(x, S)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(S.double(), want_S, rtol=1e-4, atol=1e-5)  # the state never rounds to bf16


def test_sigmoid_gate_mul():
    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(7, 30, generator=g), torch.randn(7, 30, generator=g) * 3
    torch.testing.assert_close(ops.sigmoid_gate_mul(x, gate), x * torch.sigmoid(gate))
    with pytest.raises(ValueError, match="must agree"):
        ops.sigmoid_gate_mul(x, gate[:, :29])


def test_refuses_mismatched_shapes():
    x, S0 = inputs(5, 2, 4, 12, 10)
    with pytest.raises(ValueError, match=r"state \[4, 10, 12\] is not \[Hv, Dk, Dv\]"):
        prefill(x, S0.transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match="not a multiple"):
        prefill({**x, "v": x["v"][:, :3], "a": x["a"][:, :3], "b": x["b"][:, :3],
                 "A_log": x["A_log"][:3], "dt_bias": x["dt_bias"][:3]}, S0[:3])


def test_opcheck():
    from torch.library import opcheck

    x, S0 = inputs(9, 1, 2, 8, 6)
    Dk = 8
    opcheck(ops.gated_delta_prefill.default,
            (x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], S0.clone(), Dk ** -0.5, 1e-6, 4),
            test_utils=("test_schema", "test_faketensor"))
    opcheck(ops.gated_delta_step.default,
            (x["q"][0], x["k"][0], x["v"][0], x["a"][0], x["b"][0], x["A_log"], x["dt_bias"], S0.clone(), Dk ** -0.5, 1e-6),
            test_utils=("test_schema", "test_faketensor"))
    opcheck(ops.sigmoid_gate_mul.default, (x["v"], x["v"] * 2), test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------ Triton (interpreter, subprocess)

TRITON_SCRIPT = r"""
import json, math, sys
import torch
sys.path.insert(0, sys.argv[1])
from vxc.codegen import kernels
from tests.codegen.test_gated_delta import inputs, oracle
ops = torch.ops.vxc
out = {}
def run(x, S, chunk, backend):
    with kernels.backend(backend):
        Dk = x["q"].shape[-1]
        o = ops.gated_delta_prefill(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], S, Dk ** -0.5, 1e-6, chunk)
        o1 = ops.gated_delta_step(x["q"][0], x["k"][0], x["v"][0], x["a"][0], x["b"][0], x["A_log"], x["dt_bias"], S, Dk ** -0.5, 1e-6)
    return o, o1, S
cases = {
    "three_chunks_two_vblocks": ((150, 3, 6, 12, 70, 64), torch.float32),  # Dv 70: two blocks of 64
    "chunk48_pow2_block": ((100, 2, 2, 20, 10, 48), torch.float32),  # BT 64 for a declared chunk of 48
    "short": ((5, 2, 4, 8, 6, 64), torch.float32),
    "bf16": ((80, 2, 4, 12, 10, 64), torch.bfloat16),
}
for name, (shape, dtype) in cases.items():
    T, Hk, Hv, Dk, Dv, chunk = shape
    x, S0 = inputs(T, Hk, Hv, Dk, Dv, seed=T, dtype=dtype)
    ot, st1, St = run(x, S0.clone(), chunk, "torch")
    oi, si1, Si = run(x, S0.clone(), chunk, "triton")
    want_o, want_S = oracle(**x, S0=S0, scale=Dk ** -0.5)
    out[name] = {"prefill": float((ot.double() - oi.double()).abs().max()), "step": float((st1.double() - si1.double()).abs().max()),
                 "state": float((St.double() - Si.double()).abs().max()), "state_dtype": str(Si.dtype),
                 "oracle": float((oi.double() - want_o).abs().max()),
                 "dtype": str(oi.dtype)}
g = torch.Generator().manual_seed(0)
xg, gg = torch.randn(5, 1300, generator=g), torch.randn(5, 1300, generator=g)
with kernels.backend("triton"):
    y = ops.sigmoid_gate_mul(xg, gg)
out["sigmoid_gate_mul"] = float((y - xg * torch.sigmoid(gg)).abs().max())
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def triton_results():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(REPO)], capture_output=True, text=True, env=env,
                       timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", ["three_chunks_two_vblocks", "chunk48_pow2_block", "short"])
def test_triton_matches_twin_fp32(case, triton_results):
    r = triton_results[case]
    assert r["dtype"] == "torch.float32" and r["state_dtype"] == "torch.float32"
    assert r["prefill"] < 2e-5 and r["step"] < 2e-5 and r["state"] < 2e-5, r
    assert r["oracle"] < 1e-5, r  # and the Triton prefill against the fp64 sequential oracle


def test_triton_matches_twin_bf16(triton_results):
    r = triton_results["bf16"]
    assert r["dtype"] == "torch.bfloat16" and r["state_dtype"] == "torch.float32"
    assert r["prefill"] < 5e-2 and r["step"] < 5e-2 and r["state"] < 1e-4, r


def test_triton_sigmoid_gate_mul(triton_results):
    assert triton_results["sigmoid_gate_mul"] < 1e-6
