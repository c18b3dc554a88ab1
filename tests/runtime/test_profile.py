"""The decode step profile (``vxc exec --profile``; ``vxc.runtime.replay.StepProfile``).

A profiled replay times each native call of its program (``vxc_run_program_timed``, or around each call of the
Python loop) and groups the times by the vxc op that made the call, the kernel and the encoding or dtype of the
weight it read. Checked here against what is known independently of the profile: which call of a hand-made program
sleeps how long, how many steps were replayed, which vxc ops the decode graph calls, the scheme a model was
quantised with; and that profiling changes no value.
"""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from tests import builders as B
from tests.runtime import parity_table as P
from tests.runtime.conftest import read_json_line
from vxc.runtime.replay import CAPTURES, BatchReplay

STEPS = 10


@pytest.mark.native
@pytest.mark.parametrize("loop", ["c", "python"])
def test_each_call_gets_its_own_time(loop):
    """Two C calls around Python calls that sleep 50 and 25 ms: the sleeps land on their own calls' elements, through
    C segments (each timed in C) and the Python loop alike, and the values are those of an untimed run."""
    from vxc.codegen.kernels import native as N
    from vxc.runtime.replay import _run_segments, _segments

    lib = N.load()
    add = getattr(lib, N.declare("vxc_add", N.P, N.P, N.P, N.L, N.I))
    x, y = torch.randn(64), torch.randn(64)
    z, w = torch.zeros(64), torch.zeros(64)

    def slow_double(address: int, n: int) -> None:
        time.sleep(0.05)
        N.tensor_at(address, n, torch.float32).mul_(2)

    def nap(ms: int) -> None:
        time.sleep(ms / 1000)

    conv = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(z.data_ptr()), None,
            ctypes.c_int(0)]
    program = [(add, conv, [(3, 8, 3)]),  # n = 8 + 3 pos
               (slow_double, [z.data_ptr(), 64], []),
               (add, [conv[2], conv[1], ctypes.c_void_p(w.data_ptr()), ctypes.c_long(64), ctypes.c_int(0)], []),
               (nap, [25], [])]
    segs = _segments(program) if loop == "c" else program
    for pos in (0, 5):
        z.zero_()
        _run_segments(segs, pos)
        want_z, want_w = z.clone(), w.clone()
        z.zero_()
        w.zero_()
        ns = (ctypes.c_int64 * 4)()
        _run_segments(segs, pos, ns)
        assert torch.equal(z, want_z) and torch.equal(w, want_w)
        t = list(ns)
        assert t[1] >= 50e6 and t[3] >= 25e6, t
        assert t[0] + t[2] < 25e6, t  # two adds of 64 floats, beside the 25 ms nap
        assert min(t) > 0, t


def _graph_ops(gm) -> set[str]:
    """The vxc ops a decode graph calls (read off the fx graph, not the profile)."""
    return {n.target._overloadpacket._qualified_op_name.split("::")[1] for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "vxc"}


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.native
def test_the_profile_accounts_for_every_call_and_changes_nothing(lab, name, dtype):
    from vxc.runtime.session import Session

    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, f.vocab, (STEPS,), generator=g).tolist()
    out = {}
    for profiled in (False, True):
        e = P.engine_for(ir, max_context=64, dtype=dtype, sequences=3)
        if profiled:
            e.start_profile()
        s = Session(e)
        s.prefill(ids)
        single = [s.step(t) for t in tokens]
        pos = {1: 5, 2: 9}
        for slot, n in pos.items():
            e.bind_slot(slot)
            e.prefill_graph(torch.tensor(ids[:n]), 0)
        batched = []
        for t in tokens[:6]:
            batched.append(e.decode_batch([t, t], [pos[1], pos[2]], [1, 2]))
            pos[1] += 1
            pos[2] += 1
        out[profiled] = (e, single + batched)
    e, got = out[True]
    for a, b in zip(got, out[False][1]):
        assert torch.equal(a, b)  # a profiled step computes what an unprofiled one does, bit for bit
    assert out[False][0].decode_profile() is None
    p = e.decode_profile()
    assert p["steps"] == STEPS - CAPTURES and p["calls"] == len(e.replay.program)
    assert sum(r["calls"] for r in p["rows"]) == len(e.replay.program)
    assert {r["op"] for r in p["rows"]} == _graph_ops(e.decode_graph)
    assert {r["kernel"] for r in p["rows"]} == {fn.__name__ for fn, _, _ in e.replay.program}
    # every weight the step reads is a plain weight of the session's dtype here (ops that read none: "-")
    assert {r["weights"] for r in p["rows"]} == {"-", {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]}
    assert 0 < p["calls_ms"] <= p["step_ms"] and all(r["ms"] > 0 for r in p["rows"])
    assert abs(sum(r["share"] for r in p["rows"]) - p["calls_ms"] / p["step_ms"]) < 1e-9
    b = p["batched"][2]
    assert b["steps"] == 6 - BatchReplay.CAPTURES and b["calls"] == len(e.batch_replays[2].program)
    assert sum(r["calls"] for r in b["rows"]) == b["calls"]


@pytest.fixture(scope="module")
def quantised(tmp_path_factory, cli):
    """A 2-layer llama miniature quantised with q4_k_m: rows of 256 are whole q4_k / q6_k blocks, the FFN's 288 are
    not (tests/test_quantize.py's K_CFG), so the down projections fall back to q5_0 (layer 0) and q8_0 (layer 1)."""
    d = tmp_path_factory.mktemp("profile")
    cfg = dict(B.MINI_HF["llama"], vocab_size=103, hidden_size=256, intermediate_size=288, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    mdir = B.build_hf(d / "hf", "llama", cfg, seed=5)
    assert cli("lower", mdir, "-o", d / "m.vxir").exit_code == 0
    r = cli("quantize", d / "m.vxir", "-o", d / "q.vxir", "--scheme", "q4_k_m")
    assert r.exit_code == 0, r.output
    return d / "q.vxir"


# the products a decode step runs, by the encoding of the weight each reads (by hand, from the q4_k_m mix of
# tests/test_quantize.py: q4_k for q, k, o, gate and up of both layers and layer 0's v; q6_k for layer 1's v and
# the head; q5_0 / q8_0 for the two downs, which the FFN's fused op reads beside its q4_k gate and up)
PRODUCTS = {"q4_k": 11, "q6_k": 2, "q5_0": 1, "q8_0": 1}


@pytest.mark.native
def test_exec_profile_names_the_encodings(quantised, cli):
    r = cli("exec", quantised, "--tokens", "1,2,3", "--max-new-tokens", str(STEPS), "--ignore-eos", "--profile", "--json")
    assert r.exit_code == 0, r.output
    res = read_json_line(r.stdout)
    p = res["decode_profile"]
    n_decode = len(res["generated_ids"]) - 1  # the first new token comes from the prefill's logits
    assert n_decode == STEPS - 1 and p["steps"] == n_decode - CAPTURES
    assert res["decode_replay"] == f"replaying {p['calls']} native calls per step"
    products: dict[str, int] = {}
    for row in p["rows"]:
        if row["kernel"].startswith("vxc_qgemv"):
            products[row["weights"]] = products.get(row["weights"], 0) + row["calls"]
    assert products == PRODUCTS, p["rows"]
    assert {"q4_k", "fp32"} <= {row["weights"] for row in p["rows"]}  # (the embedding; the norms' fp32 weights)
    text = cli("exec", quantised, "--tokens", "1,2,3", "--max-new-tokens", str(STEPS), "--ignore-eos", "--profile")
    assert text.exit_code == 0, text.output
    assert "decode profile: " + str(n_decode - CAPTURES) + " replayed steps of " + str(p["calls"]) in text.output
    assert " / q5_0" in text.output


@pytest.mark.native
def test_exec_profile_says_when_no_step_was_replayed(quantised, cli):
    r = cli("exec", quantised, "--tokens", "1,2,3", "--max-new-tokens", "2", "--ignore-eos", "--profile")
    assert r.exit_code == 0, r.output
    assert "decode profile: no replayed step ran (the first 3 decode steps are captured, not replayed)" in r.output
    from vxc.codegen import kernels as K

    before = K.get_backend()
    try:  # (in-process: --kernels sets the process's backend, which later tests must not inherit)
        t = cli("exec", quantised, "--tokens", "1,2,3", "--max-new-tokens", "6", "--ignore-eos", "--profile", "--kernels",
                "torch")
    finally:
        K.set_backend(before)
    assert t.exit_code == 0, t.output
    assert ("decode profile: no replayed step ran (--kernels torch: the decode steps run their graph, and only native "
            "replays are profiled)") in t.output
    assert "prefill profile: 3 tokens in 1 chunk" in t.output  # (the prefill graph's ops, whichever kernels)
    j = cli("exec", quantised, "--tokens", "1,2,3", "--max-new-tokens", "2", "--ignore-eos", "--profile", "--json")
    assert read_json_line(j.stdout)["decode_profile"] is None


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native"])
@pytest.mark.native
def test_the_prefill_profile_times_each_op_of_each_chunk(lab, name):
    """A prefill of 20 tokens in chunks of 8 (three graph runs): each vxc op of the prefill graph is timed once a run
    (the counts read off the fx graph), and the logits are those of an unprofiled prefill, bit for bit."""
    from vxc.runtime.session import Session

    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    got = {}
    for profiled in (False, True):
        e = P.engine_for(ir, max_context=64, prefill_chunk=8)
        if profiled:
            e.start_profile()
        got[profiled] = (e, Session(e).prefill(ids))
    e, logits = got[True]
    assert torch.equal(logits, got[False][1])
    assert got[False][0].prefill_profile is None
    p = e.prefill_profile.summary()
    assert (p["runs"], p["tokens"]) == (3, 20)
    gm = e._prefill_graphs["prefill"]
    want: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "vxc":
            op = n.target._overloadpacket._qualified_op_name.split("::")[1]
            want[op] = want.get(op, 0) + 3
    calls: dict[str, int] = {}
    for r in p["rows"]:
        calls[r["op"]] = calls.get(r["op"], 0) + r["calls"]
    assert calls == want
    assert 0 < p["ops_ms"] <= p["ms"] and all(r["ms"] > 0 for r in p["rows"])
    assert {r["weights"] for r in p["rows"]} <= {"-", "fp32"}


@pytest.mark.native
def test_exec_profile_covers_the_prefill(quantised, cli):
    r = cli("exec", quantised, "--tokens", ",".join(str(i) for i in range(1, 40)), "--max-new-tokens", "2",
            "--ignore-eos", "--profile", "--prefill-chunk", "16", "--json")
    assert r.exit_code == 0, r.output
    p = read_json_line(r.stdout)["prefill_profile"]
    assert (p["runs"], p["tokens"]) == (3, 39)  # chunks of 16, 16 and 7
    qlinear = {row["weights"]: row["calls"] for row in p["rows"] if row["op"] == "qlinear"}
    # q, k, o of both layers and layer 0's v are q4_k; layer 1's v and the head q6_k (the head on each chunk's last
    # position): every chunk once
    assert qlinear == {"q4_k": 7 * 3, "q6_k": 2 * 3}, p["rows"]
    text = cli("exec", quantised, "--tokens", "1,2,3,4,5", "--max-new-tokens", "2", "--ignore-eos", "--profile")
    assert "prefill profile: 5 tokens in 1 chunk, " in text.output
