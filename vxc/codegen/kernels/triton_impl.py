"""Triton implementations of the vxc kernels: ``@triton.jit`` kernels and their Python launchers.

Each launcher takes the same arguments as its ``torch.ops.vxc.<name>`` op and its torch twin in
``torch_impl``. Kernels load every input and cast it to fp32 at once (Triton's CPU interpreter computes bf16
wrongly), accumulate in fp32 and cast on store to the output's dtype. Block sizes are fixed per kernel (one
configuration, no autotuning), so the same code runs compiled on CUDA and under the CPU interpreter.

On CPU the kernels run only under Triton's interpreter. ``@triton.jit`` decides between a compiled and an
interpreted kernel as it decorates, reading ``TRITON_INTERPRET``: for the kernels here when this module is
imported, and for the library functions they call (``tl.zeros``, ``tl.sum``, ``tl.sigmoid``: ``@jit``
functions of ``triton.language.standard``) when triton itself is imported. So the variable must be set before
triton is first imported.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

# Whether the kernels below and triton's own library were both built for the interpreter (see above).
INTERPRETED: bool = triton.knobs.runtime.interpret and not isinstance(tl.zeros, triton.runtime.JITFunction)

_ACTIVATIONS = {"none": 0, "silu": 1, "sigmoid": 2}
_LOG2E = tl.constexpr(math.log2(math.e))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs need IEEE products; bf16/fp16 values are exact in tf32, so tf32 loses nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_block(n: int) -> int:
    """The power-of-two block covering n that ``tl.dot`` accepts (at least 16)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _activate(v, ACT: tl.constexpr):
    if ACT == 1:
        v = v * tl.sigmoid(v)
    elif ACT == 2:
        v = tl.sigmoid(v)
    return v


@triton.jit
def _softplus(v):
    # torch's softplus: v above 20, else log1p(exp(v)). Triton has no log1p; log(u) * e / (u - 1) with
    # u = 1 + e is accurate to a few ulp even where 1 + e rounds (Goldberg's trick).
    e = tl.exp(v)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(v > 20.0, v, log1p)


# ----------------------------------------------------------------------------------------------- norms


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


def add_rmsnorm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, zero_centred: bool, residual_fp32: bool
) -> tuple[Tensor, Tensor]:
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
    gate = _activate(tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32), ACT)
    if not NORM_BEFORE_GATE:
        x = x * gate
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / group_size + eps) * w
    if NORM_BEFORE_GATE:
        y = y * gate
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool, act: str
) -> Tensor:
    x, z = x.contiguous(), z.contiguous()
    D = x.shape[-1]
    out = torch.empty_like(x)
    _gated_rmsnorm_kernel[(x.numel() // D, D // group_size)](
        x, z, weight.contiguous(), out, D, group_size, eps,
        NORM_BEFORE_GATE=norm_before_gate, ACT=_ACTIVATIONS[act], BLOCK_G=triton.next_power_of_2(group_size),
    )
    return out


# ------------------------------------------------------------------------------------------------ conv


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
    y = _activate(acc, ACT)
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
        tl.store(y_ptr + c, _activate(y, ACT).to(y_ptr.dtype.element_ty), mask=c_mask)
    tl.debug_barrier()  # this program owns its channels: all of it has read the old history before any write
    tl.store(
        state_ptr + c[:, None] * K + i[None, :],
        history.to(state_ptr.dtype.element_ty),
        mask=c_mask[:, None] & i_mask[None, :],
    )


_CONV_BLOCK_T, _CONV_BLOCK_C = 32, 64


def conv1d_prefill(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor
) -> Tensor:
    assert conv_state.is_contiguous(), "conv_state is updated in place and must be contiguous"
    x, weight = x.contiguous(), weight.contiguous()
    (T, C), K = x.shape, weight.shape[1]
    y = torch.empty_like(x)
    b = weight if bias is None else bias.contiguous()
    act = _ACTIVATIONS[activation]
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


def conv1d_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    assert conv_state.is_contiguous(), "conv_state is updated in place and must be contiguous"
    x, weight = x.contiguous(), weight.contiguous()
    C, K = weight.shape
    y = torch.empty_like(x)
    _conv1d_state_kernel[(triton.cdiv(C, _CONV_BLOCK_C),)](
        x, conv_state, weight, weight if bias is None else bias.contiguous(), y, 1, C,
        K=K, HAS_BIAS=bias is not None, ACT=_ACTIVATIONS[activation], WRITE_Y=True, BLOCK_C=_CONV_BLOCK_C,
        BLOCK_K=triton.next_power_of_2(K),
    )
    return y


# ------------------------------------------------------------------------------------------------- SSD


@triton.jit
def _ssd_prefill_kernel(
    x_ptr, dt_ptr, A_log_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr,
    T, H, P, G, N, dt_min, dt_max,
    CLAMP_DT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (head, block of P): walks the sequence in chunks of BLOCK_L, state in registers."""
    h = tl.program_id(0)
    g = h // (H // G)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    l = tl.arange(0, BLOCK_L)
    p_mask, n_mask = p < P, n < N
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    state_offs = (h * P + p[:, None]) * N + n[None, :]
    state_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    causal = l[:, None] >= l[None, :]
    for chunk_start in range(0, T, BLOCK_L):
        t = chunk_start + l
        t_mask = t < T
        dt = _softplus(tl.load(dt_ptr + t * H + h, mask=t_mask, other=0.0).to(tl.float32) + dt_bias)
        if CLAMP_DT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dt = tl.where(t_mask, dt, 0.0)  # steps past the end neither decay nor add
        a = dt * A
        cum = tl.cumsum(a, 0)
        total = tl.sum(a, 0)
        x_mask = t_mask[:, None] & p_mask[None, :]
        x = tl.load(x_ptr + (t[:, None] * H + h) * P + p[None, :], mask=x_mask, other=0.0).to(tl.float32)
        bc_offs = (t[:, None] * G + g) * N + n[None, :]
        bc_mask = t_mask[:, None] & n_mask[None, :]
        Bm = tl.load(B_ptr + bc_offs, mask=bc_mask, other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_N]
        Cm = tl.load(C_ptr + bc_offs, mask=bc_mask, other=0.0).to(tl.float32)
        # intra-chunk: y_i += sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], -float("inf")))
        scores = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION) * decay * dt[None, :]
        y = tl.dot(scores, x, input_precision=DOT_PRECISION)
        # the state carried in: y_i += exp(cum_i) C_i . state
        y += tl.dot(Cm, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
        y += D * x
        tl.store(y_ptr + (t[:, None] * H + h) * P + p[None, :], y.to(y_ptr.dtype.element_ty), mask=x_mask)
        to_end = tl.exp(total - cum) * dt
        state = state * tl.exp(total) + tl.dot(tl.trans(x * to_end[:, None]), Bm, input_precision=DOT_PRECISION)
    tl.store(state_ptr + state_offs, state, mask=state_mask)


@triton.jit
def _ssd_step_kernel(
    x_ptr, dt_ptr, A_log_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr,
    H, P, G, N, dt_min, dt_max,
    CLAMP_DT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h = tl.program_id(0)
    g = h // (H // G)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    dt = _softplus(tl.load(dt_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32))
    if CLAMP_DT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + h * P + p, mask=p_mask, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + g * N + n, mask=n_mask, other=0.0).to(tl.float32)
    state_offs = (h * P + p[:, None]) * N + n[None, :]
    state_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptr + state_offs, state, mask=state_mask)
    y = tl.sum(state * C[None, :], 1) + tl.load(D_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + h * P + p, y.to(y_ptr.dtype.element_ty), mask=p_mask)


_SSD_BLOCK_L = 32


def _clamps_dt(dt_min: float, dt_max: float) -> bool:
    return not (dt_min == 0.0 and dt_max == math.inf)


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
    """``chunk_size`` is the model's SSD chunk; the kernel uses its own (_SSD_BLOCK_L): the result is the same."""
    assert ssm_state.is_contiguous() and ssm_state.dtype == torch.float32, "ssm_state must be contiguous fp32"
    x, dt, A_log, B, C, D, dt_bias = (t.contiguous() for t in (x, dt, A_log, B, C, D, dt_bias))
    T, H, P = x.shape
    G, N = B.shape[1:]
    y = torch.empty_like(x)
    block_p = min(_dot_block(P), 32)
    _ssd_prefill_kernel[(H, triton.cdiv(P, block_p))](
        x, dt, A_log, B, C, D, dt_bias, ssm_state, y, T, H, P, G, N, dt_min, dt_max,
        CLAMP_DT=_clamps_dt(dt_min, dt_max), BLOCK_L=_SSD_BLOCK_L, BLOCK_P=block_p, BLOCK_N=_dot_block(N),
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=8,
    )
    return y


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
    assert ssm_state.is_contiguous() and ssm_state.dtype == torch.float32, "ssm_state must be contiguous fp32"
    x, dt, A_log, B, C, D, dt_bias = (t.contiguous() for t in (x, dt, A_log, B, C, D, dt_bias))
    H, P = x.shape
    G, N = B.shape
    y = torch.empty_like(x)
    block_p = min(triton.next_power_of_2(P), 32)
    _ssd_step_kernel[(H, triton.cdiv(P, block_p))](
        x, dt, A_log, B, C, D, dt_bias, ssm_state, y, H, P, G, N, dt_min, dt_max,
        CLAMP_DT=_clamps_dt(dt_min, dt_max), BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
    )
    return y


# ---------------------------------------------------------------------------------------------- rotary


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Each output dim d reads x[d] and its pair partner: ``x[d] cos ∓ x[partner] sin`` (minus for the first)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if INTERLEAVED:
        freq = d // 2
        partner = d ^ 1
        first = d % 2 == 0
    else:
        freq = tl.where(d < HALF, d, d - HALF)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        first = d < HALF
    rotated = d < 2 * HALF
    mask = (heads < H)[:, None] & (d < D)[None, :]
    row = (t * H + heads[:, None]) * D
    x = tl.load(x_ptr + row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + row + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * HALF + freq, mask=rotated, other=1.0).to(tl.float32)  # pass-through: cos 1, sin 0
    sin = tl.load(sin_ptr + t * HALF + freq, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    out = x * cos[None, :] + x_partner * sin[None, :]
    tl.store(out_ptr + row + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    T, H, D = x.shape
    out = torch.empty_like(x)
    block_h = 4
    _rotary_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, out, H, D, cos.shape[-1],
        INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D),
    )
    return out


# ------------------------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["T", "start"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, sinks_ptr, o_ptr,
    T, start, Hq, Dk, Dv, group, window, qk_scale,
    stride_ks, stride_kh, stride_vs, stride_vh,
    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Flash attention: one program per (block of queries, query head), online softmax in base 2."""
    h = tl.program_id(1)
    kv_h = h // group
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = start + m
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    m_mask, dk_mask, dv_mask = m < T, dk < Dk, dv < Dv
    q = tl.load(q_ptr + (m[:, None] * Hq + h) * Dk + dk[None, :], mask=m_mask[:, None] & dk_mask[None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale  # scale · log2(e): exp2 of these logits is exp of the scaled ones
    if HAS_SINKS:  # the sink is one more logit column: start the running max at it with weight 1
        row_max = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
        row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    else:  # finite, so a block whose keys are all masked for a row gives exp2(-inf) = 0, never NaN
        row_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    block_first = start + tl.program_id(0) * BLOCK_M
    hi = tl.minimum(block_first + BLOCK_M, start + T)  # rows at or past the block's last query are never read
    lo = tl.where(window > 0, tl.maximum(block_first - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    for key_start in range(lo, hi, BLOCK_N):
        n = key_start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        n64 = n.to(tl.int64)
        k = tl.load(
            k_ptr + n64[None, :] * stride_ks + kv_h * stride_kh + dk[:, None],
            mask=n_mask[None, :] & dk_mask[:, None], other=0.0,
        ).to(tl.float32)  # [BLOCK_DK, BLOCK_N]
        logits = tl.dot(q, k, input_precision=DOT_PRECISION)
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (n[None, :] > q_pos[:, None] - window))
        logits = tl.where(visible, logits, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(logits - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = tl.load(
            v_ptr + n64[:, None] * stride_vs + kv_h * stride_vh + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        ).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        row_max = new_max
    # padded query rows past T may see no key at all: keep their (unstored) result finite
    out = acc / tl.where(m_mask, row_sum, 1.0)[:, None]
    tl.store(
        o_ptr + (m[:, None] * Hq + h) * Dv + dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & dv_mask[None, :],
    )


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
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous in the head dim"
    T, Hq, Dk = q.shape
    Hkv, Dv = v.shape[1:]
    k_cache[start : start + T].copy_(k)
    v_cache[start : start + T].copy_(v)
    q = q.contiguous()
    out = q.new_empty(T, Hq, Dv)
    block_m = 16 if T <= 16 else 32
    _attention_kernel[(triton.cdiv(T, block_m), Hq)](
        q, k_cache, v_cache, q if sinks is None else sinks.contiguous(), out,
        T, start, Hq, Dk, Dv, Hq // Hkv, window, scale * _LOG2E.value,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_DK=_dot_block(Dk), BLOCK_DV=_dot_block(Dv), DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out


# ------------------------------------------------------------------------------------------------ GEMM


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[M, N] = x[M, K] @ w[N, K]ᵀ (+ b)``, one output tile per program."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out = silu(x wgᵀ) * (x wuᵀ)``: both GEMMs share the x tiles, the gating is the epilogue."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_offs = rn[None, :] * K + k[:, None]
        w_mask = n_mask[None, :] & k_mask[:, None]
        x = x.to(tl.float32)
        w_gate = tl.load(wg_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
        w_up = tl.load(wu_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
    h = gate * tl.sigmoid(gate) * up
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], h.to(out_ptr.dtype.element_ty), mask=out_mask)


_GEMM_BLOCK_N, _GEMM_BLOCK_K = 64, 32


def _gemm_grid(M: int, N: int) -> tuple[int, tuple[int, int]]:
    block_m = 16 if M <= 16 else 32
    return block_m, (triton.cdiv(M, block_m), triton.cdiv(N, _GEMM_BLOCK_N))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    (M, K), N = x.shape, weight.shape[0]
    out = x.new_empty(M, N)
    block_m, grid = _gemm_grid(M, N)
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias.contiguous(), out, M, N, K,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K,
        DOT_PRECISION=_dot_precision(x.dtype),
    )
    return out


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    x = x.contiguous()
    (M, D), I = x.shape, w_gate.shape[0]
    h = x.new_empty(M, I, dtype=torch.float32)  # the gated activations stay fp32 between the two GEMMs
    block_m, grid = _gemm_grid(M, I)
    _gate_up_kernel[grid](
        x, w_gate.contiguous(), w_up.contiguous(), h, M, I, D,
        BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K, DOT_PRECISION=_dot_precision(x.dtype),
    )
    out = x.new_empty(M, D)
    w_down = w_down.contiguous()
    block_m, grid = _gemm_grid(M, D)
    _linear_kernel[grid](
        h, w_down, w_down, out, M, D, I,
        HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K,
        DOT_PRECISION=_dot_precision(x.dtype),
    )
    return out


# ------------------------------------------------------------------------------------------- embedding


@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * D + d, tl.load(table_ptr + row * D + d, mask=mask), mask=mask)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    ids, table = ids.contiguous(), table.contiguous()
    D = table.shape[1]
    out = table.new_empty(ids.shape[0], D)
    block_d = min(triton.next_power_of_2(D), 1024)
    _embedding_kernel[(ids.shape[0], triton.cdiv(D, block_d))](ids, table, out, D, BLOCK_D=block_d)
    return out
