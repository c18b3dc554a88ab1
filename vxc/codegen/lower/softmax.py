"""Lowering of the ``softmax`` attention mixer (q/k/v projections, optional per-head q/k norms, rotary,
one kv-row write + causal GQA attention group, optional output gate, o projection), and the attention
tail it shares with ``conv_qkv``."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import START, Emitter, StateRef, Val, Weight, lowering, weight


def attend(e: Emitter, p: PlanOp, q: Val, k: Val, v: Val, sinks: Weight | None = None) -> Val:
    """Heads, the declared rotary, the kv-row write + causal GQA attention, heads merged back."""
    a = p.attrs
    H, Hkv, hd = a["heads"], a["kv_heads"], a["head_dim"]
    (qh,) = e.glue(p, "reshape", [q, [-1, H, hd]])
    (kh,) = e.glue(p, "reshape", [k, [-1, Hkv, hd]])
    (vh,) = e.glue(p, "reshape", [v, [-1, Hkv, hd]])
    if a["rotary_dim"] and a["rotary_layout"] != "none":
        cos, sin = e.rope(a)
        inter = a["rotary_layout"] == "interleaved"
        (qh,) = e.kernel(p, "rotary", [qh, cos, sin, inter], f"rotary q ({a['rotary_layout']}, {a['rotary_dim']} dims)")
        (kh,) = e.kernel(p, "rotary", [kh, cos, sin, inter], f"rotary k ({a['rotary_layout']}, {a['rotary_dim']} dims)")
    (o,) = e.kernel(p, "attention", [qh, kh, vh, StateRef(p.id, "kv", 0), StateRef(p.id, "kv", 1), START, a["scale"],
                                     a.get("window", 0), sinks], "kv-row write + causal GQA softmax attention")
    (o2,) = e.glue(p, "reshape", [o, [-1, p.derived["q_dim"]]])
    return o2


@lowering("softmax")
def lower_softmax(e: Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    hd = a["head_dim"]
    (q,) = e.kernel(p, "linear", [x, weight(p, Role.AttnQ), weight(p, Role.AttnQBias)], "q projection")
    (k,) = e.kernel(p, "linear", [x, weight(p, Role.AttnK), weight(p, Role.AttnKBias)], "k projection")
    (v,) = e.kernel(p, "linear", [x, weight(p, Role.AttnV), weight(p, Role.AttnVBias)], "v projection")
    if "key_scale" in a:
        (k,) = e.kernel(p, "scale_segments", [k, [], [a["key_scale"]]], f"k · {a['key_scale']:g}")
    if a["qk_norm"]:
        (qf,) = e.glue(p, "reshape", [q, [-1, hd]])
        (kf,) = e.glue(p, "reshape", [k, [-1, hd]])
        eps, zc = a["qk_norm_eps"], a["qk_norm_zero_centred"]
        q, _ = e.kernel(p, "add_rmsnorm", [qf, None, weight(p, Role.AttnQNorm), eps, zc, False], "per-head q rmsnorm", nouts=2)
        k, _ = e.kernel(p, "add_rmsnorm", [kf, None, weight(p, Role.AttnKNorm), eps, zc, False], "per-head k rmsnorm", nouts=2)
    o = attend(e, p, q, k, v, weight(p, Role.AttnSinks))
    if a["output_gate"]:
        (gate,) = e.kernel(p, "linear", [x, weight(p, Role.AttnOutputGate), None], "output-gate projection")
        (o,) = e.kernel(p, "sigmoid_gate_mul", [o, gate], "attn · sigmoid(gate)")
    (out,) = e.kernel(p, "linear", [o, weight(p, Role.AttnO), weight(p, Role.AttnOBias)], "o projection")
    return out
