"""Lowering of the ``conv_qkv`` mixer: the fused qkv projection, a causal conv over it (no activation)
with its conv-state write, then the attention tail of ``softmax`` and out_proj."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, StateRef, Val, lowering, weight
from .softmax import attend


@lowering("conv_qkv")
def lower_conv_qkv(e: Emitter, p: PlanOp, x: Val) -> Val:
    d = p.derived
    rows = d["qkv_rows"]
    (qkv,) = e.kernel(p, "linear", [x, weight(p, Role.ConvQkvInProj), weight(p, Role.ConvQkvInProjBias)], "fused qkv projection")
    conv_state = StateRef(p.id, "conv")
    w, b = weight(p, Role.ConvQkvConv1d), weight(p, Role.ConvQkvConv1dBias)
    if e.decode:
        (q1,) = e.glue(p, "reshape", [qkv, [rows]])
        (c,) = e.kernel(p, "conv1d_step", [q1, w, b, "none", conv_state], "conv (no activation) + conv-state roll/write")
        (c,) = e.glue(p, "reshape", [c, [1, rows]])
    else:
        (c,) = e.kernel(p, "conv1d_prefill", [qkv, w, b, "none", conv_state], "causal conv over fused qkv (no activation) + conv-state write")
    q, k, v = e.glue(p, "split", [c, [d["q_dim"], d["kv_dim"], d["kv_dim"]], -1], 3)
    o = attend(e, p, q, k, v)
    (out,) = e.kernel(p, "linear", [o, weight(p, Role.ConvQkvOutProj), weight(p, Role.ConvQkvOutProjBias)], "out_proj")
    return out
