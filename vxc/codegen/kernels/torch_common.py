"""What the torch twins share: activations by name and the clamped exponential of cumulative decays.

Twins take the same arguments as their ``torch.ops.vxc.<name>`` op, compute in fp32 and return the input's
dtype; state arguments are written in place, cast to the state's own dtype. They are the CPU path for
everything the native library does not cover and the oracle the other implementations are tested against.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def activate(x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "sigmoid":
        return torch.sigmoid(x)
    if activation == "none":
        return x
    raise ValueError(f"unknown activation {activation!r}")


def check_activation(activation: str, allowed: tuple[str, ...]) -> None:
    if activation not in allowed:
        raise ValueError(f"activation {activation!r} is not one of {allowed}")


# Decay exponents are clamped below at this value before exp: exp(-60) = 8.8e-27 stands for anything smaller,
# so a term it scales stays below fp32's resolution (2^-24) of any O(1e-18)-or-larger sum it joins, and no
# result the fp32 arithmetic resolves changes. Unclamped, exponents of -87 .. -103 give subnormals and lower
# ones exact zeros, and both are slow paths for the CPU (measured on this machine: exp over [48, 64, 64] takes
# 19 us on ordinary inputs, 180 us when half of them are -inf, 700 us when half are -200; arithmetic on
# subnormals runs at a fraction of its normal rate), which doubled the SSD prefill of a model with A in
# [-16, -1]. The clamp is applied where a cumulative decay is exponentiated.
UNDERFLOW = -60.0


def exp_clamped(d: Tensor) -> Tensor:
    """``exp(max(d, UNDERFLOW))`` (a fresh tensor)."""
    return d.clamp(min=UNDERFLOW).exp_()


def at_dtype_of(index: int, fn, contiguous: bool = False):
    """``fn`` (a twin whose result is fp32) with its result cast to the dtype of its argument ``index``."""

    def cast(*args):
        out = fn(*args).to(args[index].dtype)
        return out.contiguous() if contiguous else out

    cast.__name__ = cast.__qualname__ = f"{fn.__name__}_at_dtype_of_{index}"
    return cast
