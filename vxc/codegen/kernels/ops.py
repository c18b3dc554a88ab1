"""The ``torch.ops.vxc.*`` operators: one ``torch.library.custom_op`` per kernel, with a fake for tracing.

Each op checks its arguments, then runs the torch twin or the Triton launcher chosen by ``dispatch``. The
fakes give torch.fx / torch.compile the output shapes and dtypes without running anything.
"""

from typing import Optional

import torch
from torch import Tensor

from . import native_impl
from .dispatch import implementation


def _check_activation(activation: str, allowed: tuple[str, ...]) -> None:
    if activation not in allowed:
        raise ValueError(f"activation {activation!r} is not one of {allowed}")


@torch.library.custom_op("vxc::add_rmsnorm", mutates_args=())
def add_rmsnorm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, zero_centred: bool, residual_fp32: bool
) -> tuple[Tensor, Tensor]:
    return implementation(x).add_rmsnorm(x, residual, weight, eps, zero_centred, residual_fp32)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps, zero_centred, residual_fp32):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.float32 if residual_fp32 else x.dtype)


@torch.library.custom_op("vxc::gated_rmsnorm", mutates_args=())
def gated_rmsnorm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool, act: str
) -> Tensor:
    _check_activation(act, ("silu", "sigmoid"))
    if x.shape[-1] % group_size:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of group_size {group_size}")
    return implementation(x).gated_rmsnorm(x, z, weight, eps, group_size, norm_before_gate, act)


@gated_rmsnorm.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate, act):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::conv1d_prefill", mutates_args=("conv_state",))
def conv1d_prefill(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor
) -> Tensor:
    _check_activation(activation, ("silu", "none"))
    return implementation(x).conv1d_prefill(x, weight, bias, activation, conv_state)


@conv1d_prefill.register_fake
def _(x, weight, bias, activation, conv_state):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::conv1d_step", mutates_args=("conv_state",))
def conv1d_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    _check_activation(activation, ("silu", "none"))
    return implementation(x).conv1d_step(x, weight, bias, activation, conv_state)


@conv1d_step.register_fake
def _(x, weight, bias, activation, conv_state):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::ssd_prefill", mutates_args=("ssm_state",))
def ssd_prefill(
    x: Tensor,
    dt: Tensor,
    A_log: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_min: float,
    dt_max: float,
    ssm_state: Tensor,
    chunk_size: int,
) -> Tensor:
    return implementation(x).ssd_prefill(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size)


@ssd_prefill.register_fake
def _(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::ssd_step", mutates_args=("ssm_state",))
def ssd_step(
    x: Tensor,
    dt: Tensor,
    A_log: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    dt_min: float,
    dt_max: float,
    ssm_state: Tensor,
) -> Tensor:
    return implementation(x).ssd_step(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state)


@ssd_step.register_fake
def _(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::rotary", mutates_args=())
def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rotary width {2 * cos.shape[-1]} exceeds the head dim {x.shape[-1]}")
    return implementation(x).rotary(x, cos, sin, interleaved)


@rotary.register_fake
def _(x, cos, sin, interleaved):
    return torch.empty_like(x)


@torch.library.custom_op("vxc::attention", mutates_args=("k_cache", "v_cache"))
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start: int,
    scale: float,
    window: int = 0,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    T, rows = q.shape[0], k_cache.shape[0]
    if T == 1 and implementation(q) is native_impl:  # one token natively, a sliding-window ring included
        out = native_impl.attention_step(q, k, v, k_cache, v_cache, start, scale, window, sinks)
        if out is not None:
            return out
    if start + T <= rows:
        return implementation(q).attention(q, k, v, k_cache, v_cache, start, scale, window, sinks)
    if not (0 < window <= rows):
        raise ValueError(f"rows {start}..{start + T - 1} do not fit a cache of {rows} rows")
    return _ring_attention(q, k, v, k_cache, v_cache, start, scale, window, sinks)


def _ring_attention(q, k, v, k_cache, v_cache, start, scale, window, sinks):
    """A sliding-window cache held as a ring of ``rows >= window`` rows (position p lives in row p % rows).

    The rows still visible to this call (positions start-rows+1 .. start-1) are laid out in position order
    ahead of the new ones, the implementation attends over that linear window (the same masks, positions
    shifted), then the newest positions are written back into the ring.
    """
    T, rows = q.shape[0], k_cache.shape[0]
    native_impl.refuse_capture("attention over a sliding-window ring linearised by torch ops")
    first = max(0, start - rows + 1)
    old = torch.arange(first, start, device=q.device) % rows
    k_lin = torch.cat([k_cache[old], torch.empty_like(k)])
    v_lin = torch.cat([v_cache[old], torch.empty_like(v)])
    out = implementation(q).attention(q, k, v, k_lin, v_lin, start - first, scale, window, sinks)
    keep = min(T, rows)
    dst = torch.arange(start + T - keep, start + T, device=q.device) % rows
    k_cache[dst] = k[T - keep:].to(k_cache.dtype)
    v_cache[dst] = v[T - keep:].to(v_cache.dtype)
    return out


@attention.register_fake
def _(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op("vxc::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return implementation(x).linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("vxc::swiglu", mutates_args=())
def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    return implementation(x).swiglu(x, w_gate, w_up, w_down)


@swiglu.register_fake
def _(x, w_gate, w_up, w_down):
    return x.new_empty(x.shape[0], w_down.shape[0])


@torch.library.custom_op("vxc::embedding", mutates_args=())
def embedding(ids: Tensor, table: Tensor) -> Tensor:
    return implementation(table).embedding(ids, table)


@embedding.register_fake
def _(ids, table):
    return table.new_empty(ids.shape[0], table.shape[1])
