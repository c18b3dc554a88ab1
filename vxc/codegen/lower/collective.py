"""Lowering of the ``all_reduce`` plan op the ``shard`` pass places after every split operator: one
``vxc.all_reduce`` group summing the ranks' partial outputs."""

from __future__ import annotations

from ...passes.plan import PlanOp
from .emitter import Emitter, Val, lowering


@lowering("all_reduce")
def lower_all_reduce(e: Emitter, p: PlanOp, x: Val) -> Val:
    n = p.attrs["ranks"]
    (y,) = e.kernel(p, "all_reduce", [x, n], f"sum of the partial outputs of {n} ranks")
    return y
