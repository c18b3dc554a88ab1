"""``verify``: structure, schema version, unique symbols, every referenced
symbol exists, every operator kind and attribute is declared; and, once, that
every file the module names exists where its model directory says."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.module import SCHEMA, DTYPES, Module, Op
from ..ir.operators import OPERATORS
from ..ir.roles import PLACEMENT_NORMS, Role
from .context import Context
from .findings import Finding

SLOT_OF = {"embedding": "embedding", "final_norm": "norm", "head": "head"}


def _short(v) -> str:
    """``repr(v)``, an int of thousands of digits (the IR may spell one) cut to its first digits and its length."""
    t = repr(v)
    return t if len(t) <= 40 or not isinstance(v, int) else f"{t[:12]}...({len(t)} digits)"


def _check_op(op: Op, slot: str, layer: int | None, out: list[Finding]) -> None:
    decl = OPERATORS.get(op.kind)
    if decl is None:
        known = ", ".join(k for k, d in OPERATORS.items() if d.slot == slot)
        out.append(Finding("unknown-operator", f"operator kind {op.kind} is not declared (known {slot} kinds: {known})", layer, op.kind))
        return
    if decl.slot != slot:
        out.append(Finding("wrong-slot", f"operator {op.kind} is a {decl.slot} operator, used as {slot}", layer, op.kind))
        return
    ok = True
    for a in decl.attrs:
        if a.name not in op.attrs:
            if not a.optional:
                out.append(Finding("missing-attribute", f"attribute {a.name} ({a.type}) is not declared", layer, op.kind))
                ok = False
        elif not a.accepts(op.attrs[a.name]):
            want = a.expects(op.attrs[a.name])
            out.append(Finding("bad-attribute", f"attribute {a.name}={_short(op.attrs[a.name])} is not {want}", layer, op.kind,
                               expected=want, actual=op.attrs[a.name]))
            ok = False
    for name in op.attrs:
        if decl.attr(name) is None:
            out.append(Finding("unknown-attribute", f"attribute {name} is not declared by {op.kind}", layer, op.kind))
            ok = False
    for name in op.defaults:
        if name not in op.attrs:
            out.append(Finding("bad-default", f"{name} is marked default but not declared", layer, op.kind))
    if ok:
        for message, rule in decl.rules:
            if not rule(op.attrs):
                out.append(Finding("inconsistent-attributes", message, layer, op.kind))


def verify_structure(m: Module) -> list[Finding]:
    out: list[Finding] = []
    if m.schema != SCHEMA:
        out.append(Finding("schema", f"schema {m.schema} is not supported (this vxc reads schema {SCHEMA})", expected=SCHEMA, actual=m.schema))
    if m.compute not in DTYPES:
        out.append(Finding("bad-dtype", f"compute dtype {m.compute} is unknown"))
    files = set()
    for f in m.files:
        if f.sym in files:
            out.append(Finding("duplicate-symbol", f"file symbol @{f.sym} is defined twice"))
        files.add(f.sym)
    tensors = set()
    for t in m.tensors:
        if t.sym in tensors:
            out.append(Finding("duplicate-symbol", f"tensor symbol ${t.sym} is defined twice", tensor=t.key))
        tensors.add(t.sym)
        refs = [p.file for p in t.parts] if t.is_bank else [t.file]
        for r in refs:
            if r not in files:
                out.append(Finding("undefined-symbol", f"tensor ${t.sym} names undefined file @{r}", tensor=t.key))
        if t.is_bank:
            if "{e}" not in t.key:
                out.append(Finding("bad-bank", f"bank ${t.sym} key has no {{e}} placeholder", tensor=t.key))
            if not _covers_once(t.parts, t.experts):  # interval arithmetic: nothing is expanded per expert
                out.append(Finding("bad-bank", f"bank ${t.sym} parts do not cover experts 0..{t.experts - 1} exactly once", tensor=t.key))
    layer_ids = [layer.index for layer in m.layers]
    if layer_ids != list(range(len(m.layers))):
        out.append(Finding("layer-order", f"layers must be numbered 0..{len(m.layers) - 1} in order, got {layer_ids[:8]}…"))
    operands = set()
    for o in m.operands:
        if o.sym in operands:
            out.append(Finding("duplicate-symbol", f"operand symbol %{o.sym} is defined twice", o.layer, role=str(o.role)))
        operands.add(o.sym)
        for s in o.sources:
            if s not in tensors:
                out.append(Finding("undefined-symbol", f"operand %{o.sym} names undefined tensor ${s}", o.layer, role=str(o.role)))
        if o.layer is not None and not (0 <= o.layer < len(m.layers)):
            out.append(Finding("undefined-layer", f"operand %{o.sym} is bound on layer {o.layer}, which does not exist", o.layer, role=str(o.role)))
        if any(p.encoding is not None and len(p.part_names) != len(set(p.part_names)) for p in (o, *o.parts)):
            out.append(Finding("bad-encoding", f"operand %{o.sym} names an encoded part twice", o.layer, role=str(o.role)))
    _check_op(m.embedding, "embedding", None, out)
    _check_op(m.final_norm, "norm", None, out)
    _check_op(m.head, "head", None, out)
    if m.final_norm.role != Role.FinalNorm:
        out.append(Finding("bad-norm-role", f"the final norm must bind FinalNorm, not {m.final_norm.role}", operator=m.final_norm.kind))
    for layer in m.layers:
        if layer.mixer is not None:
            _check_op(layer.mixer, "mixer", layer.index, out)
        elif layer.placement.value != "PreFfn":
            out.append(Finding("bad-placement", f"placement {layer.placement} needs a mixer; only PreFfn declares none", layer.index))
        if layer.placement.value == "PreFfn" and (layer.mixer is not None or layer.ffn is None):
            out.append(Finding("bad-placement", "placement PreFfn is an FFN-only layer: an FFN and no mixer", layer.index))
        if layer.parallel is not None:
            _check_op(layer.parallel, "mixer", layer.index, out)
        if layer.placement.value == "Parallel":
            if layer.mixer is None or layer.parallel is None:
                out.append(Finding("bad-placement", "placement Parallel declares two mixers side by side, declared "
                                   f"{len(layer.mixers())}", layer.index))
            elif layer.mixer.kind == layer.parallel.kind:
                kind = layer.parallel.kind
                out.append(Finding("bad-placement", f"placement Parallel: the two mixers are both {kind} (two mixers "
                                   f"of one kind would share their state regions' names)", layer.index))
        elif layer.parallel is not None:
            out.append(Finding("bad-placement", f"placement {layer.placement} declares one mixer; only Parallel declares "
                               f"a second", layer.index))
        if layer.ffn is not None:
            _check_op(layer.ffn, "ffn", layer.index, out)
        pre, post = PLACEMENT_NORMS[layer.placement]
        want = list(pre) + (list(post) if layer.ffn is not None else [])
        got = [n.role for n in layer.norms]
        if got != want:
            out.append(Finding("bad-placement", f"placement {layer.placement} with{'' if layer.ffn else 'out'} an FFN needs norms "
                               f"{', '.join(map(str, want)) or 'none'}, declared {', '.join(map(str, got)) or 'none'}",
                               layer.index, expected=[str(r) for r in want], actual=[str(r) for r in got]))
        if layer.placement.value == "PreMixer" and layer.ffn is not None:
            out.append(Finding("bad-placement", "placement PreMixer has no FFN sub-block, but an FFN is declared", layer.index))
        for n in layer.norms:
            _check_op(n, "norm", layer.index, out)
        names = [r.name for r in layer.regions or []]
        if len(names) != len(set(names)):
            out.append(Finding("duplicate-region", "a state region name is declared twice", layer.index))
    return out


@dataclass(frozen=True)
class Verify:
    name: str = "verify"
    check_files: bool = True

    def run(self, ctx: Context) -> list[Finding]:
        out = verify_structure(ctx.module)
        if self.check_files and ctx.model_dir is not None:
            for f in ctx.module.files:
                if not (ctx.model_dir / f.path).is_file():
                    out.append(Finding("missing-file", f"file @{f.sym} {f.path} does not exist in {ctx.model_dir} (if the checkpoint moved, point at it with --model-dir)", tensor=f.path))
        return out


MAX_BANK_EXPERTS = 1 << 16  # a bank names one stored tensor per expert: beyond this it is not a checkpoint


def _covers_once(parts, experts: int) -> bool:
    """The parts' inclusive ranges ``first..last`` tile ``0..experts-1`` exactly once (checked on the ranges'
    ends: an input naming 10**12 experts costs nothing to refuse)."""
    if not 0 < experts <= MAX_BANK_EXPERTS:
        return False
    nxt = 0
    for p in sorted(parts, key=lambda p: p.first):
        if p.first != nxt or p.last < p.first:
            return False
        nxt = p.last + 1
    return nxt == experts
