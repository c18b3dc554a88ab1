"""``codegen``: fused kernel groups → ``torch.fx.GraphModule``.

The graph is built directly with ``fx.Graph``: placeholders ``tokens`` and
``start``; weights, state regions and rotary tables as ``get_attr`` of a root
module holding them as buffers; one ``call_function(torch.ops.vxc.<kernel>)``
per fused group; shape-only glue (split, reshape) as tensor methods.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx

from . import kernels  # noqa: F401  (registers torch.ops.vxc.*)
from .lower import START, TOKENS, Lowered, RopeRef, StateRef, Val, Weight


def _safe(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


def buffer_name(ref: Any) -> str:
    if isinstance(ref, Weight):
        return ("wq_" if ref.encoded else "w_") + _safe(ref.sym)
    if isinstance(ref, StateRef):
        return "s_" + _safe(ref.id)
    if isinstance(ref, RopeRef):
        return f"rope_{abs(hash(ref.key)) % 10**8}_{ref.which}"
    raise TypeError(ref)


def build_graph_module(lw: Lowered, root: torch.nn.Module) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[str, fx.Node] = {
        TOKENS.name: g.placeholder("tokens"),
        START.name: g.placeholder("start"),
    }
    attrs: dict[str, fx.Node] = {}
    length = g.call_method("size", (env[TOKENS.name], 0))

    def get(name: str) -> fx.Node:
        if name not in attrs:
            attrs[name] = g.get_attr(name)
        return attrs[name]

    rope_rows: dict[str, fx.Node] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, Val):
            return env[a.name]
        if isinstance(a, Weight):
            return get(buffer_name(a))
        if isinstance(a, StateRef):
            node = get(buffer_name(StateRef(a.op_id, a.region)))
            return g.call_function(operator.getitem, (node, a.part)) if a.part is not None else node
        if isinstance(a, RopeRef):
            name = buffer_name(a)
            if name not in rope_rows:
                rope_rows[name] = g.call_function(torch.narrow, (get(name), 0, env[START.name], length))
            return rope_rows[name]
        if isinstance(a, list):
            return list(a)
        return a

    for c in lw.calls:
        args = tuple(arg(a) for a in c.args)
        if c.kernel is not None:
            node = g.call_function(getattr(torch.ops.vxc, c.kernel).default, args)
        else:
            node = g.call_method(c.glue, args)
        if len(c.outs) == 1:
            env[c.outs[0]] = node
        else:
            for i, o in enumerate(c.outs):
                env[o] = g.call_function(operator.getitem, (node, i))
    g.output(env[lw.output])
    g.lint()
    return fx.GraphModule(root, g, class_name=f"vxc_{lw.variant}")
