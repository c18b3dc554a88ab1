"""Lowering of the dense ``swiglu`` FFN: one fused group for SiLU gating; another activation (``gelu_tanh``), or a
declared ``gate_scale``, as the gate and up projections, the gate's scale, ``gated_act`` and the down projection."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, Val, lowering, weight


@lowering("swiglu")
def lower_swiglu(e: Emitter, p: PlanOp, x: Val) -> Val:
    act = p.attrs["act"]
    if act != "silu" or "gate_scale" in p.attrs:
        (g,) = e.kernel(p, "linear", [x, weight(p, Role.FfnGate), None], "gate projection")
        if "gate_scale" in p.attrs:
            (g,) = e.kernel(p, "scale_segments", [g, [], [p.attrs["gate_scale"]]], f"gate · {p.attrs['gate_scale']:g}")
        (u,) = e.kernel(p, "linear", [x, weight(p, Role.FfnUp), None], "up projection")
        (h,) = e.kernel(p, "gated_act", [g, u, act], f"{act}(gate) · up")
        (out,) = e.kernel(p, "linear", [h, weight(p, Role.FfnDown), None], "down projection")
        return out
    (out,) = e.kernel(p, "swiglu", [x, weight(p, Role.FfnGate), weight(p, Role.FfnUp), weight(p, Role.FfnDown)],
                      "gate/up GEMM + silu·mul + down GEMM")
    return out
