"""Batched decode (sequence slots, one step for B sequences) equals single-sequence decode, on every runtime
miniature (tests/runtime/batch_check.py says what is checked); the family miniatures under tests/families
run the same check from their own modules. Also: the slot bookkeeping of the state provider and describe."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import batch_check as BC
from tests.runtime import parity_table as P


@pytest.mark.parametrize("name", sorted(P.FAMILIES))
def test_batched_decode_equals_single(lab, name):
    _, ir = lab.built(name)
    r = BC.assert_batched(ir, P.FAMILIES[name].vocab)
    assert r["rows"] == sum(BC.NEW_TOKENS) - len(BC.NEW_TOKENS)  # every token after the first came from a batched row


@pytest.mark.parametrize("name", ["llama", "mamba2attn-native", "qwen3", "mamba2-native"])
def test_one_sequence_in_slot_0_takes_the_replayed_step_bit_identically(lab, name):
    """A batched step of slot 0 alone runs the single-sequence decode step (natively replayed once captured); it
    gives exactly the batched graph's values, step by step."""
    _, ir = lab.built(name)
    a = P.engine_for(ir, max_context=64, sequences=2)
    b = P.engine_for(ir, max_context=64, sequences=2, replay=False)
    for e in (a, b):
        e.bind_slot(0)
        e.prefill_graph(torch.arange(3, 12), 0)
    for i in range(6):
        la = a.decode_batch([5 + i], [9 + i], [0])
        lb = b.batch_graph(torch.tensor([5 + i]), [9 + i], torch.tensor([9 + i]), [0], torch.tensor([0]))
        assert torch.equal(la.reshape(-1), lb.reshape(-1)), i
    assert a.replay_status().startswith("replaying"), a.replay_status()


def test_a_step_without_a_copy_hands_out_the_replays_buffer(lab):
    """``decode_batch(..., fresh=False)`` (what the scheduler asks for: it chooses every row's token before the next
    step) returns a replayed step's own output buffer — the same memory every step, the fresh copy's values — and the
    default returns a new tensor each step; one sequence in slot 0 (the single-sequence replay) alike."""
    _, ir = lab.built("qwen3")
    e = P.engine_for(ir, max_context=64, sequences=3)
    twin = P.engine_for(ir, max_context=64, sequences=3)
    for eng in (e, twin):
        for s in range(3):
            eng.bind_slot(s)
            eng.prefill_graph(torch.arange(3, 12 + s), 0)
    for slots in ([1, 2], [0]):
        pos = {s: 9 + s for s in slots}
        ptrs, wants = set(), []
        for i in range(6):
            got = e.decode_batch([5 + i] * len(slots), [pos[s] for s in slots], slots, fresh=False)
            want = twin.decode_batch([5 + i] * len(slots), [pos[s] for s in slots], slots)
            assert torch.equal(got, want), (slots, i)
            if i >= 4:  # replaying by now (captured in the first steps)
                ptrs.add(got.data_ptr())
                wants.append(want)
            for s in slots:
                pos[s] += 1
        assert len(ptrs) == 1, slots  # the replay's buffer, step after step
        assert len({w.data_ptr() for w in wants}) == len(wants)  # the default: a new tensor each step
    assert e.batch_replays[2].ready and e.replay_status().startswith("replaying")


@pytest.mark.parametrize("name", ["mamba2attn-native", "qwen3", "mamba2-native"])
def test_native_rows_forms_equal_the_row_loop(lab, name, monkeypatch):
    """The native forms over all B rows (conv, SSD and attention steps: one call running each row's single-row step)
    give exactly what the per-row loop of single-row kernels gives, and they do run."""
    from vxc.codegen import batch
    from vxc.codegen.kernels import native as N

    _, ir = lab.built(name)
    engines = [P.engine_for(ir, max_context=64, sequences=3, replay=False) for _ in range(2)]  # (the graph's calls)
    for e in engines:
        for slot, n in ((0, 9), (1, 4), (2, 13)):
            e.bind_slot(slot)
            e.prefill_graph(torch.arange(3, 3 + n), 0)
    rec = N.Recorder()
    with N.recording(rec):
        fast = [engines[0].decode_batch([5 + i, 7, 11 + i], [9 + i, 4 + i, 13 + i], [2, 0, 1]) for i in range(3)]
    used = {name for name, _ in rec.calls}
    assert used & {"vxc_conv1d_step_rows", "vxc_ssd_step_rows", "vxc_attention_step_rows"}, used
    monkeypatch.setattr(batch, "_ROWS", {})
    slow = [engines[1].decode_batch([5 + i, 7, 11 + i], [9 + i, 4 + i, 13 + i], [2, 0, 1]) for i in range(3)]
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mamba2-native", "mamba2attn-native", "oute-base0"])
def test_batched_replay_follows_the_slots_of_each_step(lab, name):
    """The batched step of B rows is captured twice and then replayed for every later step of B rows, whatever
    slots and positions it has: step by step, its logits equal (torch.equal) those of the batched graph run on a
    second engine without replay, while the set of active slots changes at every step (and the number of rows
    changes between steps), and so does every slot's state afterwards."""
    _, ir = lab.built(name)
    a = P.engine_for(ir, max_context=64, sequences=4)
    b = P.engine_for(ir, max_context=64, sequences=4, replay=False)
    lens = {0: 9, 1: 4, 2: 13, 3: 6}
    for e in (a, b):
        for slot, n in lens.items():
            e.bind_slot(slot)
            e.prefill_graph(torch.arange(3, 3 + n), 0)
    pos = dict(lens)
    schedule = [[0, 1, 2], [2, 0, 1], [1, 2, 3], [3, 0, 1], [2], [2, 3, 0], [0, 1, 2, 3], [1, 3, 2], [3, 2, 1, 0],
                [0, 2, 1], [1], [3]]
    for i, slots in enumerate(schedule):
        toks = [(7 * i + 3 * s) % 40 + 2 for s in slots]
        positions = [pos[s] for s in slots]
        la = a.decode_batch(toks, positions, slots)
        lb = b.batch_graph(torch.tensor(toks), positions, torch.tensor(positions), slots, torch.tensor(slots))
        assert torch.equal(la, lb), (i, slots)
        for s in slots:
            pos[s] += 1
    r3 = a.batch_replays[3]
    assert r3.ready and r3.steps == 5, (r3.refused, r3.steps)  # 7 steps of 3 rows: 2 captured, 5 replayed
    assert a.batch_replays[4].ready and a.batch_replays[4].steps == 0  # two steps of 4 rows: both captured
    assert a.batch_replays[1].ready and a.batch_replays[1].steps == 1  # slots 2, 1 captured; slot 3 replayed
    for rid, full in a.state.slots.items():
        assert torch.equal(full, b.state.slots[rid]), rid


def test_scheduler_stats_count_only_requests_still_running(lab):
    """A request that ended in a step keeps its slot until the next step's start, but ``stats()["active"]`` (what
    /health shows) no longer counts it: a client holding its answer sees it gone."""
    from vxc.runtime.scheduler import Scheduler

    _, ir = lab.built("qwen3")
    sch = Scheduler(P.engine_for(ir, max_context=64, sequences=2), chunk=4)
    long = sch.submit([5, 6, 7], max_new_tokens=6)
    short = sch.submit([8, 9, 10], max_new_tokens=2)
    seen = []
    while short.finish_reason is None:
        sch.step()
        seen.append(sch.stats()["active"])
    assert seen[0] == 2 and seen[-1] == 1, seen  # both ran; the short one ended in the last step
    assert short in sch.active  # (its slot is freed at the next step's start)
    sch.run()
    assert long.finish_reason == "length" and sch.stats()["active"] == 0


def test_scheduler_counts_decode_and_prefill_time(lab):
    """The counters /health reports for the load test's decode-only rate: batched steps and their seconds, prefill
    chunks' seconds, and the generated rows those steps produced (the first token of each request comes from its
    prefill, the rest from batched rows)."""
    from vxc.runtime.scheduler import Scheduler

    _, ir = lab.built("qwen3")
    sch = Scheduler(P.engine_for(ir, max_context=64, sequences=2), chunk=4)
    st0 = sch.stats()
    assert (st0["decode_steps"], st0["decode_seconds"], st0["prefill_seconds"]) == (0, 0.0, 0.0)
    reqs = [sch.submit(list(range(5, 5 + n)), max_new_tokens=k) for n, k in ((9, 5), (6, 3), (11, 4))]
    sch.run()
    st = sch.stats()
    assert all(r.finish_reason == "length" for r in reqs)
    assert st["decoded_rows"] == (5 - 1) + (3 - 1) + (4 - 1)
    assert 0 < st["decode_steps"] <= st["steps"] and st["decode_seconds"] > 0 and st["prefill_seconds"] > 0


def test_prefill_graphs_are_built_on_first_use_at_the_bound_slot(lab):
    """The prefill graphs are built when first used: a generating session never builds the all-logits one, and a
    graph first built while another slot is bound prefills that slot — its state changes, slot 0's stays untouched —
    with the logits the same prompt gives in slot 0 of a fresh engine."""
    _, ir = lab.built("qwen3")
    e = P.engine_for(ir, max_context=64, sequences=3)
    fresh = P.engine_for(ir, max_context=64, sequences=3)
    assert e._prefill_graphs == {}
    before = {rid: t.clone() for rid, t in e.state.slots.items()}
    e.bind_slot(2)
    got = e.prefill_last_graph(torch.arange(3, 14), 0)
    assert set(e._prefill_graphs) == {"prefill_last"}
    want = fresh.prefill_last_graph(torch.arange(3, 14), 0)
    assert torch.equal(got, want)
    for rid, t in e.state.slots.items():
        assert torch.equal(t[0], before[rid][0]) and torch.equal(t[1], before[rid][1]), rid
        assert torch.equal(t[2], fresh.state.slots[rid][0]), rid
    e.bind_slot(1)  # a graph built later follows the slot bound then
    fresh.bind_slot(1)
    assert torch.equal(e.prefill_graph(torch.arange(3, 14), 0), fresh.prefill_graph(torch.arange(3, 14), 0))
    for rid, t in e.state.slots.items():
        assert torch.equal(t[1], fresh.state.slots[rid][1]), rid
    after = {rid: t.clone() for rid, t in e.state.slots.items()}
    e.bind_slot(0)  # and the one built before is pointed at the slot bound now
    other = P.engine_for(ir, max_context=64, sequences=1)
    assert torch.equal(e.prefill_last_graph(torch.arange(4, 9), 0), other.prefill_last_graph(torch.arange(4, 9), 0))
    for rid, t in e.state.slots.items():
        assert torch.equal(t[1:], after[rid][1:]) and not torch.equal(t[0], after[rid][0]), rid
