"""Collectives of tensor-parallel execution (the ``shard`` pass): ``vxc::all_reduce``.

- ``all_reduce(x, ranks)``: the elementwise sum of ``x`` over the ``ranks`` processes of the default process group
  (``torch.distributed``, gloo on CPU, NCCL on CUDA), through torch's functional collectives
  (``_functional_collectives.all_reduce`` + ``wait_tensor``): a new tensor, ``x`` untouched. Every rank gets the
  same bits (the group reduces each element once and shares the result). bf16 / fp16 partials are summed in fp32
  and rounded once. ``ranks`` is the count the plan was
  split for, checked against the group's size.

A collective is not arithmetic of its own: one implementation serves every backend column (the twin included),
so selecting ``native`` or ``triton`` never counts a fallback. In a decode step being captured for replay it sums
into the capture's pooled buffers through a recorded Python call (``native.call_py``), which the replay repeats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import IMPLEMENTATIONS, kernel


@kernel("all_reduce")
def all_reduce(x: Tensor, ranks: int) -> Tensor:
    """The sum of ``x`` over the default process group of ``ranks`` processes."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"all_reduce over {ranks} ranks: no torch.distributed process group is initialised")
    if dist.get_world_size() != ranks:
        raise ValueError(f"all_reduce: the plan is split over {ranks} ranks, the process group has {dist.get_world_size()}")


@all_reduce.fake
def _(x, ranks):
    return torch.empty_like(x)


_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DTYPES = {v: k for k, v in _CODES.items()}


def _reduce_into(src: int, wide: int, out: int, numel: int, code: int) -> None:
    """``out`` = the sum over the ranks of ``src`` (raw addresses of CPU buffers; ``wide``: an fp32 buffer for a half
    precision ``src``, 0 otherwise): the replayable form (``native.call_py``)."""
    import torch.distributed as dist

    from . import native as N

    dt = _DTYPES[code]
    x = N.tensor_at(src, numel, dt)
    if wide:
        w = N.tensor_at(wide, numel, torch.float32)
        w.copy_(x)
        dist.all_reduce(w)
        N.tensor_at(out, numel, dt).copy_(w)
    else:
        y = N.tensor_at(out, numel, dt)
        y.copy_(x)
        dist.all_reduce(y)


def all_reduce_impl(x, ranks):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    from . import native as N

    if N._rec is not None and x.device.type == "cpu" and x.is_contiguous() and x.dtype in _CODES:
        # a decode step being captured: the sum lands in a pooled buffer, so a replay repeats the call as it is
        out = N.empty(*x.shape, dtype=x.dtype)
        wide = N.empty(*x.shape, dtype=torch.float32) if x.dtype != torch.float32 else None
        N.call_py(_reduce_into, x.data_ptr(), 0 if wide is None else wide.data_ptr(), out.data_ptr(), x.numel(),
                  _CODES[x.dtype])
        return out
    # a half-precision partial sum is summed in fp32 and rounded once (as one process's fp32 accumulator would
    # round the whole sum), not rounded again after every rank's addition
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous()
    y = fc.wait_tensor(fc.all_reduce(wide, "sum", dist.group.WORLD))
    if y.dtype != x.dtype:
        return y.to(x.dtype)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


for _name in IMPLEMENTATIONS:
    all_reduce.impl(_name)(all_reduce_impl)
