"""Lowering of the ``gated_delta`` mixer (see ``vxc/ir/operators/gated_delta.py`` for its program).

Fused groups: the four input projections (q|k|v, z, b, a), the causal conv + activation + conv-state write,
one delta group (gates + l2 norms + chunked/recurrent delta rule + state write), the per-head gated
rmsnorm, and out_proj. Reads only roles and declared attributes.
"""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, StateRef, Val, lowering, weight


@lowering("gated_delta")
def lower_gated_delta(e: Emitter, p: PlanOp, x: Val) -> Val:
    a, d = p.attrs, p.derived
    Hk, Hv, Dk, Dv = a["k_heads"], a["v_heads"], a["k_head_dim"], a["v_head_dim"]
    (qkv,) = e.kernel(p, "linear", [x, weight(p, Role.LinearAttnInProjQkv), None], "q|k|v projection")
    (z,) = e.kernel(p, "linear", [x, weight(p, Role.LinearAttnInProjZ), None], "z (output gate) projection")
    (b,) = e.kernel(p, "linear", [x, weight(p, Role.LinearAttnInProjB), None], "beta logits projection")
    (dec,) = e.kernel(p, "linear", [x, weight(p, Role.LinearAttnInProjA), None], "decay logits projection")
    conv_state, delta_state = StateRef(p.id, "conv"), StateRef(p.id, "delta")
    w_conv = weight(p, Role.LinearAttnConv1d)
    act = a["conv_act"]
    common = [weight(p, Role.LinearAttnALog), weight(p, Role.LinearAttnDtBias), delta_state, a["scale"], a["l2_eps"]]
    if e.decode:
        (qkv1,) = e.glue(p, "reshape", [qkv, [d["conv_dim"]]])
        (c,) = e.kernel(p, "conv1d_step", [qkv1, w_conv, None, act, conv_state], f"conv + {act} + conv-state roll/write")
        q, k, v = e.glue(p, "split", [c, [d["key_dim"], d["key_dim"], d["value_dim"]], -1], 3)
        (q,) = e.glue(p, "reshape", [q, [Hk, Dk]])
        (k,) = e.glue(p, "reshape", [k, [Hk, Dk]])
        (v,) = e.glue(p, "reshape", [v, [Hv, Dv]])
        (b1,) = e.glue(p, "reshape", [b, [Hv]])
        (d1,) = e.glue(p, "reshape", [dec, [Hv]])
        (o,) = e.kernel(p, "gated_delta_step", [q, k, v, d1, b1, *common],
                        "gates + l2norm q,k + delta-rule state update + readout")
    else:
        (c,) = e.kernel(p, "conv1d_prefill", [qkv, w_conv, None, act, conv_state], f"causal conv + {act} + conv-state write")
        q, k, v = e.glue(p, "split", [c, [d["key_dim"], d["key_dim"], d["value_dim"]], -1], 3)
        (q,) = e.glue(p, "reshape", [q, [-1, Hk, Dk]])
        (k,) = e.glue(p, "reshape", [k, [-1, Hk, Dk]])
        (v,) = e.glue(p, "reshape", [v, [-1, Hv, Dv]])
        (o,) = e.kernel(p, "gated_delta_prefill", [q, k, v, dec, b, *common, a["chunk_size"]],
                        f"gates + l2norm q,k + chunked delta rule (WY, chunk {a['chunk_size']}) + final-state write")
    (o2,) = e.glue(p, "reshape", [o, [-1, Dv]])
    (z2,) = e.glue(p, "reshape", [z, [-1, Dv]])
    (on,) = e.kernel(p, "gated_rmsnorm", [o2, z2, weight(p, Role.LinearAttnNorm), a["norm_eps"], Dv,
                                          a["norm_order"] == "norm_then_gate", a["norm_act"]], "per-head gated rmsnorm")
    (o3,) = e.glue(p, "reshape", [on, [-1, d["value_dim"]]])
    (out,) = e.kernel(p, "linear", [o3, weight(p, Role.LinearAttnOutProj), None], "out_proj")
    return out

