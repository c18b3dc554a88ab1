"""Lowering of the dense non-gated ``mlp`` FFN: the up projection, ``activation`` and the down projection."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, Val, lowering, weight


@lowering("mlp")
def lower_mlp(e: Emitter, p: PlanOp, x: Val) -> Val:
    act = p.attrs["act"]
    (u,) = e.kernel(p, "linear", [x, weight(p, Role.FfnUp), None], "up projection")
    (h,) = e.kernel(p, "activation", [u, act], f"{act}(up)")
    (out,) = e.kernel(p, "linear", [h, weight(p, Role.FfnDown), None], "down projection")
    return out
