"""The dense kernels over ggml block-quantised weights kept resident as stored (no decoded copy): ``qlinear``,
``qswiglu``, ``qembedding`` — what the lowering emits in place of ``linear`` / ``swiglu`` / ``embedding`` when
an operand declares a ggml encoding and the engine keeps encoded weights resident (fp32 or bf16 sessions).

Each is composed of ``vxc::qgemv`` (:mod:`.quant`: native on CPU for every ggml encoding of the table, decoded in
registers; the fp32-decode twin otherwise) for every projection, one per call on all rows of ``x`` (the weight
is read once for the whole call), and torch for the elementwise parts; ``qembedding`` decodes only the rows
it gathers. Every product is computed in fp32 from the weights' exact values (x widened where it is bf16) — but a
bf16 prefill's, from ``quant.TILED_FROM`` rows of x: tiles of the weights decoded and rounded to bf16 (as weights
decoded at load are) in torch's bf16 GEMM; the output takes x's dtype (``qembedding``: ``out_dtype``), rounded once
to nearest-even where that is bf16 — a bf16 session reads the same blocks, no bf16 copy of them.

Native forms (CPU, the encodings ``quant.NATIVE_ENCODINGS`` decodes): each kernel as native calls only —
``vxc_qgemv`` per projection, ``vxc_qbias`` / ``vxc_qsilu_mul`` for the elementwise parts, ``vxc_qembedding``
decoding the gathered rows in C — so a decode step over encoded weights is captured and replayed
(``vxc.runtime.replay``) like one over decoded weights."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...ir.ggml import logical_cols
from ...runtime.ggml_blocks import dequantize
from ...runtime.weights import in_file_mapping
from . import native as N
from .native import I, L, P
from .quant import ENCODING, NATIVE_ENCODINGS, check_activations, qgemv_native
from .registry import NotCovered, kernel


def _q(enc: str, blocks: Tensor, x: Tensor, act: str) -> Tensor:
    return torch.ops.vxc.qgemv(enc, blocks, x.reshape(-1, x.shape[-1]).contiguous(), act)


@kernel("qlinear")
def qlinear(x: Tensor, encoding: str, blocks: Tensor, bias: Optional[Tensor], activations: str = "fp32") -> Tensor:
    """``x [T, cols] @ Wᵀ (+ bias)`` with W as ggml blocks ``[rows, row_bytes]``: ``[T, rows]`` in x's dtype, summed
    in fp32 (x held as int8 blocks first under ``activations`` int8_block32: see ``quant.ACTIVATIONS``)."""
    check_activations(activations)


@qlinear.fake
def _(x, encoding, blocks, bias, activations="fp32"):
    return x.new_empty(x.shape[0], blocks.shape[0])


@qlinear.impl("torch")
def qlinear_twin(x, encoding, blocks, bias, activations="fp32"):
    y = _q(encoding, blocks, x, activations)
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


@kernel("qswiglu")
def qswiglu(x: Tensor, encoding_gate: str, w_gate: Tensor, encoding_up: str, w_up: Tensor, encoding_down: str,
            w_down: Tensor, activations: str = "fp32") -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with each projection as ggml blocks: ``[T, d]`` in x's dtype, every
    product and the gating in fp32 (each projection's input held as int8 blocks under ``activations``
    int8_block32)."""
    check_activations(activations)


@qswiglu.fake
def _(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, activations="fp32"):
    return x.new_empty(x.shape[0], w_down.shape[0])


@qswiglu.impl("torch")
def qswiglu_twin(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, activations="fp32"):
    h = F.silu(_q(encoding_gate, w_gate, x, activations)) * _q(encoding_up, w_up, x, activations)
    return _q(encoding_down, w_down, h, activations).to(x.dtype)


@kernel("qmoe_shared")
def qmoe_shared(x: Tensor, routed: Tensor, encoding_gate: str, w_gate: Tensor, encoding_up: str, w_up: Tensor,
                encoding_down: str, w_down: Tensor, branch_gate: Optional[Tensor], activations: str = "fp32") -> Tensor:
    """``moe_shared`` with the shared expert's three projections as ggml blocks: ``routed + [σ(x·branch_gateᵀ)] ·
    qswiglu(x)`` summed in fp32, in routed's dtype (the branch gate ``[1, d]`` plain)."""
    check_activations(activations)


@qmoe_shared.fake
def _(x, routed, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, branch_gate, activations="fp32"):
    return torch.empty_like(routed)


@qmoe_shared.impl("torch")
def qmoe_shared_twin(x, routed, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, branch_gate,
                     activations="fp32"):
    return _shared_add(x, routed, qswiglu_twin(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down,
                                               activations), branch_gate).to(routed.dtype)


def _shared_add(x: Tensor, routed: Tensor, h: Tensor, branch_gate: Optional[Tensor]) -> Tensor:
    """``routed + [σ(x·branch_gateᵀ)] · h`` in fp32 (torch)."""
    if branch_gate is not None:
        h = torch.sigmoid(x.float() @ branch_gate.float().T) * h
    return routed.float() + h


# qembedding's out_dtype names (a gather has no input of the session's dtype to follow)
OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@kernel("qembedding", device_arg=2)
def qembedding(ids: Tensor, encoding: str, table: Tensor, out_dtype: str = "fp32") -> Tensor:
    """The rows ``ids`` of a ggml-block table ``[vocab, row_bytes]``, decoded: ``[T, d]`` fp32 (``out_dtype``
    bf16: each value then rounded to nearest-even)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"qembedding's out_dtype is one of {', '.join(OUT_DTYPES)}, not {out_dtype!r}")


@qembedding.fake
def _(ids, encoding, table, out_dtype="fp32"):
    return table.new_empty(ids.shape[0], logical_cols(encoding, int(table.shape[1])), dtype=OUT_DTYPES[out_dtype])


@qembedding.impl("torch")
def qembedding_twin(ids, encoding, table, out_dtype="fp32"):
    return dequantize(encoding, table.index_select(0, ids.reshape(-1)), torch.float32).to(OUT_DTYPES[out_dtype])


# ------------------------------------------------------------------------------------------------ native

_QBIAS = N.declare("vxc_qbias", P, P, L, L, I)
_QSILU_MUL = N.declare("vxc_qsilu_mul", P, P, P, L)
# vxc_qswiglu_a8p(enc_g, Pg, enc_u, Pu, x, h, rows, cols, B, bf): silu(gate) * up over the two packed matrices at once
_QSWIGLU_A8P = N.declare("vxc_qswiglu_a8p", I, P, I, P, P, P, L, L, L, I)
_SHARED_ADD = N.declare("vxc_shared_add", P, P, P, P, P, L, L)
_QEMBEDDING = N.declare("vxc_qembedding", I, P, P, P, L, L, L)
_TO_BF16 = N.declare("vxc_to_bf16", P, P, L)
_FROM_BF16 = N.declare("vxc_from_bf16", P, P, L)


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` (fp32 or bf16, contiguous) as fp32: itself, or widened by ``vxc_from_bf16`` (a recorded native call)."""
    if t is None or t.dtype == torch.float32:
        return t
    out = N.empty(*t.shape, dtype=torch.float32)
    if t.numel():
        N.call(_FROM_BF16, t.data_ptr(), out.data_ptr(), t.numel())
    return out


def _as(y: Tensor, dtype: torch.dtype) -> Tensor:
    """The fp32 output ``y`` of a native call in ``dtype`` (fp32 or bf16: ``vxc_to_bf16``, a recorded native call,
    so a replayed step keeps it)."""
    if dtype == torch.float32:
        return y
    out = N.empty(*y.shape, dtype=dtype)
    if y.numel():
        N.call(_TO_BF16, y.data_ptr(), out.data_ptr(), y.numel())
    return out


def _qn(enc: str, blocks: Tensor, x: Tensor, act: str) -> Tensor:
    """One projection through ``qgemv``'s native implementation (raises NotCovered as it does)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise NotCovered(N.OPERANDS)
    return qgemv_native(enc, blocks, x, act)


@qlinear.impl("native")
def qlinear_native(x, encoding, blocks, bias, activations="fp32"):
    if not N.ok(x, bias):
        raise NotCovered(N.OPERANDS)
    y = _qn(encoding, blocks, x, activations)
    if bias is not None:
        N.call(_QBIAS, y.data_ptr(), bias.data_ptr(), int(y.shape[0]), int(y.shape[1]), N.BF[bias.dtype])
    return _as(y, x.dtype)


@qswiglu.impl("native")
def qswiglu_native(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, activations="fp32"):
    if not N.ok(x):
        raise NotCovered(N.OPERANDS)
    for e in (encoding_gate, encoding_up, encoding_down):
        if e not in NATIVE_ENCODINGS:
            raise NotCovered(ENCODING)
    h = _gate_up_packed(x, encoding_gate, w_gate, encoding_up, w_up, activations)
    if h is None:
        g = _qn(encoding_gate, w_gate, x, activations)
        u = _qn(encoding_up, w_up, x, activations)
        h = N.empty(*g.shape, dtype=torch.float32)
        N.call(_QSILU_MUL, g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel())
    # h stays fp32 in a bf16 session too. (Rounded to bf16, a prefill's down product takes the bf16 GEMM on decoded
    # tiles — a 0.6B benchmark shape's q4_0 pp128 ~1.2x faster — but the 135M real model's bf16 logits move from 0.754
    # to 0.942 max-abs off the fp32 reference, past 1.25x the reference library's own 0.659: not kept; README)
    return _as(_qn(encoding_down, w_down, h, activations), x.dtype)


def _gate_up_packed(x, encoding_gate, w_gate, encoding_up, w_up, activations) -> Optional[Tensor]:
    """``silu(gate(x)) · up(x)`` by ``vxc_qswiglu_a8p`` where both products run on packed copies (int8_block32
    activations, an AVX-512 build): the same values as the two products and ``vxc_qsilu_mul``, without their
    outputs. None where it does not apply."""
    from .quant import packed_for

    if x.dim() != 2 or not x.is_contiguous():
        return None
    rows, cols, B = int(w_gate.shape[0]), int(x.shape[1]), int(x.shape[0])
    if int(w_up.shape[0]) != rows or not rows or not B:
        return None
    codes = (NATIVE_ENCODINGS[encoding_gate], NATIVE_ENCODINGS[encoding_up])
    packed = [packed_for(c, b, cols, activations) for c, b in zip(codes, (w_gate, w_up))]
    if any(p is None for p in packed):
        return None
    h = N.empty(B, rows, dtype=torch.float32)
    N.call(_QSWIGLU_A8P, codes[0], packed[0].data_ptr(), codes[1], packed[1].data_ptr(), x.data_ptr(), h.data_ptr(),
           rows, cols, B, N.BF[x.dtype])
    return h


@qmoe_shared.impl("native")
def qmoe_shared_native(x, routed, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, branch_gate,
                       activations="fp32"):
    if not (N.ok(x, routed, branch_gate) and x.dim() == 2 and routed.shape == x.shape and x.dtype == routed.dtype
            and (branch_gate is None or branch_gate.numel() == x.shape[1])):
        raise NotCovered(N.OPERANDS)
    h = qswiglu_native(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, activations)
    out = N.empty(*routed.shape, dtype=torch.float32)
    x32, h32, r32, g32 = _f32(x), _f32(h), _f32(routed), _f32(branch_gate)  # (a bf16 session's, widened: exact)
    N.call(_SHARED_ADD, x32.data_ptr(), h32.data_ptr(), r32.data_ptr(), N.ptr(g32), out.data_ptr(),
           int(x.shape[0]), int(x.shape[1]))
    return _as(out, routed.dtype)


@qembedding.impl("native")
def qembedding_native(ids, encoding, table, out_dtype="fp32"):
    code = NATIVE_ENCODINGS.get(encoding)
    if code is None:
        raise NotCovered(ENCODING)
    if not (table.device.type == "cpu" and table.dtype == torch.uint8 and table.dim() == 2 and table.is_contiguous()
            and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()):
        raise NotCovered(N.OPERANDS)
    cols = logical_cols(encoding, int(table.shape[1]))
    out = N.empty(int(ids.shape[0]), cols, dtype=torch.float32)
    if ids.shape[0]:
        # a table read in place from a weights file's mapping: the pages each gather faults in are released again
        drop = table.numel() if in_file_mapping(table) else 0
        N.call(_QEMBEDDING, code, table.data_ptr(), ids.data_ptr(), out.data_ptr(), int(ids.shape[0]), cols, drop)
    return _as(out, OUT_DTYPES[out_dtype])


# ------------------------------------------------------------------------------------------------ triton
# (appended section: qembedding's Triton form; the native section above is edited separately)
# qembedding: the gathered rows decoded by qgemv's Triton decoder (``quant._decode32``, the fp32 values
# gguf.quants.dequantize gives), one program per BLOCK_N ids and 32-value chunk. qlinear / qswiglu: each
# projection through qgemv's Triton implementation (raising NotCovered as it does), the bias and the gating
# in torch on the same device.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .quant import TRITON_ENCODING, TRITON_ENCODINGS, _decode32, qgemv_triton  # noqa: E402
from ...ir.ggml import encoding as _ggml_encoding  # noqa: E402

_QEMB_BLOCK_N = 16


@triton.jit
def _qembedding_kernel(ids_ptr, w_ptr, out_ptr, T, cols, row_bytes, ENC: tl.constexpr, TSIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    tmask = t < T
    row = tl.load(ids_ptr + t, mask=tmask, other=0).to(tl.int64)
    w = _decode32(w_ptr, row * row_bytes, tmask, g, ENC, TSIZE)
    i = tl.arange(0, 32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * cols + g * 32 + i[None, :], w, mask=tmask[:, None])


@qembedding.impl("triton")
def qembedding_triton(ids, encoding, table, out_dtype="fp32"):
    code = TRITON_ENCODINGS.get(encoding)
    if code is None:
        raise NotCovered(TRITON_ENCODING)
    ids, table = ids.reshape(-1).contiguous(), table.contiguous()
    T, cols = int(ids.shape[0]), logical_cols(encoding, int(table.shape[1]))
    out = torch.empty(T, cols, dtype=torch.float32, device=table.device)
    if T and cols:
        grid = (triton.cdiv(T, _QEMB_BLOCK_N), cols // 32)
        _qembedding_kernel[grid](ids, table, out, T, cols, int(table.shape[1]), ENC=code,
                                 TSIZE=_ggml_encoding(encoding).type_size, BLOCK_N=_QEMB_BLOCK_N)
    return out.to(OUT_DTYPES[out_dtype])


def _qt(enc: str, blocks: Tensor, x: Tensor, act: str) -> Tensor:
    return qgemv_triton(enc, blocks, x.reshape(-1, x.shape[-1]), act)


@qlinear.impl("triton")
def qlinear_triton(x, encoding, blocks, bias, activations="fp32"):
    y = _qt(encoding, blocks, x, activations)
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


@qswiglu.impl("triton")
def qswiglu_triton(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, activations="fp32"):
    for e in (encoding_gate, encoding_up, encoding_down):
        if e not in TRITON_ENCODINGS:
            raise NotCovered(TRITON_ENCODING)
    a = activations
    h = F.silu(_qt(encoding_gate, w_gate, x, a)) * _qt(encoding_up, w_up, x, a)
    return _qt(encoding_down, w_down, h, a).to(x.dtype)


@qmoe_shared.impl("triton")
def qmoe_shared_triton(x, routed, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down, branch_gate,
                       activations="fp32"):
    return _shared_add(x, routed, qswiglu_triton(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down,
                                                 activations), branch_gate).to(routed.dtype)


# ------------------------------------------------------------------------------------------------ qmoe_experts
# The routed experts of an MoE FFN whose banks are ggml-encoded ([E, rows, row_bytes] as stored: a GGUF's
# ffn_{gate,up,down}_exps), read in place — no decoded copy of a bank. Separate gate / up banks (the layout an
# encoded GGUF bank has); the twin decodes only the selected experts' matrices, per call. As moe_experts: the banks
# hold the experts ``expert_offset ..`` (tensor parallel: this rank's), a slot selecting another adds nothing.

from typing import Optional as _Opt  # noqa: E402

from .moe import _gated  # noqa: E402
from .quant import _QGEMV_A8  # noqa: E402,F401  (declared with qgemv)


@kernel("qmoe_experts")
def qmoe_experts(x: Tensor, weights: Tensor, experts: Tensor, encoding_in: str, w_in: Tensor, encoding_up: str,
                 w_up: Tensor, encoding_down: str, w_down: Tensor, b_in: _Opt[Tensor], b_down: _Opt[Tensor],
                 layout: str, act: str, alpha: _Opt[float], limit: _Opt[float], expert_offset: int = 0,
                 activations: str = "fp32") -> Tensor:
    """``moe_experts`` over encoded banks: ``[T, d]`` summed in fp32, in x's dtype."""
    check_activations(activations)
    if expert_offset < 0:
        raise ValueError(f"expert_offset {expert_offset} is negative")
    if layout != "separate":
        raise ValueError(f"encoded expert banks take the separate layout, not {layout!r}")


@qmoe_experts.fake
def _(x, weights, experts, encoding_in, w_in, encoding_up, w_up, encoding_down, w_down, b_in, b_down, layout, act,
      alpha, limit, expert_offset=0, activations="fp32"):
    return x.new_empty(x.shape[0], w_down.shape[1])


@qmoe_experts.impl("torch")
def qmoe_experts_twin(x, weights, experts, encoding_in, w_in, encoding_up, w_up, encoding_down, w_down, b_in, b_down,
                      layout, act, alpha, limit, expert_offset=0, activations="fp32"):
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for g in torch.unique(experts).tolist():  # ascending, as the references visit them
        e = g - expert_offset  # the bank row
        if not 0 <= e < w_down.shape[0]:
            continue  # another rank's expert
        tok, slot = torch.where(experts == g)
        h = x[tok].float()
        g, u = _q(encoding_in, w_in[e], h, activations), _q(encoding_up, w_up[e], h, activations)
        y = _q(encoding_down, w_down[e], _gated(g, u, act, alpha, limit), activations)
        if b_down is not None:
            y = y + b_down[e].float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


_QMOE = N.declare("vxc_qmoe", I, P, I, P, I, P, P, P, P, P, L, L, L, L, L, I, L)


@qmoe_experts.impl("native")
def qmoe_experts_native(x, weights, experts, encoding_in, w_in, encoding_up, w_up, encoding_down, w_down, b_in, b_down,
                        layout, act, alpha, limit, expert_offset=0, activations="fp32"):
    codes = [NATIVE_ENCODINGS.get(e) for e in (encoding_in, encoding_up, encoding_down)]
    if None in codes:
        raise NotCovered(ENCODING)
    banks = (w_in, w_up, w_down)
    if not (N.ok(x, weights) and x.dim() == 2 and act == "silu" and b_in is None and b_down is None
            and all(b.device.type == "cpu" and b.dtype == torch.uint8 and b.dim() == 3 and b.is_contiguous() for b in banks)
            and experts.dtype == torch.int64 and experts.is_contiguous() and weights.shape == experts.shape):
        raise NotCovered(N.OPERANDS)
    T, d = int(x.shape[0]), int(x.shape[1])
    E, I_ = int(w_in.shape[0]), int(w_in.shape[1])
    out = N.empty(T, d, dtype=torch.float32)
    x32, w32 = _f32(x), _f32(weights)  # (a bf16 session's, widened: exact)
    N.call(_QMOE, codes[0], w_in.data_ptr(), codes[1], w_up.data_ptr(), codes[2], w_down.data_ptr(), x32.data_ptr(),
           experts.data_ptr(), w32.data_ptr(), out.data_ptr(), T, int(experts.shape[1]), E, d, I_,
           int(activations == "int8_block32"), expert_offset)
    return _as(out, x.dtype)


@qmoe_experts.impl("triton")
def qmoe_experts_triton(x, weights, experts, encoding_in, w_in, encoding_up, w_up, encoding_down, w_down, b_in, b_down,
                        layout, act, alpha, limit, expert_offset=0, activations="fp32"):
    """Each selected expert's three products through qgemv's Triton implementation (on x's device)."""
    for e in (encoding_in, encoding_up, encoding_down):
        if e not in TRITON_ENCODINGS:
            raise NotCovered(TRITON_ENCODING)
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for g in torch.unique(experts).tolist():
        e = g - expert_offset  # the bank row
        if not 0 <= e < w_down.shape[0]:
            continue  # another rank's expert
        tok, slot = torch.where(experts == g)
        h = x[tok].float()
        g, u = _qt(encoding_in, w_in[e], h, activations), _qt(encoding_up, w_up[e], h, activations)
        y = _qt(encoding_down, w_down[e], _gated(g, u, act, alpha, limit), activations)
        if b_down is not None:
            y = y + b_down[e].float()
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)
