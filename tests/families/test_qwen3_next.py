"""Qwen3-Next (``qwen3_next``): gated-delta linear attention + output-gated softmax attention + MoE.

- Parity at the floor (VINDEX3.md) against transformers 5.24's Qwen3NextForCausalLM on a random fp32
  miniature (awkward widths, Hv ≠ Hk, both mixer kinds, an MoE FFN on four layers and a dense one on
  another, a prompt of three delta chunks): max-abs within tolerance, argmax agreement, vxc prefill 0..n ==
  prefill 0..k + steps, 32 greedy tokens identical, and identical expert selection at every token.
- The two config dialects execute bit-identically and match the reference; the decode step replays
  natively; the dense miniature end to end on the Triton kernels.

The lowering (program, dialects, views, refusals, the witness) is checked in tests/frontends/test_qwen3_next.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import references as R
from tests.families import qwen3_next_support as Q
from tests.families.qwen3_next_support import dialects, moe_dir, root  # noqa: F401  (fixtures)


# ---------------------------------------------------------------- parity at the floor


@pytest.fixture(scope="module")
def parity(moe_dir):
    """Every measurement of the MoE miniature, once."""
    ids = Q.prompt(0)
    ref = Q.Reference(moe_dir, moe=True)
    r32, ref_sel = ref.full(ids)
    r64, margins = ref.full64(ids)
    fl = R.floor_and_tolerance(r32, r64, ref.prefill_then_step(ids, Q.SPLIT))
    eng = Q.engine(moe_dir)
    tap = Q.RouterTap(eng)
    run = Q.vxc_run(eng, ids, Q.SPLIT, Q.GREEDY_NEW, tap)
    agree, excluded = R.argmax_agreement(r32[:, :Q.VOCAB], run.full[:, :Q.VOCAB], fl["tol"])
    return dict(ids=ids, r32=r32, r64=r64, fl=fl, run=run, agree=agree, excluded=excluded,
                ref_sel=ref_sel, margins=margins, greedy_ref=ref.greedy(ids, Q.GREEDY_NEW), eng=eng)


def test_parity_at_the_floor(parity):
    fl, run = parity["fl"], parity["run"]
    err = Q.maxabs(run.full, parity["r32"])
    step_err = Q.maxabs(run.stepped, run.full)
    row = {"family": "qwen3_next (moe miniature)", "max_abs": err, "vs_fp64": Q.maxabs(run.full, parity["r64"]),
           "floor": fl["floor"], "tol": fl["tol"], "max|logit|": fl["max_abs_logit"], "argmax": parity["agree"],
           "excluded": f"{parity['excluded']}/{len(parity['ids'])}", "step_err": step_err,
           "greedy_match": run.greedy == parity["greedy_ref"], "distinct": len(set(run.greedy))}
    print("\nPARITY", json.dumps(row))
    assert run.full.shape == (Q.PROMPT_LEN, Q.VOCAB)
    assert fl["max_abs_logit"] > 3.0  # logits spread over several units: argmax checks are not vacuous
    assert err <= fl["tol"], row
    assert step_err <= fl["tol"], row  # vxc prefill 0..n == prefill 0..k + steps k..n
    assert Q.maxabs(run.stepped, parity["r32"]) <= fl["tol"], row
    assert parity["excluded"] <= len(parity["ids"]) // 10, row
    assert parity["agree"] == 1.0, row


def test_greedy_32_tokens(parity):
    run = parity["run"]
    assert len(run.greedy) == Q.GREEDY_NEW
    assert run.greedy == parity["greedy_ref"]
    assert len(set(run.greedy)) >= Q.MIN_DISTINCT


def test_expert_selection_identical_at_every_token(parity):
    ref_sel, got = parity["ref_sel"], parity["run"].selections
    assert sorted(ref_sel) == [0, 1, 3, 4]  # MoE everywhere but mlp_only_layers [2]
    assert len(got) == 4  # one router call per MoE layer, in layer order
    for layer, sel in zip(sorted(ref_sel), got):
        assert sel.shape == (Q.PROMPT_LEN, 3)
        want = ref_sel[layer].sort(-1).values.long()
        assert torch.equal(sel.sort(-1).values.long(), want), f"layer {layer}: expert selection differs"
    # the selection is decided, not a coin toss: the closest k-th / (k+1)-th gap, for the record
    print("\nROUTER MARGINS", {i: float(m.min()) for i, m in parity["margins"].items()})


def test_runs_are_bit_identical(parity, moe_dir):
    from vxc.runtime.session import Session

    s = Session(parity["eng"])
    s.reset()
    again = s.prefill(parity["ids"])
    assert torch.equal(again, parity["run"].full)
    fresh = Session(Q.engine(moe_dir)).prefill(parity["ids"])
    assert torch.equal(fresh, parity["run"].full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.native
def test_decode_replays_natively_bit_identical_to_the_graph(moe_dir, dtype):
    """Gated delta, gated softmax, router, experts and shared expert all have native one-token forms, so the
    decode step is captured and replayed; replayed steps equal the graph's bit for bit."""
    from tests.families.latent_support import assert_replay_bit_identical

    assert_replay_bit_identical(moe_dir, Q.prompt(0)[:20], Q.prompt(1)[:12], dtype)


# ---------------------------------------------------------------- config dialects


def test_both_dialects_execute_bit_identically_and_match_the_reference(dialects):
    from vxc.runtime.session import Session

    new, hub = dialects
    ids = Q.prompt(3, n=80)
    a = Session(Q.engine(new)).prefill(ids)
    b = Session(Q.engine(hub)).prefill(ids)
    assert torch.equal(a, b)
    ref = Q.Reference(new, moe=False)  # a dense stack: swiglu on every layer
    r32, _ = ref.full(ids)
    r64, _ = ref.full64(ids)
    # the floor's fp32-vs-fp64 part (prefill-then-step is measured on the MoE miniature)
    fl = R.floor_and_tolerance(r32, r64, r32)
    assert Q.maxabs(a, r32) <= fl["tol"], (Q.maxabs(a, r32), fl)


def test_triton_end_to_end(dialects):
    """The dense 4-layer miniature with every kernel on its Triton launcher (TRITON_INTERPRET=1, a fresh
    process): two delta chunks, prefill-then-steps and greedy tokens, at the reference's floor."""
    import os
    import subprocess
    import sys

    new, _ = dialects
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from tests.families import qwen3_next_support as Q; "
            "print('RESULT ' + json.dumps(Q.triton_child(sys.argv[2])))")
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code, str(repo), str(new)], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=repo, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    print("\nTRITON E2E", json.dumps(r))
    # 2 prefills × 2 linear layers; (4 steps + 3 greedy steps) × 2; 2 gated softmax layers on every call
    assert r["counts"]["triton"] == {"gated_delta_prefill": 4, "gated_delta_step": 14, "sigmoid_gate_mul": 18}
    assert r["counts"]["torch"] == {"gated_delta_prefill": 0, "gated_delta_step": 0, "sigmoid_gate_mul": 0}
    tol = max(2 * r["fp32_vs_fp64"], 1e-5 * r["max_logit"])
    assert r["vs_ref"] <= tol and r["step_vs_ref"] <= tol and r["step_vs_full"] <= tol, (r, tol)
    assert r["greedy"] == r["greedy_ref"]


def test_batched_decode_equals_single(moe_dir):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(moe_dir, Q.VOCAB)
