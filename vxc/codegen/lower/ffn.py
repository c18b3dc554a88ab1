"""Lowering of the dense ``swiglu`` FFN: one fused group."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, Val, lowering, weight


@lowering("swiglu")
def lower_swiglu(e: Emitter, p: PlanOp, x: Val) -> Val:
    (out,) = e.kernel(p, "swiglu", [x, weight(p, Role.FfnGate), weight(p, Role.FfnUp), weight(p, Role.FfnDown)],
                      "gate/up GEMM + silu·mul + down GEMM")
    return out
