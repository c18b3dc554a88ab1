"""Norm kernels: ``vxc::add_rmsnorm`` (residual add + RMSNorm) and ``vxc::gated_rmsnorm`` (grouped RMSNorm
gated by ``act(z)``), each with its torch twin, Triton kernel and native binding."""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, F, I, L, P
from .registry import NotCovered, kernel
from .torch_common import activate, check_activation
from .triton_common import ACTIVATIONS
from .triton_common import activate as tl_activate

# ------------------------------------------------------------------------------------------------ add_rmsnorm


@kernel("add_rmsnorm")
def add_rmsnorm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, zero_centred: bool, residual_fp32: bool
) -> tuple[Tensor, Tensor]:
    """``r = x + residual``; returns ``(rmsnorm(r) * w, r)``."""


@add_rmsnorm.fake
def _(x, residual, weight, eps, zero_centred, residual_fp32):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.float32 if residual_fp32 else x.dtype)


@add_rmsnorm.impl("torch")
def add_rmsnorm_twin(x, residual, weight, eps, zero_centred, residual_fp32):
    """``r = x + residual``; returns ``(rmsnorm(r) * w, r)``.

    The norm reads ``r`` as stored (rounded to x.dtype unless residual_fp32). A zero-centred weight scales by
    ``1 + w`` in fp32 before the one cast; a plain weight scales after it: the normalised row is cast to
    x.dtype, then multiplied by ``w`` in x.dtype (each as the reference norms of its kind round).
    """
    r = x.float() if residual is None else x.float() + residual.float()
    new_residual = r.to(torch.float32 if residual_fp32 else x.dtype, copy=True)
    r = new_residual.float()
    normalised = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        normed = (normalised * (1.0 + weight.float())).to(x.dtype)
    else:
        normed = weight.to(x.dtype) * normalised.to(x.dtype)
    return normed, new_residual


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    offs = row * D + cols
    r = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = r.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offs, r, mask=mask)
    r = r.to(tl.float32)  # the norm reads the residual as stored
    h = r * tl.rsqrt(tl.sum(r * r, 0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = h * (1.0 + w)
    else:  # a plain weight: cast the normalised row, then scale in the output dtype
        dtype = out_ptr.dtype.element_ty
        out = h.to(dtype).to(tl.float32) * w.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@add_rmsnorm.impl("triton")
def add_rmsnorm_triton(x, residual, weight, eps, zero_centred, residual_fp32):
    x = x.contiguous()
    D = x.shape[-1]
    normed = torch.empty_like(x)
    new_residual = torch.empty_like(x, dtype=torch.float32 if residual_fp32 else x.dtype)
    block = triton.next_power_of_2(D)
    _add_rmsnorm_kernel[(x.numel() // D,)](
        x, x if residual is None else residual.contiguous(), weight.contiguous(), normed, new_residual, D, eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred, BLOCK_D=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return normed, new_residual


_ADD_RMSNORM = N.declare("vxc_add_rmsnorm", P, P, P, P, P, L, L, F, I, I, I, I)


@add_rmsnorm.impl("native")
def add_rmsnorm_native(x, residual, weight, eps, zero_centred, residual_fp32):
    res_dtype = torch.float32 if residual_fp32 else x.dtype
    if not (N.ok(x, residual, weight) and (residual is None or residual.dtype == res_dtype) and x.dim() == 2):
        raise NotCovered(N.OPERANDS)
    T, D = x.shape
    out, new_res = N.empty(T, D, dtype=x.dtype), N.empty(T, D, dtype=res_dtype)
    N.call(_ADD_RMSNORM, x.data_ptr(), N.ptr(residual), weight.data_ptr(), out.data_ptr(), new_res.data_ptr(),
           T, D, eps, int(zero_centred), int(residual_fp32), BF[x.dtype], BF[weight.dtype])
    return out, new_res


# ---------------------------------------------------------------------------------------------- gated_rmsnorm


@kernel("gated_rmsnorm")
def gated_rmsnorm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool, act: str
) -> Tensor:
    check_activation(act, ("silu", "sigmoid"))
    if x.shape[-1] % group_size:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of group_size {group_size}")


@gated_rmsnorm.fake
def _(x, z, weight, eps, group_size, norm_before_gate, act):
    return torch.empty_like(x)


@gated_rmsnorm.impl("torch")
def gated_rmsnorm_twin(x, z, weight, eps, group_size, norm_before_gate, act):
    """RMSNorm over each contiguous group of ``group_size`` channels, gated by ``act(z)``.

    ``norm_before_gate``: ``rmsnorm(x) * w * act(z)``; otherwise ``rmsnorm(x * act(z)) * w``.
    """
    gate = activate(z.float(), act)
    h = x.float() if norm_before_gate else x.float() * gate
    groups = h.unflatten(-1, (-1, group_size))
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if norm_before_gate:
        h = h * gate
    return h.to(x.dtype)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, D, group_size, eps,
    NORM_BEFORE_GATE: tl.constexpr, ACT: tl.constexpr, BLOCK_G: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_G)
    mask = idx < group_size
    cols = tl.program_id(1) * group_size + idx
    offs = row * D + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl_activate(tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32), ACT)
    if not NORM_BEFORE_GATE:
        x = x * gate
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / group_size + eps) * w
    if NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@gated_rmsnorm.impl("triton")
def gated_rmsnorm_triton(x, z, weight, eps, group_size, norm_before_gate, act):
    x, z = x.contiguous(), z.contiguous()
    D = x.shape[-1]
    out = torch.empty_like(x)
    _gated_rmsnorm_kernel[(x.numel() // D, D // group_size)](
        x, z, weight.contiguous(), out, D, group_size, eps,
        NORM_BEFORE_GATE=norm_before_gate, ACT=ACTIVATIONS[act], BLOCK_G=triton.next_power_of_2(group_size),
    )
    return out


_GATED_RMSNORM = N.declare("vxc_gated_rmsnorm", P, P, P, P, L, L, L, F, I, I, I, I, L, L)


@gated_rmsnorm.impl("native")
def gated_rmsnorm_native(x, z, weight, eps, group_size, norm_before_gate, act):
    if not (N.ok_rows(x, z) and N.ok(weight) and z.dtype == x.dtype and z.shape == x.shape):
        raise NotCovered(N.OPERANDS)
    D = x.shape[-1]
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_GATED_RMSNORM, x.data_ptr(), z.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // D, D,
           group_size, eps, int(norm_before_gate), N.ACT[act], BF[x.dtype], BF[weight.dtype], N.row_stride(x),
           N.row_stride(z))
    return out


# ---------------------------------------------------------------- gated rmsnorm whose one group spans the ranks
# Under tensor parallelism a Mamba2 gated norm with one RMS group over all of d_inner sees 1/N of the group on each
# rank: ``gated_rms_sumsq`` gives the rank's partial sum of squares (of x, or of x·act(z) when the gate comes
# first), the plan all-reduces it, and ``gated_rmsnorm_total`` normalises by the whole group's mean
# (``count`` channels in all). On one rank the two compose to ``gated_rmsnorm`` with one group (up to the order of
# the sum). Their native column is the twin's arithmetic as a recorded host call (below).


@kernel("gated_rms_sumsq")
def gated_rms_sumsq(x: Tensor, z: Tensor, norm_before_gate: bool, act: str) -> Tensor:
    """fp32 ``[..., 1]``: the sum over the last dim of h², h = x (norm before gate) or x·act(z)."""
    check_activation(act, ("silu", "sigmoid"))
    if x.shape != z.shape:
        raise ValueError(f"x {list(x.shape)} and z {list(z.shape)} differ")


@gated_rms_sumsq.fake
def _(x, z, norm_before_gate, act):
    return x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@gated_rms_sumsq.impl("torch")
def gated_rms_sumsq_twin(x, z, norm_before_gate, act):
    h = x.float() if norm_before_gate else x.float() * activate(z.float(), act)
    return h.pow(2).sum(-1, keepdim=True)


@triton.jit
def _gated_rms_sumsq_kernel(x_ptr, z_ptr, out_ptr, D, NORM_BEFORE_GATE: tl.constexpr, ACT: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    mask = idx < D
    h = tl.load(x_ptr + row * D + idx, mask=mask, other=0.0).to(tl.float32)
    if not NORM_BEFORE_GATE:
        h = h * tl_activate(tl.load(z_ptr + row * D + idx, mask=mask, other=0.0).to(tl.float32), ACT)
    tl.store(out_ptr + row, tl.sum(h * h, 0))


@gated_rms_sumsq.impl("triton")
def gated_rms_sumsq_triton(x, z, norm_before_gate, act):
    x, z = x.contiguous(), z.contiguous()
    D = x.shape[-1]
    out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    _gated_rms_sumsq_kernel[(x.numel() // D,)](x, z, out, D, NORM_BEFORE_GATE=norm_before_gate,
                                               ACT=ACTIVATIONS[act], BLOCK=triton.next_power_of_2(D))
    return out


@kernel("gated_rmsnorm_total")
def gated_rmsnorm_total(x: Tensor, z: Tensor, weight: Tensor, sumsq: Tensor, count: int, eps: float,
                        norm_before_gate: bool, act: str) -> Tensor:
    """``gated_rmsnorm`` of one group whose sum of squares over all its ``count`` channels is ``sumsq``."""
    check_activation(act, ("silu", "sigmoid"))
    if sumsq.shape != (*x.shape[:-1], 1) or weight.shape != x.shape[-1:]:
        raise ValueError(f"x {list(x.shape)}, weight {list(weight.shape)}, sumsq {list(sumsq.shape)} do not match")


@gated_rmsnorm_total.fake
def _(x, z, weight, sumsq, count, eps, norm_before_gate, act):
    return torch.empty_like(x)


@gated_rmsnorm_total.impl("torch")
def gated_rmsnorm_total_twin(x, z, weight, sumsq, count, eps, norm_before_gate, act):
    gate = activate(z.float(), act)
    h = x.float() if norm_before_gate else x.float() * gate
    h = h * torch.rsqrt(sumsq.float() / count + eps) * weight.float()
    if norm_before_gate:
        h = h * gate
    return h.to(x.dtype)


@triton.jit
def _gated_rmsnorm_total_kernel(x_ptr, z_ptr, w_ptr, ss_ptr, out_ptr, D, count, eps,
                                NORM_BEFORE_GATE: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    mask = idx < D
    x = tl.load(x_ptr + row * D + idx, mask=mask, other=0.0).to(tl.float32)
    gate = tl_activate(tl.load(z_ptr + row * D + idx, mask=mask, other=0.0).to(tl.float32), ACT)
    if not NORM_BEFORE_GATE:
        x = x * gate
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.load(ss_ptr + row) / count + eps) * w
    if NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + row * D + idx, y.to(out_ptr.dtype.element_ty), mask=mask)


@gated_rmsnorm_total.impl("triton")
def gated_rmsnorm_total_triton(x, z, weight, sumsq, count, eps, norm_before_gate, act):
    x, z = x.contiguous(), z.contiguous()
    D = x.shape[-1]
    out = torch.empty_like(x)
    _gated_rmsnorm_total_kernel[(x.numel() // D,)](x, z, weight.contiguous(), sumsq.contiguous(), out, D, count, eps,
                                                   NORM_BEFORE_GATE=norm_before_gate, ACT=ACTIVATIONS[act],
                                                   BLOCK=triton.next_power_of_2(D))
    return out


# The native column of the two split-norm kernels: the twin's arithmetic as a recorded host call on the output
# buffers (``native.call_py``), so a tensor-parallel decode step holding them is still captured and replayed (their
# work is a few hundred multiply-adds a row; no C kernel of their own).


def _sumsq_into(x: int, z: int, out: int, rows: int, d: int, code: int, before: int, act: int) -> None:
    dt = _HOST_DTYPES[code]
    xs, zs = N.tensor_at(x, rows * d, dt).view(rows, d), N.tensor_at(z, rows * d, dt).view(rows, d)
    N.tensor_at(out, rows, torch.float32).view(rows, 1).copy_(gated_rms_sumsq_twin(xs, zs, bool(before), _ACT_NAMES[act]))


def _total_into(x: int, z: int, w: int, ss: int, out: int, rows: int, d: int, code: int, wcode: int, count: int,
                eps: float, before: int, act: int) -> None:
    dt = _HOST_DTYPES[code]
    xs, zs = N.tensor_at(x, rows * d, dt).view(rows, d), N.tensor_at(z, rows * d, dt).view(rows, d)
    y = gated_rmsnorm_total_twin(xs, zs, N.tensor_at(w, d, _HOST_DTYPES[wcode]),
                                 N.tensor_at(ss, rows, torch.float32).view(rows, 1), count, eps, bool(before),
                                 _ACT_NAMES[act])
    N.tensor_at(out, rows * d, dt).view(rows, d).copy_(y)


_HOST_DTYPES = {0: torch.float32, 1: torch.bfloat16}
_ACT_NAMES = {v: k for k, v in N.ACT.items()}


@gated_rms_sumsq.impl("native")
def gated_rms_sumsq_native(x, z, norm_before_gate, act):
    x, z = x.contiguous(), z.contiguous()  # (a decode step's one row is contiguous already: no copy to capture)
    if not (N.ok(x, z) and z.dtype == x.dtype and z.shape == x.shape):
        raise NotCovered(N.OPERANDS)
    d = x.shape[-1]
    out = N.empty(*x.shape[:-1], 1, dtype=torch.float32)
    N.call_py(_sumsq_into, x.data_ptr(), z.data_ptr(), out.data_ptr(), x.numel() // d, d, BF[x.dtype],
              int(norm_before_gate), N.ACT[act])
    return out


@gated_rmsnorm_total.impl("native")
def gated_rmsnorm_total_native(x, z, weight, sumsq, count, eps, norm_before_gate, act):
    x, z = x.contiguous(), z.contiguous()
    if not (N.ok(x, z, weight, sumsq) and z.dtype == x.dtype and z.shape == x.shape and sumsq.dtype == torch.float32):
        raise NotCovered(N.OPERANDS)
    d = x.shape[-1]
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call_py(_total_into, x.data_ptr(), z.data_ptr(), weight.data_ptr(), sumsq.data_ptr(), out.data_ptr(),
              x.numel() // d, d, BF[x.dtype], BF[weight.dtype], count, eps, int(norm_before_gate), N.ACT[act])
    return out
