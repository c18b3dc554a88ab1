"""The binding model's views applied to tensors (torch).

Same semantics as :mod:`vxc.ir.views` (which states them and computes the
shapes): every chain is first checked there, so a view that does not apply
raises the same :class:`~vxc.ir.views.ViewError` here, before any data is
touched. Results may be non-contiguous views of the input where torch allows
(slice, transpose, most reshapes); gather copies.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ir.module import Transform
from ..ir.views import MXFP4_BLOCK, MXFP4_BLOCK_BYTES, ViewError, encoded_shape, reshape_target, view_shape

__all__ = ["FP4_VALUES", "ViewError", "apply_transform", "apply_view", "decode_mxfp4", "stack_bank"]

# FP4 (E2M1) code -> value; the high bit is the sign (code 8 is -0.0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def apply_transform(t: torch.Tensor, x: Transform) -> torch.Tensor:
    """One transform, unchecked (:func:`apply_view` checks the chain first)."""
    if x.kind == "slice":
        return t.narrow(x.dim, x.start, x.stop - x.start)
    if x.kind == "gather":
        size = t.shape[x.dim]
        grouped = t.unflatten(x.dim, (x.groups, size // x.groups))  # [..., G, S, ...]
        pieces = [grouped.narrow(x.dim + 1, a, b - a).flatten(x.dim, x.dim + 1) for a, b in x.takes]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=x.dim)
    if x.kind == "reshape":
        return t.reshape(reshape_target(tuple(t.shape), x.shape))
    if x.kind == "transpose":
        return t.transpose(x.dim, x.dim2)
    if x.kind == "log_neg":
        if not t.is_floating_point():
            raise ViewError(f"log_neg applies to a float tensor, not {t.dtype}")
        return torch.log(-t.double()).to(t.dtype)
    raise ViewError(f"unknown transform kind {x.kind!r}")


def apply_view(t: torch.Tensor, transforms: Sequence[Transform]) -> torch.Tensor:
    """``t`` seen through ``transforms``, in order; raises ViewError if the chain does not apply."""
    expected = view_shape(tuple(t.shape), transforms)
    for x in transforms:
        t = apply_transform(t, x)
    assert tuple(t.shape) == expected, (tuple(t.shape), expected)
    return t


def check_bank(tensors: Sequence[torch.Tensor]) -> None:
    """Per-expert tensors must agree in shape and dtype to form one bank."""
    tensors = list(tensors)
    if not tensors:
        raise ViewError("an expert bank needs at least one tensor")
    first = tensors[0]
    for i, x in enumerate(tensors):
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ViewError(
                f"expert bank: expert {i} is {x.dtype}{list(x.shape)}, expert 0 is {first.dtype}{list(first.shape)}")


def stack_bank(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-expert tensors → one ``[experts, ...]`` tensor (expert ``i`` at index ``i``)."""
    tensors = list(tensors)
    check_bank(tensors)
    return torch.stack(tensors)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 → ``dtype``: ``blocks`` u8 ``[..., out, G, 16]``, ``scales`` u8 ``[..., out, G]`` → ``[..., out, G*32]``.

    Element ``2j`` of a block is the low nibble of byte ``j``, element ``2j+1``
    the high nibble; each nibble is an FP4 code (:data:`FP4_VALUES`) and the
    block's 32 values are multiplied by ``2^(scale-127)``. The products are
    exact in fp32 for every scale byte (computed as two power-of-two factors,
    so neither overflows alone), then rounded once to ``dtype``.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ViewError(f"mxfp4 parts must be uint8, got blocks {blocks.dtype}, scales {scales.dtype}")
    out_shape = encoded_shape("mxfp4", {"blocks": tuple(blocks.shape), "scales": tuple(scales.shape)})
    work = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(FP4_VALUES, dtype=work, device=blocks.device)
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    vals = torch.stack((lut[lo], lut[hi]), dim=-1)  # [..., out, G, 16, 2]: low nibble first
    vals = vals.reshape(*blocks.shape[:-1], MXFP4_BLOCK)  # [..., out, G, 32]
    e = scales.to(torch.int32) - 127  # [-127, 128]
    e1 = torch.div(e, 2, rounding_mode="floor")
    two = torch.tensor(2.0, dtype=work, device=blocks.device)
    vals = vals * torch.pow(two, e1).unsqueeze(-1) * torch.pow(two, e - e1).unsqueeze(-1)
    assert MXFP4_BLOCK == 2 * MXFP4_BLOCK_BYTES
    return vals.reshape(out_shape).to(dtype)
