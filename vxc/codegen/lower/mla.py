"""Lowering of the ``mla`` mixer: the query (direct or low-rank with its norm), the latent
projection, and one fused group that normalises the latent, applies the declared rotary,
writes the latent row and attends — expanded over the cached rows in prefill, absorbed
(attention directly on the latent rows) in decode."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import START, Emitter, StateRef, Val, lowering, weight


@lowering("mla")
def lower_mla(e: Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    H, N = a["heads"], a["qk_nope_head_dim"]
    if a["q_lora"]:
        (qa,) = e.kernel(p, "linear", [x, weight(p, Role.MlaQAProj), None], "q down-projection")
        qn, _ = e.kernel(p, "add_rmsnorm", [qa, None, weight(p, Role.MlaQANorm), a["norm_eps"], False, False], "q latent rmsnorm", nouts=2)
        (q,) = e.kernel(p, "linear", [qn, weight(p, Role.MlaQBProj), None], "q up-projection")
    else:
        (q,) = e.kernel(p, "linear", [x, weight(p, Role.MlaQProj), None], "q projection")
    (qh,) = e.glue(p, "reshape", [q, [-1, H, p.derived["qk_head_dim"]]])
    (kv,) = e.kernel(p, "linear", [x, weight(p, Role.MlaKvAProj), None], "latent + shared rope-key projection")
    rotates = a["rotary_dim"] > 0 and a["rotary_layout"] != "none"
    cos, sin = e.rope(a) if rotates else (None, None)
    inter, split = a["rotary_layout"] == "interleaved", a["rotary_output"] == "split"
    args = [qh, kv, weight(p, Role.MlaKvANorm), a["norm_eps"], weight(p, Role.MlaKvBProj), cos, sin, StateRef(p.id, "latent"), START,
            a["scale"], N, inter, split]
    rope = f"rotary {a['rotary_layout']}/{a['rotary_output']}" if rotates else "no rotary"
    if e.decode:
        (o,) = e.kernel(p, "mla_decode", args, f"latent rmsnorm + {rope} + latent-row write + absorbed attention on the latent rows")
    else:
        (o,) = e.kernel(p, "mla_prefill", args, f"latent rmsnorm + {rope} + latent-row write + expanded causal attention")
    (o2,) = e.glue(p, "reshape", [o, [-1, p.derived["o_dim"]]])
    (out,) = e.kernel(p, "linear", [o2, weight(p, Role.MlaOutProj), None], "o projection")
    return out
