"""``bind``: every operand's view is applicable to its stored tensors, its role
is one its layer's operators declare under their attributes, and the view's
result meets the role's shape contract."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.module import Operand
from ..ir.views import ViewError, concat_shape, encoded_shape, view_shape
from .context import Context
from .declared import declared_roles, layer_ops
from .findings import Finding


def fmt(shape) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def source_shape(o: Operand, tensors) -> tuple[int, ...]:
    """The shape before the operand's own transforms: its stored tensor's, its encoding's decoded one, or its
    concatenated parts' (each through its own transforms)."""
    if o.parts:
        shapes = []
        for i, p in enumerate(o.parts):
            try:
                shapes.append(view_shape(source_shape(p, tensors), p.transforms))
            except ViewError as e:
                raise ViewError(f"concat part {i}: {e}") from None
        return concat_shape(shapes, o.concat_dim)
    shapes = [tensors[s].stored_shape for s in o.sources]
    if o.encoding is None:
        return shapes[0]
    for name, s in zip(o.part_names, o.sources):  # every encoding's parts are bytes
        if tensors[s].dtype != "u8":
            raise ViewError(f"{o.encoding} part {name} ${s} is {tensors[s].dtype}, an encoded part must be u8 bytes")
    return encoded_shape(o.encoding, dict(zip(o.part_names, shapes)))


def describe_operand(o: Operand, tensors) -> str:
    keys = ", ".join(tensors[s].key for s in o.sources if s in tensors)
    return f"%{o.sym} ({keys})"


@dataclass(frozen=True)
class Bind:
    name: str = "bind"

    def run(self, ctx: Context) -> list[Finding]:
        m = ctx.module
        tensors = m.tensor_table()
        tables = {None: declared_roles(layer_ops(m, None))}
        for layer in m.layers:
            tables[layer.index] = declared_roles(layer.ops())
        out: list[Finding] = []
        for o in m.operands:
            what = describe_operand(o, tensors)
            try:
                shape = view_shape(source_shape(o, tensors), o.transforms)
            except ViewError as e:
                out.append(Finding("bad-view", f"role {o.role} {what}: {e}", o.layer, role=str(o.role), tensor=what))
                continue
            if tuple(shape) != tuple(o.shape):
                out.append(Finding("shape-inconsistent", f"role {o.role} {what}: declared {fmt(o.shape)} but its view yields {fmt(shape)}",
                                   o.layer, role=str(o.role), tensor=what, expected=tuple(shape), actual=tuple(o.shape)))
            slot = tables[o.layer].get(o.role)
            if slot is None:
                continue  # a role no operator of this layer declares: closure names it
            if not slot.required:
                out.append(Finding("role-not-declared",
                                   f"role {o.role} is bound ({what}) but {slot.op.kind} declares {slot.spec.off_text()}",
                                   o.layer, slot.op.kind, str(o.role), what))
                continue
            want = slot.contract()
            if tuple(shape) != want:
                out.append(Finding("shape-mismatch", f"role {o.role} {what} has shape {fmt(shape)}, its contract is {fmt(want)}",
                                   o.layer, slot.op.kind, str(o.role), what, expected=want, actual=tuple(shape)))
        return out
