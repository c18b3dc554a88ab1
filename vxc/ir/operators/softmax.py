"""The ``softmax`` attention mixer declaration."""

from __future__ import annotations

from .decl import BLOCK_SCALES, Attrs, RegionSpec, RoleSpec, OperatorDecl, attr, register

from .attention import kv_dim as _kv_dim, q_dim as _q_dim
from .rotary import ROTARY_ATTRS


def _derive(a: Attrs) -> dict[str, int]:
    """q_dim: the width of q (and of the attention output), heads·head_dim."""
    return {"q_dim": _q_dim(a)}


SOFTMAX = OperatorDecl(
    kind="softmax",
    slot="mixer",
    surfaces=("attention",),
    derive=_derive,
    doc="softmax attention: q/k/v projections (+biases), optional per-head q/k RMSNorm, rotary, causal GQA softmax, o projection",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("kv_heads", "int"),
        attr("head_dim", "int"),
        attr("q_bias", "bool"),
        attr("k_bias", "bool"),
        attr("v_bias", "bool"),
        attr("o_bias", "bool"),
        attr("qk_norm", "bool"),
        attr("qk_norm_eps", "float", optional=True),
        attr("qk_norm_zero_centred", "bool", optional=True),
        attr("sinks", "bool"),
        attr("output_gate", "bool"),
        attr("window", "int", min=0, doc="sliding window in positions (0 = full causal)"),
        attr("scale", "float"),
        *ROTARY_ATTRS,
        attr("key_scale", "float", optional=True,
             doc="k (after its projection and bias, before rotary and the kv-row write) times this (absent: none)"),
        *BLOCK_SCALES,
    ),
    # tensor parallel: heads and kv heads split across ranks (q/k/v, their biases, sinks and the output gate by
    # rows, o by columns; the kv region follows kv_heads); per-head q/k norms whole; o's bias added once
    partition="tensor",
    divides=("heads", "kv_heads"),
    roles=(
        RoleSpec("AttnQ", lambda a: (_q_dim(a), a["d_model"]), quantise=True, shard="out"),
        RoleSpec("AttnK", lambda a: (_kv_dim(a), a["d_model"]), quantise=True, shard="out"),
        RoleSpec("AttnV", lambda a: (_kv_dim(a), a["d_model"]), quantise=True, more_bits="value", shard="out"),
        RoleSpec("AttnO", lambda a: (a["d_model"], _q_dim(a)), quantise=True, more_bits="attn_out", shard="in"),
        RoleSpec("AttnQBias", lambda a: (_q_dim(a),), when="q_bias", shard="out"),
        RoleSpec("AttnKBias", lambda a: (_kv_dim(a),), when="k_bias", shard="out"),
        RoleSpec("AttnVBias", lambda a: (_kv_dim(a),), when="v_bias", shard="out"),
        RoleSpec("AttnOBias", lambda a: (a["d_model"],), when="o_bias", shard="once"),
        RoleSpec("AttnQNorm", lambda a: (a["head_dim"],), when="qk_norm"),
        RoleSpec("AttnKNorm", lambda a: (a["head_dim"],), when="qk_norm"),
        RoleSpec("AttnSinks", lambda a: (a["heads"],), when="sinks", shard="out"),
        RoleSpec("AttnOutputGate", lambda a: (_q_dim(a), a["d_model"]), when="output_gate", quantise=True, shard="out"),
    ),
    regions=(
        RegionSpec(
            "kv", "kv_rows", lambda a: (2, a["kv_heads"], a["head_dim"]), "compute", "per_token",
            window=lambda a: a["window"],
        ),
    ),
    rules=(
        ("heads must be a multiple of kv_heads", lambda a: a["heads"] % a["kv_heads"] == 0),
        ("rotary_dim must be even and at most head_dim", lambda a: a["rotary_dim"] % 2 == 0 and a["rotary_dim"] <= a["head_dim"]),
        ("qk_norm needs qk_norm_eps and qk_norm_zero_centred", lambda a: not a["qk_norm"] or ("qk_norm_eps" in a and "qk_norm_zero_centred" in a)),
        ("window must be >= 0", lambda a: a["window"] >= 0),
    ),
)


register(SOFTMAX)
