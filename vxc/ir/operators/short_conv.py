"""The ``short_conv`` mixer: a gated short causal convolution (input-gated, output-gated depthwise conv).

Program, per token t (every vector of width ``d_model``)::

    b | c | v = x·ShortConvInProjᵀ (+ ShortConvInProjBias)     rows in this order: input gate b, output gate c,
                                                               value v (d_model each)
    u   = b ⊙ v                                                (rounded to the compute dtype)
    h   = causal depthwise conv(u; ShortConvConv1d [d_model, conv_kernel]) (+ ShortConvConv1dBias), no activation
    y   = c ⊙ h
    out = y·ShortConvOutProjᵀ (+ ShortConvOutProjBias)

Its only continuation state is the conv history: the ``conv_kernel`` most recent gated inputs ``u`` (what the
conv reads), oldest first — fixed in size, no row per position, no recurrent matrix. A checkpoint whose fused
projection orders its three blocks differently is reordered by the frontend with a view.
"""

from __future__ import annotations

from .decl import OperatorDecl, RegionSpec, RoleSpec, attr, register

def _ch(a) -> int:
    """The gated conv's channels: d_model unless declared (a tensor-parallel rank's share)."""
    return a.get("channels", a["d_model"])


_BCV = lambda a: (("channels", 1),) * 3  # noqa: E731  in_proj's rows b | c | v


SHORT_CONV = OperatorDecl(
    kind="short_conv",
    slot="mixer",
    surfaces=(),
    doc="in_proj → b | c | v; u = b⊙v; h = causal depthwise conv(u) (+bias, no activation); out_proj(c⊙h)",
    attrs=(
        attr("d_model", "int"),
        attr("conv_kernel", "int", doc="taps of the depthwise conv (and columns of its history)"),
        attr("conv_bias", "bool"),
        attr("proj_bias", "bool", doc="biases on in_proj and out_proj"),
        attr("channels", "int", optional=True, min=1,
             doc="the gated conv's channels, b, c and v each (absent: d_model; a tensor-parallel rank's share)"),
    ),
    derive=lambda a: {"channels": _ch(a)},
    # tensor parallel: the depthwise channels split (b, c and v blocks of in_proj, the conv, its history);
    # out_proj row-parallel
    partition="tensor",
    divides=("channels",),
    roles=(
        RoleSpec("ShortConvInProj", lambda a: (3 * _ch(a), a["d_model"]), quantise=True, shard="out", segments=_BCV),
        RoleSpec("ShortConvInProjBias", lambda a: (3 * _ch(a),), when="proj_bias", shard="out", segments=_BCV),
        RoleSpec("ShortConvConv1d", lambda a: (_ch(a), a["conv_kernel"]), shard="out"),
        RoleSpec("ShortConvConv1dBias", lambda a: (_ch(a),), when="conv_bias", shard="out"),
        RoleSpec("ShortConvOutProj", lambda a: (a["d_model"], _ch(a)), quantise=True, shard="in"),
        RoleSpec("ShortConvOutProjBias", lambda a: (a["d_model"],), when="proj_bias", shard="once"),
    ),
    regions=(
        # k columns: the k most recent gated inputs b⊙v, as the references allocate it
        RegionSpec("conv", "conv_history", lambda a: (_ch(a), a["conv_kernel"]), "compute", "fixed"),
    ),
)


register(SHORT_CONV)
