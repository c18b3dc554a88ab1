"""``shard``: one rank's program of a model split over ``ctx.tp`` ranks (tensor parallelism).

Reads the operator declarations only: an operator's ``partition`` says whether it runs replicated (every operand
whole on every rank: embedding, norms, head) or split (``"tensor"``); a split operator names the attributes that
divide by the number of ranks (``divides``: heads, kv_heads, intermediate …) and each role says how it is cut
(``RoleSpec.shard``: ``out`` / ``in`` / ``experts`` / ``once`` / whole). This rank then runs the operator at the
divided attributes: every role's shape is its contract at those attributes, the cut a contiguous range of the
declared dimension, and the state regions follow from the same attributes (a kv region holds this rank's kv
heads). A split operator's output is a partial sum: the plan gets one ``all_reduce`` op after it (after the
second of two mixers side by side, a Parallel layer: the sum of partial sums is reduced once). A ``once``
operand (a row-parallel projection's bias) stays bound on rank 0 only, so the sum adds it once.

A fused operand (a projection whose rows are z | x | B | C | dt) declares its ``segments``: the rank takes its
blocks of each, in order. An attribute in ``shares`` (Mamba2's B/C groups) is divided when N divides it, else each
rank holds the one block its part of the divided attributes reads. An operator's ``localise`` adjusts what
division alone cannot say (a gated-norm group spanning the ranks: ``norm_ranks``).

A ggml-encoded operand (GGUF, ``vxc quantize``) is cut as its blocks: experts and rows freely, a row only on block
boundaries (its int8 activations, quantised per block, then cut on the same boundaries); each rank reads its
blocks alone. Other encodings (MXFP4) are cut by whole experts only.

Anything without a declared partition is refused by name — an operator kind, a Parallel layer pairing a split mixer
with a replicated one, an encoded operand cut off its block boundaries (``indivisible``) or in another encoding
than ggml's, an attribute that does not divide — never replicated silently.
At ``tp == 1`` the pass changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..ir.ggml import is_block_encoded
from ..ir.module import Module, Op, Shard
from ..ir.operators import OPERATORS
from .context import Context
from .findings import Finding
from .plan import PlanOp, build_plan, plan_ops
from .state import declared_regions

REDUCE = "all_reduce"  # the plan-op kind that sums a split operator's partial outputs over the ranks


def _dim(cut: str, ndim: int) -> int:
    if cut == "experts":
        return 0
    if cut == "in":
        return ndim - 1
    return ndim - 2 if ndim >= 2 else 0  # "out": a matrix's rows, a vector's only dimension


def _ops(m: Module) -> list[tuple[int | None, Op]]:
    out: list[tuple[int | None, Op]] = [(None, m.embedding)]
    for layer in m.layers:
        out += [(layer.index, op) for op in layer.ops()]
    return out + [(None, m.final_norm), (None, m.head)]


def _value(decl, attrs: dict, name: str) -> int:
    """An attribute, or (absent) what the declaration derives for it (short_conv's ``channels``: d_model)."""
    return attrs[name] if name in attrs else decl.derived(attrs)[name]


def _local(decl, attrs: dict, n: int) -> tuple[dict, list[tuple[str, str, object]]]:
    """A rank's attributes: ``divides`` divided by ``n``; ``shares`` divided when they can be, else one per rank
    (``n`` a multiple of them); then the operator's own ``localise``. Returns them and the refusals
    ``(attribute, expected, actual)``."""
    local, bad = dict(attrs), []
    for name in decl.divides:
        v = _value(decl, attrs, name)
        if v % n:
            bad.append((name, f"{name}={v} is not divisible by --tp {n}", f"a multiple of {n}", v))
        local[name] = v // n
    for name in decl.shares:
        v = attrs[name]
        if v % n == 0:
            local[name] = v // n
        elif n % v == 0:
            local[name] = 1
        else:
            bad.append((name, f"{name}={v} neither divides by --tp {n} nor divides it", f"a multiple or divisor of {n}", v))
    if not bad and decl.localise is not None:
        for msg in decl.localise(attrs, local, n):
            bad.append((None, msg, None, None))
    return local, bad


def _spread(decl, attrs: dict, local: dict, n: int, rank: int) -> list[tuple[str, str, object, object]]:
    """``decl.spreads`` (an expert bank): each attribute keeps its whole value, and the rank's range of it is
    declared by setting its ``ranks`` / ``rank`` attributes in ``local``. Returns the refusals as ``_local`` does."""
    bad = []
    for name, ranks, mine in decl.spreads:
        v = attrs[name]
        if v % n:
            bad.append((name, f"{name}={v} is not divisible by --tp {n}", f"a multiple of {n}", v))
        local[ranks], local[mine] = n, rank
    return bad


def _ranges(decl, spec, attrs: dict, local: dict, n: int, rank: int, width: int) -> tuple[tuple[int, int], ...] | None:
    """This rank's ranges of a cut dimension of ``width`` (None when the segments do not add up to it)."""
    if spec.segments is None:
        part = width // n
        return ((rank * part, (rank + 1) * part),)
    out, off = [], 0
    for name, unit in spec.segments(attrs):
        whole, mine = _value(decl, attrs, name), _value(decl, local, name)
        first = rank * mine if whole == mine * n else (rank * whole) // n  # divided, or the one block it shares
        if mine:
            a, b = off + first * unit, off + (first + mine) * unit
            if out and out[-1][1] == a:
                a = out.pop()[0]
            out.append((a, b))
        off += whole * unit
    return tuple(out) if off == width else None


def _encoded_cut(o, cut: str, d: int, spans) -> tuple[str, str] | None:
    """Why an encoded operand cannot be cut so (None: it can). A ggml row is a run of independent blocks: experts
    and rows cut freely, a row only on block boundaries (then its int8 activations, quantised per block of the
    same row, are cut on the same boundaries). Other encodings: whole experts only."""
    if o.encoding is None:
        return None
    if not is_block_encoded(o.encoding):
        if cut == "experts":  # (a bank's experts are whole in any encoding: dim 0)
            return None
        return ("no-partition", f"operand %{o.sym} is encoded ({o.encoding}): only whole experts of it are cut")
    if o.transforms:
        return ("no-partition", f"operand %{o.sym} is encoded ({o.encoding}) under views: no declared partition")
    from ..ir.ggml import ENCODINGS

    bs = ENCODINGS[o.encoding].block_size
    if d == len(o.shape) - 1 and any(a % bs or b % bs for a, b in spans):
        return ("indivisible", f"operand %{o.sym} is {o.encoding}: this rank's columns "
                + ",".join(f"{a}:{b}" for a, b in spans) + f" are not whole {bs}-value blocks")
    return None


def shard_module(m: Module, n: int, rank: int) -> list[Finding]:
    """Rewrite ``m`` in place into rank ``rank``'s part of ``n``: local attributes, operand parts, local regions."""
    findings: list[Finding] = []
    for layer in m.layers:
        if layer.parallel is not None and len({OPERATORS[op.kind].partition for op in layer.mixers()}) != 1:
            findings.append(Finding("no-partition", "placement Parallel: a split mixer beside a replicated one (their "
                                    f"sum would hold the replicated output N times) under --tp {n}", layer.index,
                                    layer.main_kind()))
    plans = []  # (op, local attrs, [(operand, spec shard, full shape, local shape, ranges)])
    for layer_index, op in _ops(m):
        decl = OPERATORS[op.kind]
        if decl.partition is None:
            findings.append(Finding("no-partition", f"operator kind {op.kind} has no declared partition yet "
                                    f"under --tp {n}", layer_index, op.kind))
            continue
        local, bad = _local(decl, op.attrs, n)
        bad += _spread(decl, op.attrs, local, n, rank)
        for name, msg, expected, actual in bad:
            findings.append(Finding("indivisible", msg, layer_index, op.kind, expected=expected, actual=actual))
        if bad:
            continue
        bound = m.bindings(layer_index)
        cuts = []
        for role, spec in decl.role_specs(op.role):
            if not spec.required(op.attrs) or role not in bound:
                continue
            o = bound[role]
            full, part = tuple(spec.shape(op.attrs)), tuple(spec.shape(local))
            cut = spec.shard if decl.partition == "tensor" else None
            spans = None
            if cut in (None, "once"):
                if part != full:
                    findings.append(Finding("bad-partition", f"role {role} is declared whole but its contract {list(full)} "
                                            f"changes with the divided attributes ({list(part)})", layer_index, op.kind,
                                            role=str(role)))
                    continue
            else:
                d = _dim(cut, len(full))
                spans = _ranges(decl, spec, op.attrs, local, n, rank, full[d])
                same = [s for i, s in enumerate(full) if i != d] == [s for i, s in enumerate(part) if i != d]
                if (not same or spans is None or sum(b - a for a, b in spans) != part[d]
                        or (spec.segments is None and full[d] != part[d] * n)):
                    findings.append(Finding("bad-partition", f"role {role} is declared cut {cut} (dim {d}) but its contract "
                                            f"{list(full)} at the divided attributes is {list(part)}", layer_index, op.kind,
                                            role=str(role)))
                    continue
                why = _encoded_cut(o, cut, d, spans)
                if why:
                    findings.append(Finding(*why, layer_index, op.kind, role=str(role)))
                    continue
            if o.activations is not None and not is_block_encoded(o.encoding):
                findings.append(Finding("no-partition", f"operand %{o.sym} declares {o.activations} activations: no "
                                        f"declared partition yet under --tp {n}", layer_index, op.kind, role=str(role)))
                continue
            cuts.append((o, cut, full, part, spans))
        plans.append((op, local, cuts))
    if findings:
        return findings
    for op, local, cuts in plans:
        op.attrs.clear()
        op.attrs.update(local)
        for o, cut, full, part, spans in cuts:
            if cut in (None, "once"):
                o.shard = Shard(n, once=cut == "once")
                continue
            d = _dim(cut, len(full))
            o.shard = Shard(n, d, spans[0][0], spans[-1][1], ranges=spans if len(spans) > 1 else ())
            o.shape = part
    for layer in m.layers:
        layer.regions = declared_regions(layer)
    return []


def shard_plan(m: Module, n: int, rank: int) -> nx.DiGraph:
    """The plan of the sharded module with one ``all_reduce`` op after every split operator; off rank 0, the
    ``once`` operands unbound (rank 0 adds them)."""
    g = build_plan(m)
    ops: list[PlanOp] = []
    order = plan_ops(g)
    for i, p in enumerate(order):
        ops.append(p)
        decl = OPERATORS.get(p.kind)
        if decl is None or decl.partition != "tensor":
            continue
        beside = i + 1 < len(order) and order[i + 1].parallel  # mixers side by side: one reduce of their sum, after both
        for role, o in list(p.operands.items()):
            if o.shard is not None and o.shard.once and rank != 0:
                del p.operands[role]
                g.remove_edge("%" + o.sym, p.id)
                if g.out_degree("%" + o.sym) == 0:
                    g.remove_node("%" + o.sym)
        if beside:
            continue
        r = PlanOp(f"{p.id}.{REDUCE}", REDUCE, p.layer, 0, {"ranks": n}, slot="reduce")
        g.add_node(r.id, type="op", op=r)
        ops.append(r)
    g.remove_edges_from([(a, b) for a, b, d in g.edges(data=True) if d["type"] == "hidden"])
    for i, p in enumerate(ops):
        p.order = i
        if i:
            g.add_edge(ops[i - 1].id, p.id, type="hidden")
    g.graph["tp"], g.graph["rank"] = n, rank
    return g


@dataclass(frozen=True)
class ShardPass:
    name: str = "shard"

    def run(self, ctx: Context) -> list[Finding]:
        n, rank = ctx.tp, ctx.rank
        if n == 1:
            return []
        if n < 1 or not 0 <= rank < n:
            return [Finding("bad-tp", f"--tp {n} rank {rank}: ranks are 1..N, rank 0..N-1")]
        m = ctx.module
        if any(layer.regions is None for layer in m.layers):
            return [Finding("no-state", "shard needs the state pass first (a layer has no materialised regions)")]
        findings = shard_module(m, n, rank)
        if findings:
            return findings
        ctx.artefacts["plan"] = shard_plan(m, n, rank)
        return []
