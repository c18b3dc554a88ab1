"""What running a model costs beyond the model: a prefill, a captured-and-replayed decode and a batched step
import no ``torch._dynamo`` (1.1 s and ~140 MB of RSS: sympy, torch.distributed.tensor, onnx …). It used to come
with ``torch.library.custom_op``'s device wrapper and with a TorchDispatchMode's default ``__torch_dispatch__``
wrapper; vxc registers its operators with ``torch.library.Library`` and its replay guard opts out. Run in a fresh
interpreter: this test process has long imported it (opcheck, …)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests import builders as B

_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from vxc.driver import lower_to_file, model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    mdir, ir = Path(sys.argv[1]), Path(sys.argv[2])
    lower_to_file(mdir, ir)
    m = parse_file(ir)
    for kw in (dict(), dict(sequences=2)):
        eng = Engine(m, model_dir_of(m, ir), dtype=torch.float32, max_context=64, **kw)
        if "sequences" in kw:
            for slot in range(2):
                eng.bind_slot(slot)
                eng.prefill_graph(torch.arange(3, 9 + slot), 0)
            for i in range(4):
                eng.decode_batch([5, 6], [6 + i, 7 + i], [0, 1])
        else:
            s = Session(eng)
            s.prefill(list(range(3, 20)))
            for _ in range(4):
                s.step(5)
            assert eng.replay_status().startswith("replaying"), eng.replay_status()
    heavy = sorted(k for k in sys.modules if k == "torch._dynamo" or k == "sympy" or k.startswith("torch.distributed.tensor"))
    print("HEAVY", heavy)
""")


@pytest.mark.native
def test_running_a_model_imports_no_dynamo(tmp_path):
    from vxc.codegen.kernels import native as N

    if not N.available():
        pytest.skip(N.status())
    mdir = B.build_hf(tmp_path / "m", "llama", B.MINI_HF["llama"], seed=2)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(mdir), str(tmp_path / "m.vxir")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HEAVY []" in r.stdout, r.stdout[-2000:]


def test_compiled_decode_runs_the_vxc_operators(tmp_path):
    """``--compile`` (torch.compile of the decode graph, opt-in) over the Library-registered operators — their
    schemas, in-place KV writes and fakes — equals the eager decode step for step."""
    import torch

    from vxc.driver import lower_to_file, model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    mdir = B.build_hf(tmp_path / "m", "llama", B.MINI_HF["llama"], seed=2)
    ir = tmp_path / "m.vxir"
    lower_to_file(mdir, ir)
    m = parse_file(ir)
    outs = {}
    for comp in (False, True):
        s = Session(Engine(m, model_dir_of(m, ir), dtype=torch.float32, max_context=64, compile_decode=comp))
        s.prefill(list(range(3, 20)))
        outs[comp] = [s.step(5 + i) for i in range(4)]
    for a, b in zip(outs[False], outs[True]):
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), (a - b).abs().max()
