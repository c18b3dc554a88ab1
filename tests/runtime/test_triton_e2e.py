"""Every Triton kernel exercised end to end inside miniature parity runs.

A fresh process with ``TRITON_INTERPRET=1`` (it must be set before triton is
imported) routes every ``torch.ops.vxc.*`` call to the Triton launchers
(``set_backend("triton")``) and runs two miniatures against their references
at the floor tolerance:

- mamba2attn native (Mamba2 + conv-QKV attention): prefill of 40 tokens (SSD
  chunks 16 + 16 + 8), prefill 35 then 5 decode steps, then 6 greedy tokens —
  embedding, add_rmsnorm, linear, conv1d_prefill, conv1d_step, ssd_prefill,
  ssd_step, gated_rmsnorm, rotary, attention;
- qwen3 (softmax attention with q/k norms + SwiGLU): the same schedule —
  adds swiglu.

The child counts the calls reaching each Triton launcher and each torch twin;
the parent asserts every launcher ran and no twin did.

Run as a script, this file is the child: ``python test_triton_e2e.py child
NAME=MODEL_DIR=IR ...`` prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OPS = ("add_rmsnorm", "gated_rmsnorm", "conv1d_prefill", "conv1d_step", "ssd_prefill", "ssd_step", "rotary",
       "attention", "linear", "swiglu", "embedding")
N_PROMPT, SPLIT, N_GREEDY = 40, 35, 6


def child(specs: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    torch.set_num_threads(1)
    from tests import references as R
    from tests.runtime import parity_table as P
    from vxc.codegen import kernels as K
    from vxc.codegen.kernels.triton_common import INTERPRETED
    from vxc.runtime.session import Session

    assert INTERPRETED
    K.set_backend("triton")
    counts = {"triton": dict.fromkeys(OPS, 0), "torch": dict.fromkeys(OPS, 0)}

    def counting(which, name, fn):
        def wrapped(*a, **kw):
            counts[which][name] += 1
            return fn(*a, **kw)
        return wrapped

    for name in OPS:
        impls = K.KERNELS[name].impls
        impls["triton"] = counting("triton", name, impls["triton"])
        impls["torch"] = counting("torch", name, impls["torch"])
    out = {"families": {}, "interpreted": bool(INTERPRETED), "backend": K.get_backend()}
    for spec in specs:
        name, mdir, ir = spec.split("=")
        f = P.FAMILIES[name]
        ids = P.prompt_ids(f)[:N_PROMPT]
        ref = P.Reference(f, Path(mdir))
        with K.backend("torch"):  # the references never touch vxc's kernels, but be explicit
            r32, r64, rstep = ref.full(ids), ref.full(ids, fp64=True), ref.prefill_then_step(ids, SPLIT)
            gref = ref.greedy(ids, N_GREEDY)
        fl = R.floor_and_tolerance(r32, r64, rstep)
        before = {k: dict(v) for k, v in counts.items()}
        s = Session(P.engine_for(Path(ir), max_context=64))
        full = s.prefill(ids)
        s.reset()
        rows = [s.prefill(ids[:SPLIT])] + [s.step(t)[None] for t in ids[SPLIT:]]
        stepped = torch.cat(rows)
        last, gen = stepped[-1], []
        for i in range(N_GREEDY):
            gen.append(int(last[: f.vocab].argmax()))
            if i + 1 < N_GREEDY:
                last = s.step(gen[-1])
        agree, excluded = R.argmax_agreement(r32[:, : f.vocab], full[:, : f.vocab], fl["tol"])
        out["families"][name] = {
            "err": P.maxabs(full, r32), "err64": P.maxabs(full, r64), "err_step": P.maxabs(stepped, r32),
            "floor": fl["floor"], "tol": fl["tol"], "argmax": agree, "excluded": excluded,
            "greedy": gen, "greedy_ref": gref, "shape": list(full.shape),
            "calls": {k: {op: counts[k][op] - before[k][op] for op in OPS} for k in counts},
        }
    out["calls"] = counts
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "child":
        child(sys.argv[2:])
        raise SystemExit(0)
    raise SystemExit("usage: test_triton_e2e.py child NAME=MODEL_DIR=IR ...")

# ---------------------------------------------------------------- the test

import pytest  # noqa: E402

from tests.runtime.conftest import child_env, read_json_line, run_python  # noqa: E402

FAMILIES = {
    "mamba2attn-native": {"embedding", "add_rmsnorm", "linear", "conv1d_prefill", "conv1d_step", "ssd_prefill", "ssd_step",
                          "gated_rmsnorm", "rotary", "attention"},
    "qwen3": {"embedding", "add_rmsnorm", "linear", "rotary", "attention", "swiglu"},
}


@pytest.fixture(scope="module")
def triton_run(lab):
    specs = []
    for name in FAMILIES:
        mdir, ir = lab.built(name)
        specs.append(f"{name}={mdir}={ir}")
    r = run_python([__file__, "child", *specs], timeout=600, env=child_env(TRITON_INTERPRET="1"))
    assert r.exit_code == 0, r.output[-4000:]
    return read_json_line(r.stdout)


def test_every_triton_op_runs_and_no_torch_twin(triton_run):
    assert triton_run["interpreted"] and triton_run["backend"] == "triton"
    calls = triton_run["calls"]
    assert {op for op, n in calls["triton"].items() if n > 0} == set(OPS)
    assert all(n == 0 for n in calls["torch"].values()), calls["torch"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_triton_parity_at_the_floor(lab, triton_run, name):
    r = triton_run["families"][name]
    f = lab.family(name)
    print(f"{name} (triton, interpreted): max-abs {r['err']:.3e}, step {r['err_step']:.3e}, tol {r['tol']:.3e}, "
          f"excluded {r['excluded']}/{N_PROMPT}")
    assert r["shape"] == [N_PROMPT, f.padded_vocab]
    ran = {op for op, n in r["calls"]["triton"].items() if n > 0}
    assert FAMILIES[name] <= ran, FAMILIES[name] - ran
    assert r["err"] <= r["tol"] and r["err64"] <= r["tol"]
    assert r["err_step"] <= r["tol"]
    assert r["argmax"] == 1.0 and r["excluded"] <= 2
    assert r["greedy"] == r["greedy_ref"]
