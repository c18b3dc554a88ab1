"""Decode replay: a fixed-shape decode step captured as its sequence of native kernel calls, then replayed
without torch (the CPU analogue of a CUDA graph).

The decode graph is already fixed-shape and reads static buffers (weights, state regions, the engine's token
buffer); what a step still spends outside its kernels is Python and dispatcher work per op, which on this
kind of CPU costs as much as the small kernels themselves once the weight stream has evicted the caches.
So the first steps run the graph normally while ``kernels.native`` records every kernel call with its raw
arguments (pointers, sizes, flags), outputs drawn from one pool that every captured step reuses (a tensor-parallel
step's all-reduce is recorded the same way: a Python call on pooled buffers, ``native.call_py``). Three
captured steps at different positions must agree call for call; an argument that differs must be an
integer that moves linearly with the position (a rotary table row, the attention's row count), and the
third capture must match the line the first two define. Anything else — a kernel that ran its torch twin,
an aten op at graph level other than a view, an output buffer that changed — refuses the capture, with the
reason kept in ``refused``, and the engine keeps running the graph. Replay results are bit-identical to the
graph's: the same kernels run on the same buffers with the same arguments.

A batched decode step (:meth:`Engine.decode_batch`: one token for each of B sequences, each in its own state slot at
its own position) is captured and replayed the same way, one :class:`BatchReplay` per B. It takes its tokens,
positions and slots from three int64 buffers of its own, and every kernel of the captured step reads them there
(the rotary rows, the attention rows, the conv/SSD state of each slot), so its calls are the same whatever slots
and positions a step has: two captured steps must agree call for call, argument for argument, and the replay then
serves every later step of B sequences, however the set of active slots changes between steps. A stateful group
that has no native form over all rows runs row by row from the Python lists and refuses the capture.

A replay's calls run from C: ``vxc_run_program`` takes them as an array of structs and calls each kernel through
one prototype of integers and floats (:class:`_CSegment`), with no ctypes call per kernel; a recorded Python call
runs between such runs, and ``VXC_REPLAY_LOOP=python`` keeps one ctypes call per kernel.

Replayed steps run under a :class:`ThreadGovernor` (``VXC_THREADS=fixed`` turns it off): on a CPU shared with
other busy processes it moves the native kernels to fewer threads when that is faster (measured, step by step),
and back when the cores free up (``benchmarks/shared_cpu.py``).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..codegen import kernels
from ..codegen.kernels import native

CAPTURES = 3

_RUN_PROGRAM = native.declare("vxc_run_program", native.P, native.L, native.L)
_RUN_PROGRAM_TIMED = native.declare("vxc_run_program_timed", native.P, native.L, native.L, native.P)
_INT_ARGS = (native.P, native.L, native.I)  # the argument types vxc_run_program passes as integers
_FLOAT_ARGS = (native.F,)


class _CSegment:
    """Consecutive C calls of a captured program, run by one ``vxc_run_program`` call (see the C source: every
    kernel called through one prototype of integers and floats, so a step's calls cost no ctypes call each). The
    calls' constant arguments are written once into an array of the C structs; an argument that moves with the
    position is set by the C loop from its line (base + slope · pos)."""

    def __init__(self, lib, calls: list[tuple]):
        import struct

        size, off_f, off_nm, off_mi, off_base, off_slope = (int(lib.vxc_program_layout(i)) for i in range(6))
        off_i = int(lib.vxc_program_layout(9))
        self.n = len(calls)
        self.buf = (ctypes.c_char * (size * self.n))()
        for c, (fn, args, moving) in enumerate(calls):
            at = c * size
            ints, floats, slot = [], [], {}
            for i, (t, v) in enumerate(zip(fn.argtypes, args)):
                v = v.value if isinstance(v, ctypes._SimpleCData) else v
                if t in _FLOAT_ARGS:
                    floats.append(float(v))
                else:
                    slot[i] = len(ints)
                    ints.append(0 if v is None else int(v))
            struct.pack_into("<q", self.buf, at, ctypes.cast(fn, ctypes.c_void_p).value)
            struct.pack_into(f"<{len(ints)}q", self.buf, at + off_i, *ints)
            struct.pack_into(f"<{len(floats)}f", self.buf, at + off_f, *floats)
            struct.pack_into("<i", self.buf, at + off_nm, len(moving))
            for k, (i, base, slope) in enumerate(moving):
                struct.pack_into("<i", self.buf, at + off_mi + 4 * k, slot[i])
                struct.pack_into("<q", self.buf, at + off_base + 8 * k, base)
                struct.pack_into("<q", self.buf, at + off_slope + 8 * k, slope)
        self.ptr = ctypes.addressof(self.buf)
        self.fn = getattr(lib, _RUN_PROGRAM)
        self.timed_fn = getattr(lib, _RUN_PROGRAM_TIMED)

    def __call__(self, pos: int) -> None:
        self.fn(self.ptr, self.n, pos)

    def timed(self, pos: int, ns: int) -> None:
        """Run the calls, adding each one's wall time in ns to the int64 array at address ``ns``."""
        self.timed_fn(self.ptr, self.n, pos, ns)


def _segments(program: list[tuple]) -> Optional[list]:
    """The program's calls as runnable segments: runs of C calls that ``vxc_run_program`` can make (:class:`_CSegment`)
    and the other calls one by one (a recorded Python call, an argument type or count past the C struct's); None
    where it cannot run here (another calling convention) or ``VXC_REPLAY_LOOP=python`` asks for the Python loop."""
    if os.environ.get("VXC_REPLAY_LOOP", "c") == "python":
        return None
    lib = native.load()
    supported = lib.vxc_program_supported
    supported.argtypes, supported.restype = [], ctypes.c_int
    if not supported():
        return None
    layout = lib.vxc_program_layout
    layout.argtypes, layout.restype = [ctypes.c_int], ctypes.c_long
    ni, nf, nm = (int(layout(i)) for i in (6, 7, 8))

    def fits(fn, moving) -> bool:
        types = getattr(fn, "argtypes", None)
        if not isinstance(fn, ctypes._CFuncPtr) or types is None or len(moving) > nm:
            return False
        if any(t not in _INT_ARGS + _FLOAT_ARGS for t in types):
            return False
        return sum(t in _FLOAT_ARGS for t in types) <= nf and sum(t in _INT_ARGS for t in types) <= ni

    out, run = [], []
    for fn, args, moving in program:
        if fits(fn, moving):
            run.append((fn, args, moving))
            continue
        if run:
            out.append(_CSegment(lib, run))
            run = []
        out.append((fn, args, moving))
    if run:
        out.append(_CSegment(lib, run))
    return out


def _run_segments(segments: list, pos: int, ns=None) -> None:
    """Run a program's segments (or the program itself, its calls one by one) at position ``pos``; with ``ns`` (a
    ctypes int64 array, one element per call of the program) each call's wall time in ns is added to its element."""
    at, base = 0, (ctypes.addressof(ns) if ns is not None else 0)
    for seg in segments:
        if isinstance(seg, _CSegment):
            if ns is None:
                seg(pos)
            else:
                seg.timed(pos, base + 8 * at)
            at += seg.n
            continue
        fn, args, moving = seg
        if moving:
            args = list(args)
            for i, b, slope in moving:
                args[i] = b + slope * pos
        if ns is None:
            fn(*args)
        else:
            t0 = time.perf_counter_ns()
            fn(*args)
            ns[at] += time.perf_counter_ns() - t0
        at += 1


def _call_weights(args, weights: dict[int, str]) -> str:
    """The encoding (or dtype) of the first weight buffer a native call's arguments point at ('' if none)."""
    for a in args:
        v = a.value if isinstance(a, ctypes._SimpleCData) else a
        if isinstance(v, int) and v in weights:
            return weights[v]
    return ""


def _kernel_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(fn, "__qualname__", None) or repr(fn)


class StepProfile:
    """Where replayed decode steps spend their time: each native call's wall time (``vxc_run_program_timed``: one
    clock read a call), summed over the steps run while profiling, grouped by the vxc op that made the call, the
    native kernel and the encoding (or dtype) of the weight it read. A step's wall time beyond its calls' is the
    replay loop's own (and, on a step the thread governor probes, nothing else: it runs the same calls)."""

    def __init__(self, program: list, labels: list[tuple[str, str]], weights: Optional[dict[int, str]] = None):
        self.kernels = [_kernel_name(c[0]) for c in program]
        labels = labels if len(labels) == len(program) else [("", "")] * len(program)
        # a call that reads a weight is named by that weight (a fused op's calls read different ones: the gate / up
        # and the down projection of a SwiGLU FFN); others by the first weight among their op's arguments
        self.labels = [(op, _call_weights(c[1], weights or {}) or w) for c, (op, w) in zip(program, labels)]
        self.ns = (ctypes.c_int64 * max(1, len(program)))()
        self.steps = 0
        self.wall_ns = 0

    def run(self, calls: Callable) -> None:
        """Run one step, ``calls(ns)``, timing it and (through ``ns``) each of its calls."""
        t0 = time.perf_counter_ns()
        calls(self.ns)
        self.wall_ns += time.perf_counter_ns() - t0
        self.steps += 1

    def summary(self) -> dict:
        """The profile as plain data: steps, ms a step (wall, in the calls, the rest) and one row per (op, kernel,
        weights) with its calls a step, ms a step and share of the step's wall time, slowest first."""
        n = max(self.steps, 1)
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, (kernel, (op, weights)) in enumerate(zip(self.kernels, self.labels)):
            g = groups.setdefault((op or "-", kernel, weights or "-"), [0, 0])
            g[0] += 1
            g[1] += self.ns[i]
        wall = self.wall_ns / n / 1e6
        calls_ms = sum(g[1] for g in groups.values()) / n / 1e6
        rows = [{"op": op, "kernel": kernel, "weights": w, "calls": c, "ms": t / n / 1e6,
                 "share": (t / n / 1e6) / wall if wall > 0 else 0.0}
                for (op, kernel, w), (c, t) in groups.items()]
        rows.sort(key=lambda r: -r["ms"])
        return {"steps": self.steps, "calls": len(self.kernels), "step_ms": wall, "calls_ms": calls_ms,
                "other_ms": wall - calls_ms, "rows": rows}


def format_profile(p: Optional[dict], why: str = "") -> str:
    """``summary()`` as the table ``vxc exec --profile`` prints (or why there is none)."""
    if not p or not p["steps"]:
        return "decode profile: no replayed step ran" + (f" ({why})" if why else "")
    head = (f"decode profile: {p['steps']} replayed steps of {p['calls']} native calls, {p['step_ms']:.3f} ms a step "
            f"({p['calls_ms']:.3f} ms in the calls, {p['other_ms']:.3f} ms the replay loop's own)")
    return profile_table(head, "ms/step", p["rows"], ("op", "kernel", "weights"))


def profile_table(head: str, unit: str, rows: list[dict], names: tuple[str, ...]) -> str:
    """A profile's lines: ``head``, then ms, share and calls of each row, named by its ``names`` fields."""
    lines = [head, f"{unit:>9} {'share':>6} {'calls':>6}  " + " / ".join(names)]
    for r in rows:
        lines.append(f"{r['ms']:9.3f} {100 * r['share']:5.1f}% {r['calls']:6d}  " + " / ".join(str(r[n]) for n in names))
    return "\n".join(lines)


# graph-level aten ops a capturable step may run besides vxc kernels: views (no data is computed)
_VIEW_OPS = {
    "split", "split_with_sizes", "view", "_unsafe_view", "reshape", "slice", "narrow", "select", "unsqueeze",
    "squeeze", "alias", "t", "transpose", "permute", "as_strided", "expand", "detach", "sym_size", "unbind",
}


class _Guard(TorchDispatchMode):
    """Watches the graph-level ops of a captured step: views pass, each native-capable vxc op must have
    recorded a native call, anything else refuses the capture."""

    def __init__(self, rec: native.Recorder, weights: Optional[dict[int, str]] = None):
        super().__init__()
        self.rec = rec
        self.weights = weights or {}  # data_ptr -> the weight's encoding or dtype (the profile's labels)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # a capture runs eagerly, never under torch.compile: the default (True) wraps __torch_dispatch__ in
        # torch._disable_dynamo, whose first call imports torch._dynamo — 1.1 s and ~140 MB of RSS in the first
        # decode step of every process
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._opname
        before = len(self.rec.calls)
        if ns == "vxc":
            self.rec.label = (name, self._weights(args))
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.rec.label = ("", "")
        if ns == "vxc":
            if name not in kernels.NATIVE_OPS:
                self.rec.failed = self.rec.failed or f"vxc::{name} has no native form"
            elif len(self.rec.calls) == before:
                self.rec.failed = self.rec.failed or f"vxc::{name} made no native call"
        elif name not in _VIEW_OPS:
            self.rec.failed = self.rec.failed or f"graph-level op {ns}::{name} is not a view"
        return out

    def _weights(self, args) -> str:
        return arg_weights(args, self.weights)


def arg_weights(args, weights: dict[int, str]) -> str:
    """The encoding (or dtype) of the first weight among an op's arguments ('' if it reads none)."""
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, Tensor) and t.data_ptr() in weights:
                return weights[t.data_ptr()]
    return ""


class ThreadGovernor:
    """How many threads a replayed decode step's parallel regions use, following the cores actually free.

    On a CPU shared with another busy process, a parallel region on every thread waits at its barrier for a
    descheduled thread (hundreds of regions per step: a step can take 10x longer). The governor times each step
    and now and then runs ``PROBE_STEPS`` steps at a neighbouring thread count (a probe); when every step of a
    probe beats the median of the recent steps at the current count by more than ``GAIN``, that count is kept. A failed probe doubles the
    interval to the next one (up to ``MAX_INTERVAL`` steps), so a probe on the wrong side costs little; a step
    ``JUMP`` times slower than the recent median (load just arrived) brings the next probe forward. Results do
    not depend on the thread count (every kernel gives each output element to one thread, in a fixed order),
    so replayed steps stay bit-identical to the graph's.
    """

    GAIN, JUMP, FIRST_INTERVAL, MAX_INTERVAL, WINDOW, PROBE_STEPS = 0.85, 3.0, 64, 512, 8, 2

    def __init__(self, set_threads, max_threads: int):
        self.set_threads, self.max = set_threads, max(1, max_threads)
        self.n = self.max
        self.recent: list[float] = []
        self.interval = self.FIRST_INTERVAL
        self.countdown = self.interval
        self.switches = 0
        self.probes = 0
        self.probe: Optional[int] = None  # the thread count being tried, during a probe
        self.probe_times: list[float] = []

    def _median(self) -> float:
        s = sorted(self.recent)
        return s[len(s) // 2]

    def step(self, run) -> None:
        """Run one step (``run()``) at the governed thread count, timing it. The governed count stays in force
        after the step: the native library shares torch's OpenMP runtime, and the torch ops between two steps
        (the sampler's) would otherwise wake the idle threads again."""
        try:
            self._step(run)
        finally:
            self.set_threads(self.n)

    def _step(self, run) -> None:
        if self.max == 1:
            return run()
        self.countdown -= 1
        if self.probe is None and self.countdown <= 0 and len(self.recent) >= 3:
            up = self.n < self.max and (self.n == 1 or self.probes % 2 == 1)
            self.probe, self.probe_times = (self.n + 1 if up else self.n - 1), []
        n = self.probe or self.n
        self.set_threads(n)
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if self.probe is None:
            if len(self.recent) >= 3 and (dt > self.JUMP * self._median() or self.JUMP * dt < self._median()):
                # the load changed: a new window at this count, and a probe as soon as it holds three steps
                self.recent, self.countdown = [], 0
            self.recent = (self.recent + [dt])[-self.WINDOW:]
            return
        self.probe_times.append(dt)
        # a probe wins only if every one of its steps beats the recent median (one lucky step never switches), so
        # it ends at its first step that does not: on a quiet machine a probe at fewer threads costs one slow step,
        # not PROBE_STEPS of them (2 x ~2.2x the step on a 0.6B-model-shaped decode, 4 % of a 64-token run)
        lost = dt >= self.GAIN * self._median()
        if len(self.probe_times) < self.PROBE_STEPS and not lost:
            return
        self.probes += 1
        if not lost:
            self.n, self.recent, self.interval = self.probe, list(self.probe_times), self.FIRST_INTERVAL
            self.switches += 1
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)
        self.probe, self.countdown = None, self.interval

    def report(self) -> str:
        return f"{self.n} of {self.max} threads ({self.switches} switches, {self.probes} probes)"


def threads_mode() -> str:
    """``VXC_THREADS``: ``auto`` (the default: governed) or ``fixed`` (every region on all threads)."""
    mode = os.environ.get("VXC_THREADS", "auto")
    if mode not in ("auto", "fixed"):
        raise ValueError(f"VXC_THREADS={mode!r}: expected auto or fixed")
    return mode


# the thread count in force before a governor changed it (None: no governed count is in force). release_threads()
# puts it back before work that is not a replayed step (a prefill, a batched step), and a governor made while
# another's count is in force starts from this count, not from the throttled one (which would keep a second
# engine in the process on one thread for good).
_baseline: Optional[int] = None


def _set_threads(n: int) -> None:
    global _baseline
    if _baseline is None:
        _baseline = native.max_threads()
    native.load().vxc_set_threads(n)


def release_threads() -> None:
    """Restore the native thread count that was in force before any governor changed it."""
    global _baseline
    if _baseline is not None:
        native.load().vxc_set_threads(_baseline)
        _baseline = None


def governor() -> Optional[ThreadGovernor]:
    """The thread governor for replayed steps: None under ``VXC_THREADS=fixed`` or with one thread."""
    lib = native.load()
    full = _baseline if _baseline is not None else (native.max_threads() if lib is not None else 1)
    if threads_mode() == "fixed" or lib is None or full <= 1:
        return None
    return ThreadGovernor(_set_threads, full)


class _Profiled:
    """What a replay (single or batched) needs to be profiled: ``program``, ``labels``, ``weights``, ``profiling``,
    ``profile``."""

    def start_profile(self) -> None:
        """Time every replayed step from now on, call by call (``profile.summary()``); the values are unchanged."""
        self.profiling = True
        self._profile_built()

    def _profile_built(self) -> None:
        if self.profiling and self.program is not None and self.profile is None:
            self.profile = StepProfile(self.program, self.labels, self.weights)


class DecodeReplay(_Profiled):
    def __init__(self, graph: Callable[[Tensor, int], Tensor], ids: Tensor):
        self.graph, self.ids = graph, ids
        self.pool: list[Tensor] = []
        self.captures: list[tuple[int, list, Tensor]] = []
        self.program: Optional[list] = None
        self.segments: Optional[list] = None  # the program as runnable segments (_segments), when it has them
        self.refused: Optional[str] = None if native.available() else native.status()
        self.out: Optional[Tensor] = None
        self.governor: Optional[ThreadGovernor] = None
        self.weights: dict[int, str] = {}  # data_ptr -> encoding or dtype of each weight (the profile's labels)
        self.labels: list[tuple[str, str]] = []  # each program call's (vxc op, weights)
        self.profiling = False  # profile replayed steps (``profile``) once the program is built
        self.profile: Optional[StepProfile] = None
        threads_mode()  # a bad VXC_THREADS is refused before the first step, not after the captures

    @property
    def ready(self) -> bool:
        return self.program is not None

    def __call__(self, pos: int, fresh: bool = True) -> Tensor:
        """Logits of the token in ``ids`` at position ``pos`` (a fresh tensor; with ``fresh=False`` a replayed step
        returns its own output buffer, valid until the next step)."""
        if self.program is not None:
            self._run(pos)
            return self.out.clone() if fresh else self.out
        if self.refused is not None:
            return self.graph(self.ids, pos)
        rec = native.Recorder(self.pool)
        with native.recording(rec), _Guard(rec, self.weights):
            out = self.graph(self.ids, pos)
        if rec.failed:
            self._refuse(rec.failed)
        elif self.captures and (out.data_ptr() != self.captures[0][2].data_ptr() or out.shape != self.captures[0][2].shape):
            self._refuse("the step's output is not the same buffer on every captured step")
        else:
            self.captures.append((pos, rec.calls, out))
            self.labels = rec.labels
            if len(self.captures) == CAPTURES:
                self._build()
        return out.clone()

    def _refuse(self, why: str) -> None:
        self.refused, self.captures, self.pool = why, [], []

    def _build(self) -> None:
        (p0, c0, out), (p1, c1, _), (p2, c2, _) = self.captures
        if len({len(c0), len(c1), len(c2)}) != 1 or p0 == p1:
            return self._refuse("captured steps differ in their calls")
        lib = native.load()
        program = []
        for (n0, a0), (n1, a1), (n2, a2) in zip(c0, c1, c2):
            if not (n0 == n1 == n2) or not (len(a0) == len(a1) == len(a2)):
                return self._refuse(f"captured steps differ at {n0}")
            fn = n0 if callable(n0) else getattr(lib, n0)  # (a recorded Python call: ``native.call_py``)
            args, moving = list(a0), []
            for i, (x0, x1, x2) in enumerate(zip(a0, a1, a2)):
                if x0 == x1 == x2:
                    continue
                if not all(isinstance(x, int) for x in (x0, x1, x2)) or (x1 - x0) % (p1 - p0):
                    return self._refuse(f"{n0} argument {i} changes with the position non-linearly")
                slope = (x1 - x0) // (p1 - p0)
                if x0 + slope * (p2 - p0) != x2:
                    return self._refuse(f"{n0} argument {i} changes with the position non-linearly")
                moving.append((i, x0 - slope * p0, slope))
            # constant arguments converted once to their ctypes values
            conv = args if callable(n0) else [t(v) if (v is not None and i not in {m[0] for m in moving}) else v
                                              for i, (t, v) in enumerate(zip(fn.argtypes, args))]
            program.append((fn, conv, moving))
        self.program, self.out, self.captures = program, out, []
        self.segments = _segments(program)
        self.governor = governor()
        self._profile_built()

    def _run(self, pos: int) -> None:
        if self.governor is None:
            return self._calls(pos)
        self.governor.step(lambda: self._calls(pos))

    def _calls(self, pos: int) -> None:
        program = self.segments if self.segments is not None else self.program
        if self.profile is None:
            return _run_segments(program, pos)
        self.profile.run(lambda ns: _run_segments(program, pos, ns))



class BatchReplay(_Profiled):
    """The batched decode step of ``B`` sequences captured as its native calls and replayed (see the module
    docstring). ``graph(ids, positions, positions_t, slots, slots_t)`` is the engine's batched step."""

    CAPTURES = 2

    def __init__(self, graph: Callable, B: int):
        self.graph, self.B = graph, B
        self.ids, self.positions, self.slots = (torch.zeros(B, dtype=torch.int64) for _ in range(3))
        self._np = [t.numpy() for t in (self.ids, self.positions, self.slots)]  # (filled without a torch op)
        self.pool: list[Tensor] = []
        self.captures: list[tuple[list, Tensor]] = []
        self.program: Optional[list] = None
        self.segments: Optional[list] = None  # the program as runnable segments (_segments), when it has them
        self.refused: Optional[str] = None if native.available() else native.status()
        self.out: Optional[Tensor] = None
        self.governor: Optional[ThreadGovernor] = None
        self.steps = 0  # replayed steps
        self.weights: dict[int, str] = {}  # as DecodeReplay's
        self.labels: list[tuple[str, str]] = []
        self.profiling = False
        self.profile: Optional[StepProfile] = None

    @property
    def ready(self) -> bool:
        return self.program is not None

    def __call__(self, tokens: list[int], positions: list[int], slots: list[int], fresh: bool = True) -> Tensor:
        """Logits ``[B, padded_vocab]`` (a fresh tensor; with ``fresh=False`` a replayed step returns its own output
        buffer, valid until the next step) of ``tokens[b]`` at ``positions[b]`` in slot ``slots[b]``."""
        if len(tokens) != self.B or len(positions) != self.B or len(slots) != self.B:
            raise ValueError(f"a replay of {self.B} rows got {len(tokens)} tokens, {len(positions)} positions, "
                             f"{len(slots)} slots")
        for buf, vals in zip(self._np, (tokens, positions, slots)):
            buf[:] = vals
        if self.program is not None:
            if self.governor is None:
                self._calls()
            else:
                self.governor.step(self._calls)
            self.steps += 1
            return self.out.clone() if fresh else self.out
        args = (self.ids, list(positions), self.positions, list(slots), self.slots)
        if self.refused is not None:
            return self.graph(*args)
        rec = native.Recorder(self.pool)
        with native.recording(rec), _Guard(rec, self.weights):
            out = self.graph(*args)
        if rec.failed:
            self._refuse(rec.failed)
        elif self.captures and (out.data_ptr() != self.captures[0][1].data_ptr() or out.shape != self.captures[0][1].shape):
            self._refuse("the step's output is not the same buffer on every captured step")
        else:
            self.captures.append((rec.calls, out))
            self.labels = rec.labels
            if len(self.captures) == self.CAPTURES:
                self._build()
        return out.clone()

    def _refuse(self, why: str) -> None:
        self.refused, self.captures, self.pool = why, [], []

    def _build(self) -> None:
        calls = [c for c, _ in self.captures]
        if len({len(c) for c in calls}) != 1:
            return self._refuse("captured steps differ in their calls")
        lib = native.load()
        program = []
        for step in zip(*calls):
            (n0, a0) = step[0]
            if any(n != n0 or a != a0 for n, a in step[1:]):
                # every argument must be the same: slots and positions are read from the step's buffers, never
                # passed by value
                return self._refuse(f"captured steps differ at {getattr(n0, '__name__', n0)}")
            fn = n0 if callable(n0) else getattr(lib, n0)
            conv = list(a0) if callable(n0) else [t(v) if v is not None else v for t, v in zip(fn.argtypes, a0)]
            program.append((fn, conv))
        self.program, self.out, self.captures = program, self.captures[0][1], []
        self.segments = _segments([(fn, conv, []) for fn, conv in program])
        self.governor = governor()
        self._profile_built()

    def _calls(self) -> None:
        if self.profile is not None:
            program = self.segments if self.segments is not None else [(fn, a, []) for fn, a in self.program]
            return self.profile.run(lambda ns: _run_segments(program, 0, ns))
        if self.segments is not None:
            return _run_segments(self.segments, 0)
        for fn, args in self.program:
            fn(*args)
