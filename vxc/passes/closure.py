"""``closure``: every required role bound on every layer, no tensor left that
no role claims, no role bound twice, no role implying an operator the layer
does not declare. All findings are collected, never only the first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..ir.operators import role_owner
from .context import Context
from .declared import declared_roles, layer_ops
from .findings import Finding


def _fmt(shape) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


@dataclass(frozen=True)
class Closure:
    name: str = "closure"

    def run(self, ctx: Context) -> list[Finding]:
        m = ctx.module
        out: list[Finding] = []
        scopes = [None] + [layer.index for layer in m.layers]
        by_scope: dict = {s: [] for s in scopes}
        for o in m.operands:
            by_scope.setdefault(o.layer, []).append(o)
        for scope in scopes:
            ops = layer_ops(m, scope)
            table = declared_roles(ops)
            mixer = m.layers[scope].main_kind() if scope is not None else None
            bound = Counter(o.role for o in by_scope[scope])
            for role, slot in table.items():
                if slot.required and bound[role] == 0:
                    out.append(Finding("missing-operand", f"required role {role} is not bound", scope, slot.op.kind, str(role)))
            for role, n in bound.items():
                if n > 1:
                    syms = ", ".join(f"%{o.sym}" for o in by_scope[scope] if o.role == role)
                    out.append(Finding("duplicate-binding", f"role {role} is bound {n} times ({syms})", scope,
                                       table[role].op.kind if role in table else mixer, str(role), expected=1, actual=n))
            for o in by_scope[scope]:
                if o.role in table:
                    continue
                owners = role_owner(o.role) or ["a norm"]
                declared = ", ".join(op.kind if op.role is None else f"{op.kind}({op.role})" for op in ops)
                out.append(Finding("foreign-role", f"role {o.role} (%{o.sym}) implies operator {' or '.join(owners)}, which this "
                                   f"{'layer' if scope is not None else 'model level'} does not declare (declared: {declared})",
                                   scope, mixer, str(o.role)))
        claimed = {s for o in m.operands for s in o.sources}
        for t in m.tensors:
            if t.sym not in claimed:
                label = f"bank {t.key} ×{t.experts}" if t.is_bank else t.key
                out.append(Finding("unclassified", f"tensor {label} {t.dtype}{_fmt(t.stored_shape)} is claimed by no role", tensor=t.key))
        return out
