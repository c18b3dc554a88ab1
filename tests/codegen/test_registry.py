"""The kernel pattern itself: every declared kernel has its twin and an op, every native binding names a C
function of the loaded library with its ctypes signature set, and a native implementation that declines a call
(``NotCovered``) hands it to the twin visibly: recorded in ``kernels.fallbacks()``, shown by ``report()`` and by
``vxc exec --json`` / ``--kernel-report``, and refusing a decode capture."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vxc.codegen import kernels
from vxc.codegen.kernels import dense
from vxc.codegen.kernels import native as N
from vxc.codegen.kernels.registry import IMPLEMENTATIONS


def test_every_kernel_has_a_twin_and_an_op():
    assert kernels.KERNELS
    for name, k in kernels.KERNELS.items():
        assert "torch" in k.impls, f"{name} has no torch twin"
        assert set(k.impls) <= set(IMPLEMENTATIONS), (name, list(k.impls))
        assert hasattr(torch.ops.vxc, name), name
    assert kernels.NATIVE_OPS == {n for n, k in kernels.KERNELS.items() if "native" in k.impls}


@pytest.mark.native
def test_every_native_binding_is_a_library_function_with_its_signature():
    import vxc.runtime.replay  # noqa: F401  (declares vxc_run_program: run alone, nothing else imports it)

    lib = N.load()
    assert lib is not None, N.status()
    assert lib.vxc_abi_version() == N.abi_version()
    exported = set(re.findall(r"^void (vxc_\w+)\(", N.SOURCE.read_text(), re.MULTILINE))
    assert set(N.SIGNATURES) == exported  # every C kernel is bound, every binding names a C kernel
    for symbol, argtypes in N.SIGNATURES.items():
        fn = getattr(lib, symbol)
        assert fn.argtypes == argtypes and fn.restype is None, symbol


@pytest.mark.native
def test_a_native_fallback_is_recorded_reported_and_refuses_a_capture():
    kernels.reset_fallbacks()
    x, w = torch.randn(1, 40, dtype=torch.float16), torch.randn(30, 40, dtype=torch.float16)  # fp16: not native
    with pytest.raises(kernels.NotCovered, match="operands"):
        kernels.dense.linear_native(x, w, None)
    rec = N.Recorder()
    with N.recording(rec):
        got = torch.ops.vxc.linear(x, w, None)
        torch.ops.vxc.linear(x, w, None)
    torch.testing.assert_close(got, kernels.dense.linear_twin(x, w, None))
    assert rec.calls == [] and rec.failed == f"linear ran its torch twin ({N.OPERANDS})"
    assert kernels.fallbacks() == {"linear": {"native": {N.OPERANDS: 2}}}
    rep = kernels.report()
    assert rep["backend"] == "auto" and rep["native"].startswith("loaded") and rep["fallbacks"] == kernels.fallbacks()
    assert f"linear: native → torch twin × 2 ({N.OPERANDS})" in kernels.format_report()
    # a covered call records nothing; the torch backend selects the twin itself (no fallback)
    kernels.reset_fallbacks()
    torch.ops.vxc.linear(x.float(), w.float(), None)
    with kernels.backend("torch"):
        torch.ops.vxc.linear(x, w, None)
    assert kernels.fallbacks() == {}
    assert "no fallbacks" in kernels.format_report()


@pytest.fixture(scope="module")
def qwen3_ir(tmp_path_factory):
    from tests.runtime import parity_table as P

    return P.build(P.FAMILIES["qwen3"], tmp_path_factory.mktemp("registry"))[1]


def _exec(*args):
    from typer.testing import CliRunner

    from vxc.cli import app

    r = CliRunner().invoke(app, ["exec", str(args[0]), *map(str, args[1:])], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.native
def test_exec_json_reports_the_kernels(qwen3_ir):
    """A prefill of more rows than the native GEMV takes (dense.GEMV_MAX_ROWS) runs the BLAS GEMM of the twin: its
    linears are recorded fallbacks; the single-token decode steps run natively."""
    ids = ",".join(str(1 + i % 50) for i in range(dense.GEMV_MAX_ROWS + 3))
    res = json.loads(_exec(qwen3_ir, "--tokens", ids, "--max-new-tokens", 3, "--json").stdout.splitlines()[-1])
    rep = res["kernels"]
    assert rep["backend"] == "auto" and rep["native"].startswith("loaded")
    assert rep["fallbacks"]["linear"]["native"][N.SEQUENCE] > 0
    with kernels.backend("auto"):  # (exec --kernels sets the process's backend)
        r = _exec(qwen3_ir, "--tokens", "1,2,3", "--max-new-tokens", 2, "--json", "--kernels", "torch")
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["kernels"]["backend"] == "torch" and res["kernels"]["fallbacks"] == {}


@pytest.mark.native
def test_exec_kernel_report(qwen3_ir):
    ids = ",".join(str(1 + i % 50) for i in range(dense.GEMV_MAX_ROWS + 3))
    r = _exec(qwen3_ir, "--tokens", ids, "--max-new-tokens", 2, "--kernel-report")
    assert "kernels: backend auto · native loaded" in r.stderr
    assert "linear: native → torch twin × " in r.stderr and N.SEQUENCE in r.stderr
