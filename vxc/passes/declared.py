"""The roles a layer (or the model level) declares, read from operator declarations."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.module import Module, Op
from ..ir.operators import OPERATORS, RoleSpec
from ..ir.roles import Role


@dataclass
class Slot:
    op: Op
    spec: RoleSpec

    @property
    def required(self) -> bool:
        return self.spec.required(self.op.attrs)

    def contract(self) -> tuple[int, ...]:
        return tuple(self.spec.shape(self.op.attrs))


def declared_roles(ops: list[Op]) -> dict[Role, Slot]:
    """role → the operator instance that declares it (first declaration wins)."""
    out: dict[Role, Slot] = {}
    for op in ops:
        decl = OPERATORS.get(op.kind)
        if decl is None:
            continue
        for role, spec in decl.role_specs(op.role):
            out.setdefault(role, Slot(op, spec))
    return out


def layer_ops(m: Module, layer: int | None) -> list[Op]:
    return m.model_ops() if layer is None else m.layers[layer].ops()
