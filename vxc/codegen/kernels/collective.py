"""Collectives of tensor-parallel execution (the ``shard`` pass): ``vxc::all_reduce``.

- ``all_reduce(x, ranks)``: the elementwise sum of ``x`` over the ``ranks`` processes of the default process group
  (``torch.distributed``, gloo on CPU, NCCL on CUDA), through torch's functional collectives
  (``_functional_collectives.all_reduce`` + ``wait_tensor``): a new tensor, ``x`` untouched. Every rank gets the
  same bits (the group reduces each element once and shares the result). bf16 / fp16 partials are summed in fp32
  and rounded once. ``ranks`` is the count the plan was
  split for, checked against the group's size.

A collective is not arithmetic of its own: one implementation serves every backend column (the twin included),
so selecting ``native`` or ``triton`` never counts a fallback. A decode step holding it is not replayed (the
engine turns replay off under tensor parallelism).
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


def all_reduce_impl(x, ranks):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as fc

    # a half-precision partial sum is summed in fp32 and rounded once (as one process's fp32 accumulator would
    # round the whole sum), not rounded again after every rank's addition
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous()
    y = fc.wait_tensor(fc.all_reduce(wide, "sum", dist.group.WORLD))
    if y.dtype != x.dtype:
        return y.to(x.dtype)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


for _name in IMPLEMENTATIONS:
    all_reduce.impl(_name)(all_reduce_impl)
