"""Lowering of the ``moe`` FFN: one router group, one expert group over the bank, and (when declared)
one shared-expert group that adds the (optionally σ-gated) shared SwiGLU branch.

Reads roles and declared attributes only: the router variant, the expert layout and activation, the
shared-expert flags. The same three groups serve prefill and decode. Under tensor parallelism (``expert_ranks`` /
``expert_rank`` declared) the router still scores all ``experts``; the expert group is given the global id of the
first expert the rank's banks hold, and adds only the selected experts it holds.
"""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, Val, lowering, weight


@lowering("moe")
def lower_moe(e: Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    weights, experts = e.kernel(
        p, "moe_router",
        [x, weight(p, Role.MoeRouterWeight), weight(p, Role.MoeRouterBias), weight(p, Role.MoeRouterSelectionBias), a["router"],
         a["top_k"], a["norm_topk_prob"], a["routed_scaling"], a["n_group"], a["topk_group"]],
        f"router logits + {a['router']} top-{a['top_k']} of {a['experts']} + weights", nouts=2)
    if a["expert_layout"] == "separate":
        w_in, w_up, w_down = weight(p, Role.PerExpertGate), weight(p, Role.PerExpertUp), weight(p, Role.PerExpertDown)
    else:
        w_in, w_up, w_down = weight(p, Role.ExpertGateUp), None, weight(p, Role.ExpertDown)
    held = a["experts"] // a.get("expert_ranks", 1)
    first = a.get("expert_rank", 0) * held  # the global id of the first expert the banks hold
    (y,) = e.kernel(
        p, "moe_experts",
        [x, weights, experts, w_in, w_up, w_down, weight(p, Role.ExpertGateUpBias), weight(p, Role.ExpertDownBias),
         a["expert_layout"], a["act"], a.get("glu_alpha"), a.get("glu_limit"), first],
        f"selected experts: gate/up ({a['expert_layout']}) + {a['act']} + down + weighted sum"
        + (f" (experts {first}..{first + held - 1} of {a['experts']})" if held != a["experts"] else ""))
    if a["shared_experts"]:
        (y,) = e.kernel(
            p, "moe_shared",
            [x, y, weight(p, Role.SharedExpertGate), weight(p, Role.SharedExpertUp), weight(p, Role.SharedExpertDown),
             weight(p, Role.SharedExpertBranchGate)],
            "shared-expert SwiGLU" + (" × σ(branch gate)" if a["shared_gate"] else "") + " + routed sum")
    return y
