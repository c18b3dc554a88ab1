"""Lowering of the ``kda`` mixer: projections, three short convs (each with its own history),
the low-rank forget and output gates, one fused delta-rule group, the gated per-head norm."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, StateRef, Val, lowering, weight


@lowering("kda")
def lower_kda(e: Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    H, D = a["heads"], a["head_dim"]
    C = p.derived["channels"]
    convs = []
    for proj, conv, region, name in ((Role.KdaQProj, Role.KdaQConv1d, "conv_q", "q"), (Role.KdaKProj, Role.KdaKConv1d, "conv_k", "k"),
                                     (Role.KdaVProj, Role.KdaVConv1d, "conv_v", "v")):
        (h,) = e.kernel(p, "linear", [x, weight(p, proj), None], f"{name} projection")
        state = StateRef(p.id, region)
        if e.decode:
            (h1,) = e.glue(p, "reshape", [h, [C]])
            (hc,) = e.kernel(p, "conv1d_step", [h1, weight(p, conv), None, a["conv_act"], state], f"{name} conv + {a['conv_act']} + conv-state roll/write")
            (hc,) = e.glue(p, "reshape", [hc, [H, D]])
        else:
            (hc,) = e.kernel(p, "conv1d_prefill", [h, weight(p, conv), None, a["conv_act"], state], f"{name} causal conv + {a['conv_act']} + conv-state write")
            (hc,) = e.glue(p, "reshape", [hc, [-1, H, D]])
        convs.append(hc)
    (fa,) = e.kernel(p, "linear", [x, weight(p, Role.KdaFAProj), None], "forget gate down-projection")
    (f,) = e.kernel(p, "linear", [fa, weight(p, Role.KdaFBProj), None], "forget gate up-projection")
    (b,) = e.kernel(p, "linear", [x, weight(p, Role.KdaBProj), None], "beta projection")
    delta = StateRef(p.id, "delta")
    common = [weight(p, Role.KdaALog), weight(p, Role.KdaDtBias), delta, a["scale"], a["l2_eps"]]
    if e.decode:
        (f1,) = e.glue(p, "reshape", [f, [C]])
        (b1,) = e.glue(p, "reshape", [b, [H]])
        (o,) = e.kernel(p, "kda_step", [*convs, f1, b1, *common], "per-channel decay + l2 norms + delta-rule state update + readout")
    else:
        (o,) = e.kernel(p, "kda_prefill", [*convs, f, b, *common, a["chunk_size"]],
                        "per-channel decay + l2 norms + delta rule over the sequence + final-state write")
    (ga,) = e.kernel(p, "linear", [x, weight(p, Role.KdaGAProj), None], "output gate down-projection")
    (g,) = e.kernel(p, "linear", [ga, weight(p, Role.KdaGBProj), None], "output gate up-projection")
    (o2,) = e.glue(p, "reshape", [o, [-1, D]])
    (g2,) = e.glue(p, "reshape", [g, [-1, D]])
    (y,) = e.kernel(p, "gated_rmsnorm", [o2, g2, weight(p, Role.KdaONorm), a["norm_eps"], D, True, a["out_gate_act"]],
                    f"per-head rmsnorm · {a['out_gate_act']} gate")
    (y2,) = e.glue(p, "reshape", [y, [-1, C]])
    (out,) = e.kernel(p, "linear", [y2, weight(p, Role.KdaOutProj), None], "out_proj")
    return out
