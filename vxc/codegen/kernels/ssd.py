"""Mamba2 SSD kernels: ``vxc::ssd_prefill`` (chunked) and ``vxc::ssd_step`` (one token) of the recurrence
``h_t = exp(dt_t A) h_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = h_t C_t + D x_t`` on the state ``ssm_state [H, P, N]``
(read and written in place), with ``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)``."""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .native import F as Fc
from .registry import NotCovered, kernel
from .torch_common import UNDERFLOW, exp_clamped
from .triton_common import dot_block, dot_precision, softplus

MAX_STATE_N = 1024  # the native SSD step keeps B and C rows of N <= 1024 on the stack


@kernel("ssd_prefill", mutates=("ssm_state",))
def ssd_prefill(x: Tensor, dt: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, dt_min: float,
                dt_max: float, ssm_state: Tensor, chunk_size: int) -> Tensor:
    """``x [T, H, P]``, ``dt [T, H]``, ``B, C [T, G, N]``; ``chunk_size`` is the model's SSD chunk."""


@ssd_prefill.fake
def _(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size):
    return torch.empty_like(x)


@kernel("ssd_step", mutates=("ssm_state",))
def ssd_step(x: Tensor, dt: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, dt_min: float,
             dt_max: float, ssm_state: Tensor) -> Tensor:
    """One token: ``x [H, P]``, ``dt [H]``, ``B, C [G, N]``."""


@ssd_step.fake
def _(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state):
    return torch.empty_like(x)


def clamps_dt(dt_min: float, dt_max: float) -> bool:
    return not (dt_min == 0.0 and dt_max == math.inf)


# ------------------------------------------------------------------------------------------------ torch twins


def _discretised_dt(dt: Tensor, dt_bias: Tensor, dt_min: float, dt_max: float) -> Tensor:
    dt = F.softplus(dt.float() + dt_bias.float())
    if clamps_dt(dt_min, dt_max):
        dt = dt.clamp(dt_min, dt_max)
    return dt


def _per_head(groups: Tensor, heads: int) -> Tensor:
    """``[..., G, N] -> [..., H, N]``: head h reads group ``h // (H // G)``."""
    return groups.float().repeat_interleave(heads // groups.shape[-2], dim=-2)


CPU_SSD_CHUNK = 64

@ssd_prefill.impl("torch")
def ssd_prefill_twin(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size):
    """Mamba2 SSD over ``x [T, H, P]``, chunked.

    The recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = h_t C_t + D x_t``, computed per chunk:
    each chunk (the last may be shorter) adds its intra-chunk term ``((C Bᵀ) ∘ L)(x·dt)``, ``L[i, j] =
    exp(a[j+1] + ... + a[i])`` with ``a = dt·A``, to the decayed contribution of the state carried in, then
    carries the state to its end. ``ssm_state [H, P, N]`` is the initial state and receives the final one.

    ``C Bᵀ`` is formed once per group of heads (the heads of a group share B and C), and the exponents
    ``a[j+1] + ... + a[i]`` are differences of one fp64 running sum (exact to fp32 rounding however long
    the chunk), so the work per chunk is two batched GEMMs per group and one [H, L, L] elementwise pass.
    On CPU the scan steps through chunks of at most ``CPU_SSD_CHUNK`` tokens: the chunk length is a
    blocking choice of the algorithm, not part of the math (any length gives the same recurrence up to fp32
    rounding), and [H, L, L] blocks of 64 stay in cache where blocks of 256 stream through memory.
    """
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    hpg = H // G
    x32 = x.float()
    dt = _discretised_dt(dt, dt_bias, dt_min, dt_max)  # [T, H]
    A = -torch.exp(A_log.float())
    Bg, Cg = B.float(), C.float()  # [T, G, N]
    state = ssm_state.float().reshape(G, hpg * P, N)  # heads of a group side by side
    y = torch.empty_like(x32)
    step = min(chunk_size, CPU_SSD_CHUNK)
    for start in range(0, T, step):
        chunk = slice(start, min(start + step, T))
        L = chunk.stop - chunk.start
        xc, dtc, Bc, Cc = x32[chunk], dt[chunk], Bg[chunk].transpose(0, 1), Cg[chunk].transpose(0, 1)  # [G, L, N]
        run = (dtc * A).T.double().cumsum(-1)  # [H, L]: a[0] + ... + a[i]
        lower = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = (run[:, :, None] - run[:, None, :]).float().clamp_(min=UNDERFLOW).exp_().masked_fill_(~lower, 0.0)
        scores = (torch.bmm(Cc, Bc.transpose(1, 2))[:, None] * decay.view(G, hpg, L, L)).view(H, L, L)
        xdt = (xc * dtc[..., None]).transpose(0, 1)  # [H, L, P]
        intra = torch.bmm(scores, xdt)  # [H, L, P]
        into = exp_clamped(run.float()).T  # [L, H]: decay from the chunk's start to i
        carried = torch.bmm(Cc, state.transpose(1, 2)).view(G, L, hpg, P).permute(1, 0, 2, 3).reshape(L, H, P)
        y[chunk] = intra.transpose(0, 1) + carried * into[..., None]
        to_end = exp_clamped((run[:, -1:] - run).float()).T * dtc  # [L, H]: exp(a[j+1] + ... + a[L-1]) · dt_j
        w = (xc * to_end[..., None]).view(L, G, hpg * P).permute(1, 2, 0)  # [G, hpg·P, L]
        state = state * exp_clamped(run[:, -1].float()).view(G, hpg, 1, 1).expand(G, hpg, P, 1).reshape(G, hpg * P, 1) \
            + torch.bmm(w, Bc)
    ssm_state.copy_(state.view(H, P, N))
    return (y + D.float()[:, None] * x32).to(x.dtype)


@ssd_step.impl("torch")
def ssd_step_twin(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state):
    """One token of the Mamba2 recurrence: ``x [H, P]``, ``dt [H]``, ``B, C [G, N]``, ``ssm_state [H, P, N]``."""
    H = x.shape[0]
    x32 = x.float()
    dt = _discretised_dt(dt, dt_bias, dt_min, dt_max)
    A = -torch.exp(A_log.float())
    B, C = _per_head(B, H), _per_head(C, H)  # [H, N]
    if ssm_state.dtype == torch.float32:  # update in place: no fresh [H, P, N] temporaries per token
        state = ssm_state
        state.mul_(torch.exp(dt * A)[:, None, None]).addcmul_((dt[:, None] * x32)[..., None], B[:, None, :])
    else:
        state = ssm_state.float() * torch.exp(dt * A)[:, None, None] + (dt[:, None] * x32)[..., None] * B[:, None, :]
        ssm_state.copy_(state)
    y = torch.bmm(state, C[:, :, None])[..., 0]  # [H, P]
    return (y + D.float()[:, None] * x32).to(x.dtype)


def ssd_recurrent_reference(
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
) -> tuple[Tensor, Tensor]:
    """Test oracle: the SSD recurrence token by token. Returns ``(y, final_state)``; ssm_state is not touched."""
    state = ssm_state.clone()
    ys = [ssd_step_twin(x[t], dt[t], A_log, B[t], C[t], D, dt_bias, dt_min, dt_max, state) for t in range(x.shape[0])]
    return torch.stack(ys), state


# ------------------------------------------------------------------------------------------------ Triton


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
        dt = softplus(tl.load(dt_ptr + t * H + h, mask=t_mask, other=0.0).to(tl.float32) + dt_bias)
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
    dt = softplus(tl.load(dt_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32))
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


@ssd_prefill.impl("triton")
def ssd_prefill_triton(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size):
    """``chunk_size`` is the model's SSD chunk; the kernel uses its own (_SSD_BLOCK_L): the result is the same."""
    assert ssm_state.is_contiguous() and ssm_state.dtype == torch.float32, "ssm_state must be contiguous fp32"
    x, dt, A_log, B, C, D, dt_bias = (t.contiguous() for t in (x, dt, A_log, B, C, D, dt_bias))
    T, H, P = x.shape
    G, N = B.shape[1:]
    y = torch.empty_like(x)
    block_p = min(dot_block(P), 32)
    _ssd_prefill_kernel[(H, triton.cdiv(P, block_p))](
        x, dt, A_log, B, C, D, dt_bias, ssm_state, y, T, H, P, G, N, dt_min, dt_max,
        CLAMP_DT=clamps_dt(dt_min, dt_max), BLOCK_L=_SSD_BLOCK_L, BLOCK_P=block_p, BLOCK_N=dot_block(N),
        DOT_PRECISION=dot_precision(x.dtype), num_warps=8,
    )
    return y


@ssd_step.impl("triton")
def ssd_step_triton(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state):
    assert ssm_state.is_contiguous() and ssm_state.dtype == torch.float32, "ssm_state must be contiguous fp32"
    x, dt, A_log, B, C, D, dt_bias = (t.contiguous() for t in (x, dt, A_log, B, C, D, dt_bias))
    H, P = x.shape
    G, N = B.shape
    y = torch.empty_like(x)
    block_p = min(triton.next_power_of_2(P), 32)
    _ssd_step_kernel[(H, triton.cdiv(P, block_p))](
        x, dt, A_log, B, C, D, dt_bias, ssm_state, y, H, P, G, N, dt_min, dt_max,
        CLAMP_DT=clamps_dt(dt_min, dt_max), BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
    )
    return y


# ------------------------------------------------------------------------------------------------ native

_SSD_STEP = N.declare("vxc_ssd_step", P, P, P, P, P, P, P, Fc, Fc, I, P, P, L, L, L, L, I, I)


@ssd_step.impl("native")
def ssd_step_native(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state):
    if not (N.ok(x, dt, A_log, B, C, D, dt_bias, ssm_state) and ssm_state.dtype == torch.float32
            and A_log.dtype == D.dtype == dt_bias.dtype and dt.dtype == B.dtype == C.dtype == x.dtype):
        raise NotCovered(N.OPERANDS)
    if B.shape[-1] > MAX_STATE_N:
        raise NotCovered(N.LIMITS)
    H, P_ = x.shape
    G, N_ = B.shape
    out = N.empty(*x.shape, dtype=x.dtype)
    clamp = clamps_dt(dt_min, dt_max)
    N.call(_SSD_STEP, x.data_ptr(), dt.data_ptr(), A_log.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
           dt_bias.data_ptr(), dt_min, dt_max if clamp else 0.0, int(clamp), ssm_state.data_ptr(),
           out.data_ptr(), H, P_, G, N_, BF[x.dtype], BF[A_log.dtype])
    return out


_SSD_PREFILL = N.declare("vxc_ssd_prefill", P, P, P, P, P, P, P, Fc, Fc, I, P, P, L, L, L, L, L, I, I)


@ssd_prefill.impl("native")
def ssd_prefill_native(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state, chunk_size):
    """The recurrence token by token per head (``vxc_ssd_prefill``), each token exactly ``ssd_step_native``'s
    arithmetic: on CPU it beats the chunked form's many small GEMMs (mamba2-780m shape, 512 tokens: ~0.9 s of
    the twin's scan). ``chunk_size`` is a blocking choice of the chunked algorithm: unused here. The sequence's
    x, dt, B, C (column slices of one projection) are made dense first: a prefill is never replayed."""
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    if not (N.ok(x, dt, A_log, B, C, D, dt_bias, ssm_state) and ssm_state.dtype == torch.float32 and x.dim() == 3
            and A_log.dtype == D.dtype == dt_bias.dtype and dt.dtype == B.dtype == C.dtype == x.dtype):
        raise NotCovered(N.OPERANDS)
    if B.shape[-1] > MAX_STATE_N:
        raise NotCovered(N.LIMITS)
    T, H, P_ = x.shape
    G, N_ = B.shape[-2:]
    out = N.empty(*x.shape, dtype=x.dtype)
    clamp = clamps_dt(dt_min, dt_max)
    N.call(_SSD_PREFILL, x.data_ptr(), dt.data_ptr(), A_log.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
           dt_bias.data_ptr(), dt_min, dt_max if clamp else 0.0, int(clamp), ssm_state.data_ptr(), out.data_ptr(), T, H,
           P_, G, N_, BF[x.dtype], BF[A_log.dtype])
    return out


_SSD_STEP_ROWS = N.declare("vxc_ssd_step_rows", P, P, P, P, P, P, P, Fc, Fc, I, P, P, L, L, L, L, I, I, L, P)


def ssd_step_rows_native(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, states, slots):
    """``ssd_step`` for B rows (``x [B, H, P]``, ``dt [B, H]``, ``B``/``C [B, G, N]``), row b on
    ``states[slots[b]]`` (the fp32 [S, H, P, N] region) in one native call; each row exactly the single-row step."""
    if not (N.ok(x, dt, A_log, B, C, D, dt_bias, states) and states.dtype == torch.float32 and x.dim() == 3
            and A_log.dtype == D.dtype == dt_bias.dtype and dt.dtype == B.dtype == C.dtype == x.dtype
            and slots.dtype == torch.int64 and slots.is_contiguous()):
        raise NotCovered(N.OPERANDS)
    if B.shape[-1] > MAX_STATE_N:
        raise NotCovered(N.LIMITS)
    Bn, H, P_ = x.shape
    G, N_ = B.shape[1:]
    out = N.empty(*x.shape, dtype=x.dtype)
    clamp = clamps_dt(dt_min, dt_max)
    N.call(_SSD_STEP_ROWS, x.data_ptr(), dt.data_ptr(), A_log.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
           dt_bias.data_ptr(), dt_min, dt_max if clamp else 0.0, int(clamp), states.data_ptr(), out.data_ptr(), H, P_, G,
           N_, BF[x.dtype], BF[A_log.dtype], Bn, slots.data_ptr())
    return out
