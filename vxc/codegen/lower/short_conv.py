"""Lowering of the ``short_conv`` mixer from existing kernels: the fused in_proj, ``gated_act`` (no activation)
for the input gate b ⊙ v, the causal conv (no activation) with its conv-state write, ``gated_act`` again for the
output gate c ⊙ h, and out_proj."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, StateRef, Val, lowering, weight


@lowering("short_conv")
def lower_short_conv(e: Emitter, p: PlanOp, x: Val) -> Val:
    d = p.derived["channels"]
    (bcv,) = e.kernel(p, "linear", [x, weight(p, Role.ShortConvInProj), weight(p, Role.ShortConvInProjBias)], "in_proj")
    b, c, v = e.glue(p, "split", [bcv, [d, d, d], -1], 3)
    (u,) = e.kernel(p, "gated_act", [b, v, "none"], "input gate b · v")
    conv_state = StateRef(p.id, "conv")
    w, bias = weight(p, Role.ShortConvConv1d), weight(p, Role.ShortConvConv1dBias)
    if e.decode:
        (u1,) = e.glue(p, "reshape", [u, [d]])
        (h,) = e.kernel(p, "conv1d_step", [u1, w, bias, "none", conv_state], "conv (no activation) + conv-state roll/write")
        (h,) = e.glue(p, "reshape", [h, [1, d]])
    else:
        (h,) = e.kernel(p, "conv1d_prefill", [u, w, bias, "none", conv_state], "causal conv (no activation) + conv-state write")
    (y,) = e.kernel(p, "gated_act", [c, h, "none"], "output gate c · conv")
    (out,) = e.kernel(p, "linear", [y, weight(p, Role.ShortConvOutProj), weight(p, Role.ShortConvOutProjBias)], "out_proj")
    return out
