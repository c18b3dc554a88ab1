"""An ungated activation between two projections: ``vxc::activation(x, kind)`` — the middle of a non-gated MLP
``down(act(up(x)))`` (the ``mlp`` FFN operator).

- ``kind`` ``"relu2"``: ``max(x, 0)²`` (squared ReLU),
  computed in fp32 and rounded once to x's dtype (the square of a bf16 value is exact in fp32, so this is the
  reference's bf16 ``square(relu(x))`` too).

Native forms take any size (every thread from 65536 values: a prefill chunk's FFN); bf16 is widened to fp32 by
chunks of 512 values and computed by the fp32 loops (one value at a time, a bf16 call of 128 x 2048 gelu_tanh
products took 1.26 ms against torch's 1.65 and the fp32 loop's 0.08). Triton forms are one program per 1024 values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .registry import NotCovered, kernel

KINDS = {"relu2": 0}  # the codes vxc_cpu.c's vxc_activation reads


@kernel("activation")
def activation(x: Tensor, kind: str) -> Tensor:
    """``act(x)`` elementwise, ``act`` named by ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"activation kind {kind!r} is not one of {', '.join(KINDS)}")


@activation.fake
def _(x, kind):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------ torch twin


@activation.impl("torch")
def activation_twin(x, kind):
    return F.relu(x.float()).square().to(x.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _activation_kernel(x_ptr, out_ptr, N, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(x, 0.0)  # KIND 0: relu²
    tl.store(out_ptr + offs, (r * r).to(out_ptr.dtype.element_ty), mask=mask)


@activation.impl("triton")
def activation_triton(x, kind):
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _activation_kernel[(triton.cdiv(n, 1024),)](x, out, n, KIND=KINDS[kind], BLOCK=1024)
    return out


# ------------------------------------------------------------------------------------------------ native

_ACTIVATION = N.declare("vxc_activation", P, P, L, I, I)


@activation.impl("native")
def activation_native(x, kind):
    if not N.ok(x):
        raise NotCovered(N.OPERANDS)
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_ACTIVATION, x.data_ptr(), out.data_ptr(), x.numel(), KINDS[kind], BF[x.dtype])
    return out
