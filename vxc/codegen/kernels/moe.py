"""Mixture-of-experts kernels: ``vxc::moe_router``, ``vxc::moe_experts`` and ``vxc::moe_shared``.

Every argument that changes the math is a declared attribute of the ``moe`` operator, passed through:

- ``moe_router(x [T, d], weight [E, d], bias, selection_bias, router, top_k, norm_topk_prob, routed_scaling,
  n_group, topk_group) -> (weights fp32 [T, k], experts int64 [T, k])`` with ``logits = x·Wᵀ (+ bias)`` in
  fp32 and the variant ``router``:

  * ``softmax_topk``: ``p = softmax(logits)`` over all experts; the k largest; divided by their sum iff
    ``norm_topk_prob``;
  * ``sigmoid_grouped``: ``s = σ(logits)``; experts are *chosen* on ``c = s + selection_bias`` (the bias
    only when given): the groups (``n_group`` contiguous groups of ``E / n_group``) are ranked by the sum of
    their two largest ``c``, the best ``topk_group`` groups kept, and the k largest ``c`` among their
    experts chosen; the weights are the unbiased ``s`` of the chosen, divided by ``sum + 1e-20`` iff
    ``norm_topk_prob``;
  * ``topk_softmax``: the k largest logits, softmax over those k;

  then every weight is multiplied by ``routed_scaling``. Slots come out in descending order of the
  selection score.
- ``moe_experts(x, weights, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit, expert_offset)
  -> [T, d]``: ``Σ_j weights[t, j] · expert_{experts[t, j]}(x[t])`` over the slots whose expert the banks hold:
  the banks hold the E experts ``expert_offset .. expert_offset + E - 1`` (global ids; 0 and all of them on one
  rank), bank row ``id - expert_offset``; a slot selecting another expert (held by another tensor-parallel rank)
  adds nothing. ``layout="separate"``: ``w_in`` is the gate bank
  ``[E, I, d]``, ``w_up`` the up bank ``[E, I, d]``; ``layout="fused_interleaved"``: ``w_in`` is one
  ``[E, 2I, d]`` bank whose even rows are the gate and odd rows the up projection (``w_up`` is None), with
  the optional bias ``b_in [E, 2I]`` in the same row order. ``w_down [E, d, I]`` and ``b_down [E, d]``.
  ``act="silu"``: ``silu(g)·u``; ``act="clamped_glu"``: ``g = min(g, limit)``, ``u = clamp(u, −limit,
  limit)``, ``(u + 1)·g·σ(alpha·g)``.
- ``moe_shared(x, routed, w_gate, w_up, w_down, branch_gate) -> routed + [σ(x·branch_gateᵀ)] ·
  down(silu(x·gateᵀ)·(x·upᵀ))`` (the factor only when ``branch_gate [1, d]`` is given).

Torch twins compute in fp32 and return the input's dtype; the expert twin loops over the experts that
were hit, as the references do. Triton: one program per token for the router (the expert scores in
registers, iterative arg-max for the top-k); for the experts one program per (token, slot, block of the
intermediate width) for gate/up + activation, then one per (token, block of d) for down + the weighted sum
over the k slots.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .dense import gemm, linear_triton, swiglu_triton
from .native import BF, I, L, P
from .native import F as Fc
from .registry import NotCovered, kernel
from .triton_common import pow2

ROUTERS = ("softmax_topk", "sigmoid_grouped", "topk_softmax")
LAYOUTS = ("separate", "fused_interleaved")
ACTS = ("silu", "clamped_glu")
_ROUTER_ID = {name: i for i, name in enumerate(ROUTERS)}
NORM_EPS_GROUPED = 1e-20  # sigmoid_grouped: the renormalisation denominator is sum + 1e-20


# ------------------------------------------------------------------------------------------------ declarations


@kernel("moe_router")
def moe_router(x: Tensor, weight: Tensor, bias: Optional[Tensor], selection_bias: Optional[Tensor], router: str,
               top_k: int, norm_topk_prob: bool, routed_scaling: float, n_group: int,
               topk_group: int) -> tuple[Tensor, Tensor]:
    if router not in ROUTERS:
        raise ValueError(f"router {router!r} is not one of {ROUTERS}")
    E = weight.shape[0]
    if not (1 <= top_k <= E) or n_group < 1 or E % n_group or not (1 <= topk_group <= n_group):
        raise ValueError(f"router geometry: {E} experts, top_k {top_k}, n_group {n_group}, topk_group {topk_group}")
    if router == "sigmoid_grouped" and top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k {top_k} exceeds the {topk_group}·{E // n_group} experts of the kept groups")


@moe_router.fake
def _(x, weight, bias, selection_bias, router, top_k, norm_topk_prob, routed_scaling, n_group, topk_group):
    T = x.shape[0]
    return x.new_empty(T, top_k, dtype=torch.float32), x.new_empty(T, top_k, dtype=torch.int64)


@kernel("moe_experts")
def moe_experts(x: Tensor, weights: Tensor, experts: Tensor, w_in: Tensor, w_up: Optional[Tensor], w_down: Tensor,
                b_in: Optional[Tensor], b_down: Optional[Tensor], layout: str, act: str, alpha: Optional[float],
                limit: Optional[float], expert_offset: int = 0) -> Tensor:
    if layout not in LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is not one of {LAYOUTS}")
    if act not in ACTS:
        raise ValueError(f"expert activation {act!r} is not one of {ACTS}")
    if act == "clamped_glu" and (alpha is None or limit is None):
        raise ValueError("clamped_glu needs alpha and limit")
    if (layout == "separate") != (w_up is not None):
        raise ValueError("layout separate takes gate and up banks; fused_interleaved one gate_up bank and no up bank")
    if layout == "separate" and b_in is not None:
        raise ValueError("a gate/up bias needs the fused_interleaved layout")
    if expert_offset < 0:
        raise ValueError(f"expert_offset {expert_offset} is negative")
    E, I_ = w_down.shape[0], w_down.shape[2]
    rows = 2 * I_ if layout == "fused_interleaved" else I_
    if tuple(w_in.shape) != (E, rows, x.shape[1]) or w_down.shape[1] != x.shape[1]:
        raise ValueError(f"expert banks {list(w_in.shape)} / {list(w_down.shape)} do not fit x {list(x.shape)} ({layout})")


@moe_experts.fake
def _(x, weights, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit, expert_offset=0):
    return x.new_empty(x.shape[0], w_down.shape[1])


@kernel("moe_shared")
def moe_shared(x: Tensor, routed: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               branch_gate: Optional[Tensor]) -> Tensor:
    """``routed + [σ(x·branch_gateᵀ)] · down(silu(x·gateᵀ)·(x·upᵀ))``."""


@moe_shared.fake
def _(x, routed, w_gate, w_up, w_down, branch_gate):
    return torch.empty_like(routed)


# ------------------------------------------------------------------------------------------- torch twins


@moe_router.impl("torch")
def router_twin(x, weight, bias, selection_bias, router, top_k, norm_topk_prob, routed_scaling, n_group, topk_group):
    logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # [T, E]
    if router == "softmax_topk":
        probs = logits.softmax(dim=-1)
        vals, idx = probs.topk(top_k, dim=-1)
        if norm_topk_prob:
            vals = vals / vals.sum(-1, keepdim=True)
    elif router == "sigmoid_grouped":
        scores = logits.sigmoid()
        choice = scores if selection_bias is None else scores + selection_bias.float()
        T, E = choice.shape
        if n_group > 1:
            per = choice.view(T, n_group, E // n_group)
            group_scores = per.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), -math.inf)
        idx = choice.topk(top_k, dim=-1).indices
        vals = scores.gather(1, idx)
        if norm_topk_prob:
            vals = vals / (vals.sum(-1, keepdim=True) + NORM_EPS_GROUPED)
    elif router == "topk_softmax":
        vals, idx = logits.topk(top_k, dim=-1)
        vals = vals.softmax(dim=-1)
    else:
        raise ValueError(f"unknown router {router!r}")
    return (vals * routed_scaling).contiguous(), idx.contiguous()


def _gated(g: Tensor, u: Tensor, act: str, alpha: Optional[float], limit: Optional[float]) -> Tensor:
    if act == "silu":
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1.0) * (g * torch.sigmoid(g * alpha))


def _matmul(h: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """``h [M, IN] @ w[OUT, IN]ᵀ`` as fp32 (h at the activations' dtype or fp32). When the activations' dtype ``dtype`` is the weight's and
    narrower than fp32 (a bf16 run), the GEMM runs at that dtype (fp32 accumulation inside the BLAS) on ``h``
    rounded to it, and its result, rounded to it as a reference running at that dtype materialises it, comes
    back widened: no fp32 copy of an expert's weight is made per call (a bf16 decode step used to write and
    read one for every selected expert). Otherwise (fp32 runs) exactly ``h @ w.float()ᵀ``."""
    if w.dtype == dtype != torch.float32:
        return gemm(h.to(dtype), w).float()  # (one row: torch's GEMV, which streams faster)
    return h.float() @ w.float().T


@moe_experts.impl("torch")
def experts_twin(x, weights, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit, expert_offset=0):
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for g in torch.unique(experts).tolist():  # ascending, as the references visit them
        e = g - expert_offset  # the bank row
        if not 0 <= e < w_down.shape[0]:
            continue  # another rank's expert
        tok, slot = torch.where(experts == g)
        h = x[tok]  # (at x's dtype: _matmul widens or keeps it as the GEMM needs, no round trip)
        if layout == "separate":
            g, u = _matmul(h, w_in[e], x.dtype), _matmul(h, w_up[e], x.dtype)
        else:
            gu = _matmul(h, w_in[e], x.dtype)
            if b_in is not None:
                gu = gu + b_in[e].float()
            g, u = gu[:, 0::2], gu[:, 1::2]
        y = _matmul(_gated(g, u, act, alpha, limit), w_down[e], x.dtype)
        if b_down is not None:
            y = y + b_down[e].float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


@moe_shared.impl("torch")
def shared_twin(x, routed, w_gate, w_up, w_down, branch_gate):
    y = _matmul(F.silu(_matmul(x, w_gate, x.dtype)) * _matmul(x, w_up, x.dtype), w_down, x.dtype)
    if branch_gate is not None:
        y = torch.sigmoid(_matmul(x, branch_gate, x.dtype)) * y
    return (routed.float() + y).to(routed.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, b_ptr, sb_ptr, out_w_ptr, out_i_ptr,
    D, EG, NG, TOPK_GROUP, K, scaling,
    ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEL: tl.constexpr, NORM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token: the expert scores as a [groups, experts per group] tile, then the selection."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    c = tl.arange(0, BLOCK_EG)[None, :]
    valid = (g < NG) & (c < EG)
    e = g * EG + c  # flat expert index [BLOCK_G, BLOCK_EG]
    acc = tl.zeros([BLOCK_G, BLOCK_EG], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        xv = tl.load(x_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, :, None] * D + d[None, None, :], mask=valid[:, :, None] & dm[None, None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e, mask=valid, other=0.0).to(tl.float32)
    big = NG * EG
    if ROUTER == 0:  # softmax over all experts
        m = tl.max(tl.max(tl.where(valid, acc, -float("inf")), 1), 0)
        p = tl.where(valid, tl.exp(acc - m), 0.0)
        value = p / tl.sum(tl.sum(p, 1), 0)
        sel = tl.where(valid, value, -float("inf"))
    elif ROUTER == 1:  # sigmoid scores, grouped choice on the (selection-)biased scores
        value = tl.sigmoid(acc)
        sel = value
        if HAS_SEL:
            sel = sel + tl.load(sb_ptr + e, mask=valid, other=0.0).to(tl.float32)
        sel = tl.where(valid, sel, -float("inf"))
        if NG > 1:
            m1 = tl.max(sel, 1)
            i1 = tl.min(tl.where(sel == m1[:, None], c, BLOCK_EG), 1)
            m2 = tl.max(tl.where(c == i1[:, None], -float("inf"), sel), 1)
            gs = tl.where(EG > 1, m1 + m2, m1)
            gidx = tl.arange(0, BLOCK_G)
            gs = tl.where(gidx < NG, gs, -float("inf"))
            keep = gidx < 0
            for _ in range(TOPK_GROUP):
                gm = tl.max(gs, 0)
                gi = tl.min(tl.where(gs == gm, gidx, BLOCK_G), 0)
                keep = keep | (gidx == gi)
                gs = tl.where(gidx == gi, -float("inf"), gs)
            sel = tl.where(keep[:, None], sel, -float("inf"))
    else:  # top-k on the logits, softmax over the chosen
        value = acc
        sel = tl.where(valid, acc, -float("inf"))
    ks = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in range(K):
        m = tl.max(tl.max(sel, 1), 0)
        i = tl.min(tl.min(tl.where((sel == m) & valid, e, big), 1), 0)
        hit = (e == i) & valid  # padded columns alias the next group's flat indices
        v = tl.sum(tl.sum(tl.where(hit, value, 0.0), 1), 0)
        vals = tl.where(ks == j, v, vals)
        idxs = tl.where(ks == j, i.to(tl.int64), idxs)
        sel = tl.where(hit, -float("inf"), sel)
    kmask = ks < K
    if ROUTER == 2:
        vals = tl.where(kmask, tl.exp(vals - tl.max(tl.where(kmask, vals, -float("inf")), 0)), 0.0)
        vals = vals / tl.sum(vals, 0)
    elif NORM:
        s = tl.sum(tl.where(kmask, vals, 0.0), 0)
        if ROUTER == 1:
            s = s + 1e-20
        vals = vals / s
    vals = vals * scaling
    tl.store(out_w_ptr + t * K + ks, vals, mask=kmask)
    tl.store(out_i_ptr + t * K + ks, idxs, mask=kmask)


@triton.jit
def _expert_in_kernel(
    x_ptr, idx_ptr, win_ptr, wup_ptr, bin_ptr, h_ptr, K, D, I, E, OFF, alpha, limit,
    FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """h[p, i] = act(gate_i, up_i) for the pair p = (token, slot) and a block of the intermediate width (0 for a
    slot whose expert the banks do not hold: bank row id - OFF outside 0..E-1)."""
    p = tl.program_id(0).to(tl.int64)
    t = p // K
    ex = tl.load(idx_ptr + p).to(tl.int64) - OFF
    held = (ex >= 0) & (ex < E)
    ex = tl.where(held, ex, 0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    im = tl.where(held, i < I, False)
    if FUSED:
        g_rows = ex * 2 * I + 2 * i
        u_rows = g_rows + 1
    else:
        g_rows = ex * I + i
        u_rows = g_rows
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        xv = tl.load(x_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        m2 = im[:, None] & dm[None, :]
        wg = tl.load(win_ptr + g_rows[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        if FUSED:
            wu = tl.load(win_ptr + u_rows[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        else:
            wu = tl.load(wup_ptr + u_rows[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        gate += tl.sum(wg * xv[None, :], axis=1)
        up += tl.sum(wu * xv[None, :], axis=1)
    if HAS_BIAS:
        gate += tl.load(bin_ptr + g_rows, mask=im, other=0.0).to(tl.float32)
        up += tl.load(bin_ptr + u_rows, mask=im, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + p * I + i, tl.where(held, h, 0.0), mask=i < I)


@triton.jit
def _expert_out_kernel(
    h_ptr, idx_ptr, wts_ptr, wd_ptr, bd_ptr, out_ptr, K, D, I, E, OFF,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """out[t, n] = Σ_j weight[t, j] · (down_{e_j} h[t, j] + b_down_{e_j})[n] for a block of n, over the slots
    whose expert the banks hold (bank row e_j - OFF in 0..E-1)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(K):
        p = t * K + j
        ex = tl.load(idx_ptr + p).to(tl.int64) - OFF
        held = (ex >= 0) & (ex < E)
        ex = tl.where(held, ex, 0)
        wt = tl.load(wts_ptr + p).to(tl.float32)
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        hm = tl.where(held, nm, False)
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            imask = i < I
            hv = tl.load(h_ptr + p * I + i, mask=imask, other=0.0)
            w = tl.load(wd_ptr + (ex * D + n[:, None]) * I + i[None, :], mask=hm[:, None] & imask[None, :],
                        other=0.0).to(tl.float32)
            y += tl.sum(w * hv[None, :], axis=1)
        if HAS_BIAS:
            y += tl.load(bd_ptr + ex * D + n, mask=hm, other=0.0).to(tl.float32)
        acc += tl.where(held, wt, 0.0) * y
    tl.store(out_ptr + t * D + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


@moe_router.impl("triton")
def router_triton(x, weight, bias, selection_bias, router, top_k, norm_topk_prob, routed_scaling, n_group, topk_group):
    x, weight = x.contiguous(), weight.contiguous()
    T, D = x.shape
    E = weight.shape[0]
    eg = E // n_group
    out_w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    out_i = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    block_d = max(16, min(64, 8192 // (pow2(n_group) * pow2(eg))))
    _router_kernel[(T,)](
        x, weight, weight if bias is None else bias.contiguous(),
        weight if selection_bias is None else selection_bias.contiguous(), out_w, out_i,
        D, eg, n_group, topk_group, top_k, float(routed_scaling),
        ROUTER=_ROUTER_ID[router], HAS_BIAS=bias is not None, HAS_SEL=selection_bias is not None, NORM=bool(norm_topk_prob),
        BLOCK_G=pow2(n_group), BLOCK_EG=pow2(eg), BLOCK_D=pow2(block_d, 16), BLOCK_K=pow2(top_k),
    )
    return out_w, out_i


_BLOCK_I, _BLOCK_D, _BLOCK_N = 32, 64, 32


@moe_experts.impl("triton")
def experts_triton(x, weights, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit, expert_offset=0):
    x = x.contiguous()
    T, D = x.shape
    K = experts.shape[1]
    I = w_down.shape[2]
    fused = layout == "fused_interleaved"
    experts, weights = experts.contiguous(), weights.contiguous().float()
    w_in, w_down = w_in.contiguous(), w_down.contiguous()
    h = torch.empty(T * K, I, dtype=torch.float32, device=x.device)
    clamped = act == "clamped_glu"
    _expert_in_kernel[(T * K, triton.cdiv(I, _BLOCK_I))](
        x, experts, w_in, w_in if w_up is None else w_up.contiguous(), w_in if b_in is None else b_in.contiguous(), h,
        K, D, I, w_down.shape[0], expert_offset, float(alpha) if clamped else 0.0, float(limit) if clamped else 0.0,
        FUSED=fused, HAS_BIAS=b_in is not None, CLAMPED=clamped, BLOCK_I=_BLOCK_I, BLOCK_D=_BLOCK_D,
    )
    out = x.new_empty(T, D)
    _expert_out_kernel[(T, triton.cdiv(D, _BLOCK_N))](
        h, experts, weights, w_down, w_down if b_down is None else b_down.contiguous(), out, K, D, I, w_down.shape[0],
        expert_offset, HAS_BIAS=b_down is not None, BLOCK_N=_BLOCK_N, BLOCK_I=_BLOCK_I,
    )
    return out


@moe_shared.impl("triton")
def shared_triton(x, routed, w_gate, w_up, w_down, branch_gate):
    y = swiglu_triton(x.float().contiguous(), w_gate, w_up, w_down)
    if branch_gate is not None:
        y = torch.sigmoid(linear_triton(x.float().contiguous(), branch_gate, None)) * y
    return (routed.float() + y).to(routed.dtype)


# ------------------------------------------------------------------------------------------------ native (one token)

_MOE_ACT = {"silu": 1, "clamped_glu": 3}
MAX_TOP_K = 64  # the MoE step sorts its selected experts on the stack
# the native router / experts / shared steps take up to this many rows (a batched decode step's tokens, a short
# prefill chunk), each row exactly the one-token step (one call per row); longer sequences run the twin's grouped GEMMs
MAX_STEP_ROWS = 16
MAX_ROUTER_EXPERTS = 4096  # the router step keeps its logits on the stack
MAX_ROUTER_GROUPS = 256
_MOE_FFN_STEP = N.declare("vxc_moe_ffn_step", P, P, P, L, P, P, P, P, P, P, P, P, L, L, L, L, L, I, I, Fc, Fc, I, L, L)
# the same for T rows (a batched decode step): each row bit for bit the one-row call's, each selected expert read once
# for all the rows that chose it (the shared expert once for all T)
_MOE_FFN_ROWS = N.declare("vxc_moe_ffn_rows", P, P, P, L, P, P, P, P, P, P, P, P, L, L, L, L, L, I, I, Fc, Fc, I, L, L, L)
_MOE_ROUTER_STEP = N.declare("vxc_moe_router_step", P, P, P, P, P, P, L, L, I, L, I, Fc, L, L, I, I, I)


def _bank(t: Optional[Tensor], dtype: torch.dtype) -> bool:
    """A CPU bank [E, rows, cols] at ``dtype`` whose experts are each one contiguous matrix (the bank itself may
    be a slice of a wider one: its expert stride is passed)."""
    return t is None or (t.device.type == "cpu" and t.dtype == dtype and t.dim() == 3 and t.stride(2) == 1
                         and t.stride(1) == t.shape[2])


@moe_experts.impl("native")
def experts_native(x, weights, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit, expert_offset=0):
    """The routed experts of each token (up to ``MAX_STEP_ROWS``; one call for all of them from two tokens, reading
    each selected expert once for every token that chose it; only the experts the banks hold: the kernel skips the
    others, whatever their id)."""
    T = x.shape[0]
    if not 1 <= T <= MAX_STEP_ROWS:
        raise NotCovered(N.SEQUENCE)
    if not (N.ok(x, b_in, b_down) and x.dim() == 2 and all(_bank(t, x.dtype) for t in (w_in, w_up, w_down))
            and all(b is None or b.dtype == x.dtype for b in (b_in, b_down))
            and weights.dtype == torch.float32 and weights.is_contiguous() and experts.dtype == torch.int64
            and experts.is_contiguous() and weights.shape == experts.shape and experts.shape[0] == T):
        raise NotCovered(N.OPERANDS)
    k = experts.shape[1]
    if k > MAX_TOP_K:
        raise NotCovered(N.LIMITS)
    d, I_ = x.shape[1], w_down.shape[2]
    out = N.empty(T, d, dtype=x.dtype)
    args = (k, w_in.data_ptr(), N.ptr(w_up), w_down.data_ptr(), N.ptr(b_in), N.ptr(b_down), None, None,
            out.data_ptr(), d, I_, w_in.stride(0), 0 if w_up is None else w_up.stride(0), w_down.stride(0),
            int(layout == "fused_interleaved"), _MOE_ACT[act], 0.0 if alpha is None else alpha,
            0.0 if limit is None else limit, BF[x.dtype], expert_offset, w_down.shape[0])
    if T == 1:
        N.call(_MOE_FFN_STEP, x.data_ptr(), experts.data_ptr(), weights.data_ptr(), *args)
    else:
        N.call(_MOE_FFN_ROWS, x.data_ptr(), experts.data_ptr(), weights.data_ptr(), *args, T)
    return out


@moe_shared.impl("native")
def shared_native(x, routed, w_gate, w_up, w_down, branch_gate):
    """The shared expert of each token (up to ``MAX_STEP_ROWS``; from two tokens one call, its weights read once for
    all of them) added to the routed sum."""
    T = x.shape[0]
    if not 1 <= T <= MAX_STEP_ROWS:
        raise NotCovered(N.SEQUENCE)
    if not (N.ok(x, routed, w_gate, w_up, w_down, branch_gate) and x.dim() == 2 and routed.shape == x.shape
            and x.dtype == routed.dtype == w_gate.dtype == w_up.dtype == w_down.dtype
            and (branch_gate is None or (branch_gate.dtype == x.dtype and branch_gate.shape[0] == 1))):
        raise NotCovered(N.OPERANDS)
    d, I_ = x.shape[1], w_down.shape[1]
    out = N.empty(T, d, dtype=x.dtype)
    args = (None, None, 1, w_gate.data_ptr(), w_up.data_ptr(), w_down.data_ptr(), None, None, N.ptr(branch_gate),
            routed.data_ptr(), out.data_ptr(), d, I_, 0, 0, 0, 0, 1, 0.0, 0.0, BF[x.dtype], 0, 0)
    if T == 1:
        N.call(_MOE_FFN_STEP, x.data_ptr(), *args)
    else:
        N.call(_MOE_FFN_ROWS, x.data_ptr(), *args, T)
    return out


@moe_router.impl("native")
def router_native(x, weight, bias, selection_bias, router, top_k, norm_topk_prob, routed_scaling, n_group, topk_group):
    """The router of each token (up to ``MAX_STEP_ROWS``: one call per token)."""
    E, d = weight.shape
    aux = [t for t in (bias, selection_bias) if t is not None]
    T = x.shape[0]
    if not 1 <= T <= MAX_STEP_ROWS:
        raise NotCovered(N.SEQUENCE)
    if not (N.ok(x, weight, *aux) and x.dim() == 2 and x.dtype == weight.dtype
            and all(t.dim() == 1 and t.shape[0] == E for t in aux)):
        raise NotCovered(N.OPERANDS)
    if not (E <= MAX_ROUTER_EXPERTS and top_k <= MAX_TOP_K and n_group <= MAX_ROUTER_GROUPS):
        raise NotCovered(N.LIMITS)
    vals, idx = N.empty(T, top_k, dtype=torch.float32), N.empty(T, top_k, dtype=torch.int64)
    es = x.element_size()
    for t in range(T):
        N.call(_MOE_ROUTER_STEP, x.data_ptr() + t * d * es, weight.data_ptr(), N.ptr(bias), N.ptr(selection_bias),
               vals.data_ptr() + t * top_k * 4, idx.data_ptr() + t * top_k * 8, E, d, _ROUTER_ID[router] + 1, top_k,
               int(norm_topk_prob), routed_scaling, n_group, topk_group, BF[x.dtype],
               BF[bias.dtype] if bias is not None else 0, BF[selection_bias.dtype] if selection_bias is not None else 0)
    return vals, idx
