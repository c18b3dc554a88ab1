"""Mixture-of-experts operators and bindings shared by the transformers MoE frontends: the grouped
sigmoid router with a selection-only bias and shared experts (``deepseek_v3``, ``kimi_linear``) and
the expert spellings of the softmax-routed families (``qwen3_moe``, ``qwen3_next``).
"""

from __future__ import annotations

from ..ir.module import Op, Transform
from ..ir.roles import Role
from .common import Attrs, Builder, op

SEPARATE = "one tensor per expert (experts.{e}.{gate,up,down}_proj.weight)"
FUSED = "fused gate_up_proj [E, 2I, d] (gate = first I rows) + down_proj [E, d, I]"


def grouped_sigmoid_moe_op(A: Attrs, *, experts: int, top_k: int, shared: int, renorm: tuple[bool, bool],
                           groups: tuple[int, bool], topk_group: tuple[int, bool], router_declared: bool = False) -> Op:
    """The grouped sigmoid router with a selection-only bias and shared experts."""
    inter = A.need("moe_intermediate_size", kind=int)
    scaling, sd = A.get("routed_scaling_factor", default=1.0, kind=float)
    attrs = {"d_model": A.need("hidden_size", kind=int), "experts": int(experts), "top_k": int(top_k), "intermediate": int(inter),
             "router": "sigmoid_grouped", "norm_topk_prob": bool(renorm[0]), "routed_scaling": float(scaling),
             "n_group": int(groups[0]), "topk_group": int(topk_group[0]), "router_bias": False, "selection_bias": True,
             "expert_layout": "separate", "expert_bias": False, "act": "silu", "shared_experts": shared > 0,
             "shared_intermediate": int(inter * shared), "shared_gate": False}
    defaults = {"router_bias", "selection_bias", "expert_layout", "expert_bias", "shared_gate"} | (set() if router_declared else {"router"})
    defaults |= {n for n, filled in (("norm_topk_prob", renorm[1]), ("routed_scaling", sd), ("n_group", groups[1]),
                                      ("topk_group", topk_group[1])) if filled}
    if "hidden_act" not in A:
        defaults.add("act")
    return op("moe", attrs, defaults)


def softmax_topk_moe_op(A: Attrs, d: int, experts: int, top_k: int, intermediate: int, shared_intermediate: int | None) -> Op:
    """Softmax over all experts (fp32) → top-k → renormalise iff ``norm_topk_prob``; SwiGLU experts; a shared expert
    scaled by σ(x·w_shared_gate) of width ``shared_intermediate`` (None: the family has none, a fact filled in).
    (default) marks follow the config keys ``A`` filled from the family's defaults."""
    shared = shared_intermediate or 0
    attrs = {"d_model": d, "experts": experts, "top_k": top_k, "intermediate": intermediate, "router": "softmax_topk",
             "norm_topk_prob": A.take("norm_topk_prob", bool), "routed_scaling": 1.0, "n_group": 1, "topk_group": 1,
             "router_bias": False, "selection_bias": False, "expert_layout": "separate", "expert_bias": False,
             "act": "silu", "shared_experts": shared > 0, "shared_intermediate": shared, "shared_gate": shared > 0}
    defaults = {"router", "routed_scaling", "n_group", "topk_group", "router_bias", "selection_bias", "expert_bias", "shared_gate"}
    if shared_intermediate is None:
        defaults |= {"shared_experts", "shared_intermediate"}
    defaults |= {a for a, key in (("experts", "num_experts"), ("top_k", "num_experts_per_tok"), ("intermediate", "moe_intermediate_size"),
                                  ("norm_topk_prob", "norm_topk_prob"), ("act", "hidden_act"),
                                  ("shared_intermediate", "shared_expert_intermediate_size"),
                                  ("shared_experts", "shared_expert_intermediate_size")) if key in A.filled}
    return op("moe", attrs, defaults)


def bind_grouped_sigmoid_moe(b: Builder, p: str, i: int, experts: int, expert_names: tuple[str, str, str]) -> None:
    """``p`` = the MoE module prefix (``...mlp.`` / ``...block_sparse_moe.``); expert_names = gate, up, down."""
    b.bind(p + "gate.weight", Role.MoeRouterWeight, i)
    b.bind(p + "gate.e_score_correction_bias", Role.MoeRouterSelectionBias, i)
    for name, role in zip(expert_names, (Role.PerExpertGate, Role.PerExpertUp, Role.PerExpertDown)):
        b.bind_bank(p + "experts.{e}." + name + ".weight", experts, role, i)
    bind_shared_experts(b, p + "shared_experts.", i)


def bind_shared_experts(b: Builder, p: str, i: int) -> None:
    """A shared expert's SwiGLU under ``p`` (``...shared_experts.`` / ``...shared_expert.``)."""
    for name, role in (("gate_proj", Role.SharedExpertGate), ("up_proj", Role.SharedExpertUp), ("down_proj", Role.SharedExpertDown)):
        b.bind(p + f"{name}.weight", role, i)


def bind_swiglu_experts(b: Builder, m: str, i: int, experts: int, intermediate: int) -> str:
    """Routed SwiGLU experts under ``m`` (``...mlp.``), either spelling; returns the spelling found.

    One tensor per expert (what save_pretrained and the hub write) is bound as banks; the fused in-memory
    spelling ``experts.gate_up_proj [E, 2I, d]`` (gate = first I rows) + ``experts.down_proj`` through views.
    """
    if b.has(m + "experts.gate_up_proj"):
        gu = m + "experts.gate_up_proj"
        b.bind(gu, Role.PerExpertGate, i, [Transform("slice", dim=1, start=0, stop=intermediate)])
        b.bind(gu, Role.PerExpertUp, i, [Transform("slice", dim=1, start=intermediate, stop=2 * intermediate)])
        b.bind(m + "experts.down_proj", Role.PerExpertDown, i)
        return FUSED
    for name, role in (("gate_proj", Role.PerExpertGate), ("up_proj", Role.PerExpertUp), ("down_proj", Role.PerExpertDown)):
        b.bind_bank(m + "experts.{e}." + name + ".weight", experts, role, i)
    return SEPARATE
