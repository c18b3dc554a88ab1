"""A long prompt's prefill runs as chunks of the engine's ``prefill_chunk`` tokens (Session.prefill): each chunk
continues from the state the previous one left, so a step's activations are bounded by the chunk, not the prompt.

Checked on a hybrid (Mamba2 + conv-QKV attention), a softmax decoder and the Oute hybrid, with an awkward chunk
(7 and 20 tokens, so the last chunk is short; 47, so it is one token, which takes the decode graph):
- the logits are bit-identical to the same chunks prefilled one by one through the API;
- they are within the family's tolerance (VINDEX3.md "Numerical floor") of the reference implementation, with
  argmax agreement wherever the margin is clear — the parity measure of the one-piece prefill;
- ``last_only`` gives the last row of the full run (within the tolerance: the head over one row is another GEMM);
- the next decode step continues from the chunked state as from the one-piece state;
- no prefill graph call sees more than ``prefill_chunk`` tokens (a spy on the graphs);
- a negative chunk is refused.
"""

from __future__ import annotations

import pytest
import torch

from tests import references as R
from tests.runtime import parity_table as P

FAMILIES = ["mamba2attn-native", "qwen3", "oute-base1"]


def _chunks(session, ids, C):
    out = []
    for a in range(0, len(ids), C):
        out.append(session.prefill(ids[a:a + C]))
    return torch.cat(out, 0)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("C", [7, 20, 47])
def test_chunked_prefill_equals_its_chunks_and_the_reference(lab, name, C):
    from vxc.runtime.session import Session

    f = lab.family(name)
    ids = P.prompt_ids(f)
    assert len(ids) > C and len(ids) % C, "the prompt must end in a short chunk"
    one = len(ids) % C == 1  # a last chunk of one token runs the decode graph
    engine = lab.engine(name)
    s = Session(engine)
    before = engine.prefill_chunk
    try:
        engine.prefill_chunk = 0
        by_hand = _chunks(s, ids, C)
        s.reset()
        one_piece = s.prefill(ids)
        step_one = s.step(ids[3])
        s.reset()
        engine.prefill_chunk = C
        seen = []
        graphs = (engine.prefill_graph, engine.prefill_last_graph)
        calls = [g.forward for g in graphs]
        for g, fwd in zip(graphs, calls):
            g.forward = lambda ids_, pos, _f=fwd: (seen.append(int(ids_.numel())), _f(ids_, pos))[1]
        try:
            chunked = s.prefill(ids)
        finally:
            for g, fwd in zip(graphs, calls):
                g.forward = fwd
        step_chunked = s.step(ids[3])
        s.reset()
        last = s.prefill(ids, last_only=True)
    finally:
        engine.prefill_chunk = before
        s.reset()
    assert seen and max(seen) == C and sum(seen) == len(ids) - one, seen
    assert chunked.shape == one_piece.shape == (len(ids), engine.padded_vocab)
    assert torch.equal(chunked, by_hand)
    r32, r64 = lab.ref(name).full(ids), lab.ref(name).full(ids, fp64=True)
    tol = R.floor_and_tolerance(r32, r64, lab.ref(name).prefill_then_step(ids, f.split))["tol"]
    V = f.vocab
    err = P.maxabs(chunked[:, :V], r32[:, :V])
    assert 0 < err <= tol, (err, tol)
    agree, excluded = R.argmax_agreement(r32[:, :V], chunked[:, :V], tol)
    assert agree == 1.0 and excluded <= 2, (agree, excluded)
    assert last.shape == (1, engine.padded_vocab) and P.maxabs(last[0, :V], chunked[-1, :V]) <= tol
    assert P.maxabs(step_chunked[:V], step_one[:V]) <= tol


def test_a_prompt_of_one_chunk_is_one_call(lab):
    from vxc.runtime.session import Session

    engine = lab.engine("qwen3")
    ids = P.prompt_ids(lab.family("qwen3"))
    assert engine.prefill_chunk >= len(ids)  # the default chunk holds the miniature prompts whole
    s = Session(engine)
    whole = s.prefill(ids)
    s.reset()
    engine.prefill_chunk, before = 0, engine.prefill_chunk
    try:
        assert torch.equal(s.prefill(ids), whole)
    finally:
        engine.prefill_chunk = before
        s.reset()


def test_negative_chunk_is_refused(lab):
    from vxc.runtime.engine import EngineError

    with pytest.raises(EngineError, match="prefill_chunk must be >= 0"):
        P.engine_for(lab.built("qwen3")[1], max_context=64, prefill_chunk=-1)


def test_exec_prefill_chunk_option(lab, vxc_inproc, tmp_path):
    """``vxc exec --prefill-chunk 9``: the teacher-forced logits are within the tolerance of the reference and the
    greedy continuation is the reference's; ``--prefill-chunk -1`` is a usage error."""
    from safetensors.torch import load_file

    from tests.runtime.conftest import read_json_line

    name = "mamba2attn-native"
    f, ir = lab.family(name), lab.built(name)[1]
    ids = P.prompt_ids(f)
    out = tmp_path / "logits.safetensors"
    r = vxc_inproc("exec", ir, "--tokens", ",".join(map(str, ids)), "--max-new-tokens", 8, "--json",
                   "--prefill-chunk", 9, "--logits-out", out)
    assert r.exit_code == 0, r.output
    p = lab.parity(name)
    assert read_json_line(r.stdout)["generated_ids"] == p.greedy_ref[:8]
    logits = load_file(str(out))["logits"]
    assert logits.shape == (len(ids), f.padded_vocab)
    assert 0 < P.maxabs(logits[:, :f.vocab], lab.ref(name).full(ids)[:, :f.vocab]) <= p.tol
    bad = vxc_inproc("exec", ir, "--tokens", "1,2", "--prefill-chunk", -1)
    assert bad.exit_code == 2 and "--prefill-chunk" in bad.output


def test_a_prefill_hands_its_heap_back(lab, monkeypatch):
    """After a prompt's prefill (not after a single step) the C heap's free pages go back to the OS (glibc's
    malloc_trim): once per prefill, whatever its chunks."""
    from vxc.runtime import session as S

    calls = []
    monkeypatch.setattr(S, "_LIBC", [lambda pad: calls.append(pad)])
    engine = lab.engine("qwen3")
    s = S.Session(engine)
    ids = P.prompt_ids(lab.family("qwen3"))
    engine.prefill_chunk, before = 7, engine.prefill_chunk
    try:
        s.prefill(ids, last_only=True)
        assert calls == [0]
        s.step(ids[0])
        s.prefill(ids[:1])
        assert calls == [0]
        s.prefill(ids[:5])
        assert calls == [0, 0]
    finally:
        engine.prefill_chunk = before
        s.reset()
