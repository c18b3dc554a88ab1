"""Dense FFN declarations."""

from __future__ import annotations

from .decl import BLOCK_SCALES, RoleSpec, OperatorDecl, attr, register

SWIGLU = OperatorDecl(
    kind="swiglu",
    slot="ffn",
    surfaces=("ffn",),
    doc="dense gated FFN: down(act(x·gateᵀ) * (x·upᵀ)); act silu (SwiGLU) or gelu_tanh (GeGLU, tanh approximation)",
    attrs=(attr("d_model", "int"), attr("intermediate", "int"), attr("act", "enum", "silu", "gelu_tanh"),
           attr("gate_scale", "float", optional=True, doc="the gate projection's output times this, before act "
                                                           "(absent: none)"),
           *BLOCK_SCALES),
    # tensor parallel: gate/up column-parallel, down row-parallel over the intermediate width
    partition="tensor",
    divides=("intermediate",),
    roles=(
        RoleSpec("FfnGate", lambda a: (a["intermediate"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("FfnUp", lambda a: (a["intermediate"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("FfnDown", lambda a: (a["d_model"], a["intermediate"]), quantise=True, more_bits="down", shard="in"),
    ),
)


register(SWIGLU)
