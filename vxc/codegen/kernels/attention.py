"""Attention kernels: ``vxc::rotary`` (rotary embedding of the first dims of each head) and ``vxc::attention``
(causal GQA softmax attention over a KV cache, with optional sliding window and sink logits).

The attention cache holds either every position (row p for position p) or, for a sliding window, a ring of
``rows >= window`` rows (position p in row p % rows once positions outgrow the rows). The native one-token
form handles the ring itself; the torch and Triton forms attend over a linear cache, and ``_ring`` lays a
ring out linearly for them.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .native import BF
from .native import F as Fc
from .native import I, L, P
from .registry import NotCovered, kernel
from .triton_common import LOG2E, dot_block, dot_precision

# ------------------------------------------------------------------------------------------------ rotary


@kernel("rotary")
def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rotary width {2 * cos.shape[-1]} exceeds the head dim {x.shape[-1]}")


@rotary.fake
def _(x, cos, sin, interleaved):
    return torch.empty_like(x)


@rotary.impl("torch")
def rotary_twin(x, cos, sin, interleaved):
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


@rotary.impl("triton")
def rotary_triton(x, cos, sin, interleaved):
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    T, H, D = x.shape
    out = torch.empty_like(x)
    block_h = 4
    _rotary_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, out, H, D, cos.shape[-1],
        INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D),
    )
    return out


_ROTARY = N.declare("vxc_rotary", P, P, P, P, L, L, L, L, I, I, I)


@rotary.impl("native")
def rotary_native(x, cos, sin, interleaved):
    if x.device.type == "cpu" and x.dtype in N.BF and x.dim() == 3:
        x = N.dense_rows(x)  # (heads sliced out of a fused projection's rows)
    if not (N.ok(x, cos, sin) and x.dim() == 3 and cos.dtype == sin.dtype and cos.shape == sin.shape and cos.dim() == 2):
        raise NotCovered(N.OPERANDS)
    if x.shape[-1] > N.MAX_HEAD_DIM:
        raise NotCovered(N.LIMITS)
    T, H, Dh = x.shape
    out = N.empty(T, H, Dh, dtype=x.dtype)
    N.call(_ROTARY, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, H, Dh, 2 * cos.shape[-1],
           int(interleaved), BF[x.dtype], BF[cos.dtype])
    return out


# ------------------------------------------------------------------------------------------------ attention


@kernel("attention", mutates=("k_cache", "v_cache"))
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
    if start + T > rows and not (0 < window <= rows):
        raise ValueError(f"rows {start}..{start + T - 1} do not fit a cache of {rows} rows")


@attention.fake
def _(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def _ring(linear):
    """The attention ``linear`` (over a cache holding every position) extended to a sliding-window ring.

    The rows still visible to a call (positions start-rows+1 .. start-1) are laid out in position order
    ahead of the new ones, ``linear`` attends over that window (the same masks, positions shifted), then the
    newest positions are written back into the ring.
    """

    def attend(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
        T, rows = q.shape[0], k_cache.shape[0]
        if start + T <= rows:
            return linear(q, k, v, k_cache, v_cache, start, scale, window, sinks)
        N.refuse_capture("attention over a sliding-window ring linearised by torch ops")
        first = max(0, start - rows + 1)
        old = torch.arange(first, start, device=q.device) % rows
        # (at the cache's element type: a narrower cache's new rows are rounded as the linear case rounds them)
        k_lin = torch.cat([k_cache[old], k_cache.new_empty(k.shape)])
        v_lin = torch.cat([v_cache[old], v_cache.new_empty(v.shape)])
        out = linear(q, k, v, k_lin, v_lin, start - first, scale, window, sinks)
        keep = min(T, rows)
        dst = torch.arange(start + T - keep, start + T, device=q.device) % rows
        k_cache[dst] = k[T - keep:].to(k_cache.dtype)
        v_cache[dst] = v[T - keep:].to(v_cache.dtype)
        return out

    attend.__name__ = attend.__qualname__ = f"{linear.__name__}_ring"
    return attend


def attention_twin(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
    """(a cache that holds every position) Causal GQA softmax attention of ``q [T, Hq, Dk]`` at absolute positions ``start..start+T-1``.

    Writes k, v into the cache rows ``start..start+T-1`` first, then query t attends to rows ``0..start+t``
    (only rows with position > start+t-window when window > 0). ``sinks [Hq]`` adds one logit column per head
    to the softmax denominator.
    """
    T, Hq, _ = q.shape
    end = start + T
    k_cache[start:end] = k
    v_cache[start:end] = v
    if sinks is None:  # (a cache narrower than q widened to q's dtype: exact)
        return _sdpa(q, k_cache[:end].to(q.dtype), v_cache[:end].to(q.dtype), start, scale, window)
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


def _sdpa(q: Tensor, keys: Tensor, values: Tensor, start: int, scale: float, window: int = 0) -> Tensor:
    """Causal GQA attention through torch's fused CPU kernel (no [H, T, S] score tensor is materialised
    for prefill): query t sees rows 0..start+t (only rows past start+t-window when window > 0). Computed in fp32
    for fp32 inputs, in the inputs' dtype (fp32 accumulation inside the kernel) otherwise. A window that hides
    nothing (start + T <= window: every query sees every earlier row) is the plain causal case, a window that
    hides rows a mask. Before, windowed layers ran fp32 einsums over a materialised score tensor: bf16, 4 query heads
    on 1 KV head of 256, window 512, 0.71 -> 0.54 ms for 128 tokens from an empty cache, 7.32 -> 5.33 for 256 after
    512 (the window hiding rows); 16 on 8 of 128: 1.40 -> 1.11, 15.5 -> 12.1 (Zen 4, 2 threads)."""
    T, S = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [H, T|S, D]
    if window > 0 and start + T > window:
        q_pos = torch.arange(start, start + T, device=q.device)[:, None]
        k_pos = torch.arange(S, device=q.device)[None, :]
        mask, causal = (k_pos <= q_pos) & (k_pos > q_pos - window), False
    elif T == 1:
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
        row_max = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
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


def attention_triton(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
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
        T, start, Hq, Dk, Dv, Hq // Hkv, window, scale * LOG2E.value,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_DK=dot_block(Dk), BLOCK_DV=dot_block(Dv), DOT_PRECISION=dot_precision(q.dtype),
    )
    return out


attention.impl("torch")(_ring(attention_twin))
attention.impl("triton")(_ring(attention_triton))


_ATTENTION_STEP = N.declare("vxc_attention_step", P, P, P, P, P, P, L, Fc, L, L, L, L, P, L, L, P, I, I, I)


@attention.impl("native")
def attention_native(q, k, v, k_cache, v_cache, start, scale, window=0, sinks=None):
    """One query token, the sliding-window ring included (position p at cache row p % rows once the
    positions outgrow the rows); or a prefill of T > 1 fp32 tokens (``_attention_prefill_native``; a ring that the
    chunk wraps linearised around it as for the twin)."""
    if q.shape[0] != 1:
        if q.dtype != torch.float32 and not (q.dtype == torch.bfloat16 and not N.amx_bf16()):
            # torch's fused kernel multiplies in half precision: with AMX tiles (an Intel Xeon) a 512-token bf16
            # prefill of the 0.6B softmax-decoder shape ran 786 -> 662 tok/s with the native form, which widens to
            # fp32. Without them (AVX-512 BF16 on an AMD Zen 4, 2 threads) the native form is the faster: 512
            # tokens from an empty cache 8.9 against 14.3 ms (16 query heads, 8 KV heads, head dim 128), 3.7 against
            # 7.1 (4, 1, 256), 256 more after 256 6.9 against 8.3 and 2.7 against 3.5 (torch's masked path)
            raise NotCovered(N.OPERANDS)
        return _ring(_attention_prefill_native)(q, k, v, k_cache, v_cache, start, scale, window, sinks)
    if not (N.ok(q, k, v, sinks) and N.ok_cache(k_cache, v_cache) and q.dtype == k.dtype == v.dtype
            and (sinks is None or (sinks.dim() == 1 and sinks.shape[0] == q.shape[1])) and window >= 0):
        raise NotCovered(N.OPERANDS)
    if max(q.shape[-1], v.shape[-1]) > N.MAX_HEAD_DIM:
        raise NotCovered(N.LIMITS)
    rows = k_cache.shape[0]
    _, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    out = N.empty(1, Hq, Dv, dtype=q.dtype)
    scratch = N.empty(rows * Hq, dtype=torch.float32)
    N.call(_ATTENTION_STEP, q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
           out.data_ptr(), start, scale, Hq, Hkv, Dk, Dv, scratch.data_ptr(), rows, window, N.ptr(sinks),
           BF[sinks.dtype] if sinks is not None else 0, BF[q.dtype], N.KV[k_cache.dtype])
    return out


_ATTENTION_PREFILL = N.declare("vxc_attention_prefill", P, P, P, P, L, L, Fc, L, L, L, L, L, P, I, I, I)


def _attention_prefill_native(q, k, v, k_cache, v_cache, start, scale, window, sinks):
    """T > 1 fp32 queries (``attention_native`` declines other dtypes) at positions start..start+T-1 over a cache
    that holds rows 0..start+T-1 (a sliding-window ring that a chunk wraps is linearised around it by ``_ring``, as
    for the twin): the new K / V rows written first, then one blocked native call (online softmax over blocks of
    keys, the GQA group's query heads sharing each K / V load; no score tensor, no K / V expanded per query head).
    The twin's result within fp32 summation order."""
    T = q.shape[0]
    # (q read densely; k / v only copied into the cache by torch: a conv-QKV layer's split views are fine)
    q = q.contiguous() if q.device.type == "cpu" else q
    if not (N.ok(q, sinks) and N.ok_cache(k_cache, v_cache) and q.dtype == k.dtype == v.dtype
            and k.device.type == v.device.type == "cpu" and q.dim() == 3 and q.shape[1] % k.shape[1] == 0
            and (sinks is None or (sinks.dim() == 1 and sinks.shape[0] == q.shape[1])) and window >= 0):
        raise NotCovered(N.OPERANDS)
    _, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    k_cache[start:start + T] = k  # (a narrower cache: torch's round to nearest even, as the step's f2h / f2bf)
    v_cache[start:start + T] = v
    out = N.empty(T, Hq, Dv, dtype=q.dtype)
    N.call(_ATTENTION_PREFILL, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), T, start, scale,
           Hq, Hkv, Dk, Dv, window, N.ptr(sinks), BF[sinks.dtype] if sinks is not None else 0, BF[q.dtype],
           N.KV[k_cache.dtype])
    return out


_ATTENTION_STEP_ROWS = N.declare("vxc_attention_step_rows", P, P, P, P, L, L, P, P, Fc, L, L, L, L, P, L, L, P, I, I, I, L, P)


def attention_rows_native(q, k, v, kv, starts, scale, window, sinks, slots):
    """The one-token ``attention`` for B rows (``q [B, Hq, Dk]``, ``k``/``v [B, Hkv, D]``), row b at position
    ``starts[b]`` on the K and V rows of slot ``slots[b]`` of ``kv`` (the region's [S, 2, rows, Hkv, D] buffer), in
    one native call; each row exactly the single-row native step."""
    if not (N.ok(q, k, v, sinks) and N.ok_cache(kv) and q.dtype == k.dtype == v.dtype and kv.dim() == 5 and kv.shape[1] == 2
            and k.shape[-1] == v.shape[-1] == kv.shape[-1] and slots.dtype == starts.dtype == torch.int64
            and slots.is_contiguous() and starts.is_contiguous()
            and (sinks is None or (sinks.dim() == 1 and sinks.shape[0] == q.shape[1])) and window >= 0):
        raise NotCovered(N.OPERANDS)
    if max(q.shape[-1], v.shape[-1]) > N.MAX_HEAD_DIM:
        raise NotCovered(N.LIMITS)
    Bn, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    rows = kv.shape[2]
    es = kv.element_size()
    out = N.empty(Bn, Hq, Dv, dtype=q.dtype)
    scratch = N.empty(Bn * rows * Hq, dtype=torch.float32)  # each row's scores apart: the rows run side by side
    N.call(_ATTENTION_STEP_ROWS, q.data_ptr(), k.data_ptr(), v.data_ptr(), kv.data_ptr(), kv.stride(0) * es,
           kv.stride(1) * es, out.data_ptr(), starts.data_ptr(), scale, Hq, Hkv, Dk, Dv, scratch.data_ptr(), rows, window,
           N.ptr(sinks), BF[sinks.dtype] if sinks is not None else 0, BF[q.dtype], N.KV[kv.dtype], Bn, slots.data_ptr())
    return out
