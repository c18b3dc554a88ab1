"""Elementwise kernels between the projections: ``vxc::gated_act`` (``act(gate) · up``, the gating of a dense
FFN whose activation is not the fused SwiGLU's SiLU) and ``vxc::scale`` (``x · s``, e.g. an embedding scale).

- ``gated_act(gate, up, act)``: ``act`` is ``"silu"``, ``"gelu_tanh"`` (``0.5 g (1 + tanh(√(2/π) (g +
  0.044715 g³)))``, torch's ``gelu(approximate="tanh")``) or ``"none"`` (the plain product ``gate · up``, e.g. a
  gated convolution's input and output gates); computed in fp32, the result at gate's dtype.
- ``scale(x, s)``: ``x · s`` with ``s`` first rounded to x's dtype (a model that multiplies by a scale held as a
  tensor of its weights' dtype: at bf16 the product is bf16(x) · bf16(s), rounded once).

Native forms take any size (every thread from 65536 values: a prefill chunk's FFN); bf16 is widened to fp32 by
chunks of 512 values and computed by the fp32 loops (one value at a time, a bf16 call of 128 x 2048 gelu_tanh
products took 1.26 ms against torch's 1.65 and the fp32 loop's 0.08). Triton forms are one program per 1024 values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .registry import NotCovered, kernel

ACTS = {"none": 0, "silu": 1, "gelu_tanh": 3}  # the codes vxc_cpu.c's ``act`` helpers use
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@kernel("gated_act")
def gated_act(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """``act(gate) · up`` elementwise (same shapes)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} must agree")
    if act not in ACTS:
        raise ValueError(f"act {act!r} is not one of {', '.join(ACTS)}")


@gated_act.fake
def _(gate, up, act):
    return torch.empty_like(gate)


@kernel("scale")
def scale(x: Tensor, s: float) -> Tensor:
    """``x · s``, ``s`` rounded to x's dtype."""


@scale.fake
def _(x, s):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------ torch twins


@gated_act.impl("torch")
def gated_act_twin(gate, up, act):
    g = gate.float()
    a = g if act == "none" else F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return (a * up.float()).to(gate.dtype)


@scale.impl("torch")
def scale_twin(x, s):
    return x * torch.tensor(s, dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _gated_act_kernel(g_ptr, u_ptr, out_ptr, N, ACT: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g
    elif ACT == 1:
        a = g * tl.sigmoid(g)
    else:
        y = C * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * y) - 1.0))  # tanh(y) = 2σ(2y) − 1
    tl.store(out_ptr + offs, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(x_ptr, out_ptr, N, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


@gated_act.impl("triton")
def gated_act_triton(gate, up, act):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _gated_act_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, ACT=ACTS[act], C=_SQRT_2_OVER_PI, BLOCK=1024)
    return out


@scale.impl("triton")
def scale_triton(x, s):
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    s_at_dtype = float(torch.tensor(s, dtype=x.dtype))  # the scale as x's dtype holds it (exact in fp32)
    if n:
        _scale_kernel[(triton.cdiv(n, 1024),)](x, out, n, s_at_dtype, BLOCK=1024)
    return out


# ------------------------------------------------------------------------------------------------ native

_GATED_ACT = N.declare("vxc_gated_act", P, P, P, L, I, I)
_SCALE = N.declare("vxc_scale", P, P, L, N.F, I)


@gated_act.impl("native")
def gated_act_native(gate, up, act):
    if gate.device.type == "cpu" and gate.dtype in N.BF and up.dtype == gate.dtype:
        gate, up = N.dense_rows(gate), N.dense_rows(up)  # (halves of one fused projection's rows)
    if not (N.ok(gate, up) and gate.dtype == up.dtype):
        raise NotCovered(N.OPERANDS)
    out = N.empty(*gate.shape, dtype=gate.dtype)
    N.call(_GATED_ACT, gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), ACTS[act], BF[gate.dtype])
    return out


@scale.impl("native")
def scale_native(x, s):
    if not N.ok(x):
        raise NotCovered(N.OPERANDS)
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_SCALE, x.data_ptr(), out.data_ptr(), x.numel(), N.rounded(s, x.dtype), BF[x.dtype])
    return out
