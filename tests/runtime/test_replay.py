"""Decode replay (``vxc.runtime.replay``): a captured decode step replayed as native calls.

Replayed steps must be bit-identical to the graph's steps (same kernels, same buffers), return fresh tensors,
and follow the position (rotary rows, attention length); a step that cannot be captured faithfully must be
refused with its reason while decoding goes on through the graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime import parity_table as P
from vxc.codegen import kernels
from vxc.runtime.replay import CAPTURES, DecodeReplay
from vxc.runtime.session import Session

STEPS = 12


def _steps(engine, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    s = Session(engine)
    s.prefill(ids)
    return [s.step(t) for t in tokens]


def _tokens(f: P.Family) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, f.vocab, (STEPS,), generator=g).tolist()


@pytest.mark.parametrize("name", sorted(P.FAMILIES))
@pytest.mark.native
def test_replay_is_bit_identical_to_the_graph(lab, name):
    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    replayed = P.engine_for(ir, max_context=64)
    plain = P.engine_for(ir, max_context=64, replay=False)
    got, want = _steps(replayed, ids, _tokens(f)), _steps(plain, ids, _tokens(f))
    assert replayed.replay_status().startswith("replaying"), replayed.replay_status()
    assert plain.replay_status() == "off"
    assert _c_calls(replayed.replay) == len(replayed.replay.program)  # every call from C (vxc_run_program)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"
    # results are fresh tensors, not views of the replay's buffers
    assert len({t.data_ptr() for t in got}) == len(got)
    # and the twins agree within fp32 summation-order noise
    with kernels.backend("torch"):
        twin = _steps(P.engine_for(ir, max_context=64), ids, _tokens(f))
    for a, b in zip(got, twin):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def _c_calls(rep) -> int:
    """How many of a replay's calls run from C (its :class:`_CSegment` runs)."""
    from vxc.runtime.replay import _CSegment

    return sum(seg.n for seg in (rep.segments or []) if isinstance(seg, _CSegment))


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native", "mamba2-native"])
@pytest.mark.native
def test_the_c_loop_replays_what_the_python_loop_does(lab, name, monkeypatch):
    """A replayed step's calls run from C (vxc_run_program: every kernel through one integer / float prototype) or,
    with VXC_REPLAY_LOOP=python, one ctypes call each: the same values, bit for bit, single-sequence and batched."""
    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    runs = {}
    for loop in ("c", "python"):
        monkeypatch.setenv("VXC_REPLAY_LOOP", loop)
        e = P.engine_for(ir, max_context=64, sequences=3)
        single = _steps(e, ids, _tokens(f))
        pos = {1: 5, 2: 9}
        for s_, n in pos.items():
            e.bind_slot(s_)
            e.prefill_graph(torch.tensor(ids[:n]), 0)
        batched = []
        for t in _tokens(f)[:6]:
            batched.append(e.decode_batch([t, t], [pos[1], pos[2]], [1, 2]))
            pos[1] += 1
            pos[2] += 1
        b = e.batch_replays[2]
        assert e.replay.ready and b.ready
        assert (_c_calls(e.replay), _c_calls(b)) == ((len(e.replay.program), len(b.program)) if loop == "c" else (0, 0))
        runs[loop] = (single, batched)
    for a, b in zip(runs["c"][0] + runs["c"][1], runs["python"][0] + runs["python"][1]):
        assert torch.equal(a, b)


@pytest.mark.native
def test_c_runs_around_a_python_call_and_moving_arguments():
    """A program's C calls run in segments around a recorded Python call, each argument that moves with the position
    set from its line: out = (x + y)[:n(pos)] then doubled in Python, then + y again."""
    import ctypes

    from vxc.codegen.kernels import native as N
    from vxc.runtime.replay import _CSegment, _run_segments, _segments

    lib = N.load()
    add = getattr(lib, N.declare("vxc_add", N.P, N.P, N.P, N.L, N.I))
    x, y = torch.randn(64), torch.randn(64)
    z, w = torch.zeros(64), torch.zeros(64)

    def double(address: int, n: int) -> None:
        t = N.tensor_at(address, n, torch.float32)
        t.mul_(2)

    conv = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(z.data_ptr()), None,
            ctypes.c_int(0)]
    program = [(add, conv, [(3, 8, 3)]),  # n = 8 + 3 pos
               (double, [z.data_ptr(), 64], []),
               (add, [conv[2], conv[1], ctypes.c_void_p(w.data_ptr()), ctypes.c_long(64), ctypes.c_int(0)], [])]
    segs = _segments(program)
    assert [type(s).__name__ for s in segs] == ["_CSegment", "tuple", "_CSegment"]
    assert all(s.n == 1 for s in segs if isinstance(s, _CSegment))
    for pos in (0, 5, 13):
        z.zero_()
        _run_segments(segs, pos)
        n = 8 + 3 * pos
        want_z = torch.zeros(64)
        want_z[:n] = (x[:n] + y[:n]) * 2
        assert torch.equal(z, want_z) and torch.equal(w, want_z + y), pos


@pytest.mark.parametrize("name", ["mamba2-native", "qwen3", "oute-base1"])
@pytest.mark.native
def test_bf16_replay_is_bit_identical(lab, name):
    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    got = _steps(P.engine_for(ir, max_context=64, dtype=torch.bfloat16), ids, _tokens(f))
    want = _steps(P.engine_for(ir, max_context=64, dtype=torch.bfloat16, replay=False), ids, _tokens(f))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.native
def test_a_step_with_a_non_native_kernel_is_refused(lab, monkeypatch):
    """An op without a native form would be skipped by a replay: the capture refuses, naming it."""
    monkeypatch.setattr(kernels, "NATIVE_OPS", kernels.NATIVE_OPS - {"ssd_step"})
    f = P.FAMILIES["mamba2-native"]
    _, ir = lab.built("mamba2-native")
    ids = P.prompt_ids(f)[:20]
    e = P.engine_for(ir, max_context=64)
    got = _steps(e, ids, _tokens(f))
    assert e.replay_status() == "refused: vxc::ssd_step has no native form"
    want = _steps(P.engine_for(ir, max_context=64, replay=False), ids, _tokens(f))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _attention_graph(start_of):
    """A one-kernel 'decode graph' whose attention length is ``start_of(pos)``."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    kc, vc = torch.randn(32, 2, 8), torch.randn(32, 2, 8)

    def graph(ids, pos):
        return torch.ops.vxc.attention(q, k, v, kc, vc, start_of(pos), 0.3)

    return graph, (q, k, v, kc, vc)


@pytest.mark.native
def test_arguments_that_move_with_the_position_are_followed():
    graph, (q, k, v, kc, vc) = _attention_graph(lambda pos: 2 * pos + 1)
    rep = DecodeReplay(graph, torch.zeros(1, dtype=torch.int64))
    for pos in range(CAPTURES):
        rep(pos)
    assert rep.ready
    for pos in (5, 9):
        out = rep(pos)
        kc2, vc2 = kc.clone(), vc.clone()
        from vxc.codegen.kernels.attention import attention_twin

        torch.testing.assert_close(out, attention_twin(q, k, v, kc2, vc2, 2 * pos + 1, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.native
def test_a_non_linear_argument_is_refused():
    graph, _ = _attention_graph(lambda pos: pos * pos)
    rep = DecodeReplay(graph, torch.zeros(1, dtype=torch.int64))
    for pos in range(CAPTURES + 1):
        rep(pos)
    assert not rep.ready
    assert rep.refused == "vxc_attention_step argument 6 changes with the position non-linearly"


@pytest.mark.native
def test_graph_level_compute_is_refused():
    """Arithmetic outside the vxc kernels would not be replayed: refused."""
    w = torch.randn(8, 8)

    def graph(ids, pos):
        return torch.ops.vxc.linear(torch.ones(1, 8) * 2, w, None)

    rep = DecodeReplay(graph, torch.zeros(1, dtype=torch.int64))
    rep(0)
    assert rep.refused is not None and "is not a view" in rep.refused


@pytest.mark.parametrize("name", ["mamba2-native", "qwen3", "mamba2attn-native"])
def test_prefill_last_only(lab, name):
    """``prefill(last_only=True)`` runs the head on the last position only: its row matches the full prefill's
    last row (the head's GEMV for one row sums in another order than the GEMM), the state it leaves is the same
    bit for bit, and so are the steps after it."""
    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:30]
    eng = P.engine_for(ir, max_context=64)
    s = Session(eng)
    full = s.prefill(ids)
    state_full = {k: b.clone() for k, b in eng.state.buffers.items()}
    after_full = s.step(ids[0])
    s.reset()
    last = s.prefill(ids, last_only=True)
    assert last.shape == (1, full.shape[1])
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-5 * float(full[-1].abs().max()))
    assert int(last[0, :f.vocab].argmax()) == int(full[-1, :f.vocab].argmax())
    assert all(torch.equal(b, state_full[k]) for k, b in eng.state.buffers.items())
    assert torch.equal(s.step(ids[0]), after_full)


# ------------------------------------------------------------------ the thread governor


class _Clock:
    """A fake perf_counter: a step advances it by the cost of the thread count it ran at, under a given load."""

    def __init__(self):
        self.t, self.threads, self.loaded = 0.0, 2, False
        self.at = {1: 0, 2: 0}  # steps run at each thread count

    def __call__(self) -> float:
        return self.t

    def set_threads(self, n: int) -> None:
        self.threads = n

    def run(self) -> None:
        # quiet: 2 threads 1.0, 1 thread 1.8; one busy process beside: 2 threads 10 (barriers wait for a
        # descheduled thread), 1 thread 2.0
        self.t += {(2, False): 1.0, (1, False): 1.8, (2, True): 10.0, (1, True): 2.0}[self.threads, self.loaded]
        self.at[self.threads] += 1


def test_thread_governor_follows_the_load(monkeypatch):
    from vxc.runtime import replay

    clock = _Clock()
    monkeypatch.setattr(replay.time, "perf_counter", clock)
    g = replay.ThreadGovernor(clock.set_threads, 2)

    def steps(n: int) -> float:
        t0 = clock.t
        for _ in range(n):
            g.step(clock.run)
            assert clock.threads == g.n  # the governed count stays in force between steps (probes undone)
        return clock.t - t0

    quiet = steps(600)
    assert g.n == 2 and g.switches == 0 and 600 <= quiet <= 600 * 1.02  # failed probes back off: < 2 % cost
    # probes at steps 64, 64 + 128 and 64 + 128 + 256 (the interval doubling): each ends at its first slow step
    assert g.probes == 3 and clock.at[1] == 3, (g.probes, clock.at)
    clock.loaded = True
    steps(12)
    assert g.n == 1 and g.switches == 1  # load noticed within a few steps
    loaded = steps(600)
    assert loaded <= 600 * 2.0 * 1.25 and loaded < 600 * 10.0 / 4  # probes at 2 threads cost little
    clock.loaded = False
    steps(600)
    assert g.n == 2 and g.switches == 2, g.report()  # back to both threads once they are free
    assert "2 of 2 threads" in g.report()


def test_thread_governor_off_and_refusals(monkeypatch):
    from vxc.runtime import replay

    monkeypatch.setenv("VXC_THREADS", "fixed")
    assert replay.governor() is None
    monkeypatch.setenv("VXC_THREADS", "sometimes")
    with pytest.raises(ValueError, match="VXC_THREADS='sometimes': expected auto or fixed"):
        replay.threads_mode()


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native"])
@pytest.mark.native
def test_governed_steps_stay_bit_identical(lab, name, monkeypatch):
    """Replayed steps at one thread (the governor's choice under load) equal the graph's steps at two: no kernel's
    result depends on the thread count."""
    from vxc.runtime import replay

    from vxc.codegen.kernels import native

    monkeypatch.setattr(replay.ThreadGovernor, "_step", lambda self, run: (self.set_threads(1), run()))
    # governed even where the suite runs the library on one thread
    monkeypatch.setattr(replay, "governor", lambda: replay.ThreadGovernor(native.load().vxc_set_threads, 2))
    f = P.FAMILIES[name]
    _, ir = lab.built(name)
    ids = P.prompt_ids(f)[:20]
    replayed = P.engine_for(ir, max_context=64)
    got = _steps(replayed, ids, _tokens(f))
    assert replayed.replay.governor is not None and replayed.replay_status().startswith("replaying")
    want = _steps(P.engine_for(ir, max_context=64, replay=False), ids, _tokens(f))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.native
def test_governed_count_is_released_for_other_work(lab, monkeypatch):
    """A governor leaves its thread count in force after a step (one OpenMP runtime per process): a prefill — of
    this engine or another — runs the native regions at the count in force before, and a governor made later (a
    second engine's) starts from that count, not from the throttled one."""
    from vxc.codegen.kernels import native
    from vxc.runtime import replay
    from vxc.runtime.session import Session

    def settle_on_one(self, run):  # the governor's choice under load: one thread, kept after the step
        self.n = 1
        run()

    monkeypatch.setattr(replay.ThreadGovernor, "_step", settle_on_one)
    f = P.FAMILIES["qwen3"]
    _, ir = lab.built("qwen3")
    ids = P.prompt_ids(f)[:20]
    lib = native.load()
    lib.vxc_set_threads(2)
    try:
        want = Session(P.engine_for(ir, max_context=64)).prefill(ids)
        governed = P.engine_for(ir, max_context=64)
        _steps(governed, ids[:8], _tokens(f))
        assert governed.replay.governor is not None and native.max_threads() == 1  # the governed count in force
        other = P.engine_for(ir, max_context=64)
        got = Session(other).prefill(ids)
        assert native.max_threads() == 2 and torch.equal(got, want)
        _steps(other, ids[:8], _tokens(f))
        assert other.replay.governor is not None and other.replay.governor.max == 2
    finally:
        replay.release_threads()
        lib.vxc_set_threads(1 if torch.get_num_threads() == 1 else torch.get_num_threads())
