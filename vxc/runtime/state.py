"""The state provider: every declared region as a static, preallocated buffer.

Fixed regions are allocated at their declared shape; per-token regions up to
``max_context`` positions. Precision follows the IR: ``f32`` regions stay fp32
whatever the compute dtype; ``compute`` regions take it. A provider declares
the region kinds it can hold and refuses — by name — a layer needing any
other kind, rather than allocating part of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import torch

from ..ir.operators import REGION_KINDS
from ..passes.findings import Finding, Refusal
from ..passes.plan import plan_ops, region_id


@dataclass
class StateBuffers:
    buffers: dict[str, torch.Tensor]  # region id → buffer
    growing: dict[str, bool]  # region id → per-token
    max_context: int
    layout: dict[str, str] = field(default_factory=dict)  # region id → kind

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def zero_(self) -> None:
        for b in self.buffers.values():
            b.zero_()


@dataclass
class StateProvider:
    kinds: tuple[str, ...] = REGION_KINDS
    name: str = "static"

    def layout(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int):
        """(region id, region, shape, dtype) of every buffer :meth:`allocate` makes, without allocating."""
        for p in plan_ops(g):
            for r in p.regions:
                dt = torch.float32 if r.precision == "f32" else dtype
                if r.growth == "fixed":
                    shape = tuple(r.shape)
                else:
                    # a window bounds the rows: held as a ring of `window` rows (see the attention op)
                    n = min(r.window, max_context) if r.window else max_context
                    shape = (r.shape[0], n, *r.shape[1:]) if r.kind == "kv_rows" else (n, *r.shape)  # kv: K rows, V rows
                yield region_id(p.id, r.name), r, shape, dt

    def nbytes(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int) -> int:
        """The bytes :meth:`allocate` would allocate."""
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, _, shape, dt in self.layout(g, dtype, max_context))

    def allocate(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int, device: torch.device | str = "cpu") -> StateBuffers:
        findings = []
        for p in plan_ops(g):
            missing = [r for r in p.regions if r.kind not in self.kinds]
            if missing:
                need = ", ".join(f"{r.name} ({r.kind})" for r in p.regions)
                findings.append(Finding(
                    "unsupported-region",
                    f"provider {self.name} holds only {', '.join(self.kinds)}; this operator needs {need} — refusing the layer "
                    f"rather than allocating part of its state", p.layer, p.kind))
        if findings:
            raise Refusal("state provider", findings)
        buffers, growing, layout = {}, {}, {}
        for rid, r, shape, dt in self.layout(g, dtype, max_context):
            buffers[rid] = torch.zeros(shape, dtype=dt, device=device)
            growing[rid] = r.growth == "per_token"
            layout[rid] = r.kind
        return StateBuffers(buffers, growing, max_context, layout)


ROWS_ONLY = StateProvider(kinds=("kv_rows",), name="rows-only")
