"""The ``mamba2`` mixer declaration."""

from __future__ import annotations

from .decl import BLOCK_SCALES, Attrs, RegionSpec, RoleSpec, OperatorDecl, attr, register


SEGMENTS = ("z", "x", "b", "c", "dt")  # in_proj's output, in order


def segment_sizes(a: Attrs) -> list[int]:
    """The widths of in_proj's output segments z | x | B | C | dt."""
    return [a["d_inner"], a["d_inner"], _bc_dim(a), _bc_dim(a), a["heads"]]


def _bc_dim(a: Attrs) -> int:
    return a["groups"] * a["state_size"]


def _mamba2_conv_dim(a: Attrs) -> int:
    return a["d_inner"] + 2 * _bc_dim(a)


def _mamba2_in_rows(a: Attrs) -> int:
    return a["d_inner"] + _mamba2_conv_dim(a) + a["heads"]


def _derive(a: Attrs) -> dict[str, int]:
    """in_proj splits into z (d_inner) | xBC (conv_dim) | dt (heads); xBC into x (d_inner) | B | C (bc_dim each)."""
    return {"conv_dim": _mamba2_conv_dim(a), "bc_dim": _bc_dim(a)}


def _localise(a: Attrs, local: dict, n: int) -> list[str]:
    """A rank's gated norm: whole RMS groups stay on the rank when its d_inner part holds a whole number of them;
    one group over all of d_inner spans the ranks (norm_ranks); anything in between is refused."""
    if a.get("gated_norm") is False or local["d_inner"] % a["norm_group"] == 0:
        return []
    if a["norm_group"] == a["d_inner"]:
        local["norm_group"], local["norm_ranks"] = local["d_inner"], n
        return []
    return [f"norm_group={a['norm_group']}: an RMS group spans part of the ranks' d_inner={a['d_inner']} // {n} "
            f"channels (a group within a rank or one over all of them is covered)"]


_HEADS = ("heads", 1)


def _xbc(a: Attrs) -> tuple[tuple[str, int], ...]:
    return (("heads", a["head_dim"]), ("groups", a["state_size"]), ("groups", a["state_size"]))


def _in_rows(a: Attrs) -> tuple[tuple[str, int], ...]:
    """z | x | B | C | dt"""
    return (("heads", a["head_dim"]), *_xbc(a), _HEADS)


MAMBA2 = OperatorDecl(
    kind="mamba2",
    slot="mixer",
    derive=_derive,
    doc="Mamba2 SSD mixer: in_proj → z|xBC|dt, causal conv + SiLU on xBC, selective scan, gated RMSNorm, out_proj",
    attrs=(
        attr("d_model", "int"),
        attr("d_inner", "int"),
        attr("heads", "int"),
        attr("head_dim", "int"),
        attr("state_size", "int", doc="d_state N"),
        attr("groups", "int", doc="B/C groups G"),
        attr("conv_kernel", "int"),
        attr("conv_bias", "bool"),
        attr("proj_bias", "bool"),
        attr("chunk_size", "int"),
        attr("dt_min", "float"),
        attr("dt_max", "float"),
        attr("gated_norm", "bool", optional=True,
             doc="false: the output is y·act(z) with no norm (no Mamba2GatedNorm, no norm_eps / norm_order / "
                 "norm_group); absent: the gated RMSNorm"),
        attr("norm_eps", "float", min=0.0, optional=True),
        attr("norm_order", "enum", "gate_then_norm", "norm_then_gate", optional=True),
        attr("norm_act", "enum", "silu", "sigmoid", doc="the activation of the gate z"),
        attr("norm_group", "int", optional=True, doc="channels per RMS group"),
        attr("norm_ranks", "int", optional=True, min=2,
             doc="tensor parallel: the one RMS group spans this many ranks (norm_group channels on each): its sum "
                 "of squares is all-reduced and the mean divides by norm_group·norm_ranks (absent: within the rank)"),
        # multipliers of the five segments of in_proj's output z | x | B | C | dt (after its bias, before the
        # split and the conv); all five or none
        *(attr(f"{seg}_scale", "float", optional=True, doc=f"in_proj's {seg} segment times this (absent: none)")
          for seg in SEGMENTS),
        *BLOCK_SCALES,
    ),
    # tensor parallel: heads split (z, x, dt, the conv's x channels, the scan's state, the gated norm's channels);
    # the B/C groups split with them when N divides them, else each rank holds the one group its heads read;
    # out_proj row-parallel
    partition="tensor",
    divides=("heads", "d_inner"),
    shares=("groups",),
    localise=_localise,
    roles=(
        RoleSpec("Mamba2InProj", lambda a: (_mamba2_in_rows(a), a["d_model"]), quantise=True, shard="out",
                 segments=_in_rows),
        RoleSpec("Mamba2InProjBias", lambda a: (_mamba2_in_rows(a),), when="proj_bias", shard="out",
                 segments=_in_rows),
        RoleSpec("Mamba2Conv1d", lambda a: (_mamba2_conv_dim(a), a["conv_kernel"]), shard="out", segments=_xbc),
        RoleSpec("Mamba2Conv1dBias", lambda a: (_mamba2_conv_dim(a),), when="conv_bias", shard="out", segments=_xbc),
        RoleSpec("Mamba2DtBias", lambda a: (a["heads"],), shard="out"),
        RoleSpec("Mamba2ALog", lambda a: (a["heads"],), shard="out"),
        RoleSpec("Mamba2D", lambda a: (a["heads"],), shard="out"),
        RoleSpec("Mamba2GatedNorm", lambda a: (a["d_inner"],), unless="gated_norm=false", shard="out"),
        RoleSpec("Mamba2OutProj", lambda a: (a["d_model"], a["d_inner"]), quantise=True, shard="in"),
        RoleSpec("Mamba2OutProjBias", lambda a: (a["d_model"],), when="proj_bias", shard="once"),
    ),
    regions=(
        RegionSpec("ssm", "recurrent", lambda a: (a["heads"], a["head_dim"], a["state_size"]), "f32", "fixed"),
        # k columns: the k most recent raw inputs, as the references allocate it
        RegionSpec("conv", "conv_history", lambda a: (_mamba2_conv_dim(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("d_inner must equal heads*head_dim", lambda a: a["d_inner"] == a["heads"] * a["head_dim"]),
        ("heads must be a multiple of groups", lambda a: a["heads"] % a["groups"] == 0),
        ("norm_eps, norm_order and norm_group are declared exactly when the gated norm is (gated_norm not false)",
         lambda a: all((k in a) == (a.get("gated_norm") is not False) for k in ("norm_eps", "norm_order", "norm_group"))),
        ("norm_group must divide d_inner", lambda a: "norm_group" not in a or (a["norm_group"] > 0 and a["d_inner"] % a["norm_group"] == 0)),
        ("the in_proj segment scales (z_scale, x_scale, b_scale, c_scale, dt_scale) are declared all five or none",
         lambda a: len({f"{seg}_scale" in a for seg in SEGMENTS}) == 1),
    ),
)


register(MAMBA2)
