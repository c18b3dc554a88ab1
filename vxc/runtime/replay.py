"""Decode replay: a fixed-shape decode step captured as its sequence of native kernel calls, then replayed
without torch (the CPU analogue of a CUDA graph).

The decode graph is already fixed-shape and reads static buffers (weights, state regions, the engine's token
buffer); what a step still spends outside its kernels is Python and dispatcher work per op, which on this
kind of CPU costs as much as the small kernels themselves once the weight stream has evicted the caches.
So the first steps run the graph normally while ``kernels.native`` records every kernel call with its raw
arguments (pointers, sizes, flags), outputs drawn from one pool that every captured step reuses. Three
captured steps at different positions must agree call for call; an argument that differs must be an
integer that moves linearly with the position (a rotary table row, the attention's row count), and the
third capture must match the line the first two define. Anything else — a kernel that ran its torch twin,
an aten op at graph level other than a view, an output buffer that changed — refuses the capture, with the
reason kept in ``refused``, and the engine keeps running the graph. Replay results are bit-identical to the
graph's: the same kernels run on the same buffers with the same arguments.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..codegen import kernels
from ..codegen.kernels import native

CAPTURES = 3

# graph-level aten ops a capturable step may run besides vxc kernels: views (no data is computed)
_VIEW_OPS = {
    "split", "split_with_sizes", "view", "_unsafe_view", "reshape", "slice", "narrow", "select", "unsqueeze",
    "squeeze", "alias", "t", "transpose", "permute", "as_strided", "expand", "detach", "sym_size", "unbind",
}


class _Guard(TorchDispatchMode):
    """Watches the graph-level ops of a captured step: views pass, each native-capable vxc op must have
    recorded a native call, anything else refuses the capture."""

    def __init__(self, rec: native.Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._opname
        before = len(self.rec.calls)
        out = func(*args, **(kwargs or {}))
        if ns == "vxc":
            if name not in kernels.NATIVE_OPS:
                self.rec.failed = self.rec.failed or f"vxc::{name} has no native form"
            elif len(self.rec.calls) == before:
                self.rec.failed = self.rec.failed or f"vxc::{name} made no native call"
        elif name not in _VIEW_OPS:
            self.rec.failed = self.rec.failed or f"graph-level op {ns}::{name} is not a view"
        return out


class DecodeReplay:
    def __init__(self, graph: Callable[[Tensor, int], Tensor], ids: Tensor):
        self.graph, self.ids = graph, ids
        self.pool: list[Tensor] = []
        self.captures: list[tuple[int, list, Tensor]] = []
        self.program: Optional[list] = None
        self.refused: Optional[str] = None if native.available() else native.status()
        self.out: Optional[Tensor] = None

    @property
    def ready(self) -> bool:
        return self.program is not None

    def __call__(self, pos: int) -> Tensor:
        """Logits of the token in ``ids`` at position ``pos`` (a fresh tensor)."""
        if self.program is not None:
            self._run(pos)
            return self.out.clone()
        if self.refused is not None:
            return self.graph(self.ids, pos)
        rec = native.Recorder(self.pool)
        with native.recording(rec), _Guard(rec):
            out = self.graph(self.ids, pos)
        if rec.failed:
            self._refuse(rec.failed)
        elif self.captures and (out.data_ptr() != self.captures[0][2].data_ptr() or out.shape != self.captures[0][2].shape):
            self._refuse("the step's output is not the same buffer on every captured step")
        else:
            self.captures.append((pos, rec.calls, out))
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
            fn = getattr(lib, n0)
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
            conv = [t(v) if (v is not None and i not in {m[0] for m in moving}) else v
                    for i, (t, v) in enumerate(zip(fn.argtypes, args))]
            program.append((fn, conv, moving))
        self.program, self.out, self.captures = program, out, []

    def _run(self, pos: int) -> None:
        for fn, args, moving in self.program:
            if moving:
                args = list(args)
                for i, base, slope in moving:
                    args[i] = base + slope * pos
            fn(*args)

