"""Pure-torch twins of the vxc kernels: the CPU path and the oracle the Triton kernels are tested against.

Every function takes the same arguments as its ``torch.ops.vxc.<name>`` op, computes in fp32 and returns the
input's dtype. Functions that mutate a state argument write it in place, cast to the state's own dtype.
Shapes omit the batch (always 1): sequences are ``[T, ...]``.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _activate(x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "sigmoid":
        return torch.sigmoid(x)
    if activation == "none":
        return x
    raise ValueError(f"unknown activation {activation!r}")


def add_rmsnorm(
    x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, zero_centred: bool, residual_fp32: bool
) -> tuple[Tensor, Tensor]:
    """``r = x + residual``; returns ``(rmsnorm(r) * w, r)``.

    The norm reads ``r`` as stored (rounded to x.dtype unless residual_fp32). A zero-centred weight scales by
    ``1 + w`` in fp32 before the one cast; a plain weight scales after it: the normalised row is cast to
    x.dtype, then multiplied by ``w`` in x.dtype (each as the reference norms of its kind round).
    """
    r = x.float() if residual is None else x.float() + residual.float()
    new_residual = r.to(torch.float32 if residual_fp32 else x.dtype, copy=True)
    r = new_residual.float()
    normalised = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        normed = (normalised * (1.0 + weight.float())).to(x.dtype)
    else:
        normed = weight.to(x.dtype) * normalised.to(x.dtype)
    return normed, new_residual


def gated_rmsnorm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool, act: str
) -> Tensor:
    """RMSNorm over each contiguous group of ``group_size`` channels, gated by ``act(z)``.

    ``norm_before_gate``: ``rmsnorm(x) * w * act(z)``; otherwise ``rmsnorm(x * act(z)) * w``.
    """
    gate = _activate(z.float(), act)
    h = x.float() if norm_before_gate else x.float() * gate
    groups = h.unflatten(-1, (-1, group_size))
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if norm_before_gate:
        h = h * gate
    return h.to(x.dtype)


def conv1d_prefill(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor
) -> Tensor:
    """Causal depthwise conv over ``x [T, C]`` continuing the history in ``conv_state [C, K]``.

    The inputs before ``x[0]`` are the last K-1 columns of conv_state; afterwards conv_state holds the K most
    recent raw inputs, oldest first.
    """
    T, K = x.shape[0], weight.shape[1]
    history = conv_state.float()  # [C, K], oldest first
    xx = torch.cat([history, x.float().T], dim=1)  # [C, K+T]
    y = F.conv1d(xx[None, :, 1:], weight.float()[:, None, :], None if bias is None else bias.float(),
                 groups=weight.shape[0])[0].T.contiguous()  # [T, C]: output t reads inputs t-K+1 .. t
    conv_state.copy_(xx[:, -K:])
    return _activate(y, activation).to(x.dtype)


def conv1d_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    """One token ``x [C]``: shift it into the history ``conv_state [C, K]``, then convolve the history."""
    history = torch.cat([conv_state[:, 1:].float(), x.float()[:, None]], dim=1)
    conv_state.copy_(history)
    y = (history * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype)


def _discretised_dt(dt: Tensor, dt_bias: Tensor, dt_min: float, dt_max: float) -> Tensor:
    dt = F.softplus(dt.float() + dt_bias.float())
    if not (dt_min == 0.0 and dt_max == math.inf):
        dt = dt.clamp(dt_min, dt_max)
    return dt


def _per_head(groups: Tensor, heads: int) -> Tensor:
    """``[..., G, N] -> [..., H, N]``: head h reads group ``h // (H // G)``."""
    return groups.float().repeat_interleave(heads // groups.shape[-2], dim=-2)


CPU_SSD_CHUNK = 64

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
    ys = [ssd_step(x[t], dt[t], A_log, B[t], C[t], D, dt_bias, dt_min, dt_max, state) for t in range(x.shape[0])]
    return torch.stack(ys), state


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first ``R = 2 * cos.shape[-1]`` dims of each head of ``x [T, H, D]``; the rest pass through.

    Pairs are ``(i, i + R/2)`` (half-split) or ``(2i, 2i+1)`` (interleaved):
    ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``.
    """
    R = 2 * cos.shape[-1]
    x32 = x.float()
    rotated, rest = x32[..., :R], x32[..., R:]
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.stack([y1, y2], dim=-1).flatten(-2) if interleaved else torch.cat([y1, y2], dim=-1)
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)


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
    """Causal GQA softmax attention of ``q [T, Hq, Dk]`` at absolute positions ``start..start+T-1``.

    Writes k, v into the cache rows ``start..start+T-1`` first, then query t attends to rows ``0..start+t``
    (only rows with position > start+t-window when window > 0). ``sinks [Hq]`` adds one logit column per head
    to the softmax denominator.
    """
    T, Hq, _ = q.shape
    end = start + T
    k_cache[start:end] = k
    v_cache[start:end] = v
    if sinks is None and window == 0:
        return _sdpa(q, k_cache[:end], v_cache[:end], start, scale)
    group = Hq // k.shape[1]
    keys = k_cache[:end].float().repeat_interleave(group, dim=1)  # [S, Hq, Dk]
    values = v_cache[:end].float().repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->hts", q.float(), keys) * scale
    q_pos = torch.arange(start, end, device=q.device)[:, None]
    k_pos = torch.arange(end, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window > 0:
        visible &= k_pos > q_pos - window
    logits = logits.masked_fill(~visible, -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[:, None, None].expand(Hq, T, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :end]
    return torch.einsum("hts,shd->thd", probs, values).to(q.dtype).contiguous()


def _sdpa(q: Tensor, keys: Tensor, values: Tensor, start: int, scale: float) -> Tensor:
    """Causal GQA attention through torch's fused CPU kernel (no [H, T, S] score tensor is materialised
    for prefill): query t sees rows 0..start+t. Computed in fp32 for fp32 inputs, in the inputs' dtype
    (fp32 accumulation inside the kernel) otherwise."""
    T, S = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [H, T|S, D]
    if T == 1:
        mask, causal = None, False
    elif start == 0:
        mask, causal = None, True
    else:
        mask = torch.arange(S, device=q.device)[None, :] <= torch.arange(start, start + T, device=q.device)[:, None]
        causal = False
    group = qh.shape[0] // kh.shape[0]
    if group > 1 and T > 1:  # expanded heads take the fused flash kernel; enable_gqa falls back to the math path
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    # a batch dimension: torch's fused CPU (flash) kernel takes only 4-d inputs, 3-d ones go to the math path
    o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=kh.shape[0] != qh.shape[0])[0]
    return o.transpose(0, 1).contiguous()


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x [T, IN] @ weight[OUT, IN]ᵀ + bias``.

    Same-dtype operands go straight to the BLAS/oneDNN GEMM, which accumulates in fp32 (bf16 runs on the
    CPU's AMX/AVX-512 BF16 units and never materialises an fp32 copy of the weight); mixed dtypes compute in fp32.
    """
    if x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        return gemm(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Same-dtype ``x Wᵀ (+ b)``. A single bf16 row takes torch's GEMV (``mv``), which streams the weight
    ~1.4× faster on this CPU than the GEMM path ``F.linear`` picks for M=1."""
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and weight.is_contiguous():
        y = torch.mv(weight, x[0])
        return (y if bias is None else y + bias)[None]
    return F.linear(x, weight, bias)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """``down(silu(x W_gateᵀ) * (x W_upᵀ))``; GEMMs in the operands' dtype (fp32 accumulate), as ``linear``."""
    if x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype:
        return gemm(F.silu(gemm(x, w_gate)) * gemm(x, w_up), w_down)
    x32 = x.float()
    h = F.silu(x32 @ w_gate.float().T) * (x32 @ w_up.float().T)
    return (h @ w_down.float().T).to(x.dtype)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """Rows ``table[ids]``."""
    return F.embedding(ids, table)
