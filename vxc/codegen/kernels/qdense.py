"""The dense kernels over ggml block-quantised weights kept resident as stored (no decoded copy): ``qlinear``,
``qswiglu``, ``qembedding`` — what the lowering emits in place of ``linear`` / ``swiglu`` / ``embedding`` when
an operand declares a ggml encoding and the engine keeps encoded weights resident (fp32 compute).

Each is composed of ``vxc::qgemv`` (:mod:`.quant`: native on CPU for q8_0, q4_0, q4_1, q4_k, q6_k, decoded in
registers; the fp32-decode twin otherwise) for every projection, one per call on all rows of ``x`` (the weight
is read once for the whole call), and torch for the elementwise parts; ``qembedding`` decodes only the rows
it gathers. Outputs are fp32, the compute dtype of the encoded path."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...runtime.ggml_blocks import dequantize
from .registry import kernel


def _q(enc: str, blocks: Tensor, x: Tensor) -> Tensor:
    return torch.ops.vxc.qgemv(enc, blocks, x.reshape(-1, x.shape[-1]).contiguous())


@kernel("qlinear")
def qlinear(x: Tensor, encoding: str, blocks: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x [T, cols] @ Wᵀ (+ bias)`` with W as ggml blocks ``[rows, row_bytes]``: ``[T, rows]`` fp32."""


@qlinear.fake
def _(x, encoding, blocks, bias):
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


@qlinear.impl("torch")
def qlinear_twin(x, encoding, blocks, bias):
    y = _q(encoding, blocks, x)
    return y if bias is None else y + bias.to(torch.float32)


@kernel("qswiglu")
def qswiglu(x: Tensor, encoding_gate: str, w_gate: Tensor, encoding_up: str, w_up: Tensor, encoding_down: str,
            w_down: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with each projection as ggml blocks: ``[T, d]`` fp32."""


@qswiglu.fake
def _(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down):
    return x.new_empty(x.shape[0], w_down.shape[0], dtype=torch.float32)


@qswiglu.impl("torch")
def qswiglu_twin(x, encoding_gate, w_gate, encoding_up, w_up, encoding_down, w_down):
    h = F.silu(_q(encoding_gate, w_gate, x)) * _q(encoding_up, w_up, x)
    return _q(encoding_down, w_down, h)


@kernel("qembedding", device_arg=2)
def qembedding(ids: Tensor, encoding: str, table: Tensor) -> Tensor:
    """The rows ``ids`` of a ggml-block table ``[vocab, row_bytes]``, decoded: ``[T, d]`` fp32."""


@qembedding.fake
def _(ids, encoding, table):
    from ...ir.ggml import logical_cols

    return table.new_empty(ids.shape[0], logical_cols(encoding, int(table.shape[1])), dtype=torch.float32)


@qembedding.impl("torch")
def qembedding_twin(ids, encoding, table):
    return dequantize(encoding, table.index_select(0, ids.reshape(-1)), torch.float32)
