"""``state``: materialise every layer's continuation-state regions from its
operators' declarations. Infers nothing; on an IR that already carries
regions, checks they equal what the operators declare."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.module import Layer, Region
from ..ir.operators import OPERATORS
from .context import Context
from .findings import Finding


def declared_regions(layer: Layer) -> list[Region]:
    out = []
    for op in layer.ops():
        decl = OPERATORS[op.kind]
        for spec in decl.region_specs(op.attrs):
            window = spec.window(op.attrs) if spec.window is not None else 0
            out.append(Region(spec.name, spec.kind, tuple(spec.shape(op.attrs)), spec.precision, spec.growth, window))
    return out


def _key(r: Region):
    return (r.name, r.kind, tuple(r.shape), r.precision, r.growth, r.window)


def _txt(r: Region) -> str:
    w = f" window {r.window}" if r.window else ""
    return f"{r.name} {r.kind} [{','.join(map(str, r.shape))}] {r.precision} {r.growth}{w}"


@dataclass(frozen=True)
class State:
    name: str = "state"

    def run(self, ctx: Context) -> list[Finding]:
        out: list[Finding] = []
        for layer in ctx.module.layers:
            want = declared_regions(layer)
            if layer.regions is None:
                layer.regions = want
                continue
            got = layer.regions
            if [_key(r) for r in got] != [_key(r) for r in want]:
                out.append(Finding(
                    "state-mismatch",
                    f"declared state [{'; '.join(map(_txt, got))}] differs from what its operators require [{'; '.join(map(_txt, want))}]",
                    layer.index, layer.main_kind(), expected=[_txt(r) for r in want], actual=[_txt(r) for r in got]))
        return out
