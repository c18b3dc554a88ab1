"""Kernels that combine or rescale whole activation rows: ``vxc::add`` (the sum of two sub-blocks' outputs, e.g.
two mixers side by side in one layer) and ``vxc::scale_segments`` (declared multipliers applied to consecutive
column segments of a row: one segment is a plain multiplier of a whole row).

- ``add(x, y)``: ``x + y`` (same shapes), computed in fp32 and rounded once to x's dtype (what torch's own
  bf16 / fp32 addition gives).
- ``scale_segments(x, sizes, scales)``: x's last dimension split into consecutive segments of ``sizes`` columns
  (``sizes`` empty: one segment, the whole row), segment j multiplied by ``scales[j]`` held in fp32 — the
  product rounded once to x's dtype. Unlike ``vxc::scale`` (whose scale is first rounded to x's dtype, as a
  scale held as a tensor of the weights' dtype is), a multiplier declared as a number multiplies in fp32, as a
  Python float multiplies a tensor in torch.

Native forms take up to one token's worth of values (65536); Triton forms are one program per 1024 values.
"""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .registry import NotCovered, kernel

NATIVE_MAX = 65536
MAX_SEGMENTS = 16


def _ends(width: int, sizes: list[int], n_scales: int) -> list[int]:
    """The exclusive end column of each segment (checked against the row width and the scales)."""
    if not sizes:
        sizes = [width]
    if len(sizes) != n_scales:
        raise ValueError(f"{len(sizes)} segment sizes but {n_scales} scales")
    if len(sizes) > MAX_SEGMENTS or any(s < 0 for s in sizes) or sum(sizes) != width:
        raise ValueError(f"segment sizes {sizes} must be at most {MAX_SEGMENTS} non-negative sizes summing to the row "
                         f"width {width}")
    out, end = [], 0
    for s in sizes:
        end += s
        out.append(end)
    return out


@kernel("add")
def add(x: Tensor, y: Tensor) -> Tensor:
    """``x + y`` elementwise (same shapes and dtypes)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"x {list(x.shape)} {x.dtype} and y {list(y.shape)} {y.dtype} must agree")


@add.fake
def _(x, y):
    return torch.empty_like(x)


@kernel("scale_segments")
def scale_segments(x: Tensor, sizes: list[int], scales: list[float]) -> Tensor:
    """Segment j of x's last dimension (``sizes`` columns each; empty: the whole row) times ``scales[j]``."""
    _ends(x.shape[-1], list(sizes), len(scales))


@scale_segments.fake
def _(x, sizes, scales):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------ torch twins


@add.impl("torch")
def add_twin(x, y):
    return (x.float() + y.float()).to(x.dtype)


@scale_segments.impl("torch")
def scale_segments_twin(x, sizes, scales):
    ends = _ends(x.shape[-1], list(sizes), len(scales))
    per_col = torch.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for end, s in zip(ends, scales):
        per_col[start:end] = s  # the declared number, held in fp32
        start = end
    return (x.float() * per_col).to(x.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_segments_kernel(x_ptr, out_ptr, ends_ptr, scales_ptr, N, W, NSEG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    col = offs % W
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    start = 0
    for j in tl.static_range(NSEG):
        end = tl.load(ends_ptr + j)
        s = tl.where((col >= start) & (col < end), tl.load(scales_ptr + j), s)
        start = end
    tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


@add.impl("triton")
def add_triton(x, y):
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
    return out


@scale_segments.impl("triton")
def scale_segments_triton(x, sizes, scales):
    ends = _ends(x.shape[-1], list(sizes), len(scales))
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        e = torch.tensor(ends, dtype=torch.int64, device=x.device)
        s = torch.tensor(list(scales), dtype=torch.float32, device=x.device)
        _scale_segments_kernel[(triton.cdiv(n, 1024),)](x, out, e, s, n, x.shape[-1], NSEG=len(ends), BLOCK=1024)
    return out


# ------------------------------------------------------------------------------------------------ native

_ADD = N.declare("vxc_add", P, P, P, L, I)
_SCALE_SEGMENTS = N.declare("vxc_scale_segments", P, P, L, L, I, P, P, I)
# the segment tables handed to C, one per (ends, scales): kept alive and at one address, so a captured decode
# step records the same pointer on every step (and its replay reads a table that still exists)
_TABLES: dict[tuple, tuple] = {}


def _table(ends: list[int], scales: list[float]) -> tuple[int, int]:
    key = (tuple(ends), tuple(float(s) for s in scales))
    if key not in _TABLES:
        _TABLES[key] = ((ctypes.c_long * len(ends))(*ends), (ctypes.c_float * len(ends))(*key[1]))
    e, s = _TABLES[key]
    return ctypes.addressof(e), ctypes.addressof(s)


@add.impl("native")
def add_native(x, y):
    if not (N.ok(x, y) and x.dtype == y.dtype):
        raise NotCovered(N.OPERANDS)
    if x.numel() > NATIVE_MAX:
        raise NotCovered(N.LIMITS)
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_ADD, x.data_ptr(), y.data_ptr(), out.data_ptr(), x.numel(), BF[x.dtype])
    return out


@scale_segments.impl("native")
def scale_segments_native(x, sizes, scales):
    if not N.ok(x) or x.dim() == 0:
        raise NotCovered(N.OPERANDS)
    if x.numel() > NATIVE_MAX:
        raise NotCovered(N.LIMITS)
    width = x.shape[-1]
    ends = _ends(width, list(sizes), len(scales))
    e, s = _table(ends, scales)
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_SCALE_SEGMENTS, x.data_ptr(), out.data_ptr(), x.numel() // max(width, 1) if width else 0, width, len(ends),
           e, s, BF[x.dtype])
    return out
