"""Operator declarations, as data: one module per operator kind (this package).

A module here declares its operator with :class:`OperatorDecl` (see ``decl.py``)
— attributes, roles by name with their shape contracts, derived geometry and
state regions — and calls :func:`register`. Every module of the package is
imported below, so a new operator is one new file; the role vocabulary
(:mod:`vxc.ir.roles`) is assembled from the registered declarations. Passes
(bind, closure, state) are single generic walks over these declarations;
nothing else in vxc knows what an operator needs.
"""

from __future__ import annotations

import importlib
import pkgutil

from .decl import (  # noqa: F401  (the declaration vocabulary, re-exported)
    BLOCK_SCALES, GROWTHS, OPERATORS, PRECISIONS, REGION_KINDS, Attr, Attrs, OperatorDecl, RegionSpec, RoleSpec, Shape, attr,
    condition, register,
)


def role_owner(role: str) -> list[str]:
    """Operator kinds whose declaration names this role."""
    return [d.kind for d in OPERATORS.values() for s in d.roles if s.name == role]


# one module per operator kind; each registers its declaration (sorted: a stable registration order)
for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")
