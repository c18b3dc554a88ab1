"""Tensor-parallel execution over ``torch.distributed``: the process group, local launch, and what the ranks
must agree on.

- ``spawn(fn, n, *args, backend=)``: N local ranks (``torch.multiprocessing``, start method spawn), each joining a
  group through a FileStore in a fresh temporary directory, then calling ``fn(rank, *args)``.
- ``join(n, backend)``: inside ``torchrun`` (its ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` environment), the group
  it describes; the world size must be ``n``.
- ``backend_for(device)``: gloo on CPU, NCCL on CUDA (each rank then binds GPU ``LOCAL_RANK`` mod the count; NCCL
  has not run here: no GPU was lent to this work).
- ``Agreed``: a sampler whose every choice is rank 0's, broadcast (the ranks' logits are the same bits after the
  last all-reduce, but a token chosen differently on one rank would split the ranks' sequences silently).
- ``rank_path``: the file a rank's continuation state is saved to / resumed from (rank 0: the path itself).
- ``local_rank_threads(n)``: the compute threads each of n ranks started here takes: the CPUs divided among them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

TIMEOUT = timedelta(seconds=int(os.environ.get("VXC_TP_TIMEOUT", "300")))


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def backend_for(device: str) -> str:
    """The torch.distributed backend for ranks computing on ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def _bind_device(backend: str, rank: int) -> None:
    """Under NCCL each local rank computes on its own GPU (``cuda`` then means that one)."""
    if backend == "nccl":
        import torch

        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % torch.cuda.device_count())


def join(n: int, backend: str = "gloo") -> int:
    """Join (or check) the process group of ``n`` ranks; returns this process's rank."""
    import torch.distributed as dist

    from ..ir.diagnostics import VxcError

    if not dist.is_initialized():
        if not under_torchrun():
            raise VxcError(f"--tp {n}: no process group (launch with torchrun, or let vxc spawn the ranks)")
        _bind_device(backend, int(os.environ["RANK"]))
        dist.init_process_group(backend, timeout=TIMEOUT)
        # leave the group before the interpreter tears down: a gloo group still up at exit lost the race with its own
        # threads now and then ("terminate called without an active exception", SIGABRT under torchrun, about 1 run
        # in 5 on a busy machine)
        import atexit

        atexit.register(_leave)
    if dist.get_world_size() != n:
        raise VxcError(f"--tp {n}: the process group has {dist.get_world_size()} ranks")
    return dist.get_rank()


def _leave(meet: bool = True) -> None:
    """Leave the default group: first (``meet``) wait until every rank has come this far (up to ``LEAVE_TIMEOUT``;
    a rank that died is not waited for longer), so that no rank closes its connections while another still uses
    them, and with this process's own objects that hold the group collected; then destroy it."""
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    gc.collect()
    if meet:
        _meet()
    dist.destroy_process_group()


def _meet() -> None:
    """Wait until every rank of the default group has come this far (up to ``LEAVE_TIMEOUT``)."""
    import torch.distributed as dist

    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=LEAVE_TIMEOUT, wait_all_ranks=True)
        else:
            dist.barrier()
    except Exception:  # a rank that failed or left: nothing more to wait for
        pass


LEAVE_TIMEOUT = timedelta(seconds=30)


def _entry(rank: int, n: int, store: str, backend: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    _bind_device(backend, rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=n, timeout=TIMEOUT)
    ok = False
    try:
        fn(rank, *args)
        ok = True
    finally:
        _leave(meet=ok)  # (a rank that raised leaves at once: spawn stops the others)


def local_rank_threads(n: int) -> int | None:
    """The compute threads (torch's and the native library's) each of ``n`` ranks started on this machine takes:
    the CPUs this process may run on, divided among them (at least one each). Each rank with every CPU's worth of
    threads oversubscribes the machine: every parallel region then waits at its barrier for a descheduled thread
    (on 2 CPUs, TP=2 decode steps of small models took 54-71 ms at 2 threads a rank, 12-19 ms at 1). torchrun does
    the same for several ranks on one machine (``OMP_NUM_THREADS=1``). None when ``OMP_NUM_THREADS`` is set: the
    user's count stands."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // n)


@contextlib.contextmanager
def _child_threads(k: int | None):
    """Processes started inside take ``k`` threads (``OMP_NUM_THREADS``, read as they load torch and OpenMP)."""
    if k is None:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(k)
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def spawn(fn: Callable, n: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, *args)`` on ``n`` local ranks joined in one group (gloo; NCCL with ``backend="nccl"``, one
    GPU per rank); returns when all have finished (a rank that fails stops the others: ``torch.multiprocessing``'s
    ProcessExitedException / ProcessRaisedException)."""
    import logging

    import torch.multiprocessing as mp

    # (when a rank fails, torch stops the others with a warning per process: the failure itself is what is reported)
    quiet = logging.getLogger("torch.multiprocessing.spawn")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="vxc-tp-") as d, _child_threads(local_rank_threads(n)):
            mp.spawn(_entry, args=(n, str(Path(d) / "store"), backend, fn, args), nprocs=n, join=True)
    finally:
        quiet.setLevel(level)


def rank_failure(e: BaseException):
    """A rank's failure as the CLI reports an error: a VxcError naming the rank and what it raised (the last lines of
    its traceback: the exception and its message), not the traceback (``torch.multiprocessing``'s
    ProcessRaisedException carries it as text); a rank that exited keeps its exit status (None: not a rank's
    failure)."""
    import re

    import torch.multiprocessing as mp

    from ..ir.diagnostics import VxcError

    if isinstance(e, mp.ProcessExitedException):
        return SystemExit(e.exit_code or 1)
    if not isinstance(e, mp.ProcessRaisedException):
        return None
    lines = e.msg.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^([A-Za-z_][\w.]*): (.*)$", lines[i])
        if m:
            kind = m.group(1).rsplit(".", 1)[-1]
            text = " ".join([m.group(2), *(x.strip() for x in lines[i + 1:])]).strip()
            what = text if kind == "VxcError" else f"{kind}: {text}"
            return VxcError(f"rank {e.error_index}: {what}")
    return VxcError(f"rank {e.error_index} failed: {lines[-1] if lines else 'no message'}")


def _follower_entry(i: int, n: int, store: str, backend: str, fn: Callable, args: tuple) -> None:
    _entry(i + 1, n, store, backend, fn, args)


class Followers:
    """Ranks 1..N-1 started by :func:`start_followers` (this process is rank 0 of their group)."""

    def __init__(self, context, store_dir):
        self.context, self.store_dir = context, store_dir

    def abort(self, grace: float = 10.0) -> None:
        """Rank 0 failed: leave the group at once (no meeting: the followers' collectives then fail and they exit),
        wait ``grace`` seconds for them, terminate any left; their own failures are not raised (rank 0's error is
        the one reported)."""
        import time

        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            end = time.monotonic() + grace
            for p in self.context.processes:
                p.join(max(0.0, end - time.monotonic()))
            for p in self.context.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        finally:
            self.store_dir.cleanup()

    def join(self, timeout: float | None = None) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():  # meet the followers as they leave the group (_entry), then wait for their exit
                import gc

                gc.collect()
                _meet()
            self.context.join(timeout)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            self.store_dir.cleanup()


def join_followers(followers: Followers, timeout: float = 60) -> None:
    """Wait for the followers once rank 0 has finished; a follower's failure raised as :func:`rank_failure` words
    it."""
    try:
        followers.join(timeout)
    except Exception as e:
        err = rank_failure(e)
        if err is None:
            raise
        raise err from None


def start_followers(fn: Callable, n: int, *args: Any, backend: str = "gloo") -> Followers:
    """Start ranks 1..N-1 (each calls ``fn(rank, *args)`` in a group it joins) and join this process to the group as
    rank 0; returns at once (``Followers.join`` waits for them)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from ..codegen.kernels import native

    d = tempfile.TemporaryDirectory(prefix="vxc-tp-")
    store = str(Path(d.name) / "store")
    k = local_rank_threads(n)
    with _child_threads(k):
        ctx = mp.start_processes(_follower_entry, args=(n, store, backend, fn, args), nprocs=n - 1, join=False,
                                 start_method="spawn")
    if k is not None:  # this process is rank 0: its share too
        native.limit_threads(k)
    _bind_device(backend, 0)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=n, timeout=TIMEOUT)
    return Followers(ctx, d)


def rank_path(path: Path, rank: int) -> Path:
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Agreed:
    """A sampler whose choices are rank 0's (broadcast to the others); everything else is the wrapped sampler's."""

    def __init__(self, sampler):
        self.inner = sampler

    def __call__(self, logits):
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(self.inner(logits))], dtype=torch.int64)
        dist.broadcast(t, src=0)
        return int(t[0])

    def __getattr__(self, name):
        return getattr(self.inner, name)
