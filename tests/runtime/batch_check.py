"""Batched decode against single-sequence decode, for any lowered miniature (issue #14 §1).

``check(ir, vocab)`` runs a handful of requests of different lengths through a :class:`Scheduler` on an engine
with 3 sequence slots (more requests than slots, so sequences join and leave mid-run, with different numbers of
new tokens), and each request alone through a plain single-sequence :class:`Session` on an engine with one slot.
It returns what the tests assert on:

- ``greedy_equal``: every request's greedy tokens identical to its solo run;
- ``max_diff`` / ``max_logit``: the largest |logit difference| over every chosen token of every request, and
  the largest |logit| (the caller compares against the floor of VINDEX3.md: 1e-5 · max|logit| when no family
  floor is at hand — the solo run prefills in the scheduler's chunks, so the batched step, which only changes
  how many rows a row-wise GEMM sees, is the one difference);
- ``replays``: for each number of rows a batched step had, what its native replay became (replaying / capturing /
  refused: why) and how many steps it served;
- ``leak_free``: a request run in a one-slot scheduler right after a longer one gives logits bit-identical
  (torch.equal) to the same request on a fresh one-slot scheduler.
"""

from __future__ import annotations

from pathlib import Path

import torch

PROMPT_LENS = (9, 4, 13, 1, 6)
NEW_TOKENS = (7, 10, 3, 6, 8)
SLOTS, CHUNK, CONTEXT = 3, 5, 48


def _engine(ir: Path, **kw):
    """An engine of a lowered ``.vxir`` file, or of a model directory lowered in this process."""
    if Path(ir).is_dir():
        from vxc.frontends import lower
        from vxc.runtime.engine import Engine

        return Engine(lower(Path(ir)), Path(ir), max_context=CONTEXT, **kw)
    from tests.runtime.parity_table import engine_for

    return engine_for(ir, max_context=CONTEXT, **kw)


def prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def solo(engine, prompt: list[int], new: int, vocab: int) -> tuple[list[int], list[torch.Tensor]]:
    from vxc.runtime.session import Session

    s = Session(engine)
    # the prompt in the chunks the scheduler prefills it in (ending at multiples of CHUNK), so that only the
    # decode steps differ between the two runs
    for a in range(0, len(prompt), CHUNK):
        lg = s.prefill(prompt[a:a + CHUNK], last_only=True)[-1]
    toks, rows = [], []
    for i in range(new):
        rows.append(lg.clone())
        toks.append(int(torch.argmax(lg[:vocab].float())))
        if i + 1 < new:
            lg = s.step(toks[-1])
    return toks, rows


def check(ir: Path, vocab: int, *, dtype: torch.dtype = torch.float32, **engine_kw) -> dict:
    """(``engine_kw``: more arguments of every engine, e.g. ``tp`` and ``rank`` on a tensor-parallel rank.)"""
    from vxc.runtime.scheduler import Scheduler

    ps = prompts(vocab)
    one = _engine(ir, dtype=dtype, **engine_kw)
    ref = [solo(one, p, n, vocab) for p, n in zip(ps, NEW_TOKENS)]
    sch = Scheduler(_engine(ir, dtype=dtype, sequences=SLOTS, **engine_kw), chunk=CHUNK)
    reqs = [sch.submit(p, max_new_tokens=n, keep_logits=True) for p, n in zip(ps, NEW_TOKENS)]
    sch.run()
    # the batched steps' native replays, by number of rows: what each became, and how many steps it served
    replays = {B: ("replaying" if r.ready else f"refused: {r.refused}" if r.refused else "capturing", r.steps)
               for B, r in sorted(sch.engine.batch_replays.items())}
    max_diff = max_logit = 0.0
    greedy_equal = all(r.finish_reason == "length" for r in reqs)
    for r, (toks, rows) in zip(reqs, ref):
        greedy_equal &= r.generated == toks
        for a, b in zip(r.logits, rows):
            max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
            max_logit = max(max_logit, b.float().abs().max().item())
    # a freed slot leaks nothing: the last request after the longest one, in one slot, vs a fresh engine
    long_p, p = ps[2], ps[4]
    s1 = Scheduler(_engine(ir, dtype=dtype, sequences=1, **engine_kw), chunk=CHUNK)
    s1.submit(long_p, max_new_tokens=12)
    after = s1.submit(p, max_new_tokens=6, keep_logits=True)
    s1.run()
    s2 = Scheduler(_engine(ir, dtype=dtype, sequences=1, **engine_kw), chunk=CHUNK)
    fresh = s2.submit(p, max_new_tokens=6, keep_logits=True)
    s2.run()
    leak_free = len(after.logits) == 6 and all(torch.equal(a, b) for a, b in zip(after.logits, fresh.logits))
    return {"greedy_equal": greedy_equal, "max_diff": max_diff, "max_logit": max_logit, "leak_free": leak_free,
            "rows": sch.decoded_rows, "steps": sch.steps, "generated": [r.generated for r in reqs], "replays": replays}


def assert_batched(ir: Path, vocab: int, tol: float | None = None, **kw) -> dict:
    r = check(ir, vocab, **kw)
    bound = tol if tol is not None else 1e-5 * r["max_logit"]
    assert r["max_logit"] > 0.5, r  # logits that say something
    assert r["greedy_equal"], r
    assert r["max_diff"] <= bound, (r, bound)
    assert r["leak_free"], r
    from vxc.codegen import kernels
    from vxc.codegen.kernels import native

    if native.available() and kernels.get_backend() in ("auto", "native"):
        # the batched steps ran as native replays (captured twice per number of rows, then replayed whatever the
        # slots), and none was refused: every stateful group has a native form over all rows
        assert r["replays"] and all(state != "refused" and not state.startswith("refused") for state, _ in
                                    r["replays"].values()), r["replays"]
        assert sum(n for _, n in r["replays"].values()) > 0, r["replays"]
    return r
