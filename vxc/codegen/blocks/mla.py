"""Lowering of the ``mla`` mixer: the query (direct or low-rank with its norm), the latent
projection, and one fused group that normalises the latent, applies the declared rotary,
writes the latent row and attends — expanded over the cached rows in prefill, absorbed
(attention directly on the latent rows) in decode."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from ..lowering import START, StateRef, Val, _Emitter, _w, register_block


@register_block("mla")
def lower_mla(e: _Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    H, N, P, V = a["heads"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
    if a["q_lora"]:
        (qa,) = e.kernel(p, "linear", [x, _w(p, Role.MlaQAProj), None], "q down-projection")
        qn, _ = e.kernel(p, "add_rmsnorm", [qa, None, _w(p, Role.MlaQANorm), a["norm_eps"], False, False], "q latent rmsnorm", nouts=2)
        (q,) = e.kernel(p, "linear", [qn, _w(p, Role.MlaQBProj), None], "q up-projection")
    else:
        (q,) = e.kernel(p, "linear", [x, _w(p, Role.MlaQProj), None], "q projection")
    (qh,) = e.glue(p, "reshape", [q, [-1, H, N + P]])
    (kv,) = e.kernel(p, "linear", [x, _w(p, Role.MlaKvAProj), None], "latent + shared rope-key projection")
    rotates = a["rotary_dim"] > 0 and a["rotary_layout"] != "none"
    cos, sin = e.rope(a) if rotates else (None, None)
    inter, split = a["rotary_layout"] == "interleaved", a["rotary_output"] == "split"
    args = [qh, kv, _w(p, Role.MlaKvANorm), a["norm_eps"], _w(p, Role.MlaKvBProj), cos, sin, StateRef(p.id, "latent"), START,
            a["scale"], N, inter, split]
    rope = f"rotary {a['rotary_layout']}/{a['rotary_output']}" if rotates else "no rotary"
    if e.decode:
        (o,) = e.kernel(p, "mla_decode", args, f"latent rmsnorm + {rope} + latent-row write + absorbed attention on the latent rows")
    else:
        (o,) = e.kernel(p, "mla_prefill", args, f"latent rmsnorm + {rope} + latent-row write + expanded causal attention")
    (o2,) = e.glue(p, "reshape", [o, [-1, H * V]])
    (out,) = e.kernel(p, "linear", [o2, _w(p, Role.MlaOutProj), None], "o projection")
    return out
