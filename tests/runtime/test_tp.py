"""Tensor parallelism on loopback (gloo): a qwen3 miniature whose heads (12), kv heads (6) and FFN width (72) both
2 and 3 divide, with biases on q/k/v/o and per-head q/k norms, run at TP=2 and TP=3 — one spawn per rank count,
every check in the same process group — against TP=1 in this process: logits within 1e-5·max|logit|, decode ==
prefill, 32 greedy tokens identical, save-state on N ranks → resume on N ranks identical, each rank's parts read
alone and sized as ``describe --tp`` says; refusals by attribute and by operator kind; ``vxc exec --tp 2``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.runtime import tp_support as S

CFG = dict(B.MINI_HF["qwen3"], num_attention_heads=12, num_key_value_heads=6, head_dim=8, hidden_size=48,
           intermediate_size=72, num_hidden_layers=2, attention_bias=True)
RANKS = (2, 3)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("tp")
    mdir = B.build_hf(root / "q3", "qwen3", CFG)
    # transformers initialises biases to zero: give them values, or adding o's bias on every rank would pass
    from safetensors.torch import load_file, save_file

    w = load_file(mdir / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for k in w:
        if k.endswith(".bias"):
            w[k] = torch.randn(w[k].shape, generator=g) * 0.5
    save_file(w, mdir / "model.safetensors", metadata={"format": "pt"})
    ir = root / "q3.vxir"
    lower_to_file(mdir, ir)
    return root, mdir, ir


@pytest.fixture(scope="module")
def tp1(mini):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    root, mdir, ir = mini
    e = Engine(parse_file(ir), mdir, max_context=64)
    out = S.measure(e, lambda s: s)
    out.update(S.save_resume(e, lambda s: s, root / "state-tp1.safetensors"))
    out["plan_kinds"] = [d["op"].kind for _, d in e.plan.nodes(data=True) if d["type"] == "op"]
    return out


@pytest.fixture(scope="module")
def ranks(mini):
    from vxc.runtime import tp as TP

    root, mdir, ir = mini
    out = {}
    for n in RANKS:
        TP.spawn(S.rank_main, n, n, str(ir), str(mdir), str(root))
        out[n] = [torch.load(root / f"tp{n}-rank{r}.pt") for r in range(n)]
    return out


def _tol(ref: torch.Tensor) -> float:
    return 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("n", RANKS)
def test_logits_match_tp1(tp1, ranks, n):
    for res in ranks[n]:  # every rank holds the whole logits (the head is replicated after the last all-reduce)
        err = (res["full"] - tp1["full"]).abs().max().item()
        assert err <= _tol(tp1["full"]), (n, res["rank"], err)
        err = (res["stepped"] - tp1["stepped"]).abs().max().item()
        assert err <= _tol(tp1["stepped"]), (n, res["rank"], err)
    # the ranks' logits are the same bits
    for res in ranks[n][1:]:
        assert torch.equal(res["full"], ranks[n][0]["full"])


@pytest.mark.parametrize("n", RANKS)
def test_decode_equals_prefill(ranks, n):
    for res in ranks[n]:
        err = (res["stepped"] - res["full"]).abs().max().item()
        assert err <= _tol(res["full"]), (n, res["rank"], err)


@pytest.mark.parametrize("n", RANKS)
def test_greedy_identical(tp1, ranks, n):
    assert len(set(tp1["greedy"])) >= 4  # not a degenerate repeat that any model would match
    for res in ranks[n]:
        assert res["greedy"] == tp1["greedy"], (n, res["rank"])


@pytest.mark.parametrize("n", RANKS)
def test_save_resume_on_n_ranks(mini, tp1, ranks, n):
    root = mini[0]
    for res in ranks[n]:
        assert torch.equal(res["first_resumed"], res["first"]), (n, res["rank"])
        assert res["cont_resumed"] == res["cont"] == tp1["cont"], (n, res["rank"])
        assert (res["first"] - tp1["first"]).abs().max().item() <= _tol(tp1["first"])
    # one file per rank, each holding that rank's kv heads (6 / n of them)
    from safetensors import safe_open

    for r in range(n):
        p = root / (f"state-tp{n}.safetensors" + (f".rank{r}" if r else ""))
        with safe_open(str(p), framework="pt") as f:
            assert f.metadata()["tp"] == f"rank {r} of {n}"
            shapes = [f.get_slice(k).get_shape() for k in f.keys() if k != "position"]
        assert shapes and all(s[2] == 6 // n for s in shapes), shapes


def test_resume_refuses_another_rank(mini, ranks):
    """A rank's state file resumed by another rank (or by one process) is refused by name."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session, SessionError

    root, mdir, ir = mini
    s = Session(Engine(parse_file(ir), mdir, max_context=64))
    with pytest.raises(SessionError, match="saved by tensor-parallel rank 0 of 2, this is one process"):
        s.load_state(root / "state-tp2.safetensors")


@pytest.mark.parametrize("n", RANKS)
def test_parts_are_read_alone_and_described(mini, ranks, n):
    from vxc.driver import load
    from vxc.passes.surfaces import tp_ranks

    root, mdir, ir = mini
    d = tp_ranks(lambda: load(ir), n, context=64)
    assert d["ranks"] == n
    for res in ranks[n]:
        r = res["rank"]
        # every cut operand read alone: the bytes read are exactly the parts' bytes (fp32), not the tensors'
        part_bytes = sum(4 * torch.Size(shape).numel() for _, _, _, shape in res["parts"].values())
        assert res["sliced_bytes"] == part_bytes > 0
        assert {tuple(v[:3]) for k, v in res["parts"].items() if k == "l0.AttnQ"} == {(0, r * 96 // n, (r + 1) * 96 // n)}
        assert {tuple(v[:3]) for k, v in res["parts"].items() if k == "l0.FfnDown"} == {(1, r * 72 // n, (r + 1) * 72 // n)}
        # describe --tp says what the rank allocated
        mine = d["per_rank"][r]
        assert mine["weight_bytes"] == res["weight_bytes"], (n, r)
        assert mine["state"]["at_context_bytes"] == res["state_bytes"], (n, r)
        assert all(s[2] == 6 // n for s in res["kv_shapes"].values())
        # one all-reduce per mixer and per FFN, as fx nodes of the decode graph
        assert res["reduces"] == res["graph_reduces"] == 2 * CFG["num_hidden_layers"]
    # o's bias is held by rank 0 only: rank 0 holds 48 fp32 more per layer
    diff = d["per_rank"][0]["weight_bytes"] - d["per_rank"][1]["weight_bytes"]
    assert diff == 4 * 48 * CFG["num_hidden_layers"]


def test_tp1_unchanged(mini, tp1, vxc_inproc):
    root, mdir, ir = mini
    assert "all_reduce" not in tp1["plan_kinds"]
    r = vxc_inproc("passes", ir, "--print-after", "plan")
    assert r.exit_code == 0 and "all_reduce" not in r.stdout
    r = vxc_inproc("passes", ir, "--print-after", "state")
    assert r.exit_code == 0 and " | " not in r.stdout and "shard" not in r.stdout
    r = vxc_inproc("passes", ir, "--tp", "2", "--rank", "1", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "operand %l0.AttnQ f32[48,48] = $t14 layer 0 role AttnQ | shard dim 0 of 2 [48:96]" in r.stdout
    assert "role AttnOBias | whole, added once (rank 0)" in r.stdout
    assert "role Embedding | replicated" in r.stdout
    assert "state kv kv_rows [2,3,8] compute per_token" in r.stdout
    assert r.stdout.count(" all_reduce ") == 2 * CFG["num_hidden_layers"]


def test_refuses_what_does_not_divide(mini, vxc_inproc):
    root, mdir, ir = mini
    r = vxc_inproc("passes", ir, "--tp", "4", "--json")
    assert r.exit_code == 2
    found = json.loads(r.stdout)["findings"]
    # heads 12 and intermediate 72 divide by 4; kv_heads 6 does not: exactly one finding per layer, naming it
    assert [(f["layer"], f["operator"], f["code"]) for f in found] == [(0, "softmax", "indivisible"), (1, "softmax", "indivisible")]
    assert all(f["message"] == "kv_heads=6 is not divisible by --tp 4" for f in found)
    r = vxc_inproc("exec", ir, "--tokens", "1,2,3", "--tp", "5")
    assert r.exit_code == 2
    assert "layer 0 softmax: heads=12 is not divisible by --tp 5  [indivisible]" in r.stdout
    assert "layer 1 swiglu: intermediate=72 is not divisible by --tp 5  [indivisible]" in r.stdout


def test_refuses_encoded_cuts_off_blocks(mini, tmp_path, vxc_inproc):
    """A ggml-encoded operand is cut on its block boundaries only: refused by name, operand by operand, otherwise
    (tests/runtime/test_tp_encoded.py runs the cuts that fall on them)."""
    root, mdir, ir = mini
    q = tmp_path / "q8.vxir"
    r = vxc_inproc("quantize", ir, "-o", q, "--scheme", "q8_0")
    assert r.exit_code == 0, r.stdout + r.stderr
    r = vxc_inproc("passes", q, "--tp", "2", "--json")
    assert r.exit_code == 2, r.stdout
    found = json.loads(r.stdout)["findings"]
    # q8_0 blocks 32 values of a row: only o's rows (12 heads x 8 = 96) are a multiple of 32 (d_model 48 and the
    # FFN's 72 are not, so those projections stay fp32); o is row-parallel: a rank's 48 columns are 1.5 blocks
    assert [(f["layer"], f["code"], f["message"]) for f in found] == [
        (i, "indivisible", f"operand %l{i}.AttnO is q8_0: this rank's columns 0:48 are not whole 32-value blocks")
        for i in range(CFG["num_hidden_layers"])]


def test_exec_cli_tp2(mini, tp1):
    """``vxc exec --tp 2`` spawns its ranks; without OMP_NUM_THREADS each takes half the CPUs (at least one)."""
    from tests.runtime.conftest import child_env, run_python

    root, mdir, ir = mini
    ids = ",".join(map(str, S.prompt()))
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    r = run_python(["-m", "vxc.cli", "exec", str(ir), "--tokens", ids, "--max-new-tokens", str(S.N_GREEDY),
                    "--ignore-eos", "--max-context", "64", "--json", "--tp", "2"], timeout=240, env=env)
    assert r.exit_code == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)  # rank 0 alone prints: one JSON object
    assert out["generated_ids"] == tp1["greedy"]
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert out["compute_threads"] == {"torch": half, "native": half}


@pytest.mark.parametrize("command", ["exec", "serve", "chat"])
def test_a_ranks_error_is_one_line(mini, vxc_proc, command):
    """An error on the ranks (here: a prompt for a model without a tokenizer) reads as the CLI's one-line error with
    a non-zero exit — not a follower's traceback, and (serve, chat: rank 0 is this process) without waiting for
    followers at a barrier they never reach."""
    root, mdir, ir = mini
    assert not (mdir / "tokenizer.json").exists()
    args = {"exec": ["--prompt", "hi"], "serve": ["--port", "0"], "chat": []}[command]
    r = vxc_proc(command, str(ir), *args, "--tp", "2", timeout=240)
    assert r.exit_code == 1, r.output[-3000:]
    assert "tokenizer.json" in r.stderr and "error: " in r.stderr, r.stderr[-3000:]
    assert not any(s in r.output for s in ("Traceback", "monitoredBarrier", "Terminating process")), r.output[-3000:]


def test_local_rank_threads(monkeypatch):
    from vxc.runtime.tp import local_rank_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert [local_rank_threads(n) for n in (1, 2, 3, 4, 8)] == [7, 3, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's count stands
    assert local_rank_threads(2) is None


def test_rank_zero_thread_limit_reaches_the_stepping_thread():
    """A rank 0 that serves (``start_followers``) limits its own threads; OpenMP keeps the count per thread, so the
    engine's thread applies it (``apply_thread_limit``) — without that a new thread starts from every CPU."""
    from tests.runtime.conftest import child_env, run_python

    code = """
import threading, torch
from vxc.codegen.kernels import native
lib = native.load()
native.limit_threads(1)
seen = {}
def step():
    seen["before"] = lib.vxc_max_threads()
    native.apply_thread_limit()
    seen["after"] = lib.vxc_max_threads()
t = threading.Thread(target=step); t.start(); t.join()
print(torch.get_num_threads(), lib.vxc_max_threads(), native.max_threads(), seen["before"], seen["after"])
"""
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    r = run_python(["-c", code], env=env, timeout=120)
    assert r.exit_code == 0, r.stderr[-2000:]
    cpus = len(os.sched_getaffinity(0))
    assert r.stdout.split() == ["1", "1", "1", str(cpus), "1"]


def test_exec_under_torchrun(mini, tp1):
    """torchrun's ranks (its environment rendezvous, two processes on this machine: the path several machines
    take) instead of vxc's own spawn: rank 0 prints the same greedy tokens."""
    from tests.runtime.conftest import run_python

    root, mdir, ir = mini
    ids = ",".join(map(str, S.prompt()))
    r = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "vxc.cli", "exec",
                    str(ir), "--tokens", ids, "--max-new-tokens", str(S.N_GREEDY), "--ignore-eos", "--max-context", "64",
                    "--json", "--tp", "2"], timeout=240)
    assert r.exit_code == 0, r.stderr[-3000:]
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["generated_ids"] == tp1["greedy"]


def test_backend_per_device():
    from vxc.runtime.tp import backend_for

    assert [backend_for(d) for d in ("cpu", "cuda", "cuda:1")] == ["gloo", "nccl", "nccl"]


def _rank_batched(rank: int, n: int, ir: str, vocab: int, out: str) -> None:
    from tests.runtime import batch_check

    torch.set_num_threads(1)
    torch.save(batch_check.check(Path(ir), vocab, tp=n, rank=rank), Path(out) / f"batched-tp{n}-rank{rank}.pt")


def test_batched_decode_on_ranks(mini):
    """Sequence slots and the scheduler on 2 ranks: five requests of different lengths on three slots (chunked
    prefill beside batched steps, joining and leaving) give each rank the tokens of single-sequence runs on the
    same ranks, logits within 1e-5·max|logit|, nothing leaked from a freed slot -- and TP=1's tokens."""
    from tests.runtime import batch_check
    from vxc.runtime import tp as TP

    root, mdir, ir = mini
    one = batch_check.check(ir, CFG["vocab_size"])
    TP.spawn(_rank_batched, 2, 2, str(ir), CFG["vocab_size"], str(root))
    for r in range(2):
        res = torch.load(root / f"batched-tp2-rank{r}.pt")
        assert res["greedy_equal"] and res["leak_free"], (r, res)
        assert res["max_diff"] <= 1e-5 * res["max_logit"], (r, res)
        assert res["rows"] > 0 and res["steps"] < sum(batch_check.NEW_TOKENS) + sum(batch_check.PROMPT_LENS)
        assert res["generated"] == one["generated"], r


def _rank_sum(rank: int, n: int, out: str) -> None:
    from vxc.codegen.kernels.collective import all_reduce_impl

    a, b = 1.0, 2 ** -8 + 2 ** -15  # both exact in bf16
    vals = [[a, b, b], [b, b, a], [b, a, b]]  # element e holds vals[e][rank]: a meets a b first in some element
    x = torch.tensor([[vals[e][rank] for e in range(3)]], dtype=torch.bfloat16)
    torch.save(all_reduce_impl(x, n), Path(out) / f"sum-rank{rank}.pt")


def test_half_precision_partials_summed_once(tmp_path):
    """bf16 partial sums over 3 ranks are added in fp32 and rounded once: 1 + 2·(2^-8 + 2^-15) = 1 + 2^-7 + 2^-14
    rounds to 1 + 2^-7 in bf16 (whose step at 1 is 2^-7); added in bf16 one rank at a time, whichever rank comes
    first, one element rounds 1 + 2^-8 + 2^-15 up to 1 + 2^-7 and then ends at 1 + 2^-6."""
    from vxc.runtime import tp as TP

    TP.spawn(_rank_sum, 3, 3, str(tmp_path))
    for r in range(3):
        y = torch.load(tmp_path / f"sum-rank{r}.pt")
        assert y.dtype == torch.bfloat16 and y.float().tolist() == [[1 + 2 ** -7] * 3], y


def _rank_replay(rank: int, n: int, ir: str, mdir: str, out: str) -> None:
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    torch.set_num_threads(1)
    runs = {}
    for replay in (True, False):
        e = Engine(parse_file(Path(ir)), Path(mdir), max_context=64, tp=n, rank=rank, replay=replay)
        s = Session(e)
        s.prefill(S.prompt())
        runs[replay] = ([s.step(t).clone() for t in range(20, 30)], e.replay_status())
    torch.save(runs, Path(out) / f"replay-rank{rank}.pt")


def test_decode_replayed_on_ranks(mini, tmp_path):
    """A tensor-parallel decode step is captured and replayed (its all-reduces recorded as calls on pooled
    buffers), bit-identical to running its graph, on every rank."""
    from vxc.runtime import tp as TP

    root, mdir, ir = mini
    TP.spawn(_rank_replay, 2, 2, str(ir), str(mdir), str(tmp_path))
    for r in range(2):
        runs = torch.load(tmp_path / f"replay-rank{r}.pt")
        assert runs[True][1].startswith("replaying"), runs[True][1]
        assert not runs[False][1].startswith("replaying")
        assert all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0])), r
