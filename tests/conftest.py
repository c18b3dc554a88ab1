"""Shared fixtures: header-only witnesses, miniature model directories, the
golden-snapshot extension and ways to run the ``vxc`` command line.

Everything heavy is session-scoped: the three header-only witnesses cost a few
KB of disk each (their data regions are holes) and the miniatures a few KB of
random weights, so the suite builds them once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# Without a GPU, Triton runs only under its interpreter, which ``@triton.jit`` chooses as it decorates, i.e. when
# triton is first imported (tests/codegen/test_kernels.py's docstring). Set here, before anything imports triton,
# every test process can run the Triton cases in place; otherwise each Triton case (or each file's batch of them)
# re-ran itself in a fresh pytest process, its module's fixtures rebuilt there: the Triton-heavy files took 219 s
# instead of 139 s on the 2-CPU VM (2026-12-08). torch's own import does not import triton; a CUDA machine keeps
# its compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode  # noqa: E402

from tests import builders  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "golden"
PYTHON = sys.executable

# The three seed witnesses lowered at full geometry (header-only safetensors).
WITNESS_NAMES = ("mamba2-780m", "mamba2attn-2.7b", "mamba2attn-250m.oute-dialect")


def pytest_configure(config):
    """Under pytest-xdist (the README's test command: two workers on a two-core machine) each worker computes on one
    thread: two workers already use the cores, and a GEMM split over threads that another process keeps busy is
    neither fast nor — for BLAS kernels that size their partition at run time — bit-reproducible, which the
    determinism checks assert. Tests that need several threads set them themselves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        from vxc.codegen.kernels import native

        lib = native.load()
        if lib is not None:
            lib.vxc_set_threads(1)


# ---------------------------------------------------------------- golden snapshots


class _Golden(SingleFileSnapshotExtension):
    """One text file per snapshot under ``<repo>/golden/<test module>/``."""

    _write_mode = WriteMode.TEXT

    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(GOLDEN / test_location.basename)


class VxirSnapshot(_Golden):
    file_extension = "vxir"


class JsonSnapshot(_Golden):
    file_extension = "json"


class TextSnapshot(_Golden):
    file_extension = "txt"


@pytest.fixture
def snapshot(snapshot):
    """syrupy's fixture, storing ``.vxir`` text under golden/."""
    return snapshot.use_extension(VxirSnapshot)


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JsonSnapshot)


@pytest.fixture
def snapshot_text(snapshot):
    """Listings that are not IR (e.g. the ``fuse`` dump), stored as ``.txt`` under golden/."""
    return snapshot.use_extension(TextSnapshot)


# ---------------------------------------------------------------- model directories


@pytest.fixture(scope="session")
def witness_root(tmp_path_factory) -> Path:
    """A directory holding the three witnesses under their own names."""
    root = tmp_path_factory.mktemp("witnesses")
    for name in WITNESS_NAMES:
        builders.witness_header_only(name, root / name)
    return root


@pytest.fixture(scope="session")
def witnesses(witness_root) -> dict[str, Path]:
    return {name: witness_root / name for name in WITNESS_NAMES}


MINI_NAMES = ("native_mamba2", "native_mamba2attn", "oute_base0", "oute_base1",
              "hf_llama", "hf_qwen2", "hf_qwen3", "hf_mamba2")


@pytest.fixture(scope="session")
def mini_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("minis")
    builders.build_native_mamba(root / "native_mamba2", builders.MINI_NATIVE_MAMBA2, seed=1)
    builders.build_native_mamba(root / "native_mamba2attn", builders.MINI_NATIVE_MAMBA2ATTN, seed=2)
    builders.build_oute(root / "oute_base0", builders.MINI_OUTE, index_base=0, seed=3)
    # the same layer list [2, 4], but the checkpoint puts attention on layers 1, 3
    builders.build_oute(root / "oute_base1", builders.MINI_OUTE, index_base=1, seed=4)
    for mt in ("llama", "qwen2", "qwen3", "mamba2"):
        builders.build_hf(root / f"hf_{mt}", mt, builders.MINI_HF[mt], seed=5)
    return root


@pytest.fixture(scope="session")
def minis(mini_root) -> dict[str, Path]:
    return {name: mini_root / name for name in MINI_NAMES}


# ---------------------------------------------------------------- running vxc


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture(scope="session")
def cli():
    """Run the typer app in-process: ``cli("lower", dir, "-o", out)``."""
    from typer.testing import CliRunner

    from vxc.cli import app

    runner = CliRunner()

    def run(*args) -> Ran:
        r = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception  # a crash is a test failure with its own traceback
        return Ran(r.exit_code, r.stdout, r.stderr)

    return run


@pytest.fixture(scope="session")
def vxc_sub():
    """Run ``python -m``-style ``vxc`` in a subprocess (what a user sees, tracebacks included)."""

    def run(*args, cwd=None, timeout=120) -> Ran:
        code = "import sys; from vxc.cli import main; sys.argv = ['vxc'] + sys.argv[1:]; main()"
        p = subprocess.run([PYTHON, "-c", code, *map(str, args)], capture_output=True, text=True,
                           cwd=cwd, timeout=timeout, env={**os.environ, "COLUMNS": "120"})
        return Ran(p.returncode, p.stdout, p.stderr)

    return run


@pytest.fixture(scope="session")
def describe_json(cli):
    """``vxc describe --json`` of a path, parsed (cached per path and context)."""
    cache: dict = {}

    def get(path, context=None) -> dict:
        key = (str(path), context)
        if key not in cache:
            args = ["describe", path, "--json"] + (["--context", context] if context is not None else [])
            r = cli(*args)
            assert r.exit_code == 0, r.output
            cache[key] = json.loads(r.stdout)
        return cache[key]

    return get


# ---------------------------------------------------------------- the native kernels


def pytest_collection_modifyitems(config, items):
    """Tests marked ``native`` exercise the compiled CPU kernels (or the decode replay built on them): with
    ``VXC_NATIVE=0`` in the environment (the user turned them off) they are skipped, saying so; anywhere else a
    library that fails to build fails those tests (it is never skipped silently)."""
    if os.environ.get("VXC_NATIVE", "1") != "0":
        return
    skip = pytest.mark.skip(reason="needs the native kernels, turned off by VXC_NATIVE=0")
    for item in items:
        if item.get_closest_marker("native") is not None:
            item.add_marker(skip)
