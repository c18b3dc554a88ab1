"""The pieces of ``benchmarks/bench.py``: ``models`` (geometries, checkpoint building), ``engines`` (the
bandwidth and engine child processes), ``report`` (the markdown table)."""

from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench.py"  # the entry point every child process re-runs
REPO = SCRIPT.parent.parent
