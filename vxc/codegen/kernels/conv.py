"""Causal depthwise conv kernels: ``vxc::conv1d_prefill`` (a sequence) and ``vxc::conv1d_step`` (one token),
each continuing and updating the history ``conv_state [C, K]`` (the K most recent raw inputs, oldest first)."""

from typing import Optional

import torch
import torch.nn.functional as Fn
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .registry import NotCovered, kernel
from .torch_common import activate, check_activation
from .triton_common import ACTIVATIONS
from .triton_common import activate as tl_activate


@kernel("conv1d_prefill", mutates=("conv_state",))
def conv1d_prefill(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    check_activation(activation, ("silu", "none"))


@kernel("conv1d_step", mutates=("conv_state",))
def conv1d_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    check_activation(activation, ("silu", "none"))


@conv1d_prefill.fake
@conv1d_step.fake
def _(x, weight, bias, activation, conv_state):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------ torch twins


@conv1d_prefill.impl("torch")
def conv1d_prefill_twin(x, weight, bias, activation, conv_state):
    """Causal depthwise conv over ``x [T, C]`` continuing the history in ``conv_state [C, K]``.

    The inputs before ``x[0]`` are the last K-1 columns of conv_state; afterwards conv_state holds the K most
    recent raw inputs, oldest first.
    """
    K = weight.shape[1]
    history = conv_state.float()  # [C, K], oldest first
    xx = torch.cat([history, x.float().T], dim=1)  # [C, K+T]
    y = Fn.conv1d(xx[None, :, 1:], weight.float()[:, None, :], None if bias is None else bias.float(),
                  groups=weight.shape[0])[0].T.contiguous()  # [T, C]: output t reads inputs t-K+1 .. t
    conv_state.copy_(xx[:, -K:])
    return activate(y, activation).to(x.dtype)


@conv1d_step.impl("torch")
def conv1d_step_twin(x, weight, bias, activation, conv_state):
    """One token ``x [C]``: shift it into the history ``conv_state [C, K]``, then convolve the history."""
    history = torch.cat([conv_state[:, 1:].float(), x.float()[:, None]], dim=1)
    conv_state.copy_(history)
    y = (history * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return activate(y, activation).to(x.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _conv1d_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, T, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask, c_mask = t < T, c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        # tap j of output t reads input t + j - (K-1); a negative one is history column K + src of the state
        src = t + j - (K - 1)
        in_x = (src >= 0) & t_mask
        from_x = tl.load(x_ptr + src[:, None] * C + c[None, :], mask=in_x[:, None] & c_mask[None, :], other=0.0)
        in_state = src < 0
        from_state = tl.load(
            state_ptr + c[None, :] * K + (K + src)[:, None], mask=in_state[:, None] & c_mask[None, :], other=0.0
        )
        w = tl.load(w_ptr + c * K + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * (from_x.to(tl.float32) + from_state.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    y = tl_activate(acc, ACT)
    tl.store(y_ptr + t[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _conv1d_state_kernel(
    x_ptr, state_ptr, w_ptr, b_ptr, y_ptr, T, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, WRITE_Y: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Shift the T newest inputs into the history: column i becomes entry T + i of cat(history, x).

    With WRITE_Y (one token, decode) also writes the convolution of the new history.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_K)
    c_mask, i_mask = c < C, i < K
    src = T + i
    from_state = tl.load(
        state_ptr + c[:, None] * K + src[None, :], mask=c_mask[:, None] & (src < K)[None, :], other=0.0
    )
    from_x = tl.load(
        x_ptr + (src - K)[None, :] * C + c[:, None], mask=c_mask[:, None] & (i_mask & (src >= K))[None, :], other=0.0
    )
    history = from_state.to(tl.float32) + from_x.to(tl.float32)
    if WRITE_Y:
        w = tl.load(w_ptr + c[:, None] * K + i[None, :], mask=c_mask[:, None] & i_mask[None, :], other=0.0)
        y = tl.sum(history * w.to(tl.float32), 1)
        if HAS_BIAS:
            y += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + c, tl_activate(y, ACT).to(y_ptr.dtype.element_ty), mask=c_mask)
    tl.debug_barrier()  # this program owns its channels: all of it has read the old history before any write
    tl.store(
        state_ptr + c[:, None] * K + i[None, :],
        history.to(state_ptr.dtype.element_ty),
        mask=c_mask[:, None] & i_mask[None, :],
    )


_CONV_BLOCK_T, _CONV_BLOCK_C = 32, 64


@conv1d_prefill.impl("triton")
def conv1d_prefill_triton(x, weight, bias, activation, conv_state):
    assert conv_state.is_contiguous(), "conv_state is updated in place and must be contiguous"
    x, weight = x.contiguous(), weight.contiguous()
    (T, C), K = x.shape, weight.shape[1]
    y = torch.empty_like(x)
    b = weight if bias is None else bias.contiguous()
    act = ACTIVATIONS[activation]
    grid = (triton.cdiv(T, _CONV_BLOCK_T), triton.cdiv(C, _CONV_BLOCK_C))
    _conv1d_kernel[grid](
        x, weight, b, conv_state, y, T, C,
        K=K, HAS_BIAS=bias is not None, ACT=act, BLOCK_T=_CONV_BLOCK_T, BLOCK_C=_CONV_BLOCK_C,
    )
    # a second launch: the state may only change once every output has read the old history
    _conv1d_state_kernel[(triton.cdiv(C, _CONV_BLOCK_C),)](
        x, conv_state, weight, b, y, T, C,
        K=K, HAS_BIAS=bias is not None, ACT=act, WRITE_Y=False, BLOCK_C=_CONV_BLOCK_C,
        BLOCK_K=triton.next_power_of_2(K),
    )
    return y


@conv1d_step.impl("triton")
def conv1d_step_triton(x, weight, bias, activation, conv_state):
    assert conv_state.is_contiguous(), "conv_state is updated in place and must be contiguous"
    x, weight = x.contiguous(), weight.contiguous()
    C, K = weight.shape
    y = torch.empty_like(x)
    _conv1d_state_kernel[(triton.cdiv(C, _CONV_BLOCK_C),)](
        x, conv_state, weight, weight if bias is None else bias.contiguous(), y, 1, C,
        K=K, HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation], WRITE_Y=True, BLOCK_C=_CONV_BLOCK_C,
        BLOCK_K=triton.next_power_of_2(K),
    )
    return y


# ------------------------------------------------------------------------------------------------ native

_CONV1D_PREFILL = N.declare("vxc_conv1d_prefill", P, P, P, P, P, L, L, L, I, I, I, I, L)
_CONV1D_STEP = N.declare("vxc_conv1d_step", P, P, P, P, P, L, L, I, I, I, I)


@conv1d_prefill.impl("native")
def conv1d_prefill_native(x, weight, bias, activation, conv_state):
    if not (N.ok_rows(x) and N.ok(weight, bias, conv_state) and x.dim() == 2
            and (bias is None or bias.dtype == weight.dtype) and x.shape[1] == weight.shape[0] == conv_state.shape[0]
            and weight.shape[1] == conv_state.shape[1]):
        raise NotCovered(N.OPERANDS)
    T, C = x.shape
    out = N.empty(T, C, dtype=x.dtype)
    N.call(_CONV1D_PREFILL, x.data_ptr(), weight.data_ptr(), N.ptr(bias), conv_state.data_ptr(), out.data_ptr(),
           T, C, weight.shape[1], N.ACT[activation], BF[x.dtype], BF[weight.dtype], BF[conv_state.dtype],
           N.row_stride(x))
    return out


@conv1d_step.impl("native")
def conv1d_step_native(x, weight, bias, activation, conv_state):
    if not (N.ok(x, weight, bias, conv_state) and (bias is None or bias.dtype == weight.dtype) and x.dim() == 1):
        raise NotCovered(N.OPERANDS)
    C, K = weight.shape
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_CONV1D_STEP, x.data_ptr(), weight.data_ptr(), N.ptr(bias), conv_state.data_ptr(), out.data_ptr(), C, K,
           N.ACT[activation], BF[x.dtype], BF[weight.dtype], BF[conv_state.dtype])
    return out


_CONV1D_STEP_ROWS = N.declare("vxc_conv1d_step_rows", P, P, P, P, P, L, L, I, I, I, I, L, P, L)


def conv1d_step_rows_native(x, weight, bias, activation, states, slots):
    """``conv1d_step`` for B rows ``x [B, C]``, row b on ``states[slots[b]]`` (``states``: the region's [S, C, K]
    buffer, ``slots``: int64 [B]) in one native call; each row is exactly the single-row native step."""
    if not (N.ok(x, weight, bias, states) and x.dim() == 2 and states.dim() == 3 and slots.dtype == torch.int64
            and slots.is_contiguous() and (bias is None or bias.dtype == weight.dtype)):
        raise NotCovered(N.OPERANDS)
    C, K = weight.shape
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_CONV1D_STEP_ROWS, x.data_ptr(), weight.data_ptr(), N.ptr(bias), states.data_ptr(), out.data_ptr(), C, K,
           N.ACT[activation], BF[x.dtype], BF[weight.dtype], BF[states.dtype], x.shape[0], slots.data_ptr(),
           states.stride(0) * states.element_size())
    return out
