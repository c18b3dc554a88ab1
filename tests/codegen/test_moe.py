"""The MoE kernels and the ``moe`` block lowering.

(a) The router torch twin against transformers 5.24's own router modules (qwen3_moe softmax → top-k with and
    without renormalisation, deepseek_v3 sigmoid + selection bias + grouped top-k × routed scaling, gpt_oss
    top-k on biased logits → softmax) and the expert twin against transformers' eager expert modules (qwen3_moe
    SwiGLU banks bound as separate gate/up slices of the fused in-memory bank; gpt_oss clamped GLU with
    biases, its input-major bank seen through a transpose), the references in fp64, the twins computing in fp32;
(b) every Triton kernel against its twin (CPU: Triton's interpreter, in a subprocess if this process imported
    triton without TRITON_INTERPRET);
(c) MXFP4: a test quantiser's blocks/scales decoded by vxc equal transformers' dequantisation;
(d) the ``moe`` block lowers to router / experts / shared groups that execute through an fx graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import references as R  # noqa: E402
from tests.families.moe_support import quantise_mxfp4  # noqa: E402

from vxc.codegen import kernels  # noqa: E402
from vxc.codegen.kernels import moe  # noqa: E402
from vxc.codegen.kernels.triton_common import INTERPRETED  # noqa: E402

ops = torch.ops.vxc
TRITON_IN_PROCESS = torch.cuda.is_available() or INTERPRETED
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _eager(cfg):
    cfg._experts_implementation = "eager"
    return cfg


# ------------------------------------------------------------------------------ (a) twins vs transformers


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_topk_router_matches_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=40, num_experts=11, num_experts_per_tok=3, norm_topk_prob=norm)
    r = Qwen3MoeTopKRouter(cfg).double()
    torch.nn.init.normal_(r.weight, std=0.5)
    x = torch.randn(9, 40, dtype=torch.float64)
    _, w_ref, i_ref = r(x)
    w, i = ops.moe_router(x, r.weight, None, None, "softmax_topk", 3, norm, 1.0, 1, 1)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_sigmoid_grouped_router_matches_deepseek_v3(n_group, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=40, n_routed_experts=16, num_experts_per_tok=3, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
    r = DeepseekV3TopkRouter(cfg).double()
    torch.nn.init.normal_(r.weight, std=0.3)
    r.e_score_correction_bias.copy_(torch.randn(16, dtype=torch.float64) * 0.2)
    x = torch.randn(9, 40, dtype=torch.float64)
    _, w_ref, i_ref = r(x)
    w, i = ops.moe_router(x, r.weight, None, r.e_score_correction_bias, "sigmoid_grouped", 3, True, 2.5,
                          n_group, topk_group)
    # the reference leaves the k slots unsorted: compare per token as (expert → weight) maps
    for t in range(x.shape[0]):
        ref = dict(zip(i_ref[t].tolist(), w_ref[t].tolist()))
        got = dict(zip(i[t].tolist(), w[t].tolist()))
        assert set(got) == set(ref), t
        for e in ref:
            assert got[e] == pytest.approx(ref[e], rel=1e-6)


def test_topk_softmax_router_matches_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=40, num_local_experts=10, num_experts_per_tok=4)
    r = GptOssTopKRouter(cfg).double()
    torch.nn.init.normal_(r.weight, std=0.5)
    torch.nn.init.normal_(r.bias, std=0.5)
    x = torch.randn(9, 40, dtype=torch.float64)
    _, w_ref, i_ref = r(x)
    w, i = ops.moe_router(x, r.weight, r.bias, None, "topk_softmax", 4, False, 1.0, 1, 1)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_swiglu_experts_match_qwen3_moe_banks_as_slices():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, d, I, k = 7, 40, 24, 3
    ex = Qwen3MoeExperts(_eager(Qwen3MoeConfig(hidden_size=d, num_experts=E, moe_intermediate_size=I))).double()
    torch.nn.init.normal_(ex.gate_up_proj, std=0.2)
    torch.nn.init.normal_(ex.down_proj, std=0.2)
    x = torch.randn(6, d, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(6)])
    w = torch.rand(6, k, dtype=torch.float64)
    ref = ex(x, idx, w)
    gate, up = ex.gate_up_proj[:, :I], ex.gate_up_proj[:, I:]  # the separate layout through slice views
    got = ops.moe_experts(x, w, idx, gate, up, ex.down_proj, None, None, "separate", "silu", None, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the twin computes in fp32


@torch.no_grad()
def test_bf16_experts_and_shared_track_the_bf16_reference():
    """In a bf16 run the expert and shared-expert GEMMs run at bf16 on the bf16 banks (no fp32 copy of an expert
    per call): against the fp64 result on the same bf16 weights, vxc's error is of the size transformers' own bf16
    experts make (the reference module run in bf16), not larger."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, d, I, k, T = 7, 72, 40, 3, 9
    ex = Qwen3MoeExperts(_eager(Qwen3MoeConfig(hidden_size=d, num_experts=E, moe_intermediate_size=I)))
    torch.nn.init.normal_(ex.gate_up_proj, std=0.2)
    torch.nn.init.normal_(ex.down_proj, std=0.2)
    ex = ex.bfloat16()
    x = torch.randn(T, d).bfloat16()
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k).bfloat16()
    exact = Qwen3MoeExperts(_eager(Qwen3MoeConfig(hidden_size=d, num_experts=E, moe_intermediate_size=I))).double()
    exact.load_state_dict({n: p.double() for n, p in ex.state_dict().items()})
    want = exact(x.double(), idx, w.double())
    ref_err = float((ex(x, idx, w).double() - want).abs().max())
    gate, up = ex.gate_up_proj[:, :I], ex.gate_up_proj[:, I:]
    got = ops.moe_experts(x, w, idx, gate, up, ex.down_proj, None, None, "separate", "silu", None, None)
    assert got.dtype == torch.bfloat16
    err = float((got.double() - want).abs().max())
    assert 0 < err <= 2 * ref_err, (err, ref_err)

    g, u, dn = (ex.gate_up_proj[0, :I], ex.gate_up_proj[0, I:], ex.down_proj[0])
    routed = torch.randn(T, d).bfloat16()
    shared = torch.nn.functional.silu(x.double() @ g.double().T) * (x.double() @ u.double().T) @ dn.double().T
    got = ops.moe_shared(x, routed, g, u, dn, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), routed.double() + shared, rtol=2e-2, atol=2e-2 * float(shared.abs().max()))


@torch.no_grad()
def test_clamped_glu_experts_match_gpt_oss_input_major_bank():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    E, d, I, k = 6, 40, 24, 2
    ex = GptOssExperts(_eager(GptOssConfig(hidden_size=d, num_local_experts=E, intermediate_size=I))).double()
    for p in (ex.gate_up_proj, ex.down_proj):
        torch.nn.init.normal_(p, std=0.8)  # large enough that the ±7 clamps bite
    for p in (ex.gate_up_proj_bias, ex.down_proj_bias):
        torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(6, d, dtype=torch.float64) * 2
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(6)])
    w = torch.rand(6, k, dtype=torch.float64)
    ref = ex(x, idx, w)
    gu = (x @ ex.gate_up_proj[0] + ex.gate_up_proj_bias[0]).detach()
    assert float(gu[:, 0::2].max()) > 7.0 and float(gu[:, 1::2].abs().max()) > 7.0  # the clamps are exercised
    got = ops.moe_experts(x, w, idx, ex.gate_up_proj.transpose(1, 2), None, ex.down_proj.transpose(1, 2),
                          ex.gate_up_proj_bias, ex.down_proj_bias, "fused_interleaved", "clamped_glu", 1.702, 7.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the twin computes in fp32


def test_shared_expert_matches_qwen3_next_branch():
    x = torch.randn(5, 40, dtype=torch.float64)
    routed = torch.randn(5, 40, dtype=torch.float64)
    g, u, dn, bg = (torch.randn(*s, dtype=torch.float64) * 0.3 for s in ((24, 40), (24, 40), (40, 24), (1, 40)))
    shared = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ dn.T
    fp32 = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.moe_shared(x, routed, g, u, dn, bg), routed + torch.sigmoid(x @ bg.T) * shared, **fp32)
    torch.testing.assert_close(ops.moe_shared(x, routed, g, u, dn, None), routed + shared, **fp32)


def test_refusals():
    x, W = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="router"):
        ops.moe_router(x, W, None, None, "softmax", 2, False, 1.0, 1, 1)
    with pytest.raises(ValueError, match="geometry"):
        ops.moe_router(x, W, None, None, "sigmoid_grouped", 2, False, 1.0, 4, 1)
    with pytest.raises(ValueError, match="clamped_glu"):
        ops.moe_experts(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), torch.randn(6, 8, 8), None,
                        torch.randn(6, 8, 4), None, None, "fused_interleaved", "clamped_glu", None, None)


# ------------------------------------------------------------------------------ (c) MXFP4


def test_mxfp4_decode_equals_transformers_dequantisation():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 64) * torch.logspace(-3, 2, 40)[None, :, None]
    blocks, scales = quantise_mxfp4(w)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    from vxc.runtime.views import decode_mxfp4

    got = decode_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(got, ref.transpose(1, 2))
    assert (got - w).abs().max() <= w.abs().amax(-1, keepdim=True).max() / 4  # a quantiser, not a copy
    assert torch.equal(decode_mxfp4(blocks, scales, torch.bfloat16), got.to(torch.bfloat16))


# ------------------------------------------------------------------------------ (b) Triton vs twin


_TRITON_TESTS: list[str] = []


def triton_test(test):
    _TRITON_TESTS.append(test.__name__)
    if TRITON_IN_PROCESS:
        return test

    def in_subprocess(triton_subprocess):
        run = triton_subprocess
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

    in_subprocess.__name__ = test.__name__
    return in_subprocess


@pytest.fixture(scope="module")
def triton_subprocess():
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", " or ".join(_TRITON_TESTS)]
    return subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True)


def _tri(op, *args):
    with kernels.backend("triton"):
        return op(*args)


ROUTER_CASES = [  # router, top_k, norm, scaling, n_group, topk_group, bias, selection bias
    ("softmax_topk", 3, True, 1.0, 1, 1, False, False),
    ("softmax_topk", 4, False, 1.0, 1, 1, False, False),
    ("sigmoid_grouped", 3, True, 2.5, 4, 2, False, True),
    ("sigmoid_grouped", 2, False, 1.0, 1, 1, False, False),
    ("topk_softmax", 4, False, 1.0, 1, 1, True, False),
]


@triton_test
def test_triton_router():
    for r, k, norm, sc, ng, tg, has_b, has_s in ROUTER_CASES:
        for E in (12, 20):
            x, W = torch.randn(7, 72, device=DEVICE), torch.randn(E, 72, device=DEVICE) * 0.3
            b = torch.randn(E, device=DEVICE) if has_b else None
            s = torch.randn(E, device=DEVICE) * 0.3 if has_s else None
            w0, i0 = moe.router_twin(x, W, b, s, r, k, norm, sc, ng, tg)
            w1, i1 = _tri(ops.moe_router, x, W, b, s, r, k, norm, sc, ng, tg)
            assert torch.equal(i0, i1), (r, E)
            torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


def _r(*s):
    return torch.randn(*s, device=DEVICE) * 0.3


def _expert_cases(T, d, E, I, k):
    """Tokens, their top-k experts and weights, and two bank cases: separate SiLU, fused clamped GLU with biases."""
    x = torch.randn(T, d, device=DEVICE)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, device=DEVICE)
    cases = [(_r(E, I, d), _r(E, I, d), None, None, "separate", "silu", None, None),
             (_r(E, 2 * I, d) * 4, None, _r(E, 2 * I), _r(E, d), "fused_interleaved", "clamped_glu", 1.702, 7.0)]
    return x, idx, w, cases


@triton_test
def test_triton_experts_and_shared():
    T, d, E, I, k = 5, 72, 9, 40, 3
    x, idx, w, cases = _expert_cases(T, d, E, I, k)
    r = _r
    for w_in, w_up, b_in, b_dn, layout, act, al, lim in cases:
        wd = r(E, d, I)
        y0 = moe.experts_twin(x, w, idx, w_in, w_up, wd, b_in, b_dn, layout, act, al, lim)
        y1 = _tri(ops.moe_experts, x, w, idx, w_in, w_up, wd, b_in, b_dn, layout, act, al, lim)
        exact = R.experts_fp64(x, w, idx, w_in, w_up, wd, b_in, b_dn, layout, act, al, lim)
        R.assert_kernel_at_floor(y1, y0, exact, f"moe_experts {layout}/{act}")
    args = (x, r(T, d), r(I, d), r(I, d), r(d, I), r(1, d))
    R.assert_kernel_at_floor(_tri(ops.moe_shared, *args), moe.shared_twin(*args), R.shared_fp64(*args), "moe_shared")


@triton_test
def test_triton_experts_hold_a_range():
    """Tensor parallel: banks holding experts [lo, lo + 4) of 12 (``expert_offset`` lo) add only the selected experts
    they hold — twin and Triton against fp64 over the whole bank with the other slots' weights zeroed — and the
    three ranks' parts add up to the whole bank's result."""
    T, d, E, I, k = 6, 72, 12, 40, 3
    x, idx, w, cases = _expert_cases(T, d, E, I, k)
    for w_in, w_up, b_in, b_dn, layout, act, al, lim in cases:
        wd = _r(E, d, I)
        whole = (x, w, idx, w_in, w_up, wd, b_in, b_dn, layout, act, al, lim)
        parts = []
        for lo in (0, 4, 8):
            held = lambda t: None if t is None else t[lo:lo + 4]  # noqa: E731
            args = (x, w, idx, held(w_in), held(w_up), held(wd), held(b_in), held(b_dn), layout, act, al, lim, lo)
            y0, y1 = moe.experts_twin(*args), _tri(ops.moe_experts, *args)
            mine = w * ((idx >= lo) & (idx < lo + 4))
            exact = R.experts_fp64(x, mine, idx, w_in, w_up, wd, b_in, b_dn, layout, act, al, lim)
            R.assert_kernel_at_floor(y1, y0, exact, f"moe_experts {layout}/{act} experts {lo}..{lo + 3}")
            assert exact.abs().max() > 0
            parts.append(y0)
        R.assert_kernel_at_floor(sum(parts), moe.experts_twin(*whole), R.experts_fp64(*whole), f"moe_experts {layout} parts")


def test_shared_expert_split_over_ranks_adds_up():
    """The shared expert split like a SwiGLU (gate/up rows, down columns) under its whole branch gate: the ranks'
    partial outputs (the routed partial sums added on each) add up to the whole shared expert plus the routed sum."""
    T, d, S, n = 4, 40, 24, 3
    x, bg = torch.randn(T, d), torch.randn(1, d) * 0.3
    g, u, dn = torch.randn(S, d) * 0.3, torch.randn(S, d) * 0.3, torch.randn(d, S) * 0.3
    routed = [torch.randn(T, d) for _ in range(n)]
    c = S // n
    got = sum(ops.moe_shared(x, routed[i], g[i * c:(i + 1) * c], u[i * c:(i + 1) * c], dn[:, i * c:(i + 1) * c], bg)
              for i in range(n))
    want = R.shared_fp64(x, sum(routed), g, u, dn, bg)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ (d) block lowering


def test_moe_block_lowers_and_executes():
    """A hand-made plan op (roles + attributes only) → router / experts / shared groups → an fx graph."""
    from types import SimpleNamespace

    from vxc.codegen.fxgen import build_graph_module, buffer_name
    from vxc.codegen.lower import LOWERINGS as BLOCKS, Emitter as _Emitter, Val, Weight
    from vxc.ir.roles import Role
    from vxc.passes.plan import PlanOp

    from vxc.codegen import lower  # noqa: F401  (registers moe)

    E, d, I, S = 8, 24, 16, 12
    attrs = {"d_model": d, "experts": E, "top_k": 2, "intermediate": I, "router": "sigmoid_grouped",
             "norm_topk_prob": True, "routed_scaling": 1.5, "n_group": 2, "topk_group": 1, "router_bias": False,
             "selection_bias": True, "expert_layout": "separate", "expert_bias": False, "act": "silu",
             "shared_experts": True, "shared_intermediate": S, "shared_gate": True}
    shapes = {Role.MoeRouterWeight: (E, d), Role.MoeRouterSelectionBias: (E,), Role.PerExpertGate: (E, I, d),
              Role.PerExpertUp: (E, I, d), Role.PerExpertDown: (E, d, I), Role.SharedExpertGate: (S, d),
              Role.SharedExpertUp: (S, d), Role.SharedExpertDown: (d, S), Role.SharedExpertBranchGate: (1, d)}
    p = PlanOp("l0.ffn", "moe", 0, 0, attrs, {r: SimpleNamespace(sym=f"l0.{r}") for r in shapes}, slot="ffn")
    e = _Emitter("prefill")
    x = Val("tokens")
    out = BLOCKS["moe"](e, p, x)
    e.out.output = out.name
    assert [c.kernel for c in e.out.groups()] == ["moe_router", "moe_experts", "moe_shared"]
    root = torch.nn.Module()
    weights = {r: torch.randn(*s) * 0.3 for r, s in shapes.items()}
    for r, t in weights.items():
        root.register_buffer(buffer_name(Weight(f"l0.{r}")), t)
    gm = build_graph_module(e.out, root)
    h = torch.randn(5, d)
    got = gm(h, 0)
    W = weights
    rw, ri = moe.router_twin(h, W[Role.MoeRouterWeight], None, W[Role.MoeRouterSelectionBias], "sigmoid_grouped",
                             2, True, 1.5, 2, 1)
    routed = moe.experts_twin(h, rw, ri, W[Role.PerExpertGate], W[Role.PerExpertUp], W[Role.PerExpertDown], None,
                              None, "separate", "silu", None, None)
    want = moe.shared_twin(h, routed, W[Role.SharedExpertGate], W[Role.SharedExpertUp], W[Role.SharedExpertDown],
                           W[Role.SharedExpertBranchGate])
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------ registration


def test_opcheck():
    """Schemas and fakes (the shapes torch.fx / torch.compile trace with), on the torch twins."""
    from torch.library import opcheck

    T, d, E, I, k = 4, 32, 6, 8, 2
    x = torch.randn(T, d)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    opcheck(ops.moe_router.default, (x, torch.randn(E, d), torch.randn(E), None, "topk_softmax", k, False, 1.0, 1, 1))
    opcheck(ops.moe_router.default, (x, torch.randn(E, d), None, torch.randn(E), "sigmoid_grouped", k, True, 2.0, 2, 1))
    opcheck(ops.moe_experts.default, (x, w, idx, torch.randn(E, I, d), torch.randn(E, I, d), torch.randn(E, d, I),
                                      None, None, "separate", "silu", None, None))
    opcheck(ops.moe_experts.default, (x, w, idx, torch.randn(E, 2 * I, d), None, torch.randn(E, d, I), torch.randn(E, 2 * I),
                                      torch.randn(E, d), "fused_interleaved", "clamped_glu", 1.702, 7.0))
    opcheck(ops.moe_shared.default, (x, torch.randn(T, d), torch.randn(I, d), torch.randn(I, d), torch.randn(d, I),
                                     torch.randn(1, d)))
