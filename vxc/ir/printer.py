"""Deterministic printer: Module → VINDEX3 text. ``parse(print(m))`` round-trips."""

from __future__ import annotations

import json
import math
from typing import Any

from .module import Layer, Module, Op, Operand, Region, Tensor, Transform


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
        return "[" + ", ".join(str(x) for x in v) + "]"
    if isinstance(v, str):
        return v if v.isidentifier() and v not in ("true", "false", "inf", "nan") else json.dumps(v)
    raise TypeError(f"cannot print attribute value {v!r}")


def fmt_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def fmt_attrs(op: Op) -> str:
    parts = []
    for name, value in op.attrs.items():
        mark = " (default)" if name in op.defaults else ""
        parts.append(f"{name}={fmt_value(value)}{mark}")
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
    raise ValueError(t.kind)


def fmt_tensor(t: Tensor) -> str:
    head = f"tensor ${t.sym} {t.dtype}{fmt_shape(t.shape)}"
    if not t.is_bank:
        return f"{head} @{t.file} {fmt_str(t.key)}"
    parts = " ".join(f"@{p.file} {p.first}..{p.last}" for p in t.parts)
    return f"{head} bank {fmt_str(t.key)} experts {t.experts} {parts}"


def fmt_operand(o: Operand) -> str:
    if o.encoding is None:
        src = f"${o.sources[0]}"
    else:
        src = o.encoding + "(" + ", ".join(f"{n} ${s}" for n, s in zip(o.part_names, o.sources)) + ")"
    xs = "".join(" " + fmt_transform(t) for t in o.transforms)
    layer = f" layer {o.layer}" if o.layer is not None else ""
    return f"operand %{o.sym} {o.dtype}{fmt_shape(o.shape)} = {src}{xs}{layer} role {o.role}"


def fmt_region(r: Region) -> str:
    w = f" window {r.window}" if r.window else ""
    return f"state {r.name} {r.kind} {fmt_shape(r.shape)} {r.precision} {r.growth}{w}"


def _op_line(keyword: str, op: Op) -> str:
    role = f" {op.role}" if op.role is not None else ""
    attrs = fmt_attrs(op)
    return f"{keyword}{role} {op.kind}" + (f" {attrs}" if attrs else "")


def fmt_layer(layer: Layer, ind: str) -> list[str]:
    out = [f"{ind}layer {layer.index} {{"]
    i2 = ind + "  "
    out.append(f"{i2}residual {layer.residual}")
    out.append(f"{i2}placement {layer.placement}")
    for n in layer.norms:
        out.append(i2 + _op_line("norm", n))
    out.append(i2 + _op_line("mixer", layer.mixer))
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
        lines.append(f"{ind}fact {f.name} {fmt_value(f.value)} evidence {fmt_str(f.evidence)}")
    lines.append(f"{ind}compute {m.compute}")
    if m.index is not None:
        lines.append(f"{ind}index {fmt_str(m.index.path)} size {m.index.size} sha256 {fmt_str(m.index.sha256)}")
    for f in m.files:
        lines.append(f"{ind}file @{f.sym} {fmt_str(f.path)} size {f.size} header_sha256 {fmt_str(f.header_sha256)}")
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
