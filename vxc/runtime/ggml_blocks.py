"""ggml block formats decoded (and, for the 32-value formats, encoded) with vectorised torch ops.

Bit-compatible with ggml and with the ``gguf`` package's reference (``gguf.quants``): decoding computes in
fp32 in the reference's operation order (``d * q``, ``dl = d * sc``, ``ml = dmin * m``, ``dl * q - ml``), so
the fp32 results are equal bit for bit. (The order is in fact immaterial: an f16 scale has 11 significant
bits and every factor it meets is an integer of at most 12 bits -- ``sc * q`` included -- so every product
is exact in fp32 and a decode rounds at most once, in the final ``+ m`` / ``- ml``; a fused multiply-add
gives the same bits.) Encoding uses the reference's formulas (scale from the block's
absolute maximum or its range, reciprocal 0 for a zero scale, ``roundf`` / ``trunc(v + 0.5)`` rounding) and
gives the same bytes (one corner aside: in a q4_1 / q5_1 block whose minimum is a zero present with both
signs, the sign bit of the stored zero ``m`` (or ``d``) follows ggml's first-occurrence rule, where numpy's
reduction order decides it in gguf-py; the decoded values agree but for the sign of a decoded zero). In
q4_0 / q5_0 the maximum is gguf-py's (the first element of largest magnitude, so an all-zero block takes
the sign of its first zero), where ggml's loop starts from +0.0 and stores ``d = -0.0`` for any all-zero
block. The table of encodings (block and type sizes, ggml type ids, layouts) is
:mod:`vxc.ir.ggml`.

Every function works on whole tensors on any device, one op per step over all blocks at once. Divisions are
tensor / tensor: on CUDA torch computes a division by a Python scalar as a multiplication by its
reciprocal, which is not the reference's correctly rounded quotient (``x / 127`` would differ). Multi-byte
fields are read in the machine's byte order, which must be little-endian, as ggml stores them.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ir.ggml import ENCODINGS, GGMLError, encoding, logical_cols, row_bytes

__all__ = ["DEQUANTIZE", "QUANTIZE", "GGMLError", "dequantize", "quantize"]

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------- unpacking
def _fields(b: Tensor, *widths: int) -> list[Tensor]:
    """Split blocks ``[N, type_size]`` into consecutive byte fields of the given widths."""
    out, at = [], 0
    for w in widths:
        out.append(b[:, at:at + w])
        at += w
    assert at == b.shape[1]
    return out


def _f16(b: Tensor) -> Tensor:
    """Two bytes per block ``[N, 2]`` -> the f16 they hold, exactly widened to f32 ``[N, 1]``."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _planes(x: Tensor, groups: int, bits: int) -> Tensor:
    """Bytes ``[N, groups*L]`` -> ``[N, groups * (8/bits) * L]``: within each group of ``L`` bytes, the lowest
    ``bits`` of every byte, then the next ``bits`` of every byte, and so on (ggml's "plane" order)."""
    n, width = x.shape
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device).view(1, 1, -1, 1)
    planes = (x.reshape(n, groups, 1, width // groups) >> shifts) & ((1 << bits) - 1)
    return planes.reshape(n, width * 8 // bits)


def _bits_bytewise(x: Tensor) -> Tensor:
    """Bytes ``[N, B]`` -> bits ``[N, 8B]``: bit ``i`` is bit ``i % 8`` of byte ``i // 8`` (a little-endian word)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return ((x.unsqueeze(-1) >> shifts) & 1).reshape(x.shape[0], 8 * x.shape[1])


def _kquant_scale_min(s: Tensor) -> tuple[Tensor, Tensor]:
    """q4_k / q5_k: 12 bytes -> eight 6-bit scales and eight 6-bit mins ``[N, 8]`` each. Bytes 0-3 hold scales
    0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low
    nibbles of scales 4-7 (low half) and of mins 4-7 (high half)."""
    a, m, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 2) & 48)), dim=1)
    mn = torch.cat((m & 63, (c >> 4) | ((m >> 2) & 48)), dim=1)
    return sc, mn


def _f32(x: Tensor) -> Tensor:
    return x.to(torch.float32)


# ---------------------------------------------------------------------------------------------- decoders
# each: blocks u8 [N, type_size] -> fp32 [N, block_size]

def _dq_q8_0(b: Tensor) -> Tensor:
    d, qs = _fields(b, 2, 32)
    return _f32(qs.contiguous().view(torch.int8)) * _f16(d)


def _dq_q4_0(b: Tensor) -> Tensor:
    d, qs = _fields(b, 2, 16)
    return _f16(d) * (_f32(_planes(qs, 1, 4)) - 8)


def _dq_q4_1(b: Tensor) -> Tensor:
    d, m, qs = _fields(b, 2, 2, 16)
    return (_f16(d) * _f32(_planes(qs, 1, 4))) + _f16(m)


def _q5(qh: Tensor, qs: Tensor) -> Tensor:
    return _planes(qs, 1, 4) | (_bits_bytewise(qh) << 4)


def _dq_q5_0(b: Tensor) -> Tensor:
    d, qh, qs = _fields(b, 2, 4, 16)
    return _f16(d) * (_f32(_q5(qh, qs)) - 16)


def _dq_q5_1(b: Tensor) -> Tensor:
    d, m, qh, qs = _fields(b, 2, 2, 4, 16)
    return (_f16(d) * _f32(_q5(qh, qs))) + _f16(m)


def _dq_q2_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    sc, qs, d, dmin = _fields(b, 16, 64, 2, 2)
    dl = (_f16(d) * _f32(sc & 15)).view(n, 16, 1)
    ml = (_f16(dmin) * _f32(sc >> 4)).view(n, 16, 1)
    q = _f32(_planes(qs, 2, 2)).view(n, 16, 16)
    return (dl * q - ml).view(n, 256)


def _dq_q3_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    hmask, qs, sc, d = _fields(b, 32, 64, 12, 2)
    # 16 6-bit scales: low nibbles from bytes 0-7 (scales 0-7 low halves, 8-15 high halves),
    # top 2 bits from bytes 8-11 (scale j: bits 2*(j//4) of byte 8 + j%4)
    lo = torch.cat((sc[:, :8] & 15, sc[:, :8] >> 4), dim=1)
    hi = _planes(sc[:, 8:12], 1, 2)
    dl = (_f16(d) * (_f32(lo | (hi << 4)) - 32)).view(n, 16, 1)
    # 2 low bits from qs; the high bit set means no offset, clear means -4
    q = _f32(_planes(qs, 2, 2)) - _f32((_planes(hmask, 1, 1) ^ 1) << 2)
    return (dl * q.view(n, 16, 16)).view(n, 256)


def _dq_k45(b: Tensor, fifth_bit: bool) -> Tensor:
    n = b.shape[0]
    if fifth_bit:
        d, dmin, s, qh, qs = _fields(b, 2, 2, 12, 32, 128)
    else:
        d, dmin, s, qs = _fields(b, 2, 2, 12, 128)
    sc, mn = _kquant_scale_min(s)
    dl = (_f16(d) * _f32(sc)).view(n, 8, 1)
    ml = (_f16(dmin) * _f32(mn)).view(n, 8, 1)
    q = _planes(qs, 4, 4)
    if fifth_bit:
        q = q | (_planes(qh, 1, 1) << 4)
    return (dl * _f32(q).view(n, 8, 32) - ml).view(n, 256)


def _dq_q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql, qh, sc, d = _fields(b, 128, 64, 16, 2)
    dl = (_f16(d) * _f32(sc.contiguous().view(torch.int8))).view(n, 16, 1)
    q = _f32(_planes(ql, 2, 4) | (_planes(qh, 2, 2) << 4)) - 32
    return (dl * q.view(n, 16, 16)).view(n, 256)


DEQUANTIZE: dict[str, Callable[[Tensor], Tensor]] = {
    "q8_0": _dq_q8_0, "q4_0": _dq_q4_0, "q4_1": _dq_q4_1, "q5_0": _dq_q5_0, "q5_1": _dq_q5_1,
    "q2_k": _dq_q2_k, "q3_k": _dq_q3_k, "q4_k": lambda b: _dq_k45(b, False), "q5_k": lambda b: _dq_k45(b, True),
    "q6_k": _dq_q6_k,
}
assert set(DEQUANTIZE) == set(ENCODINGS)


def dequantize(encoding_name: str, blocks: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode ``blocks`` (uint8 ``[..., rows, row_bytes]``, whole blocks per row) to ``[..., rows, cols]``,
    ``cols = row_bytes / type_size * block_size``, on the input's device. Computed in fp32 (bit-exact with
    ``gguf.quants.dequantize``), then cast to ``dtype``."""
    enc = encoding(encoding_name)
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        got = blocks.dtype if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise GGMLError(f"{enc.name}: blocks must be a uint8 tensor, not {got}")
    if blocks.dim() < 1:
        raise GGMLError(f"{enc.name}: blocks must have a row dimension (got a 0-d tensor)")
    cols = logical_cols(enc.name, int(blocks.shape[-1]))
    flat = blocks.reshape(blocks.numel() // enc.type_size, enc.type_size)
    out = DEQUANTIZE[enc.name](flat).reshape(*blocks.shape[:-1], cols)
    return out if dtype == torch.float32 else out.to(dtype)


# ---------------------------------------------------------------------------------------------- encoders
# each: fp32 [N, 32] (finite) -> u8 [N, type_size]

def _div(a: Tensor, k: float) -> Tensor:
    """``a / k`` correctly rounded on every device (a tensor divisor, never a reciprocal multiply)."""
    return a / torch.full_like(a, k)


def _inv(d: Tensor) -> Tensor:
    """The reference's ``id = d == 0 ? 0 : 1 / d``."""
    inv = torch.ones_like(d) / torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), inv)


def _f16_bytes(x: Tensor) -> Tensor:
    """fp32 ``[N, 1]`` -> its f16 (round to nearest even) as 2 bytes ``[N, 2]``."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _codes(v: Tensor, hi: int) -> Tensor:
    """``trunc(v)`` as uint8 codes, clipped to ``0..hi`` (the reference clips after the cast; NaN -> 0)."""
    return torch.nan_to_num(torch.trunc(v), nan=0.0).clamp(0, hi).to(torch.uint8)


def _signed_absmax(x: Tensor) -> Tensor:
    """The element of largest magnitude, sign kept; the first one on a tie (numpy's argmax)."""
    return x.gather(1, x.abs().argmax(dim=1, keepdim=True))


def _nibble_pack(q: Tensor) -> Tensor:
    """32 codes -> 16 bytes: code ``j`` in the low nibble of byte ``j``, code ``j + 16`` in its high nibble."""
    return (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)


def _high_bits(q: Tensor) -> Tensor:
    """32 five-bit codes -> 4 bytes (a little-endian word): bit ``j`` is bit 4 of code ``j``."""
    bits = ((q >> 4) & 1).view(q.shape[0], 4, 8).to(torch.int32)
    weights = (torch.ones(8, dtype=torch.int32, device=q.device) << torch.arange(8, dtype=torch.int32, device=q.device))
    return (bits * weights).sum(dim=2).to(torch.uint8)


def _q_q8_0(x: Tensor) -> Tensor:
    d = _div(x.abs().amax(dim=1, keepdim=True), 127.0)
    v = x * _inv(d)
    # roundf (half away from zero), exactly as the reference computes it
    a = v.abs()
    fl = torch.floor(a)
    r = torch.sign(v) * (fl + torch.floor(2 * (a - fl)))
    q = torch.nan_to_num(r, nan=0.0).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=1)


def _q_sym(x: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """q4_0 / q5_0: ``d = max / -(levels/2)`` (``max`` the signed absolute maximum), codes
    ``trunc(x * id + levels/2 + 0.5)``."""
    half = levels // 2
    d = _div(_signed_absmax(x), -float(half))
    return d, _codes(x * _inv(d) + (half + 0.5), levels - 1)


def _q_affine(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """q4_1 / q5_1: ``d = (max - min) / (levels - 1)``, codes ``trunc((x - min) * id + 0.5)``. ``min`` and
    ``max`` are the first minimal / maximal elements, as ggml's loop finds them: it decides the sign of a zero
    ``min`` (and of ``d`` when ``max == min == 0``) in a block holding both +0.0 and -0.0, which numpy's
    ``min`` / ``max`` (gguf-py) leave to its SIMD reduction order."""
    mn = x.gather(1, x.argmin(dim=1, keepdim=True))
    mx = x.gather(1, x.argmax(dim=1, keepdim=True))
    d = _div(mx - mn, float(levels - 1))
    return d, mn, _codes((x - mn) * _inv(d) + 0.5, levels - 1)


def _q_q4_0(x: Tensor) -> Tensor:
    d, q = _q_sym(x, 16)
    return torch.cat((_f16_bytes(d), _nibble_pack(q)), dim=1)


def _q_q4_1(x: Tensor) -> Tensor:
    d, mn, q = _q_affine(x, 16)
    return torch.cat((_f16_bytes(d), _f16_bytes(mn), _nibble_pack(q)), dim=1)


def _q_q5_0(x: Tensor) -> Tensor:
    d, q = _q_sym(x, 32)
    return torch.cat((_f16_bytes(d), _high_bits(q), _nibble_pack(q)), dim=1)


def _q_q5_1(x: Tensor) -> Tensor:
    d, mn, q = _q_affine(x, 32)
    return torch.cat((_f16_bytes(d), _f16_bytes(mn), _high_bits(q), _nibble_pack(q)), dim=1)


QUANTIZE: dict[str, Callable[[Tensor], Tensor]] = {
    "q8_0": _q_q8_0, "q4_0": _q_q4_0, "q4_1": _q_q4_1, "q5_0": _q_q5_0, "q5_1": _q_q5_1,
}


def quantize(encoding_name: str, x: Tensor) -> Tensor:
    """Encode ``x`` (floating ``[..., rows, cols]``, finite, taken as fp32; ``cols`` a whole number of blocks)
    to uint8 blocks ``[..., rows, row_bytes]`` on the input's device, byte-for-byte what
    ``gguf.quants.quantize`` gives. Only the 32-value formats (q8_0, q4_0, q4_1, q5_0, q5_1): the reference
    encoders of the k-quants search their scales iteratively and gguf-py has none to be exact with."""
    enc = encoding(encoding_name)
    if enc.name not in QUANTIZE:
        raise GGMLError(f"{enc.name}: vxc does not encode this format (it encodes {', '.join(QUANTIZE)})")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise GGMLError(f"{enc.name}: values to encode must be a floating tensor, not {got}")
    if x.dim() < 1:
        raise GGMLError(f"{enc.name}: values to encode must have a row dimension (got a 0-d tensor)")
    nb = row_bytes(enc.name, int(x.shape[-1]))
    x = x.to(torch.float32)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise GGMLError(f"{enc.name}: values to encode must be finite (found NaN or inf)")
    out = QUANTIZE[enc.name](x.reshape(x.numel() // enc.block_size, enc.block_size))
    return out.reshape(*x.shape[:-1], nb)
