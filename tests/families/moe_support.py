"""Helpers of the MoE family tests (qwen3_moe, gpt_oss): the transformers reference at fp32 and fp64, the
router taps, the parity measurement with expert selection, the lowering and checkpoint-copy helpers the
frontend halves use, and a test MXFP4 quantiser. Every expected number is written in the tests from the
miniature's geometry, never read from vxc's declarations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from tests.runtime import parity_table as P


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


def quantise_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A test quantiser: ``w [..., out, in]`` (in a multiple of 32) → (blocks u8 [..., out, in/32, 16], scales
    u8 [..., out, in/32]); per block the scale is the power of two that puts the largest |value| at ≤ 6, each
    value the nearest FP4 code."""
    from vxc.runtime.views import FP4_VALUES

    *lead, out, n = w.shape
    blocks = w.double().reshape(*lead, out, n // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, e)[..., None]
    table = torch.tensor(FP4_VALUES[:8], dtype=torch.float64)
    code = (scaled.abs()[..., None] - table).abs().argmin(-1)
    code = code + 8 * ((scaled < 0) & (code > 0)).long()
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (e + 127).to(torch.uint8)
