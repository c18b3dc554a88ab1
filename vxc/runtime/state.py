"""The state provider: every declared region as a static, preallocated buffer.

Fixed regions are allocated at their declared shape; per-token regions up to
``max_context`` positions. With ``sequences`` S > 1 every region gets a leading
slot dimension: one independent copy of the whole continuation state per
sequence slot (``StateBuffers.slots``), each growing region up to its own
``max_context``; ``buffers`` are the views of the slot a single-sequence
session runs in (slot 0). Precision follows the IR: ``f32`` regions stay fp32
whatever the compute dtype; ``compute`` regions take it — or, for the growing
row regions (KV rows, latent rows) only, ``kv_dtype`` where one is asked for
(``--kv-dtype``: a cache narrower than the activations, as the common f16 KV
cache; the fixed regions never change). A provider declares
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
    buffers: dict[str, torch.Tensor]  # region id → the buffer of slot 0 (a view of ``slots``)
    growing: dict[str, bool]  # region id → per-token
    max_context: int
    layout: dict[str, str] = field(default_factory=dict)  # region id → kind
    slots: dict[str, torch.Tensor] = field(default_factory=dict)  # region id → [sequences, *buffer shape]
    sequences: int = 1
    ring: dict[str, bool] = field(default_factory=dict)  # region id → a per-token region held as a ring of window rows

    def nbytes(self) -> int:
        """Bytes allocated for every slot."""
        return sum(b.numel() * b.element_size() for b in self.slots.values())

    def slot(self, i: int) -> dict[str, torch.Tensor]:
        """Region id → the buffer of slot ``i`` (views: writes land in the slot)."""
        if not 0 <= i < self.sequences:
            raise IndexError(f"slot {i} outside 0..{self.sequences - 1}")
        return {rid: b[i] for rid, b in self.slots.items()}

    def zero_(self, slot: int = 0) -> None:
        for b in self.slots.values():
            b[slot].zero_()

    def rows(self, rid: str, buf: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Positions ``start..end`` of a growing region's buffer (one slot's): K and V rows of ``kv_rows`` both."""
        return buf[:, start:end] if self.layout[rid] == "kv_rows" else buf[start:end]


@dataclass
class StateProvider:
    kinds: tuple[str, ...] = REGION_KINDS
    name: str = "static"

    def layout(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int, kv_dtype: torch.dtype | None = None):
        """(region id, region, shape, dtype) of every buffer :meth:`allocate` makes, without allocating."""
        for p in plan_ops(g):
            for r in p.regions:
                dt = region_torch_dtype(r.precision, r.growth, dtype, kv_dtype)
                if r.growth == "fixed":
                    shape = tuple(r.shape)
                else:
                    # a window bounds the rows: held as a ring of `window` rows (see the attention op)
                    n = min(r.window, max_context) if r.window else max_context
                    shape = (r.shape[0], n, *r.shape[1:]) if r.kind == "kv_rows" else (n, *r.shape)  # kv: K rows, V rows
                yield region_id(p.id, r.name), r, shape, dt

    def nbytes(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int, sequences: int = 1,
               kv_dtype: torch.dtype | None = None) -> int:
        """The bytes :meth:`allocate` would allocate."""
        one = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                  for _, _, shape, dt in self.layout(g, dtype, max_context, kv_dtype))
        return one * sequences

    def allocate(self, g: nx.DiGraph, dtype: torch.dtype, max_context: int, device: torch.device | str = "cpu",
                 sequences: int = 1, kv_dtype: torch.dtype | None = None) -> StateBuffers:
        if sequences < 1:
            raise ValueError(f"sequences must be at least 1, not {sequences}")
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
        slots, growing, layout, ring = {}, {}, {}, {}
        for rid, r, shape, dt in self.layout(g, dtype, max_context, kv_dtype):
            slots[rid] = _zeros((sequences, *shape), dt, device)
            growing[rid] = r.growth == "per_token"
            layout[rid] = r.kind
            # fewer rows than the context: positions wrap around (position p in row p % rows)
            ring[rid] = growing[rid] and bool(r.window) and r.window < max_context
        return StateBuffers({rid: b[0] for rid, b in slots.items()}, growing, max_context, layout, slots, sequences, ring)


def region_torch_dtype(precision: str, growth: str, dtype: torch.dtype, kv_dtype: torch.dtype | None) -> torch.dtype:
    """A region's element type: fp32 for a fixed-precision (``f32``) region; for a ``compute`` one the compute dtype,
    or ``kv_dtype`` (when given) if it grows per token (KV / latent rows)."""
    if precision == "f32":
        return torch.float32
    return kv_dtype if kv_dtype is not None and growth == "per_token" else dtype


def _zeros(shape: tuple, dt: torch.dtype, device) -> torch.Tensor:
    """A zeroed region buffer; on the CPU in transparent huge pages where the kernel allows them (weights'
    ``hugepage_empty``): a decode step reads one K and one V row per position of a head, a region's row apart — a
    4 KiB page each — so at long contexts the step was walking the page tables (the 0.6B softmax-decoder shape at
    2048 positions: the attention 50 -> 18 ms of a 57 ms step with prefetching and huge pages)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dt, device=device)
    from .weights import hugepage_empty

    n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    return hugepage_empty(n).view(dt).reshape(shape).zero_()


ROWS_ONLY = StateProvider(kinds=("kv_rows",), name="rows-only")
