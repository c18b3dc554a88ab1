"""What passes share: the module, where it came from, and derived artefacts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ir.module import Module


@dataclass
class Context:
    module: Module
    model_dir: Path | None = None  # where the module's files live, when known
    artefacts: dict[str, Any] = field(default_factory=dict)  # e.g. "plan" → networkx.DiGraph
    tp: int = 1  # tensor parallelism: ranks, and the rank whose program the ``shard`` pass makes
    rank: int = 0

    @property
    def plan(self):
        return self.artefacts.get("plan")
