"""What the Triton implementations share: the interpreter switch, ``tl.dot`` precision and block sizes, and
the ``@triton.jit`` helpers (activation codes, softplus) their kernels call.

Kernels load every input and cast it to fp32 at once (Triton's CPU interpreter computes bf16 wrongly),
accumulate in fp32 and cast on store to the output's dtype. Block sizes are fixed per kernel (one
configuration, no autotuning), so the same code runs compiled on CUDA and under the CPU interpreter.

On CPU the kernels run only under Triton's interpreter. ``@triton.jit`` decides between a compiled and an
interpreted kernel as it decorates, reading ``TRITON_INTERPRET``: for vxc's kernels when their family module
is imported, and for the library functions they call (``tl.zeros``, ``tl.sum``, ``tl.sigmoid``: ``@jit``
functions of ``triton.language.standard``) when triton itself is imported. So the variable must be set before
triton (and so ``vxc.codegen.kernels``) is first imported.
"""

import math

import torch
import triton
import triton.language as tl

# Whether vxc's kernels and triton's own library were both built for the interpreter (see above).
INTERPRETED: bool = triton.knobs.runtime.interpret and not isinstance(tl.zeros, triton.runtime.JITFunction)

ACTIVATIONS = {"none": 0, "silu": 1, "sigmoid": 2}  # the ACT codes of ``activate``
LOG2E = tl.constexpr(math.log2(math.e))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs need IEEE products; bf16/fp16 values are exact in tf32, so tf32 loses nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_block(n: int) -> int:
    """The power-of-two block covering n that ``tl.dot`` accepts (at least 16)."""
    return max(16, triton.next_power_of_2(n))


def pow2(n: int, floor: int = 1) -> int:
    """The power of two covering n (at least ``floor``)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def activate(v, ACT: tl.constexpr):
    if ACT == 1:
        v = v * tl.sigmoid(v)
    elif ACT == 2:
        v = tl.sigmoid(v)
    return v


@triton.jit
def softplus(v):
    # torch's softplus: v above 20, else log1p(exp(v)). Triton has no log1p; log(u) * e / (u - 1) with
    # u = 1 + e is accurate to a few ulp even where 1 + e rounds (Goldberg's trick).
    e = tl.exp(v)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(v > 20.0, v, log1p)
