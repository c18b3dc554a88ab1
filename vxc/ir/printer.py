"""Deterministic printer: Module → VINDEX3 text. ``parse(print(m))`` round-trips."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .module import Layer, Module, Op, Operand, Region, Tensor, Transform

# What the grammar lexes as NAME / a symbol. Anything printed bare must match,
# or the printer would write text the parser rejects (or reads differently).
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SYM = {"$": re.compile(r"[A-Za-z0-9_.]+"), "@": re.compile(r"[A-Za-z0-9_.]+"), "%": re.compile(r"[A-Za-z0-9_.\-]+")}
# Line breaks for str.splitlines() that JSON leaves unescaped; keep them out of
# the text so every line number means the same to lark and to diagnostics.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _ident(s: Any, what: str) -> str:
    if not isinstance(s, str) or not _IDENT.fullmatch(s):
        raise ValueError(f"cannot print {what} {s!r}: not an identifier [A-Za-z_][A-Za-z0-9_]*")
    return s


def _sym(prefix: str, s: Any, what: str) -> str:
    if not isinstance(s, str) or not _SYM[prefix].fullmatch(s):
        raise ValueError(f"cannot print {what} {prefix}{s!r}: not a symbol name {_SYM[prefix].pattern}")
    return prefix + s


def fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, list):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise TypeError(f"cannot print attribute value {v!r}: lists hold ints only")
        return "[" + ", ".join(str(x) for x in v) + "]"
    if isinstance(v, str):
        # str.isidentifier() admits non-ASCII names the grammar's NAME does not
        return v if _IDENT.fullmatch(v) and v not in ("true", "false", "inf", "nan") else json.dumps(v)
    raise TypeError(f"cannot print attribute value {v!r}")


def fmt_str(s: str) -> str:
    out = json.dumps(s, ensure_ascii=False)
    for ch, esc in _LINE_BREAKS.items():
        out = out.replace(ch, esc)
    return out


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def fmt_attrs(op: Op) -> str:
    parts = []
    for name, value in op.attrs.items():
        mark = " (default)" if name in op.defaults else ""
        parts.append(f"{_ident(name, 'attribute name')}={fmt_value(value)}{mark}")
    return " ".join(parts)


def fmt_transform(t: Transform) -> str:
    if t.kind == "slice":
        return f"| slice {t.dim} [{t.start}:{t.stop}]"
    if t.kind == "gather":
        takes = ", ".join(f"{a}:{b}" for a, b in t.takes)
        return f"| gather {t.dim} groups {t.groups} [{takes}]"
    if t.kind == "reshape":
        return f"| reshape {fmt_shape(t.shape)}"
    if t.kind == "transpose":
        return f"| transpose {t.dim} {t.dim2}"
    if t.kind == "log_neg":
        return "| log_neg"
    raise ValueError(t.kind)


def fmt_tensor(t: Tensor) -> str:
    head = f"tensor {_sym('$', t.sym, 'tensor')} {_ident(t.dtype, 'dtype')}{fmt_shape(t.shape)}"
    if not t.is_bank:
        return f"{head} {_sym('@', t.file, 'file')} {fmt_str(t.key)}"
    if not t.parts:
        raise ValueError(f"cannot print bank ${t.sym}: it has no parts")
    parts = " ".join(f"{_sym('@', p.file, 'file')} {p.first}..{p.last}" for p in t.parts)
    return f"{head} bank {fmt_str(t.key)} experts {t.experts} {parts}"


def _fmt_source(o: Operand) -> str:
    if o.parts:
        if o.concat_dim is None:
            raise ValueError(f"cannot print operand %{o.sym}: parts but no concat dim")
        return f"concat {o.concat_dim} (" + ", ".join(
            _fmt_source(p) + "".join(" " + fmt_transform(t) for t in p.transforms) for p in o.parts) + ")"
    if o.encoding is None:
        if len(o.sources) != 1:
            raise ValueError(f"cannot print operand %{o.sym}: {len(o.sources)} sources but no encoding")
        return _sym("$", o.sources[0], "tensor")
    if not o.sources or len(o.part_names) != len(o.sources):
        raise ValueError(f"cannot print operand %{o.sym}: encoded parts {o.part_names} do not match sources {o.sources}")
    if o.encoding == "concat":  # the keyword of a concatenation: no encoding can be called so
        raise ValueError(f"cannot print operand %{o.sym}: encoding name 'concat' is the concatenation keyword")
    return _ident(o.encoding, "encoding") + "(" + ", ".join(
        f"{_ident(n, 'encoded part name')} {_sym('$', s, 'tensor')}" for n, s in zip(o.part_names, o.sources)) + ")"


def fmt_operand(o: Operand) -> str:
    src = _fmt_source(o)
    xs = "".join(" " + fmt_transform(t) for t in o.transforms)
    layer = f" layer {o.layer}" if o.layer is not None else ""
    act = f" activations {_ident(o.activations, 'activation precision')}" if o.activations is not None else ""
    part = f" | {o.shard.text()}" if o.shard is not None else ""  # tensor parallel (the shard pass): this rank's part
    return f"operand {_sym('%', o.sym, 'operand')} {_ident(o.dtype, 'dtype')}{fmt_shape(o.shape)} = {src}{xs}{layer} role {o.role}{act}{part}"


def fmt_region(r: Region) -> str:
    w = f" window {r.window}" if r.window else ""
    return (f"state {_ident(r.name, 'region name')} {_ident(r.kind, 'region kind')} {fmt_shape(r.shape)} "
            f"{_ident(r.precision, 'precision')} {_ident(r.growth, 'growth')}{w}")


def _op_line(keyword: str, op: Op) -> str:
    role = f" {op.role}" if op.role is not None else ""
    attrs = fmt_attrs(op)
    return f"{keyword}{role} {_ident(op.kind, 'operator kind')}" + (f" {attrs}" if attrs else "")


def fmt_layer(layer: Layer, ind: str) -> list[str]:
    out = [f"{ind}layer {layer.index} {{"]
    i2 = ind + "  "
    out.append(f"{i2}residual {_ident(layer.residual, 'residual')}")
    out.append(f"{i2}placement {layer.placement}")
    for n in layer.norms:
        out.append(i2 + _op_line("norm", n))
    if layer.mixer is not None:
        out.append(i2 + _op_line("mixer", layer.mixer))
    if layer.parallel is not None:  # placement Parallel: the second mixer, its own line in order
        out.append(i2 + _op_line("mixer", layer.parallel))
    if layer.ffn is not None:
        out.append(i2 + _op_line("ffn", layer.ffn))
    for r in layer.regions or []:
        out.append(i2 + fmt_region(r))
    out.append(f"{ind}}}")
    return out


def print_module(m: Module) -> str:
    ind = "  "
    lines = [f"vindex3 schema {m.schema}", f"module {fmt_str(m.name)} {{"]
    s = m.source
    lines.append(
        f"{ind}source frontend {fmt_str(s.frontend)} dialect {fmt_str(s.dialect)} "
        f"model_dir {fmt_str(s.model_dir)} config_sha256 {fmt_str(s.config_sha256)}"
    )
    for f in m.facts:
        lines.append(f"{ind}fact {_ident(f.name, 'fact name')} {fmt_value(f.value)} evidence {fmt_str(f.evidence)}")
    lines.append(f"{ind}compute {_ident(m.compute, 'compute dtype')}")
    if m.index is not None:
        lines.append(f"{ind}index {fmt_str(m.index.path)} size {m.index.size} sha256 {fmt_str(m.index.sha256)}")
    for f in m.files:
        fmt = "" if f.format == "safetensors" else f" format {_ident(f.format, 'file format')}"
        lines.append(f"{ind}file {_sym('@', f.sym, 'file')} {fmt_str(f.path)}{fmt} size {f.size} header_sha256 {fmt_str(f.header_sha256)}")
    lines.append("")
    for t in m.tensors:
        lines.append(ind + fmt_tensor(t))
    lines.append("")
    for o in m.operands:
        lines.append(ind + fmt_operand(o))
    lines.append("")
    lines.append(ind + _op_line("embedding", m.embedding))
    for layer in m.layers:
        lines.extend(fmt_layer(layer, ind))
    lines.append(ind + _op_line("final_norm", m.final_norm))
    lines.append(ind + _op_line("head", m.head))
    lines.append("}")
    return "\n".join(lines) + "\n"
