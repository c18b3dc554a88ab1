"""Quantised kernels: ``vxc::qgemv``, the decode GEMV read straight from ggml block-quantised weights.

``qgemv(encoding, blocks, x) -> y``: ``blocks`` is a weight of ``rows x cols`` stored as GGUF stores it,
uint8 ``[rows, row_bytes]`` (each row ``cols / block_size`` blocks of ``type_size`` bytes, the layouts of
:mod:`vxc.ir.ggml`); ``x`` is ``[B, cols]`` fp32 or bf16 (B small: decode, a few rows); ``y[b, r] =
sum_c W[r, c] x[b, c]`` is ``[B, rows]`` fp32.

- torch twin: the blocks decoded with :func:`vxc.runtime.ggml_blocks.dequantize` (fp32, bit-exact with
  ``gguf.quants``; every encoding of the table), then an fp32 matmul. It materialises the decoded weight:
  the oracle and the fallback, not the fast path.
- native (``vxc_qgemv``): q8_0, q4_0, q4_1, q4_k, q6_k decoded in registers, never copied out: group sums of
  the integer values times x, multiplied by the group's scale, as ggml's reference dot products (see the C
  source). Other encodings (q5_0, q5_1, q2_k, q3_k, q5_k) raise ``NotCovered`` and run the twin.

Refused by name (``GGMLError``, a ValueError): an unknown encoding, blocks that are not uint8 ``[rows,
row_bytes]`` of whole blocks, an ``x`` whose columns are not the weight's logical columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...ir.ggml import GGMLError, encoding, logical_cols
from ...runtime.ggml_blocks import dequantize
from . import native as N
from .native import I, L, P
from .registry import NotCovered, kernel

# the C library's encoding codes (vxc_cpu.c, the quant section)
NATIVE_ENCODINGS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q6_k": 4}

# the reason the native implementation gives for an encoding it does not decode
ENCODING = f"an encoding without a native decoder (native: {' '.join(NATIVE_ENCODINGS)})"


@kernel("qgemv", device_arg=1)
def qgemv(encoding_name: str, blocks: Tensor, x: Tensor) -> Tensor:
    """``y [B, rows] fp32 = x [B, cols] @ W[rows, cols]ᵀ`` with W given as ggml blocks ``[rows, row_bytes]``."""
    check(encoding_name, blocks, x)


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
def _(encoding_name, blocks, x):
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ torch twin


@qgemv.impl("torch")
def qgemv_twin(encoding_name, blocks, x):
    """The weight decoded to fp32 (``ggml_blocks.dequantize``), then ``x Wᵀ`` in fp32."""
    w = dequantize(encoding_name, blocks, torch.float32)
    return x.to(torch.float32) @ w.T


# ------------------------------------------------------------------------------------------------ native

# vxc_qgemv(enc, W, x, y, rows, cols, B, bf)
_QGEMV = N.declare("vxc_qgemv", I, P, P, P, L, L, L, I)


@qgemv.impl("native")
def qgemv_native(encoding_name, blocks, x):
    code = NATIVE_ENCODINGS.get(encoding_name)
    if code is None:
        raise NotCovered(ENCODING)
    if not (blocks.device.type == "cpu" and blocks.is_contiguous() and N.ok(x)):
        raise NotCovered(N.OPERANDS)
    rows, cols = int(blocks.shape[0]), int(x.shape[1])
    B = int(x.shape[0])
    y = N.empty(B, rows, dtype=torch.float32)
    if rows and B:
        N.call(_QGEMV, code, blocks.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, B, N.BF[x.dtype])
    return y
