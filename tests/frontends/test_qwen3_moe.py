"""qwen3_moe lowering: Qwen3 attention + a softmax → top-k → renormalise MoE (and a dense SwiGLU layer) as
program lines; the hub dialect and the fused expert spelling lower to the same program (binding the same
weights); the sliding-window dialect is refused. Parity against transformers is in
tests/families/test_qwen3_moe.py. Every expected number is written here from the miniature's geometry, never
read from vxc's declarations.
"""

from __future__ import annotations

import pytest
import torch

from tests import references as R
from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.families.moe_support import copy_model, load_reference, lowered_text, program_lines
from tests.families.qwen3_moe_support import built  # noqa: F401  (fixture)
from tests.families.qwen3_moe_support import D, E, FAMILY, HD, I_DENSE, I_MOE, KV, TOP_K
from tests.runtime import parity_table as P


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
