"""qwen3_moe: Qwen3 attention + a softmax → top-k → renormalise MoE (and a dense SwiGLU layer), against
transformers 5.24's Qwen3MoeForCausalLM at the numerical floor, with the selected experts identical at every
token; the hub dialect and the fused expert spelling lower to the same program.

The helpers at the top (reference loading, the router taps, the parity measurement with expert selection)
serve test_gpt_oss.py too. Every expected number is written here from the miniature's geometry, never read
from vxc's declarations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from tests import builders as B
from tests import references as R
from tests.runtime import parity_table as P

# ------------------------------------------------------------------------------ shared helpers


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_reference(mdir: Path, family: P.Family, **load_kw) -> P.Reference:
    """transformers at fp32 and fp64 (the MoE experts switched to the eager loop, which takes fp64)."""
    import transformers

    ref = P.Reference.__new__(P.Reference)
    ref.f = family
    ref.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32, **load_kw).eval()
    m64 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32, **load_kw)
    m64.set_experts_implementation("eager")
    ref.m64 = m64.double().eval()
    return ref


class RouterTap(TorchDispatchMode):
    """Records the selected experts [T, k] of every ``vxc::moe_router`` call (test-only observation)."""

    def __init__(self):
        super().__init__()
        self.selected: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.vxc.moe_router.default:
            self.selected.append(out[1].detach().cpu().clone())
        return out


def vxc_selection(engine, ids: list[int]) -> list[torch.Tensor]:
    from vxc.runtime.session import Session

    s = Session(engine)
    with RouterTap() as tap:
        s.prefill(ids)
    return tap.selected


@torch.no_grad()
def reference_selection(model, ids: list[int], router_of) -> tuple[list[torch.Tensor], float]:
    """Per MoE layer the reference router's selected experts [T, k], and the smallest gap between the k-th and
    (k+1)-th routing score over all tokens and layers (how far every selection is from a tie)."""
    picked, gaps, hooks = [], [], []
    for layer in model.model.layers:
        r = router_of(layer)
        if r is None:
            continue

        def hook(mod, inp, out):
            logits, _, idx = out
            picked.append(idx.detach().clone())
            s = torch.sort(logits.float(), dim=-1, descending=True).values
            k = idx.shape[-1]
            gaps.append(float((s[:, k - 1] - s[:, k]).min()))

        hooks.append(r.register_forward_hook(hook))
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return picked, min(gaps)


@dataclass
class MoeParity:
    parity: P.Parity
    layers: int  # MoE layers compared
    tokens: int  # positions compared per layer
    selection_match: bool
    selection_match_fp64: bool
    min_gap: float

    def row(self) -> dict:
        r = self.parity.row()
        r.update(moe_layers=self.layers, tokens=self.tokens, expert_selection=self.selection_match,
                 expert_selection_fp64=self.selection_match_fp64, min_router_gap=self.min_gap)
        return r


def measure_moe(family: P.Family, mdir: Path, ir: Path, router_of, **load_kw) -> MoeParity:
    ref = load_reference(mdir, family, **load_kw)
    engine = P.engine_for(ir, max_context=256)
    par = P.measure(family, mdir, ir, ref=ref, engine=engine)
    seq = P.prompt_ids(family) + par.greedy_vxc  # the prompt and the whole greedy continuation
    got = vxc_selection(P.engine_for(ir, max_context=256), seq)
    want, gap = reference_selection(ref.m32, seq, router_of)
    want64, _ = reference_selection(ref.m64, seq, router_of)

    def same(a, b):
        return len(a) == len(b) and all(
            x.shape == y.shape and all(set(u.tolist()) == set(v.tolist()) for u, v in zip(x, y)) for x, y in zip(a, b))

    return MoeParity(par, len(want), len(seq), same(got, want), same(got, want64), gap)


def print_row(m: MoeParity) -> str:
    r = m.row()
    return (f"{r['family']}: max-abs {r['max_abs']:.2e} (vs fp64 {r['max_abs_vs_fp64']:.2e}), floor {r['floor']:.2e}, "
            f"tol {r['tol']:.2e}, argmax {100 * r['argmax']:.1f}%, excluded {r['excluded']}/{r['positions']}, "
            f"greedy {'match' if r['greedy_match'] else 'DIFFER'} ({r['distinct']} distinct), "
            f"experts {'identical' if r['expert_selection'] else 'DIFFER'} at {r['tokens']} tokens × {r['moe_layers']} "
            f"MoE layers (min router gap {r['min_router_gap']:.2e})")


def assert_at_floor(m: MoeParity) -> None:
    p = m.parity
    assert 0.0 < p.fp32_vs_fp64 < 1e-3 and 0.0 < p.full_vs_step < 1e-3
    assert p.max_abs_logit > 4.0 and p.tol < 1e-3
    assert p.err <= p.tol, f"vxc vs reference fp32 {p.err:.3e} > tol {p.tol:.3e}"
    assert p.err64 <= p.tol, f"vxc vs reference fp64 {p.err64:.3e} > tol {p.tol:.3e}"
    assert p.argmax == 1.0 and p.excluded <= 2
    assert p.greedy_vxc == p.greedy_ref and p.distinct >= P.MIN_DISTINCT
    assert p.err_step <= p.tol and p.err_step_ref <= p.tol
    assert p.deterministic
    assert m.selection_match, "vxc's router chose other experts than the reference's at some token"
    assert m.selection_match_fp64
    assert m.min_gap > 10 * p.tol  # no selection is a near-tie (the margin rule of the argmax check)


def lowered_text(mdir: Path) -> str:
    from vxc.frontends import lower
    from vxc.ir import print_module
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    m = lower(mdir, relative_to=mdir.parent)
    ctx = PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(m, model_dir=mdir))
    return print_module(ctx.module)


def program_lines(text: str) -> list[str]:
    """The executable program: layers, operators, norms and states — not sources, facts, tensors or operands."""
    keep = ("layer ", "mixer ", "ffn ", "norm ", "state ", "embedding", "final_norm", "head ", "}")
    return [line.strip() for line in text.splitlines() if line.strip().startswith(keep)]


def copy_model(src: Path, dst: Path, cfg_edit=None, tensors_edit=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg = cfg_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    sd = load_file(str(src / "model.safetensors"))
    if tensors_edit:
        sd = tensors_edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


# ------------------------------------------------------------------------------ qwen3_moe

# Miniature: hidden 56, 4 heads × 18 (q 72, k/v 36), 3 layers, layer 1 dense (SwiGLU 88), layers 0 and 2
# MoE: 10 experts of width 40, top-3, renormalised; vocab 131.
VOCAB, E, TOP_K, I_MOE, I_DENSE, D, H, KV, HD = 131, 10, 3, 40, 88, 56, 4, 2, 18
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=I_DENSE, moe_intermediate_size=I_MOE, num_hidden_layers=3,
            num_attention_heads=H, num_key_value_heads=KV, head_dim=HD, num_experts=E, num_experts_per_tok=TOP_K,
            norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEED = 31
FAMILY = P.Family("qwen3_moe", lambda d: B.build_hf(d, "qwen3_moe", MINI, seed=SEED), "hf", VOCAB, VOCAB)


def qwen3_router(layer):
    return getattr(layer.mlp, "gate", None) if hasattr(layer.mlp, "experts") else None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    return P.build(FAMILY, root)


@pytest.fixture(scope="module")
def parity(built):
    mdir, ir = built
    return measure_moe(FAMILY, mdir, ir, qwen3_router)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.native
def test_decode_replay(built, dtype):
    """The softmax top-k router and the experts run natively for one token: the decode step is replayed
    bit-identically to the graph."""
    from tests.wave2.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built[0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 12, seed=4), dtype)


def test_program(built):
    mdir, ir = built
    text = ir.read_text()
    prog = program_lines(text)
    ffn = [line.split()[1] for line in prog if line.startswith("ffn ")]
    assert ffn == ["moe", "swiglu", "moe"]
    moe = next(line for line in prog if line.startswith("ffn moe"))
    for want in (f"experts={E}", f"top_k={TOP_K}", f"intermediate={I_MOE}", "router=softmax_topk", "norm_topk_prob=true",
                 "expert_layout=separate", "act=silu", "shared_experts=false"):
        assert want in moe, want
    assert f"swiglu d_model={D} intermediate={I_DENSE}" in text
    # per-expert keys folded into one bank entry per role: 3 roles × 2 MoE layers
    banks = [line for line in text.splitlines() if " bank " in line]
    assert len(banks) == 6 and all(f"experts {E} @w0 0..{E - 1}" in line for line in banks)
    assert f'f32[{I_MOE},{D}] bank "model.layers.0.mlp.experts.{{e}}.gate_proj.weight"' in text
    assert 'fact experts_read_from "one tensor per expert' in text
    assert "fact experts_count_read_from num_local_experts" in text
    assert prog.count(f"state kv kv_rows [2,{KV},{HD}] compute per_token") == 3


def test_parity_at_floor_with_identical_expert_selection(parity, capsys):
    with capsys.disabled():
        print("\n" + print_row(parity))
    assert_at_floor(parity)
    assert parity.layers == 2 and parity.tokens == 48 + 32


def test_hub_dialect_and_fused_experts_lower_to_the_same_program(built, tmp_path):
    mdir, _ = built

    def hub(cfg):
        cfg = dict(cfg)
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["rope_scaling"] = None
        cfg["num_experts"] = cfg.pop("num_local_experts")
        return cfg

    def fuse(sd):
        out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
        for i in (0, 2):
            p = f"model.layers.{i}.mlp.experts."
            g = torch.stack([sd[f"{p}{e}.gate_proj.weight"] for e in range(E)])
            u = torch.stack([sd[f"{p}{e}.up_proj.weight"] for e in range(E)])
            out[p + "gate_up_proj"] = torch.cat([g, u], dim=1).contiguous()
            out[p + "down_proj"] = torch.stack([sd[f"{p}{e}.down_proj.weight"] for e in range(E)]).contiguous()
        return out

    base = lowered_text(mdir)
    hub_text = lowered_text(copy_model(mdir, tmp_path / "hub", cfg_edit=hub))
    fused_dir = copy_model(mdir, tmp_path / "fused", tensors_edit=fuse)
    fused_text = lowered_text(fused_dir)
    # the same values; only which of them were filled from a default differs with the spelling
    assert [x.replace(" (default)", "") for x in program_lines(hub_text)] == [x.replace(" (default)", "") for x in program_lines(base)]
    assert program_lines(fused_text) == program_lines(base)
    assert "fact rope_read_from rope_parameters" in base and 'fact rope_read_from "rope_theta/rope_scaling"' in hub_text
    assert "fact experts_count_read_from num_experts" in hub_text
    assert 'source frontend "transformers" dialect "qwen3_moe (hub)"' in hub_text
    assert "fused gate_up_proj" in fused_text and "slice" in fused_text
    # the fused spelling binds the same weights: every operand the engines hold is bit-identical (the claim is
    # about binding, so it is checked on the weights; the logits of two engines need not be bit-equal, since a
    # GEMM's rounding may depend on its operands' memory alignment), and computes logits within the floor
    from vxc.driver import lower_to_file
    from vxc.runtime.session import Session

    ea = P.engine_for(lower_to_file(mdir, tmp_path / "a.vxir") and tmp_path / "a.vxir", max_context=64)
    eb = P.engine_for(lower_to_file(fused_dir, tmp_path / "b.vxir") and tmp_path / "b.vxir", max_context=64)
    wa = {n: t for n, t in ea.root.named_buffers() if n.startswith("w_")}
    wb = {n: t for n, t in eb.root.named_buffers() if n.startswith("w_")}
    assert wa.keys() == wb.keys() and any("Expert" in n for n in wa)
    for n in wa:
        assert wa[n].dtype == wb[n].dtype and torch.equal(wa[n], wb[n]), n
    ids = P.prompt_ids(FAMILY)[:20]
    ref = load_reference(mdir, FAMILY)
    with torch.no_grad():
        r32, r64 = (ref.m32(torch.tensor([ids])).logits[0], ref.m64(torch.tensor([ids])).logits[0])
    tol = R.floor_and_tolerance(r32, r64, r32)["tol"]
    la, lb = Session(ea).prefill(ids), Session(eb).prefill(ids)
    assert float((la.double() - lb.double()).abs().max()) <= tol
    assert float((lb[:, : r64.shape[-1]].double() - r64).abs().max()) <= tol


def test_sliding_window_dialect_is_refused(built, tmp_path):
    from vxc.frontends import lower
    from vxc.frontends.common import FrontendError

    mdir, _ = built
    d = copy_model(mdir, tmp_path / "sw", cfg_edit=lambda c: {**c, "use_sliding_window": True, "sliding_window": 16})
    with pytest.raises(FrontendError, match="use_sliding_window"):
        lower(d)
