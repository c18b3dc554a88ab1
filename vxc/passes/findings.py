"""Findings: itemised, machine-readable refusals."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Finding:
    code: str  # e.g. "missing-operand", "unclassified", "shape-mismatch"
    message: str
    layer: int | None = None
    operator: str | None = None
    role: str | None = None
    tensor: str | None = None
    expected: Any = None
    actual: Any = None
    pass_name: str = ""

    def where(self) -> str:
        if self.layer is None:
            return f"model {self.operator}" if self.operator else "model"
        return f"layer {self.layer} {self.operator}" if self.operator else f"layer {self.layer}"

    def line(self) -> str:
        return f"{self.where()}: {self.message}  [{self.code}]"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("pass_name")
        for k in ("expected", "actual"):
            d[k] = _json_value(d[k])
        return d


def _json_value(v: Any) -> Any:
    """A value strict JSON can hold: tuples as lists; a NaN or infinite float (an attribute may be one) as the
    IR spells it ("nan", "inf", "-inf") — json.dumps would write NaN / Infinity, which JSON parsers reject."""
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class Refusal(Exception):
    def __init__(self, pass_name: str, findings: list[Finding]):
        self.pass_name = pass_name
        self.findings = findings
        super().__init__(self.text())

    def text(self) -> str:
        n = len(self.findings)
        lines = [f"refused: {n} finding{'s' if n != 1 else ''} ({self.pass_name})"]
        lines += ["  " + f.line() for f in self.findings]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"refused": True, "pass": self.pass_name, "count": len(self.findings),
                "findings": [f.to_json() for f in self.findings]}
