"""Gated-delta (Gated DeltaNet) kernels: ``vxc::gated_delta_prefill``, ``vxc::gated_delta_step`` and the
output-gate multiply ``vxc::sigmoid_gate_mul``.

The two delta ops take the post-conv ``q, k`` (``[T, Hk, Dk]``; one token: ``[Hk, Dk]``) and ``v``
(``[T, Hv, Dv]`` / ``[Hv, Dv]``), the raw decay and beta logits ``a, b`` (``[T, Hv]`` / ``[Hv]``), and compute
inside one fused group (fp32 throughout):

    g = −exp(A_log) · softplus(a + dt_bias)          β = σ(b)              (one per value head)
    q ← q·rsqrt(Σq² + l2_eps)·scale                  k ← k·rsqrt(Σk² + l2_eps)
    S ← e^{g_t} S;   u_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀ q_t

on the fp32 state ``[Hv, Dk, Dv]`` (``S[h, key channel, value channel]``) read and written in place. Value
head ``h`` reads key head ``h // (Hv / Hk)``.

Prefill, chunked (WY form), both implementations: within a chunk of L ≤ ``chunk_size`` tokens with
inclusive cumulative log-decays ``c_i = g_1 + … + g_i`` and the carried state ``S₀``,

    A_ij = β_i (k_i·k_j) e^{c_i − c_j}   (j < i, strictly lower)      T = (I + A)⁻¹   (unit lower triangular)
    U = T (β ⊙ V),   W = T (β e^{c} ⊙ K)                             (the WY representation)
    Δ = U − W S₀                                                      (the corrected new values u_t)
    O = (e^{c} ⊙ Q) S₀ + [(Q Kᵀ) ∘ e^{c_i − c_j}]_{j ≤ i} Δ
    S = e^{c_L} S₀ + (e^{c_L − c} ⊙ K)ᵀ Δ

The last chunk may be shorter (no padding in the torch twin; masked rows in Triton contribute nothing).
The torch twin solves the triangular systems with ``torch.linalg.solve_triangular``; the Triton kernel (one
program per (value head, block of Dv)) inverts ``I + A`` by forward substitution, row by row, then uses
``tl.dot`` for every product. Decode: the recurrence for one token. (The tests hold a plain sequential
oracle of their own.)

``sigmoid_gate_mul(x, gate) = x · σ(gate)`` (fp32, cast to x's dtype): the output gate of gated softmax
attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF, I, L, P
from .native import F as Fc
from .registry import NotCovered, kernel
from .torch_common import at_dtype_of, exp_clamped
from .triton_common import dot_precision, softplus

# ------------------------------------------------------------------------------------------------ declarations


def _check(q, k, v, a, b, A_log, dt_bias, state) -> None:
    Hk, Dk = q.shape[-2:]
    Hv, Dv = v.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must agree")
    if q.shape[:-2] != v.shape[:-2] or a.shape != v.shape[:-1] or b.shape != v.shape[:-1]:
        raise ValueError(f"q {list(q.shape)}, v {list(v.shape)}, a {list(a.shape)}, b {list(b.shape)}: "
                         "token dims disagree or a/b are not one per value head")
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads")
    if tuple(A_log.shape) != (Hv,) or tuple(dt_bias.shape) != (Hv,):
        raise ValueError(f"A_log {list(A_log.shape)} and dt_bias {list(dt_bias.shape)} must be [{Hv}]")
    if tuple(state.shape) != (Hv, Dk, Dv):
        raise ValueError(f"state {list(state.shape)} is not [Hv, Dk, Dv] = [{Hv}, {Dk}, {Dv}]")


@kernel("gated_delta_prefill", mutates=("state",))
def gated_delta_prefill(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                        state: Tensor, scale: float, l2_eps: float, chunk_size: int) -> Tensor:
    """``T`` tokens: q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]``, a, b ``[T, Hv]``; state ``[Hv, Dk, Dv]`` in place."""
    _check(q, k, v, a, b, A_log, dt_bias, state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size} must be >= 1")


@kernel("gated_delta_step", mutates=("state",))
def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                     state: Tensor, scale: float, l2_eps: float) -> Tensor:
    """One token: q, k ``[Hk, Dk]``, v ``[Hv, Dv]``, a, b ``[Hv]``; state ``[Hv, Dk, Dv]`` in place."""
    _check(q, k, v, a, b, A_log, dt_bias, state)


@gated_delta_prefill.fake
def _(q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps, chunk_size):
    return torch.empty_like(v)


@gated_delta_step.fake
def _(q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps):
    return torch.empty_like(v)


@kernel("sigmoid_gate_mul")
def sigmoid_gate_mul(x: Tensor, gate: Tensor) -> Tensor:
    """``x · σ(gate)`` elementwise (same shapes)."""
    if x.shape != gate.shape:
        raise ValueError(f"x {list(x.shape)} and gate {list(gate.shape)} must agree")


@sigmoid_gate_mul.fake
def _(x, gate):
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------- torch twin


def _l2(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _per_value_head(x: Tensor, v_heads: int) -> Tensor:
    """``[..., Hk, D] -> [..., Hv, D]``: value head h reads key head ``h // (Hv / Hk)``."""
    return x.repeat_interleave(v_heads // x.shape[-2], dim=-2)


def gated_delta_step_twin(q, k, v, a, b, A_log, dt_bias, state, scale: float, l2_eps: float) -> Tensor:
    """One token: q, k ``[Hk, Dk]``, v ``[Hv, Dv]``, a, b ``[Hv]``; returns o ``[Hv, Dv]`` in fp32."""
    Hv = v.shape[0]
    q = _per_value_head(_l2(q, l2_eps) * scale, Hv)
    k = _per_value_head(_l2(k, l2_eps), Hv)
    g, beta = _gates(a, b, A_log, dt_bias)
    S = state.float() * torch.exp(g)[:, None, None]
    u = beta[:, None] * (v.float() - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * u[:, None, :]
    state.copy_(S)
    return torch.einsum("hkv,hk->hv", S, q)


def gated_delta_prefill_twin(q, k, v, a, b, A_log, dt_bias, state, scale: float, l2_eps: float,
                             chunk_size: int) -> Tensor:
    """``T`` tokens, chunked (WY form, see the module docstring); returns o ``[T, Hv, Dv]`` in fp32."""
    T, Hv = v.shape[0], v.shape[1]
    qh = _per_value_head(_l2(q, l2_eps) * scale, Hv).transpose(0, 1)  # [Hv, T, Dk]
    kh = _per_value_head(_l2(k, l2_eps), Hv).transpose(0, 1)
    vh = v.float().transpose(0, 1)  # [Hv, T, Dv]
    g, beta = (x.T for x in _gates(a, b, A_log, dt_bias))  # [Hv, T]
    S = state.float()
    out = torch.empty_like(vh)
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, gc, bc = qh[:, sl], kh[:, sl], vh[:, sl], g[:, sl], beta[:, sl]
        L = gc.shape[-1]
        c = gc.cumsum(-1)  # [Hv, L]
        lower = torch.ones(L, L, dtype=torch.bool, device=c.device).tril()
        decay = exp_clamped(c[:, :, None] - c[:, None, :]).masked_fill_(~lower, 0.0)  # e^{c_i - c_j}, j <= i
        kb = kc * bc[..., None]
        system = (kb @ kc.transpose(-1, -2) * decay).tril(-1) + torch.eye(L, device=c.device)
        U = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(system, kb * exp_clamped(c)[..., None], upper=False, unitriangular=True)
        delta = U - W @ S
        out[:, sl] = (qc * exp_clamped(c)[..., None]) @ S + (qc @ kc.transpose(-1, -2) * decay) @ delta
        last = c[:, -1:]
        S = S * exp_clamped(last)[..., None] + (kc * exp_clamped(last - c)[..., None]).transpose(-1, -2) @ delta
    state.copy_(S)
    return out.transpose(0, 1)


gated_delta_step.impl("torch")(at_dtype_of(2, gated_delta_step_twin))  # the twins compute in fp32: at v's dtype
gated_delta_prefill.impl("torch")(at_dtype_of(2, gated_delta_prefill_twin))


@sigmoid_gate_mul.impl("torch")
def sigmoid_gate_mul_twin(x, gate):
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


# ------------------------------------------------------------------------------------------------ triton

@triton.jit
def _gated_delta_chunk_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr,
    T, HK, HV, DK, DV, scale, l2_eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (value head, block of BV value channels); walks the sequence in chunks of BT with its
    [BK, BV] slice of the state in registers. Rows past T are masked: zero k, q, β and g."""
    h = tl.program_id(0)
    hk = h // (HV // HK)
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    tt = tl.arange(0, BT)
    k_mask, v_mask = kk < DK, vv < DV
    state_offs = (h * DK + kk[:, None]) * DV + vv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    S = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)  # [BK, BV]
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    lower = tt[:, None] >= tt[None, :]
    strictly_lower = tt[:, None] > tt[None, :]
    eye = tl.where(tt[:, None] == tt[None, :], 1.0, 0.0)
    for start in range(0, T, BT):
        t = start + tt
        t_mask = t < T
        qk_mask = t_mask[:, None] & k_mask[None, :]
        qk_offs = (t[:, None] * HK + hk) * DK + kk[None, :]
        q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)  # [BT, BK]
        k = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0).to(tl.float32)
        tv_mask = t_mask[:, None] & v_mask[None, :]
        tv_offs = (t[:, None] * HV + h) * DV + vv[None, :]
        v = tl.load(v_ptr + tv_offs, mask=tv_mask, other=0.0).to(tl.float32)  # [BT, BV]
        a = tl.load(a_ptr + t * HV + h, mask=t_mask, other=0.0).to(tl.float32) + dt_bias
        b = tl.load(b_ptr + t * HV + h, mask=t_mask, other=0.0).to(tl.float32)
        g = tl.where(t_mask, A * softplus(a), 0.0)
        beta = tl.where(t_mask, tl.sigmoid(b), 0.0)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + l2_eps) * scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + l2_eps)[:, None]
        c = tl.cumsum(g, 0)  # [BT]
        decay = tl.where(lower, tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0)), 0.0)
        kb = k * beta[:, None]
        system = tl.where(strictly_lower, tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
        # Tinv = (I + system)^-1 by forward substitution: row i = e_i − Σ_{j<i} system_ij · row j
        Tinv = eye
        for i in range(1, BT):
            at_i = tt == i
            row = tl.sum(tl.where(at_i[:, None], system, 0.0), 0)  # system[i, :], zero from column i on
            new = -tl.sum(row[:, None] * Tinv, 0)
            Tinv = tl.where(at_i[:, None], eye + new[None, :], Tinv)
        ec = tl.exp(c)
        U = tl.dot(Tinv, v * beta[:, None], input_precision=DOT_PRECISION)  # [BT, BV]
        W = tl.dot(Tinv, kb * ec[:, None], input_precision=DOT_PRECISION)  # [BT, BK]
        delta = U - tl.dot(W, S, input_precision=DOT_PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        o = tl.dot(q * ec[:, None], S, input_precision=DOT_PRECISION) + tl.dot(scores, delta, input_precision=DOT_PRECISION)
        tl.store(o_ptr + tv_offs, o.to(o_ptr.dtype.element_ty), mask=tv_mask)
        # c at the last row, exactly (rows past T add g = 0): tl.sum(g) rounds differently from the scan, and
        # last − c_j must be exactly 0 for the newest token
        last = tl.sum(tl.where(tt == BT - 1, c, 0.0), 0)
        to_end = tl.exp(last - c)
        S = S * tl.exp(last) + tl.dot(tl.trans(k * to_end[:, None]), delta, input_precision=DOT_PRECISION)
    tl.store(state_ptr + state_offs, S.to(state_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _gated_delta_step_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr,
    HK, HV, DK, DV, scale, l2_eps,
    BK: tl.constexpr, BV: tl.constexpr,
):
    h = tl.program_id(0)
    hk = h // (HV // HK)
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    k_mask, v_mask = kk < DK, vv < DV
    state_offs = (h * DK + kk[:, None]) * DV + vv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    S = tl.load(state_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + hk * DK + kk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + hk * DK + kk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + h * DV + vv, mask=v_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    b = tl.load(b_ptr + h).to(tl.float32)
    g = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus(a)
    beta = tl.sigmoid(b)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
    S = S * tl.exp(g)
    u = beta * (v - tl.sum(S * k[:, None], 0))
    S = S + k[:, None] * u[None, :]
    tl.store(state_ptr + state_offs, S.to(state_ptr.dtype.element_ty), mask=state_mask)
    o = tl.sum(S * q[:, None], 0)
    tl.store(o_ptr + h * DV + vv, o.to(o_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _sigmoid_gate_mul_kernel(x_ptr, g_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.sigmoid(g)).to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(Dk: int, Dv: int) -> tuple[int, int]:
    block_k = max(16, triton.next_power_of_2(Dk))
    block_v = min(max(16, triton.next_power_of_2(Dv)), 64 if block_k <= 64 else 32)
    return block_k, block_v


@gated_delta_prefill.impl("triton")
def gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps, chunk_size):
    assert state.is_contiguous(), "the delta state is updated in place and must be contiguous"
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    out = torch.empty_like(v)
    block_k, block_v = _blocks(Dk, Dv)
    # the chunk is a computation detail (any chunking computes the same recurrence): tl.dot wants a power of
    # two of at least 16, and the row-by-row inverse costs BT³, so blocks of at most 64 tokens
    block_t = min(64, max(16, triton.next_power_of_2(chunk_size)))
    _gated_delta_chunk_kernel[(Hv, triton.cdiv(Dv, block_v))](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), state, out,
        T, Hk, Hv, Dk, Dv, float(scale), float(l2_eps),
        BT=block_t, BK=block_k, BV=block_v, DOT_PRECISION=dot_precision(v.dtype), num_warps=4,
    )
    return out


@gated_delta_step.impl("triton")
def gated_delta_step_triton(q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps):
    assert state.is_contiguous(), "the delta state is updated in place and must be contiguous"
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    Hk, Dk = q.shape
    Hv, Dv = v.shape
    out = torch.empty_like(v)
    block_k, block_v = _blocks(Dk, Dv)
    _gated_delta_step_kernel[(Hv, triton.cdiv(Dv, block_v))](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), state, out,
        Hk, Hv, Dk, Dv, float(scale), float(l2_eps), BK=block_k, BV=block_v, num_warps=4,
    )
    return out


@sigmoid_gate_mul.impl("triton")
def sigmoid_gate_mul_triton(x, gate):
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    block = 1024
    _sigmoid_gate_mul_kernel[(triton.cdiv(n, block),)](x, gate, out, n, BLOCK=block)
    return out


# ------------------------------------------------------------------------------------------------ native

_DELTA_STEP = N.declare("vxc_delta_step", P, P, P, P, P, P, P, P, P, L, L, L, L, Fc, Fc, I, I, I)
_SIGMOID_GATE_MUL = N.declare("vxc_sigmoid_gate_mul", P, P, P, L, I)


def delta_step_native(kda: bool, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                      dt_bias: Tensor, state: Tensor, scale: float, l2_eps: float) -> Tensor:
    """One delta-rule token natively (fp32 state): per-head decay (gated delta) or per key channel (``kda``)."""
    if not (N.ok(q, k, v, a, b, A_log, dt_bias, state) and q.dtype == k.dtype == v.dtype == a.dtype == b.dtype
            and A_log.dtype == dt_bias.dtype and state.dtype == torch.float32 and q.dim() == v.dim() == 2):
        raise NotCovered(N.OPERANDS)
    if q.shape[-1] > N.MAX_HEAD_DIM or v.shape[-1] > N.MAX_HEAD_DIM:
        raise NotCovered(N.LIMITS)
    (Hk, Dk), (Hv, Dv) = q.shape, v.shape
    o = N.empty(Hv, Dv, dtype=v.dtype)
    N.call(_DELTA_STEP, q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr(), A_log.data_ptr(),
           dt_bias.data_ptr(), state.data_ptr(), o.data_ptr(), Hk, Hv, Dk, Dv, scale, l2_eps, int(kda), BF[v.dtype],
           BF[A_log.dtype])
    return o


_DELTA_STEP_ROWS = N.declare("vxc_delta_step_rows", P, P, P, P, P, P, P, P, P, L, L, L, L, Fc, Fc, I, I, I, L, P)


def delta_step_rows_native(kda: bool, q, k, v, a, b, A_log, dt_bias, states, scale, l2_eps, slots) -> Tensor:
    """The delta-rule step for B rows (``q``, ``k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``a``, ``b``), row r on
    ``states[slots[r]]`` (the fp32 [S, Hv, Dk, Dv] region) in one native call; each row exactly the single-row step."""
    if not (N.ok(q, k, v, a, b, A_log, dt_bias, states) and q.dtype == k.dtype == v.dtype == a.dtype == b.dtype
            and A_log.dtype == dt_bias.dtype and states.dtype == torch.float32 and q.dim() == v.dim() == 3
            and states.dim() == 4 and slots.dtype == torch.int64 and slots.is_contiguous()):
        raise NotCovered(N.OPERANDS)
    if q.shape[-1] > N.MAX_HEAD_DIM or v.shape[-1] > N.MAX_HEAD_DIM:
        raise NotCovered(N.LIMITS)
    Bn, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if a.numel() != Bn * (Hv * Dk if kda else Hv) or b.numel() != Bn * Hv or tuple(states.shape[1:]) != (Hv, Dk, Dv):
        raise NotCovered(N.OPERANDS)
    o = N.empty(Bn, Hv, Dv, dtype=v.dtype)
    N.call(_DELTA_STEP_ROWS, q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr(), A_log.data_ptr(),
           dt_bias.data_ptr(), states.data_ptr(), o.data_ptr(), Hk, Hv, Dk, Dv, scale, l2_eps, int(kda), BF[v.dtype],
           BF[A_log.dtype], Bn, slots.data_ptr())
    return o


@gated_delta_step.impl("native")
def gated_delta_step_native(q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps):
    return delta_step_native(False, q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps)


@sigmoid_gate_mul.impl("native")
def sigmoid_gate_mul_native(x, gate):
    """``x · σ(gate)`` for up to one token's worth of values."""
    if not (N.ok(x, gate) and x.dtype == gate.dtype):
        raise NotCovered(N.OPERANDS)
    if x.numel() > 65536:
        raise NotCovered(N.LIMITS)
    out = N.empty(*x.shape, dtype=x.dtype)
    N.call(_SIGMOID_GATE_MUL, x.data_ptr(), gate.data_ptr(), out.data_ptr(), x.numel(), BF[x.dtype])
    return out
