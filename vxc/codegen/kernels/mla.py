"""Multi-head latent attention kernels on latent rows: ``vxc::mla_prefill`` and ``vxc::mla_decode``.

Shapes (``R`` latent rank, ``P`` rope dims, ``N`` nope dims, ``V`` value dims, ``S`` cache positions):
``q [T, H, N+P]`` (pre-rotary), ``kv [T, R+P]`` (the raw ``kv_a`` projection: latent ``c`` then ``k_pe``),
``norm_w [R]`` with ``eps`` (the latent's RMSNorm), ``w_kvb [H·(N+V), R]`` (per head ``k_nope`` rows then
``v`` rows), ``cos, sin [T, P/2]`` or None (no rotary), ``cache [S, R+P]`` (latent rows, updated in place).

Both ops first normalise ``c``, rotate ``q_pe`` and ``k_pe`` (``interleaved``: pairs (2i, 2i+1), else
(i, i+P/2); ``split_out``: write each pair's first members, then its second members, else write them back
in place), write ``[c | k_pe]`` into cache rows ``start..start+T-1``, then attend causally with
``scale · (q_nope·k_nope + q_pe·k_pe)``:

- ``mla_prefill`` *expands* every cached row through ``w_kvb`` (``k_nope``, ``v`` per head) and runs
  ordinary causal softmax attention — the rows before ``start`` come from the cache;
- ``mla_decode`` *absorbs* ``w_kvb``: ``q_lat[h] = q_nope[h]·Wk[h]`` (``R`` wide) scores against ``c``
  directly, the probabilities sum the latent rows, and ``Wv[h]`` maps the result to ``V`` — attention
  over the latent rows with no expanded K/V anywhere. Its T may be any length (every query sees the
  rows up to its own position), so absorbed and expanded can be compared on the same inputs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .attention import attention_triton
from .dense import linear_triton
from .native import BF, I, L, P
from .native import F as Fc
from .registry import NotCovered, kernel
from .torch_common import at_dtype_of

# ------------------------------------------------------------------------------------------------ declarations


def _check(q, kv, norm_w, w_kvb, cos, cache, start, nope):
    T, H, NQ = q.shape
    R = norm_w.shape[0]
    P = NQ - nope
    if kv.shape != (T, R + P):
        raise ValueError(f"kv {list(kv.shape)} is not [T, R+P] = [{T}, {R + P}]")
    if cache.shape[-1] != R + P:
        raise ValueError(f"latent rows of {cache.shape[-1]} values, expected R+P = {R + P}")
    if w_kvb.shape[1] != R or w_kvb.shape[0] % H:
        raise ValueError(f"kv_b {list(w_kvb.shape)} is not [H·(N+V), R]")
    if cos is not None and 2 * cos.shape[-1] != P:
        raise ValueError(f"rotary tables of {2 * cos.shape[-1]} dims, rope part has {P}")
    if start + T > cache.shape[0]:
        raise ValueError(f"rows {start}..{start + T - 1} do not fit a cache of {cache.shape[0]} rows")


@kernel("mla_prefill", mutates=("cache",))
def mla_prefill(q: Tensor, kv: Tensor, norm_w: Tensor, eps: float, w_kvb: Tensor, cos: Optional[Tensor],
                sin: Optional[Tensor], cache: Tensor, start: int, scale: float, nope: int, interleaved: bool,
                split_out: bool) -> Tensor:
    _check(q, kv, norm_w, w_kvb, cos, cache, start, nope)


@kernel("mla_decode", mutates=("cache",))
def mla_decode(q: Tensor, kv: Tensor, norm_w: Tensor, eps: float, w_kvb: Tensor, cos: Optional[Tensor],
               sin: Optional[Tensor], cache: Tensor, start: int, scale: float, nope: int, interleaved: bool,
               split_out: bool) -> Tensor:
    _check(q, kv, norm_w, w_kvb, cos, cache, start, nope)


@mla_prefill.fake
@mla_decode.fake
def _(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    return q.new_empty(q.shape[0], q.shape[1], w_kvb.shape[0] // q.shape[1] - nope)


# ------------------------------------------------------------------------------------------- torch twin


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, split_out: bool) -> Tensor:
    """Rotate the last dim of ``x [T, ..., P]`` by ``cos, sin [T, P/2]`` (fp32)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().reshape(shape), sin.float().reshape(shape)
    x = x.float()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved and not split_out:
        return torch.stack([y1, y2], dim=-1).flatten(-2)
    return torch.cat([y1, y2], dim=-1)


def _latent_rows(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out):
    """(q with its rope part rotated, fp32) after writing this call's latent rows into the cache."""
    R = norm_w.shape[0]
    c = kv[:, :R].float()
    normalised = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    c = norm_w.to(kv.dtype) * normalised.to(kv.dtype)  # plain-weight RMSNorm, as the block's other norms
    k_pe, q = kv[:, R:].float(), q.float()
    if cos is not None:
        q = torch.cat([q[..., :nope], rope(q[..., nope:], cos, sin, interleaved, split_out)], dim=-1)
        k_pe = rope(k_pe, cos, sin, interleaved, split_out)
    cache[start:start + kv.shape[0]] = torch.cat([c.to(cache.dtype), k_pe.to(cache.dtype)], dim=-1)
    return q


def _causal(T: int, start: int, device) -> Tensor:
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    return torch.arange(start + T, device=device)[None, :] <= q_pos  # [T, S]


def mla_prefill_twin(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    T, H, _ = q.shape
    R = norm_w.shape[0]
    q = _latent_rows(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out)
    rows = cache[:start + T].float()
    kvb = (rows[:, :R] @ w_kvb.float().T).reshape(rows.shape[0], H, -1)  # [S, H, N+V]
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    logits = (torch.einsum("thn,shn->hts", q[..., :nope], k_nope)
              + torch.einsum("thp,sp->hts", q[..., nope:], rows[:, R:])) * scale
    logits = logits.masked_fill(~_causal(T, start, q.device), -math.inf)
    return torch.einsum("hts,shv->thv", logits.softmax(-1), v)


def mla_decode_twin(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    T, H, _ = q.shape
    R = norm_w.shape[0]
    q = _latent_rows(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out)
    rows = cache[:start + T].float()
    W = w_kvb.float().reshape(H, -1, R)
    Wk, Wv = W[:, :nope], W[:, nope:]  # [H, N, R], [H, V, R]
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], Wk)
    logits = (torch.einsum("thr,sr->hts", q_lat, rows[:, :R])
              + torch.einsum("thp,sp->hts", q[..., nope:], rows[:, R:])) * scale
    logits = logits.masked_fill(~_causal(T, start, q.device), -math.inf)
    o_lat = torch.einsum("hts,sr->thr", logits.softmax(-1), rows[:, :R])
    return torch.einsum("thr,hvr->thv", o_lat, Wv)


# ----------------------------------------------------------------------------------------------- Triton


@triton.jit
def _mla_rows_kernel(
    q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr, q_out_ptr,
    start, H, R, P, NQ, nope, eps,
    HAS_ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, SPLIT_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """One program per token: normalise c, rotate k_pe, write the latent row; rotate each head's q_pe."""
    t = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    c = tl.load(kv_ptr + t * (R + P) + r, mask=r_mask, other=0.0).to(tl.float32)
    c = c * tl.rsqrt(tl.sum(c * c, 0) / R + eps)
    dt = kv_ptr.dtype.element_ty
    w = tl.load(w_ptr + r, mask=r_mask, other=0.0).to(tl.float32)
    c = c.to(dt).to(tl.float32) * w.to(dt).to(tl.float32)
    row = (start + t) * (R + P)
    tl.store(cache_ptr + row + r, c.to(cache_ptr.dtype.element_ty), mask=r_mask)
    # output dim d of a rotated vector reads its pair (a, b) and the pair's frequency
    d = tl.arange(0, BLOCK_P)
    d_mask = d < P
    half = P // 2
    if SPLIT_OUT or not INTERLEAVED:
        freq = tl.where(d < half, d, d - half)
        first = d < half
    else:
        freq = d // 2
        first = d % 2 == 0
    if INTERLEAVED:
        a, b = 2 * freq, 2 * freq + 1
    else:
        a, b = freq, freq + half
    if HAS_ROPE:
        cs = tl.load(cos_ptr + t * half + freq, mask=d_mask, other=1.0).to(tl.float32)
        sn = tl.load(sin_ptr + t * half + freq, mask=d_mask, other=0.0).to(tl.float32)
    kp_base = kv_ptr + t * (R + P) + R
    xa = tl.load(kp_base + a, mask=d_mask, other=0.0).to(tl.float32)
    xb = tl.load(kp_base + b, mask=d_mask, other=0.0).to(tl.float32)
    if HAS_ROPE:
        y = tl.where(first, xa * cs - xb * sn, xb * cs + xa * sn)
    else:
        y = tl.load(kp_base + d, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(cache_ptr + row + R + d, y.to(cache_ptr.dtype.element_ty), mask=d_mask)
    j = tl.arange(0, BLOCK_Q)
    for h in range(0, H):
        base = (t * H + h) * NQ
        xq = tl.load(q_ptr + base + j, mask=j < nope, other=0.0).to(tl.float32)
        tl.store(q_out_ptr + base + j, xq, mask=j < nope)
        qa = tl.load(q_ptr + base + nope + a, mask=d_mask, other=0.0).to(tl.float32)
        qb = tl.load(q_ptr + base + nope + b, mask=d_mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            yq = tl.where(first, qa * cs - qb * sn, qb * cs + qa * sn)
        else:
            yq = tl.load(q_ptr + base + nope + d, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(q_out_ptr + base + nope + d, yq, mask=d_mask)


@triton.jit
def _mla_absorbed_kernel(
    q_ptr, w_ptr, cache_ptr, o_ptr,
    T, start, H, R, P, nope, V, scale,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (query, head): absorbed query, online softmax over the latent rows, absorbed output."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    NQ = nope + P
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_mask, p_mask = r < R, p < P
    q_base = (t * H + h).to(tl.int64) * NQ
    w_base = h.to(tl.int64) * (nope + V) * R
    # q_lat[r] = Σ_n q_nope[n] · Wk[h, n, r]
    q_lat = tl.zeros([BLOCK_R], dtype=tl.float32)
    for n0 in range(0, nope, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < nope
        qn = tl.load(q_ptr + q_base + n, mask=n_mask, other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + w_base + n[:, None] * R + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        q_lat += tl.sum(qn[:, None] * wk.to(tl.float32), 0)
    q_pe = tl.load(q_ptr + q_base + nope + p, mask=p_mask, other=0.0).to(tl.float32)
    q_pos = start + t
    row_max = tl.full([1], -1.0e30, tl.float32)
    row_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, q_pos + 1, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s <= q_pos
        rows = cache_ptr + s.to(tl.int64)[:, None] * (R + P)
        c = tl.load(rows + r[None, :], mask=s_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        kp = tl.load(rows + R + p[None, :], mask=s_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
        logits = (tl.sum(c * q_lat[None, :], 1) + tl.sum(kp * q_pe[None, :], 1)) * scale
        logits = tl.where(s_mask, logits, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(logits, 0))
        rescale = tl.exp(row_max - new_max)
        pr = tl.exp(logits - new_max)
        row_sum = row_sum * rescale + tl.sum(pr, 0)
        acc = acc * rescale + tl.sum(pr[:, None] * c, 0)
        row_max = new_max
    o_lat = acc / row_sum
    o_base = (t * H + h).to(tl.int64) * V
    for v0 in range(0, V, BLOCK_V):
        vv = v0 + tl.arange(0, BLOCK_V)
        v_mask = vv < V
        wv = tl.load(w_ptr + w_base + (nope + vv)[:, None] * R + r[None, :], mask=v_mask[:, None] & r_mask[None, :], other=0.0)
        o = tl.sum(wv.to(tl.float32) * o_lat[None, :], 1)
        tl.store(o_ptr + o_base + vv, o.to(o_ptr.dtype.element_ty), mask=v_mask)


def _rows_triton(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out):
    assert cache.is_contiguous(), "the latent rows are written in place and must be contiguous"
    q, kv = q.contiguous(), kv.contiguous()
    T, H, NQ = q.shape
    R = norm_w.shape[0]
    P = kv.shape[1] - R
    q_out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    has_rope = cos is not None
    _mla_rows_kernel[(T,)](
        q, kv, norm_w.contiguous(), cos.contiguous() if has_rope else kv, sin.contiguous() if has_rope else kv, cache, q_out,
        start, H, R, P, NQ, nope, eps,
        HAS_ROPE=has_rope, INTERLEAVED=interleaved, SPLIT_OUT=split_out,
        BLOCK_R=triton.next_power_of_2(R), BLOCK_P=triton.next_power_of_2(P), BLOCK_Q=triton.next_power_of_2(max(nope, 1)),
    )
    return q_out


def mla_prefill_triton(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    T, H, _ = q.shape
    R = norm_w.shape[0]
    q_rot = _rows_triton(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out)
    end = start + T
    rows = cache[:end].float()
    kvb = linear_triton(rows[:, :R].contiguous(), w_kvb.float().contiguous(), None).reshape(end, H, -1)  # [S, H, N+V]
    k = torch.cat([kvb[..., :nope], rows[:, None, R:].expand(end, H, rows.shape[1] - R)], dim=-1).contiguous()
    v = kvb[..., nope:].contiguous()
    # the flash kernel reads rows 0..end-1 of these (its write of rows start.. rewrites the same values)
    return attention_triton(q_rot, k[start:], v[start:], k, v, start, scale)


def mla_decode_triton(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    T, H, _ = q.shape
    R = norm_w.shape[0]
    P = kv.shape[1] - R
    V = w_kvb.shape[0] // H - nope
    q_rot = _rows_triton(q, kv, norm_w, eps, cos, sin, cache, start, nope, interleaved, split_out)
    out = torch.empty(T, H, V, dtype=torch.float32, device=q.device)
    _mla_absorbed_kernel[(T, H)](
        q_rot, w_kvb.contiguous(), cache, out, T, start, H, R, P, nope, V, scale,
        BLOCK_N=min(triton.next_power_of_2(max(nope, 1)), 32), BLOCK_R=triton.next_power_of_2(R),
        BLOCK_P=triton.next_power_of_2(P), BLOCK_S=16, BLOCK_V=min(triton.next_power_of_2(V), 32),
    )
    return out


for _k, _twin, _triton in ((mla_prefill, mla_prefill_twin, mla_prefill_triton),
                           (mla_decode, mla_decode_twin, mla_decode_triton)):
    _k.impl("torch")(at_dtype_of(0, _twin, contiguous=True))  # fp32 results: at q's dtype
    _k.impl("triton")(at_dtype_of(0, _triton, contiguous=True))


# ------------------------------------------------------------------------------------------------ native

_MLA_DECODE = N.declare("vxc_mla_decode", P, P, P, P, P, P, P, P, L, L, L, L, L, L, Fc, Fc, I, I, I, I, I, I, I)


def _native_dims(q, norm_w, w_kvb, cos, nope):
    """(H, R, P, V) of a native MLA step on ``q [rows, H, N + P]``, within the kernel's limits."""
    rows, H, NP = q.shape
    R = norm_w.shape[0]
    P_ = NP - nope
    V = w_kvb.shape[0] // H - nope
    M = N.MAX_HEAD_DIM
    if not (R <= M and NP <= 2 * M and V <= M and P_ <= M and (cos is None or cos.shape == (rows, P_ // 2))):
        raise NotCovered(N.LIMITS)
    return H, R, P_, V


@mla_decode.impl("native")
def mla_decode_native(q, kv, norm_w, eps, w_kvb, cos, sin, cache, start, scale, nope, interleaved, split_out):
    """One MLA token (absorbed attention over the latent rows)."""
    if q.shape[0] != 1 or kv.shape[0] != 1:
        raise NotCovered(N.SEQUENCE)
    if not (N.ok(q, kv, norm_w, w_kvb, cos, sin) and N.ok_cache(cache) and q.dtype == kv.dtype and (cos is None) == (sin is None)):
        raise NotCovered(N.OPERANDS)
    H, R, P_, V = _native_dims(q, norm_w, w_kvb, cos, nope)
    out = N.empty(1, H, V, dtype=q.dtype)
    N.call(_MLA_DECODE, q.data_ptr(), kv.data_ptr(), norm_w.data_ptr(), w_kvb.data_ptr(), N.ptr(cos), N.ptr(sin),
           cache.data_ptr(), out.data_ptr(), H, nope, P_, V, R, start, eps, scale, int(interleaved), int(split_out),
           BF[q.dtype], BF[norm_w.dtype], BF[w_kvb.dtype], BF[cos.dtype] if cos is not None else 0, N.KV[cache.dtype])
    return out


_MLA_DECODE_ROWS = N.declare("vxc_mla_decode_rows", P, P, P, P, P, P, P, L, P, L, L, L, L, L, P, Fc, Fc, I, I, I, I, I,
                             I, I, L, P)


def mla_decode_rows_native(q, kv, norm_w, eps, w_kvb, cos, sin, caches, starts, scale, nope, interleaved, split_out,
                           slots):
    """One MLA token for B rows (``q [B, H, N + P]``, ``kv [B, R + P]``, ``cos``/``sin [B, P/2]``), row b at
    position ``starts[b]`` on the latent rows of slot ``slots[b]`` of ``caches`` (the region's [S, rows, R + P]
    buffer), in one native call; each row exactly the single-row native step."""
    if not (N.ok(q, kv, norm_w, w_kvb, cos, sin) and N.ok_cache(caches) and q.dtype == kv.dtype and (cos is None) == (sin is None)
            and q.dim() == 3 and kv.dim() == 2 and caches.dim() == 3 and slots.dtype == starts.dtype == torch.int64
            and slots.is_contiguous() and starts.is_contiguous()):
        raise NotCovered(N.OPERANDS)
    Bn = q.shape[0]
    H, R, P_, V = _native_dims(q, norm_w, w_kvb, cos, nope)
    out = N.empty(Bn, H, V, dtype=q.dtype)
    N.call(_MLA_DECODE_ROWS, q.data_ptr(), kv.data_ptr(), norm_w.data_ptr(), w_kvb.data_ptr(), N.ptr(cos), N.ptr(sin),
           caches.data_ptr(), caches.stride(0) * caches.element_size(), out.data_ptr(), H, nope, P_, V, R,
           starts.data_ptr(), eps, scale, int(interleaved), int(split_out), BF[q.dtype], BF[norm_w.dtype],
           BF[w_kvb.dtype], BF[cos.dtype] if cos is not None else 0, N.KV[caches.dtype], Bn, slots.data_ptr())
    return out
