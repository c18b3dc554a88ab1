"""Dense FFN declarations."""

from __future__ import annotations

from ..roles import Role
from . import RoleSpec, OperatorDecl, attr, register

SWIGLU = OperatorDecl(
    kind="swiglu",
    slot="ffn",
    surfaces=("ffn",),
    doc="dense gated FFN: down(act(x·gateᵀ) * (x·upᵀ))",
    attrs=(attr("d_model", "int"), attr("intermediate", "int"), attr("act", "enum", "silu")),
    roles=(
        RoleSpec(Role.FfnGate, lambda a: (a["intermediate"], a["d_model"])),
        RoleSpec(Role.FfnUp, lambda a: (a["intermediate"], a["d_model"])),
        RoleSpec(Role.FfnDown, lambda a: (a["d_model"], a["intermediate"])),
    ),
)


register(SWIGLU)
