"""Lowering of the ``moe`` FFN: one router group, one expert group over the bank, and (when declared)
one shared-expert group that adds the (optionally σ-gated) shared SwiGLU branch.

Reads roles and declared attributes only: the router variant, the expert layout and activation, the
shared-expert flags. The same three groups serve prefill and decode.
"""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from ..lowering import Val, _Emitter, _w, register_block


@register_block("moe")
def lower_moe(e: _Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    weights, experts = e.kernel(
        p, "moe_router",
        [x, _w(p, Role.MoeRouterWeight), _w(p, Role.MoeRouterBias), _w(p, Role.MoeRouterSelectionBias), a["router"],
         a["top_k"], a["norm_topk_prob"], a["routed_scaling"], a["n_group"], a["topk_group"]],
        f"router logits + {a['router']} top-{a['top_k']} of {a['experts']} + weights", nouts=2)
    if a["expert_layout"] == "separate":
        w_in, w_up, w_down = _w(p, Role.PerExpertGate), _w(p, Role.PerExpertUp), _w(p, Role.PerExpertDown)
    else:
        w_in, w_up, w_down = _w(p, Role.ExpertGateUp), None, _w(p, Role.ExpertDown)
    (y,) = e.kernel(
        p, "moe_experts",
        [x, weights, experts, w_in, w_up, w_down, _w(p, Role.ExpertGateUpBias), _w(p, Role.ExpertDownBias),
         a["expert_layout"], a["act"], a.get("glu_alpha"), a.get("glu_limit")],
        f"selected experts: gate/up ({a['expert_layout']}) + {a['act']} + down + weighted sum")
    if a["shared_experts"]:
        (y,) = e.kernel(
            p, "moe_shared",
            [x, y, _w(p, Role.SharedExpertGate), _w(p, Role.SharedExpertUp), _w(p, Role.SharedExpertDown),
             _w(p, Role.SharedExpertBranchGate)],
            "shared-expert SwiGLU" + (" × σ(branch gate)" if a["shared_gate"] else "") + " + routed sum")
    return y
