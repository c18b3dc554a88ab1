"""Continuation state: save → a fresh process loads it → continues exactly as
the uninterrupted run (ids identical, logits bit-identical), greedy and
sampled (the sampler's RNG state travels in the file), through the Session
API and through ``vxc exec --save-state / --resume-state``.

Run as a script, this file is the fresh process: ``python test_session.py
child JOBS.json`` resumes every job listed and writes its ids and logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # the child process: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

N_PROMPT, N_NEW, K = 40, 14, 6  # uninterrupted run: 14 new tokens; interrupted after 6
MAX_CONTEXT = 128
SAMPLING = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "seed": 1234}


def _sampler(spec: dict | None, vocab: int):
    from vxc.runtime.sampling import Sampler

    return Sampler(vocab=vocab) if spec is None else Sampler(spec["temperature"], spec["top_k"], spec["top_p"], spec["seed"], vocab=vocab)


def _run(session, sampler, n: int, first_logits: torch.Tensor):
    """exec's loop: choose from the given logits, feed every chosen token but the last.
    Returns (ids, the logits each id was chosen from)."""
    ids, seen, last = [], [], first_logits
    for i in range(n):
        seen.append(last.clone())
        ids.append(sampler(last))
        if i + 1 < n:
            last = session.step(ids[-1])
    return ids, torch.stack(seen)


def child(jobs_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from tests.runtime.parity_table import engine_for
    from vxc.runtime.session import Session

    jobs = json.loads(Path(jobs_path).read_text())
    for job in jobs:
        engine = engine_for(Path(job["ir"]), max_context=MAX_CONTEXT)
        session = Session(engine)
        sampler = _sampler(job["sampling"], engine.vocab)
        session.load_state(Path(job["state"]), sampler)
        pos = session.pos
        # continue as `vxc exec --resume-state S --tokens <last id>` does: feed the last generated id
        first = session.prefill([job["last"]])[-1]
        ids, seen = _run(session, sampler, job["n"], first)
        save_file({"logits": seen.contiguous()}, job["out"], metadata={"ids": json.dumps(ids), "position": str(pos)})


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    child(sys.argv[2])
    raise SystemExit(0)

# ---------------------------------------------------------------- the tests

import pytest  # noqa: E402

from tests.runtime import parity_table as P  # noqa: E402
from tests.runtime.conftest import read_json_line, run_python  # noqa: E402

FAMILIES = ["mamba2attn-native", "qwen3", "oute-base1"]

# declared regions per family, as (shape at position p, dtype) with p the saved position:
#   mamba2attn-native: Mamba2 layers 0, 2 (ssm [13,8,14] fp32, conv [132,4]); conv-QKV layer 1 (kv [2,p,2,10], conv [100,3])
#   qwen3: 3 softmax layers, kv [2,p,2,14]
#   oute-base1: Mamba2 layers 0, 2, 4 (ssm [14,8,12], conv [160,4]); conv-QKV 1, 3 (kv [2,p,3,9], conv [108,3])
F32 = torch.float32


def _regions(name: str, p: int) -> list:
    return sorted({
        "mamba2attn-native": [((13, 8, 14), F32)] * 2 + [((132, 4), F32)] * 2 + [((2, p, 2, 10), F32), ((100, 3), F32)],
        "qwen3": [((2, p, 2, 14), F32)] * 3,
        "oute-base1": [((14, 8, 12), F32)] * 3 + [((160, 4), F32)] * 3 + [((2, p, 3, 9), F32)] * 2 + [((108, 3), F32)] * 2,
    }[name], key=str)


def _prompt(lab, name):
    return P.prompt_ids(lab.family(name))[:N_PROMPT]


@pytest.fixture(scope="module")
def runs(lab, tmp_path_factory):
    """For each family and mode: the uninterrupted run A, the interrupted run B (state saved after K
    tokens), and the fresh process's continuation of B."""
    from vxc.runtime.session import Session

    tmp = tmp_path_factory.mktemp("resume")
    out, jobs = {}, []
    for name in FAMILIES:
        ir = lab.built(name)[1]
        engine = P.engine_for(ir, max_context=MAX_CONTEXT)
        for mode, spec in (("greedy", None), ("sampled", SAMPLING)):
            s = Session(engine)
            prompt = _prompt(lab, name)
            a_ids, a_logits = _run(s, _sampler(spec, engine.vocab), N_NEW, s.prefill(prompt)[-1])
            s.reset()
            sampler = _sampler(spec, engine.vocab)
            b_ids, _ = _run(s, sampler, K, s.prefill(prompt)[-1])
            state = tmp / f"{name}-{mode}.state.safetensors"
            s.save_state(state, sampler)
            res = tmp / f"{name}-{mode}.out.safetensors"
            jobs.append({"ir": str(ir), "state": str(state), "last": b_ids[-1], "n": N_NEW - K,
                         "sampling": spec, "out": str(res)})
            out[name, mode] = {"a_ids": a_ids, "a_logits": a_logits, "b_ids": b_ids, "state": state, "res": res,
                               "pos": s.pos, "engine": engine, "spec": spec}
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    r = run_python([__file__, "child", tmp / "jobs.json"])
    assert r.exit_code == 0, r.output
    for v in out.values():
        with safe_open(str(v["res"]), framework="pt") as f:
            meta = f.metadata()
            v["c_logits"] = f.get_tensor("logits")
        v["c_ids"], v["c_pos"] = json.loads(meta["ids"]), int(meta["position"])
    return out


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("name", FAMILIES)
def test_resume_in_fresh_process(runs, name, mode):
    v = runs[name, mode]
    assert v["b_ids"] == v["a_ids"][:K]
    assert v["c_pos"] == N_PROMPT + K - 1  # the last chosen id was not fed before saving
    assert v["b_ids"] + v["c_ids"] == v["a_ids"]
    assert torch.equal(v["c_logits"], v["a_logits"][K:]), "continued logits are not bit-identical"
    assert len(set(v["a_ids"])) >= 5


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("name", FAMILIES)
def test_state_file_holds_only_declared_regions(runs, name, mode):
    v = runs[name, mode]
    data = load_file(str(v["state"]))
    engine = v["engine"]
    extra = {"position"} | ({"rng_state"} if mode == "sampled" else set())
    assert set(data) == set(engine.state.buffers) | extra
    regions = sorted(((tuple(t.shape), t.dtype) for k, t in data.items() if k not in extra), key=str)
    p = v["pos"]
    assert regions == _regions(name, p)  # growing regions saved up to the position only
    assert data["position"].tolist() == [p] and data["position"].dtype == torch.int64
    assert not any("." in k and ("layers" in k or "weight" in k) for k in data)  # no tensor names, no weights


def test_rng_state_is_what_makes_sampling_resume(runs):
    """Without the saved RNG state (a freshly seeded sampler) the continuation differs:
    the sampled resume test above can fail."""
    from vxc.runtime.session import Session

    v = runs["mamba2attn-native", "sampled"]
    s = Session(v["engine"])
    s.load_state(v["state"])  # regions only, the sampler keeps its fresh seed
    sampler = _sampler(SAMPLING, v["engine"].vocab)
    ids, _ = _run(s, sampler, N_NEW - K, s.prefill([v["b_ids"][-1]])[-1])
    assert v["b_ids"] + ids != v["a_ids"]


def test_load_state_refuses_another_model(runs, tmp_path):
    from vxc.runtime.session import Session, SessionError

    other = runs["qwen3", "greedy"]["engine"]
    with pytest.raises(SessionError, match="do not match"):
        Session(other).load_state(runs["mamba2attn-native", "greedy"]["state"])


def test_new_session_on_a_used_engine_starts_clean(lab):
    """A session starts at position 0 from zeroed state, even on an engine another session used
    (prefill continues from whatever the state buffers hold)."""
    from vxc.runtime.session import Session

    ir = lab.built("mamba2attn-native")[1]
    engine = P.engine_for(ir, max_context=MAX_CONTEXT)
    prompt = _prompt(lab, "mamba2attn-native")
    first = Session(engine).prefill(prompt)
    again = Session(engine).prefill(prompt)
    assert torch.equal(first, again)


# ---------------------------------------------------------------- through the CLI


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--top-k", "30", "--top-p", "0.9", "--seed", "7"]],
                         ids=["greedy", "sampled"])
def test_cli_save_resume(lab, vxc_inproc, vxc_proc, tmp_path, sampling):
    ir = lab.built("mamba2attn-native")[1]
    toks = ",".join(map(str, _prompt(lab, "mamba2attn-native")))
    common = ["--max-context", "256", "--json", *sampling]
    full = vxc_inproc("exec", ir, "--tokens", toks, "--max-new-tokens", 8, *common)
    assert full.exit_code == 0, full.output
    want = read_json_line(full.stdout)["generated_ids"]
    state = tmp_path / "S.safetensors"
    first = vxc_inproc("exec", ir, "--tokens", toks, "--max-new-tokens", 4, "--save-state", state, *common)
    assert first.exit_code == 0, first.output
    got1 = read_json_line(first.stdout)["generated_ids"]
    assert got1 == want[:4]
    keys = set(load_file(str(state)))
    assert ("rng_state" in keys) == bool(sampling)
    # a new process resumes
    second = vxc_proc("exec", ir, "--resume-state", state, "--tokens", got1[-1], "--max-new-tokens", 4, *common)
    assert second.exit_code == 0, second.output
    res = read_json_line(second.stdout)
    assert got1 + res["generated_ids"] == want
    assert res["position"] == N_PROMPT + 8 - 1


if __name__ == "__main__":
    raise SystemExit("usage: test_session.py child JOBS.json")
