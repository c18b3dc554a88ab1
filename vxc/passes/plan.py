"""``plan``: a generic, ordered op plan of the whole model, held as a
networkx DiGraph. Op nodes carry their operator kind, declared attributes and
bound operands; operand and state-region nodes hang off them on typed edges,
and ``hidden`` edges chain the ops in program order. No family knowledge:
only placements, operator kinds, roles and declared regions are read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from ..ir.module import Module, Op, Operand, Region
from ..ir.operators import OPERATORS
from ..ir.roles import PLACEMENT_NORMS, Placement, Role
from .context import Context
from .findings import Finding


_STATE = ".state."


def region_id(op_id: str, region: str) -> str:
    """The id of a plan op's state region: its plan node, its state buffer, its name in a state file."""
    return f"{op_id}{_STATE}{region}"


def split_region_id(rid: str) -> tuple[str, str]:
    """``(op id, region name)`` of a region id (the inverse of :func:`region_id`)."""
    op_id, sep, region = rid.rpartition(_STATE)
    if not sep or not op_id or not region:
        raise ValueError(f"not a state region id: {rid!r}")
    return op_id, region


@dataclass
class PlanOp:
    id: str
    kind: str  # "embedding" | "add_rmsnorm" | "rmsnorm" | "residual_add" | a mixer/ffn kind | "head"
    layer: int | None
    order: int
    attrs: dict[str, Any] = field(default_factory=dict)
    operands: dict[Role, Operand] = field(default_factory=dict)
    regions: list[Region] = field(default_factory=list)
    slot: str = ""  # "embedding" | "norm" | "mixer" | "ffn" | "residual" | "head"
    residual: str = "compute"  # the layer's residual policy (norm ops)
    role: Role | None = None  # norms: the norm role
    # a mixer of a Parallel layer after the first: it reads the input of the op before it (the same normed
    # hidden) and its output is added to that op's output
    parallel: bool = False

    @property
    def derived(self) -> dict[str, int]:
        """The geometry the operator's declaration derives from the attributes (conv widths, inner sizes)."""
        decl = OPERATORS.get(self.kind)
        return decl.derived(self.attrs) if decl is not None else {}


def build_plan(m: Module) -> nx.DiGraph:
    g = nx.DiGraph(name=m.name, compute=m.compute, layers=len(m.layers))
    order = 0
    prev: str | None = None

    def add(p: PlanOp) -> None:
        nonlocal prev, order
        g.add_node(p.id, type="op", op=p)
        for role, o in p.operands.items():
            g.add_node("%" + o.sym, type="operand", operand=o)
            g.add_edge("%" + o.sym, p.id, type="operand", role=str(role))
        for r in p.regions:
            rid = region_id(p.id, r.name)
            g.add_node(rid, type="state", region=r, layer=p.layer)
            g.add_edge(rid, p.id, type="state", region=r.name)
        if prev is not None:
            g.add_edge(prev, p.id, type="hidden")
        prev = p.id
        order += 1

    def bound(layer: int | None) -> dict[Role, Operand]:
        return {o.role: o for o in m.operands if o.layer == layer}

    top = bound(None)
    add(PlanOp("embedding", "embedding", None, order, dict(m.embedding.attrs), {Role.Embedding: top[Role.Embedding]}, slot="embedding"))

    def roles_of(op: Op, ops_bound: dict[Role, Operand]) -> dict[Role, Operand]:
        decl = OPERATORS[op.kind]
        return {r: ops_bound[r] for r, s in decl.role_specs(op.role) if s.required(op.attrs) and r in ops_bound}

    for layer in m.layers:
        lb = bound(layer.index)
        norms = {n.role: n for n in layer.norms}
        pre, post = PLACEMENT_NORMS[layer.placement]
        blocks = [(layer.mixer, "mixer", pre)] if layer.mixer is not None else []
        if layer.parallel is not None:
            blocks.append((layer.parallel, "mixer", ()))  # beside the mixer: no norm of its own
        if layer.ffn is not None:
            blocks.append((layer.ffn, "ffn", post))
        for op, slot, block_norms in blocks:
            if op is layer.parallel:
                regions = [r for r in (layer.regions or []) if _owned(op, r)]
                add(PlanOp(f"L{layer.index}.{op.kind}", op.kind, layer.index, order, dict(op.attrs), roles_of(op, lb), regions,
                           slot=slot, parallel=True))
                continue
            first = norms[block_norms[0]]
            add(PlanOp(f"L{layer.index}.{first.role}", "add_rmsnorm", layer.index, order, dict(first.attrs), roles_of(first, lb),
                       slot="norm", residual=layer.residual, role=first.role))
            regions = [r for r in (layer.regions or []) if _owned(op, r)]
            add(PlanOp(f"L{layer.index}.{op.kind}", op.kind, layer.index, order, dict(op.attrs), roles_of(op, lb), regions, slot=slot))
            if layer.placement == Placement.PrePost:
                second = norms[block_norms[1]]
                add(PlanOp(f"L{layer.index}.{second.role}", "rmsnorm", layer.index, order, dict(second.attrs), roles_of(second, lb),
                           slot="norm", residual=layer.residual, role=second.role))
    add(PlanOp("final_norm", "add_rmsnorm", None, order, dict(m.final_norm.attrs), roles_of(m.final_norm, top), slot="norm",
               residual=m.layers[-1].residual if m.layers else "compute", role=m.final_norm.role))
    head_w = top.get(Role.Embedding) if m.head.attrs.get("tied") else top.get(Role.LmHead)
    add(PlanOp("head", "head", None, order, dict(m.head.attrs), {Role.LmHead: head_w} if head_w else {}, slot="head"))
    return g


def _owned(op: Op, r: Region) -> bool:
    return any(spec.name == r.name for spec in OPERATORS[op.kind].region_specs(op.attrs))


def plan_ops(g: nx.DiGraph) -> list[PlanOp]:
    ops = [d["op"] for _, d in g.nodes(data=True) if d["type"] == "op"]
    return sorted(ops, key=lambda p: p.order)


def plan_regions(g: nx.DiGraph) -> list[tuple[PlanOp, Region]]:
    out = []
    for p in plan_ops(g):
        out += [(p, r) for r in p.regions]
    return out


def print_plan(g: nx.DiGraph) -> str:
    lines = [f"plan {g.graph['name']!r}: {len(plan_ops(g))} ops"]
    for p in plan_ops(g):
        where = f"layer {p.layer}" if p.layer is not None else "model"
        ops = " ".join(f"{r}=%{o.sym}" for r, o in p.operands.items())
        regs = "".join(f" state:{r.name}" for r in p.regions)
        par = " (parallel: same input, outputs summed)" if p.parallel else ""
        lines.append(f"  {p.order:4d} {where:>9} {p.kind:<12} {ops}{regs}{par}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Plan:
    name: str = "plan"

    def run(self, ctx: Context) -> list[Finding]:
        m = ctx.module
        if any(layer.regions is None for layer in m.layers):
            return [Finding("no-state", "plan needs the state pass first (a layer has no materialised regions)")]
        ctx.artefacts["plan"] = build_plan(m)
        return []
