"""Surfaces: what a compiled model reports it contains, read from the plan
only — operator counts and layers, attention / FFN / MoE surfaces, and the
continuation state (regions, elements, bytes; fixed vs per-token)."""

from __future__ import annotations

from typing import Any

import networkx as nx

from ..ir.module import DTYPES
from ..ir.operators import OPERATORS
from .plan import plan_ops, region_id


def region_dtype(precision: str, compute: str, growth: str = "fixed", kv: str | None = None) -> str:
    """A region's element type (as the state provider allocates it): fp32 for a fixed-precision region, else the
    compute dtype — or ``kv`` (``--kv-dtype``) for a growing one (KV / latent rows)."""
    if precision == "f32":
        return "f32"
    return kv if kv is not None and growth == "per_token" else compute


def region_bytes_per_element(precision: str, compute: str, growth: str = "fixed", kv: str | None = None) -> int:
    return DTYPES[region_dtype(precision, compute, growth, kv)]


def describe(g: nx.DiGraph, context: int | None = None, compute: str | None = None, sequences: int = 1,
             kv: str | None = None) -> dict[str, Any]:
    """``kv``: the growing row regions' element type when it is not ``compute`` (``--kv-dtype``)."""
    compute = compute or g.graph["compute"]
    ops = plan_ops(g)
    layer_ops = [p for p in ops if p.layer is not None and p.slot in ("mixer", "ffn")]
    operators: dict[str, dict[str, Any]] = {}
    surf = {"attention": set(), "ffn": set(), "moe": set()}
    for p in layer_ops:
        e = operators.setdefault(p.kind, {"count": 0, "layers": []})
        e["count"] += 1
        e["layers"].append(p.layer)
        for s in OPERATORS[p.kind].surfaces:
            surf[s].add(p.layer)
    emb = next(p for p in ops if p.kind == "embedding")
    regions = []
    per_layer: dict[int, list] = {}
    fixed_el = fixed_b = tok_el = tok_b = 0
    at_ctx = 0
    for p in ops:
        for r in p.regions:
            n = r.elements()
            bpe = region_bytes_per_element(r.precision, compute, r.growth, kv)
            regions.append({"layer": p.layer, "operator": p.kind, "name": r.name, "kind": r.kind, "shape": list(r.shape),
                            "dtype": region_dtype(r.precision, compute, r.growth, kv),
                            "growth": r.growth if not r.window else f"per_token window {r.window}"})
            per_layer.setdefault(p.layer, []).append(r)
            if r.growth == "fixed":
                fixed_el += n
                fixed_b += n * bpe
            else:
                tok_el += n
                tok_b += n * bpe
                if context is not None:
                    at_ctx += n * bpe * (min(context, r.window) if r.window else context)
    recurrent = sum(1 for rs in per_layer.values() if rs and all(r.growth == "fixed" for r in rs))
    growing = sum(1 for rs in per_layer.values() if any(r.growth == "per_token" for r in rs))
    state: dict[str, Any] = {
        "recurrent_layers": recurrent, "growing_layers": growing,
        "fixed_elements": fixed_el, "fixed_bytes": fixed_b,
        "per_token_elements": tok_el, "per_token_bytes": tok_b,
    }
    if context is not None:
        # S sequence slots hold S independent copies of every region, each growing up to the context
        state["at_context"] = {"tokens": context, "sequences": sequences, "bytes_per_sequence": fixed_b + at_ctx,
                               "bytes": sequences * (fixed_b + at_ctx)}
    state["regions"] = regions
    return {
        "schema": 6,
        "name": g.graph["name"],
        "layers": g.graph["layers"],
        "compute": compute,
        **({"kv_dtype": kv} if kv is not None else {}),
        "vocab": {"logical": emb.attrs["vocab"], "padded": emb.attrs["padded_vocab"]},
        "operators": operators,
        "surfaces": {k: len(v) for k, v in surf.items()},
        "state": state,
        "weights": weight_bytes(g),
    }


def _operand_bytes(o) -> tuple[str, int, int]:
    """(encoding or stored dtype, bytes as stored, bytes of one row of its last two dims)."""
    import math

    from ..ir.views import _ggml

    if o.encoding in _ggml():
        from ..ir.ggml import row_bytes

        rb = row_bytes(o.encoding, o.shape[-1])
        return o.encoding, math.prod(o.shape[:-1]) * rb, rb
    if o.encoding == "mxfp4":  # 32 FP4 values in 16 bytes + one E8M0 scale
        rb = o.shape[-1] // 32 * 17
        return o.encoding, math.prod(o.shape[:-1]) * rb, rb
    item = DTYPES[o.dtype]
    return o.dtype, math.prod(o.shape) * item, o.shape[-1] * item


def _streamed(p, o, nbytes: int) -> int:
    """Bytes of ``o`` one token reads: an expert bank (leading dim = the op's declared ``experts``, or under tensor
    parallelism the rank's part of them) is read for at most its ``top_k`` selected experts."""
    experts, k = p.attrs.get("experts"), p.attrs.get("top_k")
    if isinstance(experts, int) and isinstance(p.attrs.get("expert_ranks"), int):
        experts //= p.attrs["expert_ranks"]  # the experts this rank's banks hold
    if isinstance(experts, int) and isinstance(k, int) and len(o.shape) >= 3 and o.shape[0] == experts:
        return nbytes // experts * min(k, experts)
    return nbytes


def weight_bytes(g: nx.DiGraph) -> dict[str, Any]:
    """Weight bytes by encoding (a plain operand by its stored dtype), read from the plan's operands, and the
    bytes one decode step reads when weights are streamed as stored: every operand whole, except the embedding,
    of which one row is read (a tied head reads the table again, whole), and expert banks, of which the
    ``top_k`` selected experts are read."""
    by: dict[str, dict[str, int]] = {}
    total = step = 0
    seen: set[tuple[str, bool]] = set()
    acts: dict[str, int] = {}
    for p in plan_ops(g):
        for role, o in p.operands.items():
            enc, nbytes, row = _operand_bytes(o)
            lookup = p.kind == "embedding"
            if (o.sym, lookup) not in seen:  # a weight read by several ops is streamed once per step
                seen.add((o.sym, lookup))
                step += row if lookup else _streamed(p, o, nbytes)
            if any(sym == o.sym for sym, _ in seen - {(o.sym, lookup)}):
                continue  # bytes already counted (a tied head reads the embedding's table)
            e = by.setdefault(enc, {"operands": 0, "bytes": 0})
            e["operands"] += 1
            e["bytes"] += nbytes
            total += nbytes
            if o.activations is not None:  # the precision its products quantise their input to (declared)
                acts[o.activations] = acts.get(o.activations, 0) + 1
    out = {"by_encoding": dict(sorted(by.items())), "total_bytes": total, "decode_step_bytes": step}
    if acts:  # only when some operand declares one (the default, x as given, is not listed)
        out["activations"] = dict(sorted(acts.items()))
    return out


def _dot_str(s: str) -> str:
    """``s`` as a Graphviz quoted string: the module name is the IR's text and may hold quotes, backslashes or
    line breaks, which written bare end the string early or break the file."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n") + '"'


def to_dot(g: nx.DiGraph) -> str:
    """Layers, operators and state regions as a Graphviz picture."""
    lines = [f'digraph {_dot_str(g.graph["name"])} {{', "  rankdir=TB; node [fontname=Helvetica];"]
    ops = plan_ops(g)
    layers: dict[Any, list] = {}
    for p in ops:
        layers.setdefault(p.layer, []).append(p)
    for layer, ps in layers.items():
        if layer is not None:
            lines.append(f'  subgraph "cluster_L{layer}" {{ label="layer {layer}"; style=rounded;')
        for p in ps:
            shape = "box" if p.slot in ("mixer", "ffn") else "ellipse"
            lines.append(f'    "{p.id}" [label="{p.kind}", shape={shape}];')
            for r in p.regions:
                rid = region_id(p.id, r.name)
                dims = "×".join(map(str, r.shape))
                grow = "per token" if r.growth == "per_token" else "fixed"
                lines.append(f'    "{rid}" [label="{r.name}: {r.kind}\\n[{dims}] {grow}", shape=cylinder, style=filled, '
                             f'fillcolor="{"#fde2c8" if r.growth == "per_token" else "#d6e9f8"}"];')
                lines.append(f'    "{rid}" -> "{p.id}" [style=dashed, dir=both];')
        if layer is not None:
            lines.append("  }")
    for a, b, d in g.edges(data=True):
        if d["type"] == "hidden":
            lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def tp_ranks(load, n: int, context: int | None = None, sequences: int = 1) -> dict[str, Any]:
    """What each rank of tensor parallelism over ``n`` ranks holds (``vxc describe --tp N``): its weight bytes and
    state bytes, read from the plan the ``shard`` pass makes for it (``load()`` gives a fresh context each time:
    the pass rewrites its module)."""
    from .manager import TP_PIPELINE, PassManager, parse_pipeline

    ranks = []
    for r in range(n):
        ctx = load()
        ctx.tp, ctx.rank = n, r
        PassManager(parse_pipeline(TP_PIPELINE), emit=lambda s: None).run(ctx)
        d = describe(ctx.plan, context, sequences=sequences)
        s = d["state"]
        state = {"fixed_bytes": s["fixed_bytes"], "per_token_bytes": s["per_token_bytes"]}
        if context is not None:
            state["at_context_bytes"] = s["at_context"]["bytes"]
        ranks.append({"rank": r, "weight_bytes": d["weights"]["total_bytes"], "state": state})
    return {"ranks": n, "per_rank": ranks}
