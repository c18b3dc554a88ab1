"""KDA (per-channel gated delta rule) kernels: ``vxc::kda_prefill`` and ``vxc::kda_step``.

Both take the post-conv ``q, k, v`` (``[T, H, D]`` / ``[H, D]``), the raw forget-gate logits ``f``
(``f_b(f_a x)``, ``[T, H·D]``) and the raw beta logits ``b`` (``[T, H]``), and compute inside one fused
group: the log-decay ``g = −exp(A_log_h)·softplus(f + dt_bias)`` (fp32, one per key channel), ``β = σ(b)``,
the l2 norms of q and k (``x / √(Σx² + l2_eps)``, q then times ``scale``) and the delta rule

    S ← diag(e^{g_t}) S;   u_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀ q_t

on the fp32 state ``[H, D, D]`` (``S[key channel, value channel]``), which they read and write in place.

- torch twin, prefill: chunked (chunks of ``chunk_size``): within a chunk with inclusive cumulative
  log-decays ``G``, ``(I + diag(β) A) U = diag(β)(V − (e^G ⊙ K) S₀)`` with the strictly lower
  ``A_ij = Σ_d k_i[d] k_j[d] e^{G_i[d]−G_j[d]}`` (a unit-triangular solve), then
  ``O = (e^G ⊙ Q) S₀ + B U`` with the lower ``B_ij = Σ_d q_i[d] k_j[d] e^{G_i[d]−G_j[d]}``, and
  ``S = diag(e^{G_L}) S₀ + Σ_j diag(e^{G_L−G_j}) k_j u_jᵀ``.
- torch twin, step: the recurrence token by token.
- Triton: one program per (head, block of value channels) walks the sequence with its slice of the
  state in registers (a recurrent scan; the same kernel serves the step with T = 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .delta import delta_step_native
from .registry import kernel
from .torch_common import at_dtype_of, exp_clamped

# ------------------------------------------------------------------------------------------------ declarations


def _check(q, k, v, f, b, A_log, dt_bias, state):
    H, D = q.shape[-2:]
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must agree")
    if f.shape[-1] != H * D or b.shape[-1] != H or A_log.shape != (H,) or dt_bias.shape != (H * D,):
        raise ValueError("forget logits [.., H·D], beta logits [.., H], A_log [H], dt_bias [H·D] expected")
    if tuple(state.shape) != (H, D, D):
        raise ValueError(f"state {list(state.shape)} is not [H, D, D] = [{H}, {D}, {D}]")


@kernel("kda_prefill", mutates=("state",))
def kda_prefill(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                state: Tensor, scale: float, l2_eps: float, chunk_size: int) -> Tensor:
    _check(q, k, v, f, b, A_log, dt_bias, state)


@kernel("kda_step", mutates=("state",))
def kda_step(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
             state: Tensor, scale: float, l2_eps: float) -> Tensor:
    """One token: q, k, v [H, D], f [H·D], b [H]."""
    _check(q, k, v, f, b, A_log, dt_bias, state)


@kda_prefill.fake
def _(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps, chunk_size):
    return torch.empty_like(v)


@kda_step.fake
def _(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps):
    return torch.empty_like(v)


# ------------------------------------------------------------------------------------------- torch twin


def _softplus(x: Tensor) -> Tensor:
    # log(1 + e^x), linear above 20 (the reference's spelling, not log1p)
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def _l2(x: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, f, b, A_log, dt_bias, scale, l2_eps):
    """fp32 q (normalised, scaled), k (normalised), v, g (log-decay) and β, each [..., H, D] / [..., H]."""
    H, D = q.shape[-2], q.shape[-1]
    g = f.float().reshape(*f.shape[:-1], H, D) + dt_bias.float().reshape(H, D)
    g = -torch.exp(A_log.float())[:, None] * _softplus(g)
    beta = torch.sigmoid(b.float())
    return _l2(q.float(), l2_eps) * scale, _l2(k.float(), l2_eps), v.float(), g, beta


def kda_step_twin(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps):
    q, k, v, g, beta = _prepare(q, k, v, f, b, A_log, dt_bias, scale, l2_eps)  # [H, D], β [H]
    S = state.float() * torch.exp(g)[..., None]
    u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[..., None] * u[:, None, :]
    state.copy_(S)
    return torch.einsum("hkv,hk->hv", S, q)


def kda_prefill_twin(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps, chunk_size):
    T, H, D = q.shape
    q, k, v, g, beta = _prepare(q, k, v, f, b, A_log, dt_bias, scale, l2_eps)
    # head-major: [H, T, D]
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
    beta = beta.T
    S = state.float()
    out = torch.empty_like(v)
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        G = g[:, sl].cumsum(1)  # [H, L, D], inclusive
        L = qc.shape[1]
        lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
        strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device), diagonal=-1)
        # [H, i, j, D]: e^{G_i − G_j} for j <= i (a product of decays <= 1), 0 above the diagonal
        decay = exp_clamped(G[:, :, None, :] - G[:, None, :, :]).masked_fill_(~lower[None, :, :, None], 0.0)
        A = torch.einsum("hid,hjd,hijd->hij", kc, kc, decay).masked_fill(~strict, 0.0)
        Bm = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        eG = exp_clamped(G)
        rhs = bc[..., None] * (vc - torch.einsum("hid,hdv->hiv", eG * kc, S))
        M = torch.eye(L, device=q.device) + bc[..., None] * A
        U = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        out[:, sl] = torch.einsum("hid,hdv->hiv", eG * qc, S) + Bm @ U
        to_end = exp_clamped(G[:, -1:, :] - G)  # [H, L, D]
        S = exp_clamped(G[:, -1, :])[..., None] * S + torch.einsum("hjd,hjv->hdv", to_end * kc, U)
    state.copy_(S)
    return out.transpose(0, 1)


kda_step.impl("torch")(at_dtype_of(0, kda_step_twin))  # the twins compute in fp32: at q's dtype
kda_prefill.impl("torch")(at_dtype_of(0, kda_prefill_twin))


# ----------------------------------------------------------------------------------------------- Triton


@triton.jit
def _kda_scan_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, o_ptr,
    T, H, D, scale, l2_eps,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per (head, block of value channels): the whole sequence, the state slice in registers."""
    h = tl.program_id(0)
    kd = tl.arange(0, BLOCK_K)
    vd = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = kd < D, vd < D
    A = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h * D + kd, mask=k_mask, other=0.0).to(tl.float32)
    s_offs = (h * D + kd[:, None]) * D + vd[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    S = tl.load(state_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    for t in range(0, T):
        row = (t * H + h).to(tl.int64) * D
        q = tl.load(q_ptr + row + kd, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row + kd, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row + vd, mask=v_mask, other=0.0).to(tl.float32)
        x = tl.load(f_ptr + row + kd, mask=k_mask, other=0.0).to(tl.float32) + dt_bias
        # softplus as the reference spells it: log(1 + e^x), linear above 20
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        decay = tl.exp(-A * sp)
        decay = tl.where(k_mask, decay, 1.0)
        beta = tl.sigmoid(tl.load(b_ptr + t * H + h).to(tl.float32))
        q = q / tl.sqrt(tl.sum(q * q, 0) + l2_eps) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + l2_eps)
        S = S * decay[:, None]
        u = beta * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + row + vd, o.to(o_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptr + s_offs, S, mask=s_mask)


def _scan(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps):
    assert state.is_contiguous() and state.dtype == torch.float32, "the KDA state must be contiguous fp32"
    q, k, v, f, b = (x.contiguous() for x in (q, k, v, f, b))
    T, H, D = q.shape
    out = torch.empty_like(v)
    block_k = triton.next_power_of_2(D)
    block_v = min(block_k, 32)
    _kda_scan_kernel[(H, triton.cdiv(D, block_v))](
        q, k, v, f, b, A_log.contiguous(), dt_bias.contiguous(), state, out, T, H, D, scale, l2_eps,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4,
    )
    return out


@kda_prefill.impl("triton")
def kda_prefill_triton(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps, chunk_size):
    return _scan(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps)


@kda_step.impl("triton")
def kda_step_triton(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps):
    return _scan(q[None], k[None], v[None], f[None], b[None], A_log, dt_bias, state, scale, l2_eps)[0]


# ------------------------------------------------------------------------------------------------ native


@kda_step.impl("native")
def kda_step_native(q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps):
    """One KDA token natively (fp32 state, per-key-channel decay): the delta-rule step of ``delta``."""
    return delta_step_native(True, q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps)
