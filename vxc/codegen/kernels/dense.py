"""Dense kernels: ``vxc::linear`` (``x Wᵀ + b``), ``vxc::swiglu`` (``down(silu(x W_gateᵀ) * (x W_upᵀ))``) and
``vxc::embedding`` (rows of a table), with the same-dtype GEMM helper ``gemm`` the MoE twins share."""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import native as N
from .elementwise import _GATED_ACT, ACTS
from .native import BF, I, L, P
from .registry import NotCovered, kernel
from .triton_common import dot_precision


@kernel("linear")
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x [T, IN] @ weight[OUT, IN]ᵀ + bias``."""


@linear.fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@kernel("swiglu")
def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """``down(silu(x W_gateᵀ) * (x W_upᵀ))``."""


@swiglu.fake
def _(x, w_gate, w_up, w_down):
    return x.new_empty(x.shape[0], w_down.shape[0])


@kernel("embedding", device_arg=1)
def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """Rows ``table[ids]``."""


@embedding.fake
def _(ids, table):
    return table.new_empty(ids.shape[0], table.shape[1])


# ------------------------------------------------------------------------------------------------ torch twins


@linear.impl("torch")
def linear_twin(x, weight, bias):
    """``x [T, IN] @ weight[OUT, IN]ᵀ + bias``.

    Same-dtype operands go straight to the BLAS/oneDNN GEMM, which accumulates in fp32 (bf16 runs on the
    CPU's AMX/AVX-512 BF16 units and never materialises an fp32 copy of the weight); mixed dtypes compute in fp32.
    """
    if x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        return gemm(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _onednn_linear():
    """torch's oneDNN linear (``mkldnn::_linear_pointwise``, what torch.compile's CPU fusions call), or None where
    this torch build lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


# fp32 GEMMs of 2 or more rows on the CPU go to oneDNN instead of the BLAS (MKL) ``F.linear`` calls: on the prefill's
# shapes it was 1.5-1.8x faster (AMD EPYC Zen 4, 2 threads, 84 distinct 0.6B-model-shaped weight matrices from
# memory, best of 10: 17 rows 59 -> 106 GFLOP/s, 64 rows 112 -> 172, 128 rows 130 -> 196, 512 rows 194 -> 211), with
# no copy of the weight (a 262144 x 640 head at 128 rows: the same peak RSS as F.linear, 406 -> 248 ms). fp32 sums
# in another order than MKL's (max difference ~1e-4 on 1024-term dot products of unit normals); deterministic, and a
# row's values do not depend on the other rows (checked at 64 and 128 rows). None: F.linear throughout.
ONEDNN_FP32 = _onednn_linear()


def gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Same-dtype ``x Wᵀ (+ b)``. A single bf16 row takes torch's GEMV (``mv``), which streams the weight
    ~1.4× faster on this CPU than the GEMM path ``F.linear`` picks for M=1; fp32 rows (2 or more, CPU, 2-D,
    contiguous) take oneDNN (``ONEDNN_FP32``)."""
    if x.shape[0] == 1 and x.dtype == torch.bfloat16 and weight.is_contiguous():
        y = torch.mv(weight, x[0])
        return (y if bias is None else y + bias)[None]
    if (ONEDNN_FP32 is not None and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and weight.dim() == 2 and x.shape[0] > 1 and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and bias.is_contiguous()))):
        return ONEDNN_FP32(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@swiglu.impl("torch")
def swiglu_twin(x, w_gate, w_up, w_down):
    """``down(silu(x W_gateᵀ) * (x W_upᵀ))``; GEMMs in the operands' dtype (fp32 accumulate), as ``linear``."""
    if x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype:
        return gemm(F.silu(gemm(x, w_gate)) * gemm(x, w_up), w_down)
    x32 = x.float()
    h = F.silu(x32 @ w_gate.float().T) * (x32 @ w_up.float().T)
    return (h @ w_down.float().T).to(x.dtype)


@embedding.impl("torch")
def embedding_twin(ids, table):
    """Rows ``table[ids]``."""
    return F.embedding(ids, table)


# ------------------------------------------------------------------------------------------------ Triton


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


@linear.impl("triton")
def linear_triton(x, weight, bias):
    x, weight = x.contiguous(), weight.contiguous()
    (M, K), N = x.shape, weight.shape[0]
    out = x.new_empty(M, N)
    block_m, grid = _gemm_grid(M, N)
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias.contiguous(), out, M, N, K,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out


@swiglu.impl("triton")
def swiglu_triton(x, w_gate, w_up, w_down):
    x = x.contiguous()
    (M, D), I = x.shape, w_gate.shape[0]
    h = x.new_empty(M, I, dtype=torch.float32)  # the gated activations stay fp32 between the two GEMMs
    block_m, grid = _gemm_grid(M, I)
    _gate_up_kernel[grid](
        x, w_gate.contiguous(), w_up.contiguous(), h, M, I, D,
        BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K, DOT_PRECISION=dot_precision(x.dtype),
    )
    out = x.new_empty(M, D)
    w_down = w_down.contiguous()
    block_m, grid = _gemm_grid(M, D)
    _linear_kernel[grid](
        h, w_down, w_down, out, M, D, I,
        HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=_GEMM_BLOCK_N, BLOCK_K=_GEMM_BLOCK_K,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out


@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * D + d, tl.load(table_ptr + row * D + d, mask=mask), mask=mask)


@embedding.impl("triton")
def embedding_triton(ids, table):
    ids, table = ids.contiguous(), table.contiguous()
    D = table.shape[1]
    out = table.new_empty(ids.shape[0], D)
    block_d = min(triton.next_power_of_2(D), 1024)
    _embedding_kernel[(ids.shape[0], triton.cdiv(D, block_d))](ids, table, out, D, BLOCK_D=block_d)
    return out


# ------------------------------------------------------------------------------------------------ native

_GEMV = N.declare("vxc_gemv", P, P, P, P, L, L, I)
_SWIGLU_UP = N.declare("vxc_swiglu_up", P, P, P, P, L, L, I)
_EMBEDDING = N.declare("vxc_embedding", P, P, P, L, L, L)
_GEMV_ROWS = N.declare("vxc_gemv_rows", P, P, P, P, L, L, L, I)
_SWIGLU_UP_ROWS = N.declare("vxc_swiglu_up_rows", P, P, P, P, L, L, L, I)

# up to this many rows (a batched decode step of that many sequences; a short prefill chunk) the GEMV kernels
# take every row of x per pass over the weights: memory-bound like one row, where the BLAS GEMM at a handful of
# rows runs at less than half the read bandwidth (a 151936 x 1024 fp32 head: 41 ms at M=1, 95 at M=2, 109 at M=8)
GEMV_MAX_ROWS = 16


@linear.impl("native")
def linear_native(x, weight, bias):
    T = x.shape[0]
    if not 1 <= T <= GEMV_MAX_ROWS:
        raise NotCovered(N.SEQUENCE)
    if not (N.ok(x, weight, bias) and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)):
        raise NotCovered(N.OPERANDS)
    Nout, K = weight.shape
    y = N.empty(T, Nout, dtype=x.dtype)
    if T == 1:
        N.call(_GEMV, weight.data_ptr(), x.data_ptr(), N.ptr(bias), y.data_ptr(), Nout, K, BF[x.dtype])
    else:
        N.call(_GEMV_ROWS, weight.data_ptr(), x.data_ptr(), N.ptr(bias), y.data_ptr(), Nout, K, T, BF[x.dtype])
    return y


@swiglu.impl("native")
def swiglu_native(x, w_gate, w_up, w_down):
    T = x.shape[0]
    if not (N.ok(x, w_gate, w_up, w_down) and x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        raise NotCovered(N.OPERANDS)
    if T > GEMV_MAX_ROWS and x.dtype == torch.float32:
        # a prefill chunk: the GEMMs as the twin's, silu(g) · u in one native pass over them, in place (the twin's
        # F.silu and product: two passes and a temporary; 128 x 1536 values from cache 63 -> 54 us, Zen 4, 2
        # threads; a SmolLM2-135M fp32 prefill of 128 tokens had spent 4.7 ms in those 30 pairs). bf16 keeps the
        # twin, whose two roundings (the activation, then the product) the native pass does not make
        N.refuse_capture("swiglu's prefill form multiplies with torch's GEMM (not a native call)")
        g, u = gemm(x, w_gate), gemm(x, w_up)
        N.call(_GATED_ACT, g.data_ptr(), u.data_ptr(), g.data_ptr(), g.numel(), ACTS["silu"], 0)  # in place
        return gemm(g, w_down)
    if not 1 <= T <= GEMV_MAX_ROWS:
        raise NotCovered(N.SEQUENCE)
    Nh, K = w_gate.shape
    bf = BF[x.dtype]
    h = N.empty(T, Nh, dtype=x.dtype)
    y = N.empty(T, w_down.shape[0], dtype=x.dtype)
    if T == 1:
        N.call(_SWIGLU_UP, w_gate.data_ptr(), w_up.data_ptr(), x.data_ptr(), h.data_ptr(), Nh, K, bf)
        N.call(_GEMV, w_down.data_ptr(), h.data_ptr(), None, y.data_ptr(), w_down.shape[0], Nh, bf)
    else:
        N.call(_SWIGLU_UP_ROWS, w_gate.data_ptr(), w_up.data_ptr(), x.data_ptr(), h.data_ptr(), Nh, K, T, bf)
        N.call(_GEMV_ROWS, w_down.data_ptr(), h.data_ptr(), None, y.data_ptr(), w_down.shape[0], Nh, T, bf)
    return y


@embedding.impl("native")
def embedding_native(ids, table):
    if not (N.ok(table) and ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 1 and table.dim() == 2):
        raise NotCovered(N.OPERANDS)
    out = N.empty(ids.shape[0], table.shape[1], dtype=table.dtype)
    N.call(_EMBEDDING, ids.data_ptr(), table.data_ptr(), out.data_ptr(), ids.shape[0], table.shape[1],
           table.element_size())
    return out
