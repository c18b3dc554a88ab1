"""Runtime test fixtures: miniatures built and lowered once per session, their
references and engines cached, and ways to run vxc in-process and in a fresh
process.

The miniatures (tests/builders.py geometries, random weights, seeds chosen in
``parity_table.FAMILIES``) are tiny, so the runtime tests run single-threaded:
on a small, shared CPU, OpenMP threads spinning over 40-wide matrices cost far
more than they save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.runtime import parity_table as P

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a fresh python process: the repo importable, one thread, quiet transformers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                "TRANSFORMERS_VERBOSITY": "error", "COLUMNS": "120", "PYTHONHASHSEED": "0"})
    env.update(extra)
    return env


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_python(args: list[str], timeout: int = 300, env: dict | None = None, cwd: Path | None = None) -> Ran:
    p = subprocess.run([PYTHON, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=env or child_env(), cwd=cwd or REPO)
    return Ran(p.returncode, p.stdout, p.stderr)


@pytest.fixture(scope="session")
def vxc_proc():
    """``vxc ARGS`` in a fresh process (what a user sees, tracebacks included)."""
    def run(*args, timeout: int = 300, cwd: Path | None = None) -> Ran:
        return run_python(["-m", "vxc.cli", *args], timeout=timeout, cwd=cwd)

    return run


@pytest.fixture(scope="session")
def vxc_inproc():
    """``vxc ARGS`` through the typer app in this process; a crash (not a clean exit) raises."""
    from typer.testing import CliRunner

    from vxc.cli import app

    runner = CliRunner()

    def run(*args) -> Ran:
        r = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
        return Ran(r.exit_code, r.stdout, r.stderr)

    return run


# ---------------------------------------------------------------- miniatures


class Lab:
    """Lazily builds, lowers and measures each family once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, tuple[Path, Path]] = {}
        self._refs: dict[str, P.Reference] = {}
        self._engines: dict[str, object] = {}
        self._parity: dict[str, P.Parity] = {}

    def family(self, name: str) -> P.Family:
        return P.FAMILIES[name]

    def built(self, name: str) -> tuple[Path, Path]:
        """(model dir, .vxir)."""
        if name not in self._built:
            self._built[name] = P.build(P.FAMILIES[name], self.root)
        return self._built[name]

    def ref(self, name: str) -> P.Reference:
        if name not in self._refs:
            self._refs[name] = P.Reference(P.FAMILIES[name], self.built(name)[0])
        return self._refs[name]

    def engine(self, name: str):
        """The shared fp32 engine (max_context 256); callers reset its state before use."""
        if name not in self._engines:
            self._engines[name] = P.engine_for(self.built(name)[1], max_context=256)
        return self._engines[name]

    def parity(self, name: str) -> P.Parity:
        if name not in self._parity:
            mdir, ir = self.built(name)
            self._parity[name] = P.measure(P.FAMILIES[name], mdir, ir, ref=self.ref(name), engine=self.engine(name))
        return self._parity[name]


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Lab:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return Lab(tmp_path_factory.mktemp("runtime-minis"))


def read_json_line(stdout: str) -> dict:
    """The one JSON object ``--json`` prints (the last non-empty line)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])
