"""The ``fuse`` and ``codegen`` passes (registered with the pass manager on import).

``fuse`` lowers the plan to fused kernel groups for both variants; ``codegen``
builds the two ``torch.fx.GraphModule``s over placeholder (meta) buffers —
the runtime builds the same graphs over real weights and state."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..ir.module import Module
from ..passes.context import Context
from ..passes.findings import Finding
from ..passes.manager import register
from ..passes.plan import plan_ops, region_id
from .fxgen import buffer_name, build_graph_module
from .lower import Lowered, RopeRef, StateRef, Unsupported, Weight, lower_plan, print_groups


class FuseResult(dict):
    def listing(self) -> str:
        return "".join(print_groups(lw) for lw in self.values())


class CodegenResult(dict):
    def listing(self) -> str:
        return "".join(fx_listing(name, gm.graph) for name, gm in self.items())


@dataclass(frozen=True)
class Fuse:
    name: str = "fuse"

    def run(self, ctx: Context) -> list[Finding]:
        if ctx.plan is None:
            return [Finding("no-plan", "fuse needs the plan pass first")]
        try:
            ctx.artefacts["fuse"] = FuseResult((v, lower_plan(ctx.plan, v)) for v in ("prefill", "decode"))
        except Unsupported as e:
            return [Finding("no-kernel", str(e))]
        return []


def meta_root(m: Module, lowered: list[Lowered], plan) -> torch.nn.Module:
    root = torch.nn.Module()
    ops = m.operand_table()
    regions = {region_id(p.id, r.name): r for p in plan_ops(plan) for r in p.regions}
    for lw in lowered:
        for c in lw.calls:
            for a in c.args:
                if isinstance(a, Weight):
                    t = torch.empty(ops[a.sym].shape, device="meta")
                elif isinstance(a, StateRef):
                    a = StateRef(a.op_id, a.region)
                    r = regions[a.id]
                    t = torch.empty(r.shape, device="meta")
                elif isinstance(a, RopeRef):
                    t = torch.empty((1, dict(a.key)["rotary_dim"] // 2), device="meta")
                else:
                    continue
                name = buffer_name(a)
                if not hasattr(root, name):
                    root.register_buffer(name, t, persistent=False)
    return root


@dataclass(frozen=True)
class Codegen:
    name: str = "codegen"

    def run(self, ctx: Context) -> list[Finding]:
        fused = ctx.artefacts.get("fuse")
        if fused is None:
            return [Finding("no-fuse", "codegen needs the fuse pass first")]
        root = meta_root(ctx.module, list(fused.values()), ctx.plan)
        ctx.artefacts["codegen"] = CodegenResult((v, build_graph_module(lw, root)) for v, lw in fused.items())
        return []


def _target(n: fx.Node) -> str:
    t = n.target
    if n.op == "call_method":
        return f".{t}"
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}"
    return getattr(t, "__name__", str(t))


def fx_listing(name: str, graph: fx.Graph) -> str:
    """Normalised listing: nodes renumbered in order, targets by stable names (not GraphModule.code)."""
    ids: dict[fx.Node, str] = {}
    lines = [f"graph {name}:"]

    def fmt(a) -> str:
        if isinstance(a, fx.Node):
            return ids[a]
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(x) for x in a) + "]"
        if isinstance(a, float):
            return repr(a)
        if isinstance(a, str):
            return f'"{a}"'
        return "none" if a is None else str(a)

    for i, n in enumerate(graph.nodes):
        ids[n] = f"%{i}"
        if n.op == "placeholder":
            lines.append(f"  %{i} = input {n.target}")
        elif n.op == "get_attr":
            lines.append(f"  %{i} = buffer {n.target}")
        elif n.op == "output":
            lines.append(f"  return {fmt(n.args[0])}")
        else:
            lines.append(f"  %{i} = {_target(n)}({', '.join(fmt(a) for a in n.args)})")
    return "\n".join(lines) + "\n"


register("fuse", Fuse)
register("codegen", Codegen)
