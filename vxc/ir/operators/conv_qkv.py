"""The ``conv_qkv`` mixer declaration (fused QKV projection + causal depthwise conv over it, then attention)."""

from __future__ import annotations

from .decl import Attrs, RegionSpec, RoleSpec, OperatorDecl, attr, register

from .attention import kv_dim as _kv_dim, q_dim as _q_dim
from .rotary import ROTARY_ATTRS


def _qkv_rows(a: Attrs) -> int:
    return _q_dim(a) + 2 * _kv_dim(a)


def _derive(a: Attrs) -> dict[str, int]:
    """The fused projection (and the conv over it) is q (q_dim) | k (kv_dim) | v (kv_dim)."""
    return {"q_dim": _q_dim(a), "kv_dim": _kv_dim(a), "qkv_rows": _qkv_rows(a)}


def _qkv(a: Attrs) -> tuple[tuple[str, int], ...]:
    """q | k | v rows of the fused projection (and channels of the conv over it): heads, kv heads, kv heads."""
    return (("heads", a["head_dim"]), ("kv_heads", a["head_dim"]), ("kv_heads", a["head_dim"]))


CONV_QKV = OperatorDecl(
    kind="conv_qkv",
    slot="mixer",
    surfaces=("attention",),
    derive=_derive,
    doc="fused QKV projection, causal depthwise conv over the fused QKV (no activation), rotary, causal GQA softmax",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("kv_heads", "int"),
        attr("head_dim", "int"),
        attr("conv_kernel", "int"),
        attr("conv_bias", "bool"),
        attr("qkv_bias", "bool"),
        attr("out_bias", "bool"),
        attr("causal", "bool"),
        attr("scale", "float"),
        *ROTARY_ATTRS,
    ),
    # tensor parallel: heads and kv heads split (a rank's q heads read its kv heads: contiguous GQA groups); the
    # fused projection and the conv over it cut segment by segment; out_proj row-parallel, its bias added once
    partition="tensor",
    divides=("heads", "kv_heads"),
    roles=(
        RoleSpec("ConvQkvInProj", lambda a: (_qkv_rows(a), a["d_model"]), quantise=True, more_bits="value", shard="out",
                 segments=_qkv),
        RoleSpec("ConvQkvInProjBias", lambda a: (_qkv_rows(a),), when="qkv_bias", shard="out", segments=_qkv),
        RoleSpec("ConvQkvConv1d", lambda a: (_qkv_rows(a), a["conv_kernel"]), shard="out", segments=_qkv),
        RoleSpec("ConvQkvConv1dBias", lambda a: (_qkv_rows(a),), when="conv_bias", shard="out", segments=_qkv),
        RoleSpec("ConvQkvOutProj", lambda a: (a["d_model"], _q_dim(a)), quantise=True, more_bits="attn_out",
                 shard="in"),
        RoleSpec("ConvQkvOutProjBias", lambda a: (a["d_model"],), when="out_bias", shard="once"),
    ),
    regions=(
        RegionSpec("kv", "kv_rows", lambda a: (2, a["kv_heads"], a["head_dim"]), "compute", "per_token"),
        RegionSpec("conv", "conv_history", lambda a: (_qkv_rows(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("heads must be a multiple of kv_heads", lambda a: a["heads"] % a["kv_heads"] == 0),
        ("rotary_dim must be even and at most head_dim", lambda a: a["rotary_dim"] % 2 == 0 and a["rotary_dim"] <= a["head_dim"]),
        ("only causal attention is defined", lambda a: a["causal"] is True),
    ),
)


register(CONV_QKV)
