"""Triton cases that need the CPU interpreter.

Triton decides at decoration time whether a kernel is interpreted, so when another test module imported
triton without ``TRITON_INTERPRET=1`` the case cannot run here: it re-runs itself, by node id, in a fresh
process with the variable set, and reports that run's outcome. Never a skip.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def triton_case(available: bool):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if available:
                return fn(*args, **kwargs)
            nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
            r = subprocess.run([sys.executable, "-m", "pytest", nodeid, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                               capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=900)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
            assert "1 passed" in r.stdout, r.stdout[-2000:]
        return wrapper
    return deco
