"""Quantised kernels: ``vxc::qgemv``, the decode GEMV read straight from ggml block-quantised weights.

``qgemv(encoding, blocks, x) -> y``: ``blocks`` is a weight of ``rows x cols`` stored as GGUF stores it,
uint8 ``[rows, row_bytes]`` (each row ``cols / block_size`` blocks of ``type_size`` bytes, the layouts of
:mod:`vxc.ir.ggml`); ``x`` is ``[B, cols]`` fp32 or bf16 (B small: decode, a few rows); ``y[b, r] =
sum_c W[r, c] x[b, c]`` is ``[B, rows]`` fp32.

- torch twin: the blocks decoded with :func:`vxc.runtime.ggml_blocks.dequantize` (fp32, bit-exact with
  ``gguf.quants``; every encoding of the table), then an fp32 matmul. It materialises the decoded weight:
  the oracle and the fallback, not the fast path.
- native (``vxc_qgemv``): every encoding of the table (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k,
  iq4_nl, iq4_xs and the ternary tq1_0 / tq2_0 with int8_block32 packed tiles; the grid formats iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs,
  iq3_s: fp32 x — each weight row decoded to fp32 once for all rows of x, from ``TILED_FROM`` rows decoded tiles into
  torch's GEMM; int8_block32 — integer products on AVX-512 VNNI builds (a row kernel, from 16 rows of x a tiled
  int8 GEMM), elsewhere x rounded to its int8 blocks' values and the fp32 path)
  decoded in registers, never copied out, each weight
  to the fp32 value ``dequantize`` gives it, accumulated in fp32 (the fp32 product with the dequantised
  matrix up to summation order: at the floor of the reference, see the C source). From ``TILED_FROM`` bf16 / fp16
  rows of x (prefill) a tile of rows at a time is decoded (``vxc_qdequant``) into torch's GEMM instead. An
  encoding missing from ``NATIVE_ENCODINGS`` would raise ``NotCovered`` and run the twin.
- triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): every encoding of the table (the ternary tq1_0 / tq2_0 included) but the i-quants (iq4_nl / iq4_xs and
  the grid formats) read straight from the blocks and
  decoded in registers to the same fp32 values; a GEMV for few rows of x, a ``tl.dot`` GEMM on decoded tiles
  from ``TRITON_DOT_FROM`` rows (prefill); fp32 accumulation either way. Others raise ``NotCovered``.

Refused by name (``GGMLError``, a ValueError): an unknown encoding, blocks that are not uint8 ``[rows,
row_bytes]`` of whole blocks, an ``x`` whose columns are not the weight's logical columns.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ...ir.ggml import ACTIVATION_PRECISIONS, GRID_ENCODINGS, GGMLError, encoding, logical_cols
from ...runtime.ggml_blocks import dequantize, grid_table, ksigns_table
from ...runtime.weights import drop_pages, resident_empty
from . import native as N
from .native import I, L, P
from .registry import NotCovered, kernel

# the C library's encoding codes (vxc_cpu.c, the quant section)
NATIVE_ENCODINGS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q6_k": 4, "q5_0": 5, "q5_k": 6, "q5_1": 7, "q2_k": 8, "q3_k": 9,
                    "iq4_nl": 10, "iq4_xs": 11, "iq2_xxs": 12, "iq2_xs": 13, "iq2_s": 14, "iq3_xxs": 15, "iq3_s": 16,
                    "iq1_s": 17, "iq1_m": 18, "tq1_0": 19, "tq2_0": 20}
assert set(GRID_ENCODINGS) <= set(NATIVE_ENCODINGS)


def _hand_over_grids(lib) -> None:
    """The grid formats' tables (gguf-py's, ``ggml_blocks.grid_table``) copied into the C library at its load."""
    blob = torch.cat([grid_table(n).reshape(-1) for n in ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s")]
                     + [ksigns_table().view(torch.int8)])
    fn = lib.vxc_set_iq_tables
    fn.argtypes, fn.restype = [P, L], I
    if fn(blob.data_ptr(), int(blob.numel())) != 0:
        raise RuntimeError(f"vxc_set_iq_tables refused {blob.numel()} bytes of grid tables")


N.on_load(_hand_over_grids)


_GRID_A8: list = []


def _grid_a8() -> bool:
    """Whether this build runs int8_block32 products on the grid formats in integers (vxc_iq_a8; asked once)."""
    if not _GRID_A8:
        lib = N.load()
        fn = getattr(lib, "vxc_iq_a8", None)
        if fn is not None:
            fn.argtypes, fn.restype = [], I
        _GRID_A8.append(bool(fn()) if fn is not None else False)
    return _GRID_A8[0]

# the reason the native implementation gives for an encoding it does not decode
ENCODING = f"an encoding without a native decoder (native: {' '.join(NATIVE_ENCODINGS)})"


# the activation precisions of qgemv: "fp32" — x as given (an operand declaring none); the ones an encoded operand
# may declare (``activations`` in the IR, ``vxc.ir.ggml.ACTIVATION_PRECISIONS``): "int8_block32" — each row of x
# quantised per 32-value block to int8 with an fp32 scale (d = amax / 127, q = round-half-even(x / d), 0 where
# amax = 0), the products summed exactly in integers per block (native: AVX-512 VNNI / AVX2 / scalar)
ACTIVATIONS = ("fp32", *ACTIVATION_PRECISIONS)


@kernel("qgemv", device_arg=1)
def qgemv(encoding_name: str, blocks: Tensor, x: Tensor, activations: str = "fp32") -> Tensor:
    """``y [B, rows] fp32 = x [B, cols] @ W[rows, cols]ᵀ`` with W given as ggml blocks ``[rows, row_bytes]``
    (x first quantised per block when ``activations`` is ``int8_block32``)."""
    check(encoding_name, blocks, x)
    check_activations(activations)


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise GGMLError(f"unknown activation precision {activations!r} (known: {', '.join(ACTIVATIONS)})")


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [B, cols]`` (cols a multiple of 32) as ``int8_block32`` holds it: int8 ``q [B, cols]`` and fp32 ``d
    [B, cols / 32]`` (``d = amax / 127``; ``q = round(x / d)``, half to even; 0 where the block is all 0)."""
    x = x.to(torch.float32)
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d == 0, torch.zeros_like(g), torch.round(g / torch.where(d == 0, torch.ones_like(d), d)))
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1)


def dequantize_activations(x: Tensor) -> Tensor:
    """The fp32 values ``d q`` of ``x`` held as ``int8_block32``: the twin's activation operand."""
    q, d = quantize_activations(x)
    return (q.reshape(q.shape[0], -1, 32).to(torch.float32) * d.unsqueeze(-1)).reshape(q.shape)


def check(encoding_name: str, blocks: Tensor, x: Tensor) -> int:
    """The argument checks of ``qgemv`` (raise ``GGMLError`` naming the encoding); returns ``cols``."""
    enc = encoding(encoding_name)  # an unknown name is refused, listing the known ones
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise GGMLError(f"{enc.name}: qgemv's blocks must be uint8 [rows, row_bytes], not {blocks.dtype} "
                        f"{list(blocks.shape)}")
    cols = logical_cols(enc.name, int(blocks.shape[1]))  # refuses a row of partial blocks, by name
    if x.dim() != 2 or not x.is_floating_point():
        raise GGMLError(f"{enc.name}: qgemv's x must be a floating [B, cols] tensor, not {x.dtype} {list(x.shape)}")
    if int(x.shape[1]) != cols:
        raise GGMLError(f"{enc.name}: blocks [{blocks.shape[0]}, {blocks.shape[1]}] hold rows of {cols} values "
                        f"({blocks.shape[1]} bytes = {blocks.shape[1] // enc.type_size} blocks of {enc.block_size}); "
                        f"x has {x.shape[1]} columns")
    if blocks.device != x.device:
        raise GGMLError(f"{enc.name}: qgemv's blocks are on {blocks.device}, x on {x.device}")
    return cols


@qgemv.fake
def _(encoding_name, blocks, x, activations="fp32"):
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ torch twin


@qgemv.impl("torch")
def qgemv_twin(encoding_name, blocks, x, activations="fp32"):
    """The weight decoded to fp32 (``ggml_blocks.dequantize``), then ``x Wᵀ`` in fp32 (x as its int8 blocks'
    values ``d q`` under ``int8_block32``)."""
    w = dequantize(encoding_name, blocks, torch.float32)
    x = dequantize_activations(x) if activations == "int8_block32" else x.to(torch.float32)
    return x @ w.T


# ------------------------------------------------------------------------------------------------ native

# vxc_qgemv(enc, W, x, y, rows, cols, B, bf); vxc_qdequant(enc, W, out, r0, r1, cols)
_QGEMV = N.declare("vxc_qgemv", I, P, P, P, L, L, L, I)
_QDEQUANT = N.declare("vxc_qdequant", I, P, P, L, L, L)
_QDEQUANT_BF16 = N.declare("vxc_qdequant_bf16", I, P, P, L, L, L)
# vxc_qgemv_a8(enc, W, x, y, rows, cols, B, bf): int8_block32 activations
_QGEMV_A8 = N.declare("vxc_qgemv_a8", I, P, P, P, L, L, L, I)
_QUANTIZE_A8 = N.declare("vxc_quantize_a8", P, P, P, L, L)
# the 16-row packed layout of every native encoding for int8_block32 products (AVX-512 builds; see the C source)
_QPACK = N.declare("vxc_qpack", I, P, P, L, L)
_QGEMV_A8P = N.declare("vxc_qgemv_a8p", I, P, P, P, L, L, L, I)

PACK_ROWS = 4096  # rows packed per run (a multiple of the 16-row tile)
PACK = True  # int8_block32 products on the packed layout where the build has one (tests turn it off: the row kernel)

# blocks tensor -> its packed copy (made at its first int8_block32 product, kept while the blocks live: an
# engine packs its resident weights once, at load — ``prepack``; the copy is counted by ``packed_bytes``)
_PACKED = WeakIdKeyDictionary()  # by identity (a tensor's == is elementwise)


def packed_bytes() -> int:
    """Bytes held by the packed copies of live weights."""
    return sum(int(t.numel()) for t in list(_PACKED.values()))


def _packed(code: int, blocks: Tensor, rows: int, cols: int) -> Tensor | None:
    """The packed copy of ``blocks`` (made now if new), or None where this build has no packed form."""
    got = _PACKED.get(blocks)
    if got is not None:
        return got
    lib = N.load()
    tb = lib.vxc_qpack_tile_bytes  # a query returning long (bound by hand, as vxc_max_threads)
    tb.argtypes, tb.restype = [I, L], L
    tile = int(tb(code, cols))
    if tile <= 0:
        return None
    out = resident_empty(((rows + 15) // 16) * tile)  # streamed at every step: 2 MiB pages where the kernel allows
    # packed PACK_ROWS rows at a time, each run's source pages dropped once it is packed (a view of a weights file:
    # its pages leave RSS, re-read from the file if ever read again), so the source and the copy of a large matrix
    # (a tied 151936-row head: 128 MB) are never both resident; data preparation: never recorded
    for r0 in range(0, rows, PACK_ROWS):
        r1 = min(rows, r0 + PACK_ROWS)
        getattr(lib, _QPACK)(code, blocks[r0].data_ptr(), out.data_ptr() + r0 // 16 * tile, r1 - r0, cols)
        drop_pages(blocks[r0:r1])
    drop_pages(blocks)  # (the pages straddling two runs)
    _PACKED[blocks] = out
    return out


def packed_for(code: int, blocks: Tensor, cols: int, activations: str) -> Tensor | None:
    """The packed copy an int8_block32 product over ``blocks`` (2-D, contiguous, CPU) runs on, made now if new; None
    where the product runs on the row layout (other activations, PACK off, a build without the packed form)."""
    if activations != "int8_block32" or not PACK or blocks.device.type != "cpu" or not blocks.is_contiguous():
        return None
    return _packed(code, blocks, int(blocks.shape[0]), cols)


def prepack(encoding_name: str, blocks: Tensor) -> None:
    """Make the packed copy of ``blocks`` (a 2-D ggml matrix read with int8_block32 activations) now, where this
    build has a packed form: an engine packs at load, before any prefill's short-lived buffers exist, so the
    long-lived copies do not end up between them in the C heap (and the first prefill does not pay the packing)."""
    code = NATIVE_ENCODINGS.get(encoding_name)
    if (code is None or not PACK or blocks.dim() != 2 or blocks.device.type != "cpu" or not blocks.is_contiguous()
            or not N.available()):
        return
    _packed(code, blocks, int(blocks.shape[0]), logical_cols(encoding_name, int(blocks.shape[1])))


def quantize_activations_native(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quantize_activations`` by the C library (what ``vxc_qgemv_a8`` multiplies by): for tests and tools."""
    if not N.available():
        raise RuntimeError(f"the native library is not loaded: {N.status()}")
    x = x.to(torch.float32).contiguous()
    B, cols = int(x.shape[0]), int(x.shape[1])
    q = torch.empty(B, cols, dtype=torch.int8)
    d = torch.empty(B, cols // 32, dtype=torch.float32)
    if B and cols:
        N.call(_QUANTIZE_A8, x.data_ptr(), q.data_ptr(), d.data_ptr(), B, cols)
    return q, d

# bf16 / fp16 rows of x from which a prefill runs as decoded tiles into torch's half-precision GEMM
# (``qgemm_tiled``) rather than in registers: measured with /tmp-style sweeps of 4096 x 4096 q4_0 on Zen 4
# (2 threads, AVX-512 BF16, no AMX): at B = 16 the register path is ~2x faster, at 64 the tiled GEMM
# ~1.5x, at 512 ~2x. fp32 x always runs in registers: there the register path beat torch's fp32 GEMM on the
# decoded weight itself at every B measured (2 .. 256), and the fp32 GEMM would buy nothing.
TILED_FROM = 32
# fp32 bytes of weight decoded per tile (~1000 rows of 4096: the decode and the GEMM meet in L2/L3)
TILE_BYTES = 1 << 22


@qgemv.impl("native")
def qgemv_native(encoding_name, blocks, x, activations="fp32"):
    code = NATIVE_ENCODINGS.get(encoding_name)
    if code is None:
        raise NotCovered(ENCODING)
    if not (blocks.device.type == "cpu" and blocks.is_contiguous() and N.ok(x)):
        raise NotCovered(N.OPERANDS)
    rows, cols = int(blocks.shape[0]), int(x.shape[1])
    B = int(x.shape[0])
    a8 = activations == "int8_block32"  # the integer path at every B (its own GEMM: ~1.7-1.9x the fp32 path at B 4-16)
    if B >= TILED_FROM and x.dtype != torch.float32 and not a8:
        return qgemm_tiled(code, blocks, x)
    if B >= TILED_FROM and encoding_name in GRID_ENCODINGS and not (a8 and _grid_a8()):
        # the grid formats' fp32 path has no register GEMM: decoded tiles into torch's GEMM from TILED_FROM rows
        # (4096 x 4096 iq3_s, 2 threads, Zen 4: 32 rows 12.7 -> 9.2 ms, 128 rows 74.9 -> 28.2), x first rounded to
        # its int8 blocks' values under int8_block32 where the build has no integer path (the twin's definition);
        # with one (AVX-512 VNNI), vxc_qgemv_a8's own tiled int8 GEMM (128 rows: 11.4 ms)
        return qgemm_tiled(code, blocks, dequantize_activations(x) if a8 else x)
    y = N.empty(B, rows, dtype=torch.float32)
    if rows and B:
        pk = packed_for(code, blocks, cols, activations)
        if pk is not None:
            N.call(_QGEMV_A8P, code, pk.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, B, N.BF[x.dtype])
        else:
            N.call(_QGEMV_A8 if a8 else _QGEMV, code, blocks.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, B,
                   N.BF[x.dtype])
    return y


def qgemm_tiled(code: int, blocks: Tensor, x: Tensor) -> Tensor:
    """Prefill in half precision (many bf16 / fp16 rows of x): a tile of weight rows at a time decoded to the fp32
    values ``dequantize`` gives and rounded to x's dtype as a weight decoded at load is (bf16: ``vxc_qdequant_bf16``,
    one pass; fp16 / fp32: ``vxc_qdequant``, then a copy), multiplied by torch's GEMM in x's dtype, the next tile
    decoded into the same (reused) buffer — never the whole matrix at once. fp32 ``[B, rows]`` out, row-major, as
    every qgemv returns it: its callers hand the result's memory to native calls (a bias, silu(gate) * up)."""
    N.refuse_capture("qgemv's tiled path multiplies with torch's GEMM (not a native call)")
    rows, cols, B = int(blocks.shape[0]), int(x.shape[1]), int(x.shape[0])
    direct = x.dtype == torch.bfloat16
    step = max(4, min(rows, TILE_BYTES // (x.element_size() * max(cols, 1))))
    w = None if direct else _tile(step * cols, torch.float32)
    wh = w if x.dtype == torch.float32 else _tile(step * cols, x.dtype, 1)
    y = torch.empty(B, rows, dtype=torch.float32)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if direct:
            N.call(_QDEQUANT_BF16, code, blocks.data_ptr(), wh.data_ptr(), r0, r0 + n, cols)
        else:
            N.call(_QDEQUANT, code, blocks.data_ptr(), w.data_ptr(), r0, r0 + n, cols)
            if wh is not w:
                wh[: n * cols].copy_(w[: n * cols])
        y[:, r0:r0 + n] = torch.mm(x, wh[: n * cols].view(n, cols).T)  # rounded to x's dtype, then widened: exact
    return y


_TILES = threading.local()


def _tile(numel: int, dtype: torch.dtype, slot: int = 0) -> Tensor:
    """A flat buffer of at least ``numel`` elements (at most ``TILE_BYTES``), kept per thread, dtype and slot for the
    next tiled call rather than allocated at every projection of a prefill (with the one-pass bf16 decode and the
    row-major GEMM: 128 bf16 rows on the 0.6B benchmark shape's q4_0 matrices, 1.33-1.51x -> 1.14-1.28x the time of
    torch's GEMM on the decoded weight)."""
    bufs = _TILES.__dict__.setdefault("bufs", {})
    t = bufs.get((dtype, slot))
    if t is None or t.numel() < numel:
        t = bufs[(dtype, slot)] = torch.empty(numel, dtype=dtype)
    return t


def dequantize_native(encoding_name: str, blocks: Tensor) -> Tensor:
    """The whole matrix decoded by ``vxc_qdequant`` (fp32 ``[rows, cols]``): for tests and tools."""
    if not N.available():
        raise RuntimeError(f"the native library is not loaded: {N.status()}")
    code = NATIVE_ENCODINGS[encoding_name]
    rows, cols = int(blocks.shape[0]), logical_cols(encoding_name, int(blocks.shape[1]))
    out = torch.empty(rows, cols, dtype=torch.float32)
    if rows:
        N.call(_QDEQUANT, code, blocks.contiguous().data_ptr(), out.data_ptr(), 0, rows, cols)
    return out


# ------------------------------------------------------------------------------------------------ triton
# Read straight from the blocks, 32 values at a time: a [BLOCK_N rows, 32] tile of W decoded in registers to
# the fp32 values gguf.quants.dequantize gives (``_decode32``: bytes -> int8 / nibbles / 6-bit codes, f16
# scales reassembled from their two bytes and bitcast, q4_k's 6-bit scales and mins unpacked; the reference's
# operation order: d q, d q + m, (d sc) q - (dmin mn), (d sc)(q - 32), whose products are exact, so one
# rounding at most), then an fp32 product with the matching 32 columns of x. Few rows of x (decode): a
# broadcast-and-reduce over BLOCK_B rows of x per program (each tile of W decoded once for them); from
# ``TRITON_DOT_FROM`` rows (prefill): a tiled GEMM, ``tl.dot`` of [BLOCK_M, 32] x tiles with the decoded
# tile in IEEE fp32. Other encodings raise NotCovered (the twin runs).

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .triton_common import pow2  # noqa: E402

TRITON_ENCODINGS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q6_k": 4, "q5_k": 5, "q2_k": 6, "q3_k": 7, "q5_0": 8,
                    "q5_1": 9, "tq2_0": 10, "tq1_0": 11}
TRITON_ENCODING = f"an encoding without a Triton decoder (Triton: {' '.join(TRITON_ENCODINGS)})"
TRITON_DOT_FROM = 16  # rows of x from which the tl.dot GEMM runs (tl.dot needs tiles of at least 16)
_BLOCK_N_GEMV, _BLOCK_B_GEMV = 32, 4
_BLOCK_N_GEMM = 64


@triton.jit
def _f16_at(ptr, off, mask):
    """The little-endian f16 at byte ``off`` (a tensor of offsets), exactly widened to fp32."""
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode32(w_ptr, row0, nmask, g, ENC: tl.constexpr, TSIZE: tl.constexpr):
    """Values ``32 g .. 32 g + 31`` of the rows whose blocks start at byte ``row0`` ([BLOCK_N]): [BLOCK_N, 32]."""
    i = tl.arange(0, 32)
    m2 = nmask[:, None]
    if ENC < 3 or ENC == 8 or ENC == 9:  # one block of 32
        base = row0 + g * TSIZE
        d = _f16_at(w_ptr, base, nmask)[:, None]
        if ENC == 0:  # q8_0: d, 32 int8
            q = tl.load(w_ptr + base[:, None] + 2 + i[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d
        elif ENC == 8 or ENC == 9:  # q5_0 (d, qh, qs) / q5_1 (d, m, qh, qs): q4_0's nibbles with bit i of the u32 qh as bit 4
            hoff = 2 if ENC == 8 else 4
            byte = tl.load(w_ptr + base[:, None] + hoff + 4 + (i % 16)[None, :], mask=m2, other=0).to(tl.int32)
            qh = tl.load(w_ptr + base[:, None] + hoff + (i // 8)[None, :], mask=m2, other=0).to(tl.int32)
            q = ((byte >> ((i // 16) * 4)[None, :]) & 15) | (((qh >> (i % 8)[None, :]) & 1) << 4)
            if ENC == 8:
                w = d * (q - 16).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + _f16_at(w_ptr, base + 2, nmask)[:, None]
        else:  # q4_0 / q4_1: value i is nibble i % 16 of qs, low nibbles first
            qoff = 2 if ENC == 1 else 4
            byte = tl.load(w_ptr + base[:, None] + qoff + (i % 16)[None, :], mask=m2, other=0).to(tl.int32)
            q = (byte >> ((i // 16) * 4)[None, :]) & 15
            if ENC == 1:
                w = d * (q - 8).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + _f16_at(w_ptr, base + 2, nmask)[:, None]
    else:  # a 256-value super-block: chunk j of its eight
        base = row0 + (g // 8) * TSIZE
        j = g % 8
        if ENC == 3 or ENC == 5:  # q4_k: d, dmin, 12 bytes of 6-bit scales / mins, 128 bytes of nibbles; q5_k: the
            # same with 32 bytes of fifth bits (bit j of byte i: value i of chunk j) before the nibbles
            d = _f16_at(w_ptr, base, nmask)
            dmin = _f16_at(w_ptr, base + 2, nmask)
            jj = j % 4
            a = tl.load(w_ptr + base + 4 + jj, mask=nmask, other=0).to(tl.int32)
            mb = tl.load(w_ptr + base + 8 + jj, mask=nmask, other=0).to(tl.int32)
            c = tl.load(w_ptr + base + 12 + jj, mask=nmask, other=0).to(tl.int32)
            hi = j >= 4
            sc = tl.where(hi, (c & 15) | ((a >> 2) & 48), a & 63)
            mn = tl.where(hi, (c >> 4) | ((mb >> 2) & 48), mb & 63)
            qoff = 16 if ENC == 3 else 48
            byte = tl.load(w_ptr + base[:, None] + qoff + (j // 2) * 32 + i[None, :], mask=m2, other=0).to(tl.int32)
            q = (byte >> ((j % 2) * 4)) & 15
            if ENC == 5:
                qh = tl.load(w_ptr + base[:, None] + 16 + i[None, :], mask=m2, other=0).to(tl.int32)
                q = q | (((qh >> j) & 1) << 4)
            dl = d * sc.to(tl.float32)
            ml = dmin * mn.to(tl.float32)
            w = dl[:, None] * q.to(tl.float32) - ml[:, None]
        elif ENC == 6 or ENC == 7:  # q2_k: 16 scale / min bytes, 64 of 2-bit codes, d, dmin; q3_k: 32 hmask bytes
            # (bit j of byte i: value i of chunk j's high bit, clear meaning -4), 64 of 2-bit codes, 12 of 6-bit scales, d
            qoff = 16 if ENC == 6 else 32
            byte = tl.load(w_ptr + base[:, None] + qoff + (j // 4) * 32 + i[None, :], mask=m2, other=0).to(tl.int32)
            q = (byte >> ((j % 4) * 2)) & 3
            sb = 2 * j + (i // 16)[None, :]  # the 16-value sub-block
            if ENC == 6:
                sm = tl.load(w_ptr + base[:, None] + sb, mask=m2, other=0).to(tl.int32)
                dl = _f16_at(w_ptr, base + 80, nmask)[:, None] * (sm & 15).to(tl.float32)
                ml = _f16_at(w_ptr, base + 82, nmask)[:, None] * (sm >> 4).to(tl.float32)
                w = dl * q.to(tl.float32) - ml
            else:
                hm = tl.load(w_ptr + base[:, None] + i[None, :], mask=m2, other=0).to(tl.int32)
                q = q - (((hm >> j) & 1) ^ 1) * 4
                lo = tl.load(w_ptr + base[:, None] + 96 + (sb % 8), mask=m2, other=0).to(tl.int32)
                lo = (lo >> ((sb // 8) * 4)) & 15
                hi = tl.load(w_ptr + base[:, None] + 104 + (sb % 4), mask=m2, other=0).to(tl.int32)
                hi = (hi >> ((sb // 4) * 2)) & 3
                dl = _f16_at(w_ptr, base + 108, nmask)[:, None] * ((lo | (hi << 4)) - 32).to(tl.float32)
                w = dl * q.to(tl.float32)
        elif ENC == 10:  # tq2_0: 64 bytes of 2-bit codes 0..2 in q2_k's order, d; value d (code - 1)
            byte = tl.load(w_ptr + base[:, None] + (j // 4) * 32 + i[None, :], mask=m2, other=0).to(tl.int32)
            q = (byte >> ((j % 4) * 2)) & 3
            w = _f16_at(w_ptr, base + 64, nmask)[:, None] * (q - 1).to(tl.float32)
        elif ENC == 11:  # tq1_0: 48 bytes of 5 base-3 digits, 4 of 4, d; digit k of byte v ((v 3^k) & 255) 3 >> 8
            part = (j < 7) | (i < 16)  # chunks 5..7: the second 16 bytes' digits (chunk 7's last 16 values: qh's)
            off = tl.where(j < 5, i, tl.where(part, 32 + i % 16, 48 + i % 4))
            k = tl.where(j < 5, j, tl.where(part, 2 * j - 10 + i // 16, i // 4 - 4))
            p3 = tl.where(k == 0, 1, tl.where(k == 1, 3, tl.where(k == 2, 9, tl.where(k == 3, 27, 81))))
            byte = tl.load(w_ptr + base[:, None] + off[None, :], mask=m2, other=0).to(tl.int32)
            q = (((byte * p3[None, :]) & 255) * 3) >> 8
            w = _f16_at(w_ptr, base + 52, nmask)[:, None] * (q - 1).to(tl.float32)
        else:  # q6_k: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d
            h = j // 4
            r = j % 4
            lo = tl.load(w_ptr + base[:, None] + h * 64 + (r % 2) * 32 + i[None, :], mask=m2, other=0).to(tl.int32)
            hb = tl.load(w_ptr + base[:, None] + 128 + h * 32 + i[None, :], mask=m2, other=0).to(tl.int32)
            q = (((lo >> ((r // 2) * 4)) & 15) | (((hb >> (r * 2)) & 3) << 4)) - 32
            s = tl.load(w_ptr + base[:, None] + 192 + j * 2 + (i // 16)[None, :], mask=m2, other=0)
            d = _f16_at(w_ptr, base + 208, nmask)
            dl = d[:, None] * s.to(tl.int8, bitcast=True).to(tl.float32)
            w = dl * q.to(tl.float32)
    return w


@triton.jit
def _qgemv_kernel(w_ptr, x_ptr, y_ptr, rows, cols, row_bytes, B, ENC: tl.constexpr, TSIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Few rows of x: ``y[b, n]`` for BLOCK_B rows of x and BLOCK_N weight rows, a broadcast product reduced
    over each 32-column chunk."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    nmask, bmask = n < rows, b < B
    row0 = n.to(tl.int64) * row_bytes
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    for g in range(0, cols // 32):
        w = _decode32(w_ptr, row0, nmask, g, ENC, TSIZE)  # [BLOCK_N, 32]
        xv = tl.load(x_ptr + b[:, None] * cols + g * 32 + i[None, :], mask=bmask[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + b[:, None] * rows + n[None, :], acc, mask=bmask[:, None] & nmask[None, :])


@triton.jit
def _qgemm_kernel(w_ptr, x_ptr, y_ptr, rows, cols, row_bytes, B, ENC: tl.constexpr, TSIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Many rows of x (prefill): an output tile [BLOCK_M, BLOCK_N] per program, ``tl.dot`` over 32-column
    chunks of x with the decoded [32, BLOCK_N] tile of Wᵀ (IEEE fp32 products, fp32 accumulation)."""
    m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < B, n < rows
    row0 = n.to(tl.int64) * row_bytes
    i = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, cols // 32):
        w = _decode32(w_ptr, row0, nmask, g, ENC, TSIZE)
        xv = tl.load(x_ptr + m[:, None] * cols + g * 32 + i[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
        acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
    tl.store(y_ptr + m[:, None] * rows + n[None, :], acc, mask=mmask[:, None] & nmask[None, :])


@qgemv.impl("triton")
def qgemv_triton(encoding_name, blocks, x, activations="fp32"):
    code = TRITON_ENCODINGS.get(encoding_name)
    if code is None:
        raise NotCovered(TRITON_ENCODING)
    if activations == "int8_block32":  # x as its int8 blocks' values d q (torch, on x's device), then the fp32 GEMV
        x = dequantize_activations(x)
    blocks, x = blocks.contiguous(), x.to(torch.float32).contiguous()  # (a bf16 session's x widened: exact)
    rows, cols, B = int(blocks.shape[0]), int(x.shape[1]), int(x.shape[0])
    y = torch.empty(B, rows, dtype=torch.float32, device=x.device)
    if not (rows and B):
        return y
    args = (blocks, x, y, rows, cols, int(blocks.shape[1]), B)
    tsize = encoding(encoding_name).type_size
    if B >= TRITON_DOT_FROM:
        block_m = min(pow2(B, 16), 64)
        grid = (triton.cdiv(B, block_m), triton.cdiv(rows, _BLOCK_N_GEMM))
        _qgemm_kernel[grid](*args, ENC=code, TSIZE=tsize, BLOCK_M=block_m, BLOCK_N=_BLOCK_N_GEMM, num_warps=4)
    else:
        block_b = min(pow2(B), _BLOCK_B_GEMV)
        grid = (triton.cdiv(rows, _BLOCK_N_GEMV), triton.cdiv(B, block_b))
        _qgemv_kernel[grid](*args, ENC=code, TSIZE=tsize, BLOCK_N=_BLOCK_N_GEMV, BLOCK_B=block_b, num_warps=4)
    return y


@triton.jit
def _qdequant_kernel(w_ptr, out_ptr, rows, cols, row_bytes, ENC: tl.constexpr, TSIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    nmask = n < rows
    w = _decode32(w_ptr, n.to(tl.int64) * row_bytes, nmask, g, ENC, TSIZE)
    i = tl.arange(0, 32)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * cols + g * 32 + i[None, :], w, mask=nmask[:, None])


def dequantize_triton(encoding_name: str, blocks: Tensor) -> Tensor:
    """The whole matrix decoded by the Triton kernels' decoder (fp32 ``[rows, cols]``): for tests and tools."""
    code = TRITON_ENCODINGS[encoding_name]
    blocks = blocks.contiguous()
    rows, cols = int(blocks.shape[0]), logical_cols(encoding_name, int(blocks.shape[1]))
    out = torch.empty(rows, cols, dtype=torch.float32, device=blocks.device)
    if rows and cols:
        grid = (triton.cdiv(rows, _BLOCK_N_GEMV), cols // 32)
        _qdequant_kernel[grid](blocks, out, rows, cols, int(blocks.shape[1]), ENC=code,
                               TSIZE=encoding(encoding_name).type_size, BLOCK_N=_BLOCK_N_GEMV)
    return out
