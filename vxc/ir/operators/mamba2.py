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
        # multipliers of the five segments of in_proj's output z | x | B | C | dt (after its bias, before the
        # split and the conv); all five or none
        *(attr(f"{seg}_scale", "float", optional=True, doc=f"in_proj's {seg} segment times this (absent: none)")
          for seg in SEGMENTS),
        *BLOCK_SCALES,
    ),
    roles=(
        RoleSpec("Mamba2InProj", lambda a: (_mamba2_in_rows(a), a["d_model"]), quantise=True),
        RoleSpec("Mamba2InProjBias", lambda a: (_mamba2_in_rows(a),), when="proj_bias"),
        RoleSpec("Mamba2Conv1d", lambda a: (_mamba2_conv_dim(a), a["conv_kernel"])),
        RoleSpec("Mamba2Conv1dBias", lambda a: (_mamba2_conv_dim(a),), when="conv_bias"),
        RoleSpec("Mamba2DtBias", lambda a: (a["heads"],)),
        RoleSpec("Mamba2ALog", lambda a: (a["heads"],)),
        RoleSpec("Mamba2D", lambda a: (a["heads"],)),
        RoleSpec("Mamba2GatedNorm", lambda a: (a["d_inner"],), unless="gated_norm=false"),
        RoleSpec("Mamba2OutProj", lambda a: (a["d_model"], a["d_inner"]), quantise=True),
        RoleSpec("Mamba2OutProjBias", lambda a: (a["d_model"],), when="proj_bias"),
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
