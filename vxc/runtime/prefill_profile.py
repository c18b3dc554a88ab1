"""Where a prefill's time goes (``vxc exec --profile``): each vxc op of the prefill graphs timed as it runs.

A prefill runs its fx graph op by op (it is not replayed: its shapes follow the prompt), so a dispatch mode around
the graph times every ``torch.ops.vxc`` call and groups the times by the op and the encoding (or dtype) of the weight
it reads, as the decode profile (:class:`vxc.runtime.replay.StepProfile`) does by native call. Graph-level glue
(views) is not timed one by one: it is in the wall time beyond the ops, with the mode's own cost (a clock read and a
dictionary update an op).
"""

from __future__ import annotations

import time
from typing import Optional

from torch.utils._python_dispatch import TorchDispatchMode

from .replay import arg_weights, profile_table


class PrefillProfile(TorchDispatchMode):
    def __init__(self, weights: dict[int, str]):
        super().__init__()
        self.weights = weights
        self.groups: dict[tuple[str, str], list[int]] = {}
        self.runs = 0  # graph runs (a prompt longer than the prefill chunk runs as several)
        self.tokens = 0
        self.wall_ns = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the replay's guard: never import torch._dynamo for this

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "vxc":
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter_ns()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter_ns() - t0
        g = self.groups.setdefault((func._opname, arg_weights(args, self.weights) or "-"), [0, 0])
        g[0] += 1
        g[1] += dt
        return out

    def run(self, graph, ids, pos):
        """``graph(ids, pos)`` with its vxc ops timed."""
        t0 = time.perf_counter_ns()
        with self:
            out = graph(ids, pos)
        self.wall_ns += time.perf_counter_ns() - t0
        self.runs += 1
        self.tokens += int(ids.numel())
        return out

    def summary(self) -> dict:
        """runs, tokens, ms in all (wall, in the ops, the rest) and one row per (op, weights) with its calls, ms and
        share of the wall time, slowest first."""
        wall = self.wall_ns / 1e6
        ops = sum(g[1] for g in self.groups.values()) / 1e6
        rows = [{"op": op, "weights": w, "calls": c, "ms": t / 1e6, "share": (t / 1e6) / wall if wall > 0 else 0.0}
                for (op, w), (c, t) in self.groups.items()]
        rows.sort(key=lambda r: -r["ms"])
        return {"runs": self.runs, "tokens": self.tokens, "ms": wall, "ops_ms": ops, "other_ms": wall - ops, "rows": rows}


class ProfiledGraph:
    """A prefill graph whose calls run under a :class:`PrefillProfile` (what ``Engine.prefill_graph`` returns while
    profiling); everything else is the graph's."""

    def __init__(self, graph, profile: PrefillProfile):
        self.graph, self.profile = graph, profile

    def __call__(self, ids, pos):
        return self.profile.run(self.graph, ids, pos)

    def __getattr__(self, name):
        return getattr(self.graph, name)


def format_prefill(p: Optional[dict]) -> str:
    """``summary()`` as the table ``vxc exec --profile`` prints."""
    if not p or not p["runs"]:
        return "prefill profile: no prefill graph ran (a one-token prompt runs the decode step)"
    head = (f"prefill profile: {p['tokens']} tokens in {p['runs']} chunk{'s' if p['runs'] != 1 else ''}, {p['ms']:.3f} ms "
            f"({p['ops_ms']:.3f} ms in the vxc ops, {p['other_ms']:.3f} ms outside them)")
    return profile_table(head, "ms", p["rows"], ("op", "weights"))
