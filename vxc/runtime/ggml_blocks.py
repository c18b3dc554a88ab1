"""ggml block formats decoded and encoded with vectorised torch ops.

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

from ..ir.ggml import ENCODINGS, IQ4_LEVELS, GGMLError, encoding, logical_cols, row_bytes

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


def _iq4(qs: Tensor) -> Tensor:
    """Nibbles (q4_0's order) -> their iq4 levels as fp32."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=qs.device)
    return levels[_planes(qs, qs.shape[1] // 16, 4).long()]


def _dq_iq4_nl(b: Tensor) -> Tensor:
    d, qs = _fields(b, 2, 16)
    return _f16(d) * _iq4(qs)


def _dq_iq4_xs(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, sh, sl, qs = _fields(b, 2, 2, 4, 128)
    lo = _planes(sl, 4, 4)  # scale j's low 4 bits: nibble j % 2 of byte j // 2
    hi = (sh[:, 0:1].to(torch.int32) | (sh[:, 1:2].to(torch.int32) << 8)) >> torch.arange(0, 16, 2, device=b.device)
    sc = (lo.to(torch.int32) | ((hi & 3) << 4)) - 32
    dl = (_f16(d) * _f32(sc)).view(n, 8, 1)
    return (dl * _iq4(qs).view(n, 8, 32)).view(n, 256)


# ------------------------------------------------------------------------------- the grid formats (i-quants)
# ggml's grids and sign table as gguf-py holds them (``gguf.quants``: the classes' ``grid`` after ``init_grid``,
# ``IQ2_XXS.ksigns``): the one source of these tables in vxc (the native library is handed the same bytes)
_GRID_CLASS = {"iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_s": "IQ2_S", "iq3_xxs": "IQ3_XXS", "iq3_s": "IQ3_S",
               "iq1_s": "IQ1_S", "iq1_m": "IQ1_S"}


def grid_table(name: str) -> Tensor:
    """The grid of encoding ``name`` as int8 ``[entries, values per entry]`` (iq1: -1 / 0 / 1)."""
    import gguf.quants as gq

    cls = getattr(gq, _GRID_CLASS[name])
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).astype("int8"))


def ksigns_table() -> Tensor:
    """ggml's ``ksigns_iq2xs`` (uint8 [128]): a 7-bit index -> 8 sign bits (the eighth makes the parity even)."""
    import gguf.quants as gq

    return torch.frombuffer(bytearray(gq.IQ2_XXS.ksigns), dtype=torch.uint8)


_TABLES: dict = {}


def _grid(name: str, device: torch.device) -> Tensor:
    """fp32 grid of ``name`` on ``device`` (cached)."""
    key = (_GRID_CLASS[name], str(device))
    if key not in _TABLES:
        _TABLES[key] = grid_table(name).to(torch.float32).to(device)
    return _TABLES[key]


def _sign_bits(bits: Tensor) -> Tensor:
    """Bytes ``[...]`` -> ``[..., 8]`` fp32: -1 where bit i is set, else 1."""
    one = torch.ones((), dtype=torch.float32, device=bits.device)
    b = (bits.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=bits.device, dtype=torch.int32)) & 1
    return torch.where(b == 0, one, -one)


def _ksigns(idx: Tensor) -> Tensor:
    """7-bit sign indices ``[...]`` (int) -> ``[..., 8]`` fp32 signs through ``ksigns_iq2xs``."""
    key = ("ksigns", str(idx.device))
    if key not in _TABLES:
        _TABLES[key] = ksigns_table().to(idx.device)
    return _sign_bits(_TABLES[key][idx.long()])


def _aligned(b: Tensor, k: int) -> Tensor:
    """``b`` contiguous and starting at a multiple of ``k`` bytes of its storage (a view as a k-byte type needs it)."""
    b = b.contiguous()
    if b.storage_offset() % k or any(st % k for st in b.stride()[:-1]):  # (a one-row slice keeps its row's stride)
        b = b.clone(memory_format=torch.contiguous_format)
    return b


def _u16(b: Tensor) -> Tensor:
    """Bytes ``[N, 2k]`` -> the k little-endian u16 as int32 ``[N, k]``."""
    return _aligned(b, 2).view(torch.int16).to(torch.int32) & 0xFFFF


def _u32(b: Tensor) -> Tensor:
    """Bytes ``[N, 4k]`` -> the k little-endian u32 as int64 ``[N, k]``."""
    return _aligned(b, 4).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _nibbles(b: Tensor) -> Tensor:
    """Bytes ``[N, k]`` -> ``[N, 2k]``: each byte's low nibble, then its high one."""
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], 2 * b.shape[1])


def _dq_iq2_xxs(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs = _fields(b, 2, 64)
    aux = _u32(qs).view(n, 8, 2)
    db = (_f16(d) * (0.5 + _f32(aux[..., 1] >> 28))) * 0.25  # [n, 8]
    signs = _ksigns((aux[..., 1:2] >> torch.arange(0, 28, 7, device=b.device)) & 127)  # [n, 8, 4, 8]
    grid = _grid("iq2_xxs", b.device)[qs.reshape(n, 8, 8)[..., :4].long()]  # [n, 8, 4, 8]
    return (db.view(n, 8, 1, 1) * grid * signs).reshape(n, 256)


def _iq2_scales(sc: Tensor, d: Tensor, n: int) -> Tensor:
    """iq2_xs / iq2_s: 16 4-bit scales -> ``(d * (0.5 + s)) * 0.25`` as ``[n, 16, 1, 1]``."""
    return ((d * (0.5 + _f32(_nibbles(sc)))) * 0.25).view(n, 16, 1, 1)


def _dq_iq2_xs(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs, sc = _fields(b, 2, 64, 8)
    q = _u16(qs)  # [n, 32]: 9-bit grid index, 7-bit sign index
    grid = _grid("iq2_xs", b.device)[(q & 511).long()].view(n, 16, 2, 8)
    return (_iq2_scales(sc, _f16(d), n) * grid * _ksigns(q >> 9).view(n, 16, 2, 8)).reshape(n, 256)


def _dq_iq2_s(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs, sg, qh, sc = _fields(b, 2, 32, 32, 8, 8)
    hi = (qh.to(torch.int32).unsqueeze(-1) >> torch.arange(0, 8, 2, device=b.device, dtype=torch.int32)) & 3
    idx = qs.to(torch.int32) | (hi.reshape(n, 32) << 8)
    grid = _grid("iq2_s", b.device)[idx.long()].view(n, 16, 2, 8)
    return (_iq2_scales(sc, _f16(d), n) * grid * _sign_bits(sg).view(n, 16, 2, 8)).reshape(n, 256)


def _dq_iq3_xxs(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs, ss = _fields(b, 2, 64, 32)
    aux = _u32(ss)  # [n, 8]
    db = ((_f16(d) * (0.5 + _f32(aux >> 28))) * 0.5).view(n, 8, 1, 1)
    signs = _ksigns((aux.unsqueeze(-1) >> torch.arange(0, 28, 7, device=b.device)) & 127)  # [n, 8, 4, 8]
    grid = _grid("iq3_xxs", b.device)[qs.long()].view(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _dq_iq3_s(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs, qh, sg, sc = _fields(b, 2, 64, 8, 32, 4)
    db = (_f16(d) * _f32(1 + 2 * _nibbles(sc).to(torch.int32))).view(n, 8, 1, 1)
    hi = (qh.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=b.device, dtype=torch.int32)) & 1
    idx = qs.to(torch.int32) | (hi.reshape(n, 64) << 8)
    grid = _grid("iq3_s", b.device)[idx.long()].view(n, 8, 4, 8)
    return (db * grid * _sign_bits(sg).view(n, 8, 4, 8)).reshape(n, 256)


def _iq1_delta(bit: Tensor) -> Tensor:
    """+0.125 where ``bit`` is 0, else -0.125 (fp32)."""
    v = torch.full((), 0.125, dtype=torch.float32, device=bit.device)
    return torch.where(bit == 0, v, -v)


def _dq_iq1_s(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, qs, qh = _fields(b, 2, 32, 16)
    h = _u16(qh)  # [n, 8]
    dl = (_f16(d) * _f32(2 * ((h >> 12) & 7) + 1)).view(n, 8, 1, 1)
    delta = _iq1_delta(h & 0x8000).view(n, 8, 1, 1)
    idx = qs.to(torch.int32).view(n, 8, 4) | (((h.unsqueeze(-1) >> torch.arange(0, 12, 3, device=b.device)) & 7) << 8)
    grid = _grid("iq1_s", b.device)[idx.long()]  # [n, 8, 4, 8]
    return (dl * (grid + delta)).reshape(n, 256)


def _dq_iq1_m(b: Tensor) -> Tensor:
    n = b.shape[0]
    qs, qh, sc = _fields(b, 32, 16, 8)
    s = _u16(sc)  # [n, 4]: 4 x 3-bit scales each, and a nibble of d on top
    dbits = ((s[:, 0] >> 12) | ((s[:, 1] >> 8) & 0xF0) | ((s[:, 2] >> 4) & 0xF00) | (s[:, 3] & 0xF000)).view(n, 1)
    d = dbits.to(torch.int16).view(torch.float16).to(torch.float32)
    ls = (s.unsqueeze(-1) >> torch.arange(0, 12, 3, device=b.device)) & 7  # [n, 4, 4] -> 16 scales
    dl = (d * _f32(2 * ls.reshape(n, 16) + 1)).view(n, 16, 1, 1)
    nib = _nibbles(qh).to(torch.int32)  # [n, 32]: one per grid entry
    idx = qs.to(torch.int32) | ((nib & 7) << 8)
    grid = _grid("iq1_m", b.device)[idx.long()].view(n, 16, 2, 8)
    return (dl * (grid + _iq1_delta(nib & 8).view(n, 16, 2, 1))).reshape(n, 256)


# the ternary formats: values -1, 0, 1 times one f16 d per 256-value block
def _dq_tq2_0(b: Tensor) -> Tensor:
    """tq2_0: 2-bit codes 0..2 in q2_k's plane order (per 128-value half, byte ``l``'s bits ``2k`` give value
    ``32k + l``), value ``d * (code - 1)``."""
    qs, d = _fields(b, 64, 2)
    return _f16(d) * (_f32(_planes(qs, 2, 2)) - 1)


# tq1_0's base-3 digits: byte v's digit k is ``((v * 3^k mod 256) * 3) >> 8`` (each byte holds 5 digits, the
# stored byte ``ceil(n * 256 / 243)`` of their base-3 number n, most significant digit first)
_POW3 = (1, 3, 9, 27, 81)


def _tq1_digits(v: Tensor, k: int) -> Tensor:
    """Bytes ``[N, L]`` -> ``[N, k * L]``: digit 0 of every byte, then digit 1, ... (values 0..2)."""
    w = v.to(torch.int32).unsqueeze(1) * torch.tensor(_POW3[:k], dtype=torch.int32, device=v.device).view(1, k, 1)
    return (((w & 255) * 3) >> 8).reshape(v.shape[0], k * v.shape[1])


def _dq_tq1_0(b: Tensor) -> Tensor:
    """tq1_0: 48 bytes of 5 digits each (values 0..159 from bytes 0..31, digit k of byte l value ``32k + l``;
    values 160..239 from bytes 32..47, ``160 + 16k + l``), 4 bytes of 4 digits (values ``240 + 4k + l``), f16
    d; value ``d * (digit - 1)``."""
    qs, qh, d = _fields(b, 48, 4, 2)
    q = torch.cat((_tq1_digits(qs[:, :32], 5), _tq1_digits(qs[:, 32:], 5), _tq1_digits(qh, 4)), dim=1)
    return _f16(d) * (_f32(q) - 1)


DEQUANTIZE: dict[str, Callable[[Tensor], Tensor]] = {
    "q8_0": _dq_q8_0, "q4_0": _dq_q4_0, "q4_1": _dq_q4_1, "q5_0": _dq_q5_0, "q5_1": _dq_q5_1,
    "q2_k": _dq_q2_k, "q3_k": _dq_q3_k, "q4_k": lambda b: _dq_k45(b, False), "q5_k": lambda b: _dq_k45(b, True),
    "q6_k": _dq_q6_k, "iq4_nl": _dq_iq4_nl, "iq4_xs": _dq_iq4_xs, "iq2_xxs": _dq_iq2_xxs, "iq2_xs": _dq_iq2_xs,
    "iq2_s": _dq_iq2_s, "iq3_xxs": _dq_iq3_xxs, "iq3_s": _dq_iq3_s, "iq1_s": _dq_iq1_s, "iq1_m": _dq_iq1_m,
    "tq1_0": _dq_tq1_0, "tq2_0": _dq_tq2_0,
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
    """``trunc(v)`` as uint8 codes, clipped to ``0..hi``. Both references cast before they clip, and the cast of
    an infinite or NaN value (``v = x * inf`` where an fp32 ``d`` is so small that ``1 / d`` overflows: blocks
    of subnormal values) gives 0 on x86 (gguf-py's ``astype(np.uint8)``, ggml's ``(int8_t)``): 0 here too."""
    t = torch.trunc(v)
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t)).clamp(0, hi).to(torch.uint8)


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


def _roundf(v: Tensor) -> Tensor:
    """C's ``roundf`` (half away from zero), exactly as the references compute it."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


def _q_q8_0(x: Tensor) -> Tensor:
    d = _div(x.abs().amax(dim=1, keepdim=True), 127.0)
    q = torch.nan_to_num(_roundf(x * _inv(d)), nan=0.0).clamp(-127, 127).to(torch.int8).view(torch.uint8)
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


# ---------------------------------------------------------------------------------------------- k-quant encoders
# ggml's reference encoders (ggml-quants.c: quantize_row_q2_K_ref / q4_K_ref / q5_K_ref with make_qkx2_quants,
# quantize_row_q3_K_ref with make_q3_quants, quantize_row_q6_K_ref with make_qx_quants), what the ggml quantize
# tool runs without an importance matrix. They search each group's scale (and min) over fixed candidate steps
# (q3_k: value-by-value refinement passes), so the bytes depend on every fp32 rounding of that search: sums are
# accumulated one element after another as the C loops do (``_seq_sum``), candidates are taken in the reference's
# order with its strict comparisons (in q4_k a step that wins moves the min the later steps start from, so the
# steps run one after another, each over all groups), ``sqrtf`` is correctly rounded (``_sqrtf``) and
# ``nearest_int`` is the reference's bit trick, out-of-range values included. ggml-base is compiled without FMA
# contraction, so every product and sum here rounds on its own.
_GROUP_MAX_EPS = 1e-15  # ggml's GROUP_MAX_EPS, as an fp32 constant
_CHUNK = 1 << 16  # groups searched at once (bounds q6_k's [groups, candidates, values] temporaries)


def _seq_sum(t: Tensor, init: Tensor | None = None) -> Tensor:
    """``acc = init (or 0); for i: acc += t[..., i]``: fp32, in index order (torch's reductions pair terms)."""
    acc = torch.zeros_like(t[..., 0]) if init is None else init
    for i in range(t.shape[-1]):
        acc = acc + t[..., i]
    return acc


def _nearest_int(v: Tensor) -> Tensor:
    """ggml's ``nearest_int``: ``v + 12582912.f``, the low 23 bits of the sum, less ``0x400000`` (int32).
    Round half to even for ``|v| <= 4194303``; beyond (the reference only asserts it) the same bits it gives."""
    bits = (v + 12582912.0).view(torch.int32)
    return (bits & 0x7FFFFF) - 0x400000


def _sqrtf(v: Tensor) -> Tensor:
    """``sqrtf`` correctly rounded (``v >= 0`` fp32). torch's fp32 (and fp64) sqrt is not on every CPU (its
    AVX-512 path is off by an ulp for ~15% of inputs): the fp64 root rounded to fp32, then moved to the
    neighbour whose side of the midpoint it is on (midpoints and their squares are exact in fp64)."""
    r = torch.sqrt(v.double()).float()
    d, rd = v.double(), r.double()
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    dn = torch.nextafter(r, torch.zeros_like(r))
    hi, lo = (rd + up.double()) / 2, (rd + dn.double()) / 2
    r = torch.where(hi * hi < d, up, r)
    return torch.where((lo * lo > d) & (r > 0), dn, r)


def _f32c(ref: Tensor, v: float) -> Tensor:
    return torch.full((), v, dtype=torch.float32, device=ref.device)


def _first_max(v: Tensor) -> Tensor:
    """Index of the first maximal element of each row, NaN never chosen (``if (v > best)`` from ``best = 0``)."""
    return torch.where(torch.isnan(v), torch.zeros_like(v), v).argmax(dim=-1, keepdim=True)


def _make_qkx2_quants(x: Tensor, w: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                      use_mad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """make_qkx2_quants on groups ``x [M, n]`` with weights ``w``: codes ``L`` (int32 ``[M, n]``), the scale and
    ``the_min`` (``[M]``; the stored min is ``-the_min``). The error is ``sum w * diff^2`` or, with ``use_mad``
    (q2_k), ``sum w * |diff|``. The candidate steps run one after another: a step that lowers the error
    replaces the min the later steps offset and scale by."""
    mn = x.gather(1, x.argmin(dim=1, keepdim=True)).squeeze(1)  # first occurrence, as ``if (x < min)``
    mx = x.gather(1, x.argmax(dim=1, keepdim=True)).squeeze(1)
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)
    flat = mx == mn  # all codes 0, the_min = -min, scale 0 (no search)
    sum_w = _seq_sum(w[:, 1:], w[:, 0])
    sum_x = _seq_sum(w[:, 1:] * x[:, 1:], w[:, 0] * x[:, 0])

    def codes(iscale: Tensor, mn: Tensor) -> Tensor:
        rng = torch.where(flat, torch.ones_like(mx), mx - mn)
        return _nearest_int((iscale / rng)[:, None] * (x - mn[:, None])).clamp(0, nmax)

    def error(scale: Tensor, mn: Tensor, L: Tensor) -> Tensor:
        diff = (scale[:, None] * L.to(torch.float32) + mn[:, None]) - x
        return _seq_sum(w * (diff.abs() if use_mad else diff * diff))

    L = codes(torch.full_like(mx, float(nmax)), mn)
    scale = torch.ones_like(mx) / (torch.full_like(mx, float(nmax)) / torch.where(flat, torch.ones_like(mx), mx - mn))
    best = error(scale, mn, L)
    for s in range(nstep + 1):
        step = (_f32c(x, rmin) + _f32c(x, rdelta) * float(s)) + float(nmax)
        la = codes(step.expand_as(mx), mn)
        lf = la.to(torch.float32)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _seq_sum(torch.stack((wl, wl * lf, wl * x), dim=1)).unbind(1)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min, la)
        take = (D > 0) & (cur < best) & ~flat  # ``if (cur_error < best_error)``
        L = torch.where(take[:, None], la, L)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    return torch.where(flat[:, None], torch.zeros_like(L), L), torch.where(flat, torch.zeros_like(scale), scale), -mn


def _make_qx_quants(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """make_qx_quants with ``rmse_type = 1`` and no importance weights on groups ``x [M, n]``: codes
    ``L = l + nmax`` (int32 ``[M, n]``; 0 for a group below GROUP_MAX_EPS) and the scale ``[M]``."""
    at = _first_max(x.abs())
    mx = x.gather(1, at).squeeze(1)
    zero = mx.abs() < _f32c(x, _GROUP_MAX_EPS)
    safe = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x

    def candidate(iscale: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # iscale [M, k] -> l [M, k, n], sums [M, k]
        lf = _nearest_int(iscale[:, :, None] * x[:, None, :]).clamp(-nmax, nmax - 1).to(torch.float32)
        wl = w[:, None, :] * lf
        s = _seq_sum(torch.stack(((w[:, None, :] * x[:, None, :]) * lf, wl * lf), dim=-1).transpose(-1, -2))
        return lf, s[..., 0], s[..., 1]

    iscale = (torch.full_like(safe, float(-nmax)) / safe)[:, None]
    lf, sumlx, suml2 = candidate(iscale)
    L, sumlx, suml2 = lf[:, 0], sumlx[:, 0], suml2[:, 0]
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(suml2))
    best = scale * sumlx
    steps = torch.tensor([s for s in range(-9, 10) if s], dtype=torch.float32, device=x.device)
    isc = (-(float(nmax) + _f32c(x, 0.1) * steps))[None, :] / safe[:, None]
    lf, sumlx, suml2 = candidate(isc)
    for k in range(steps.numel()):  # ``if (suml2 > 0 && sumlx*sumlx > best*suml2)``, in step order
        take = (suml2[:, k] > 0) & (sumlx[:, k] * sumlx[:, k] > best * suml2[:, k])
        scale = torch.where(take, sumlx[:, k] / suml2[:, k], scale)
        best = torch.where(take, scale * sumlx[:, k], best)
        L = torch.where(take[:, None], lf[:, k], L)
    L = (L + nmax).to(torch.int32)
    return torch.where(zero[:, None], torch.zeros_like(L), L), torch.where(zero, torch.zeros_like(scale), scale)


def _chunked(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        step = max(1, _CHUNK * 32 // x.shape[1])
        parts = [f(x[i:i + step]) for i in range(0, x.shape[0], step)]
        return torch.cat(parts) if parts else f(x)
    return run


def _as_u8(v: Tensor) -> Tensor:
    """An int32 stored into a ``uint8_t`` (modulo 256, as C converts it)."""
    return (v & 0xFF).to(torch.uint8)


@_chunked
def _q_q4_k(x: Tensor) -> Tensor:
    n = x.shape[0]
    d16, dmin16, scales, L = _k45_scales(x, 15, -1.0, 20)
    qs = (L[:, 0::2] | (L[:, 1::2] << 4)).reshape(n, 128)  # groups 2g (low nibbles), 2g+1 (high) per 32 bytes
    return torch.cat((d16, dmin16, scales, qs), dim=1)


def _k45_scales(x: Tensor, nmax: int, rmin: float, nstep: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q4_k's and q5_k's shared part (ggml's quantize_row_q4_K_ref / q5_K_ref): each 32-value group's scale and min
    searched (make_qkx2_quants, weights av + |x|), the eight quantised to 6 bits against the block's largest,
    then the codes 0..nmax under the stored scales. Returns (d16, dmin16, the 12 scale bytes, codes [n, 8, 32])."""
    n = x.shape[0]
    xs = x.reshape(n * 8, 32)
    av = _sqrtf(_seq_sum(xs * xs) / torch.full((), 32.0, device=x.device))
    L, sc, mins = _make_qkx2_quants(xs, av[:, None] + xs.abs(), nmax, rmin, 0.1, nstep)
    sc, mins, L = sc.view(n, 8), mins.view(n, 8), L.view(n, 8, 32)
    zero = torch.zeros_like(sc)
    max_scale = torch.where(sc > 0, sc, zero).amax(dim=1, keepdim=True)  # ``if (scale > max_scale)`` from 0
    max_min = torch.where(mins > 0, mins, zero).amax(dim=1, keepdim=True)

    def six_bits(v: Tensor, top: Tensor) -> Tensor:
        inv = torch.where(top > 0, torch.full_like(top, 63.0) / top, torch.zeros_like(top))
        return torch.minimum(_as_u8(_nearest_int(inv * v)), torch.full_like(v, 63, dtype=torch.uint8))

    ls, lm = six_bits(sc, max_scale), six_bits(mins, max_min)
    d16, dmin16 = _f16_bytes(_div(max_scale, 63.0)), _f16_bytes(_div(max_min, 63.0))
    d = (_f16(d16) * _f32(ls))[:, :, None]
    dm = (_f16(dmin16) * _f32(lm))[:, :, None]
    x3 = x.view(n, 8, 32)
    q = _nearest_int((x3 + dm) / torch.where(d != 0, d, torch.ones_like(d))).clamp(0, nmax)
    L = torch.where(d != 0, q, L).to(torch.uint8)  # ``if (!d) continue``: the search's codes stay
    scales = torch.cat((
        (ls[:, :4] & 63) | ((ls[:, 4:] >> 4) << 6),
        (lm[:, :4] & 63) | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4),
    ), dim=1)
    return d16, dmin16, scales, L


@_chunked
def _q_q5_k(x: Tensor) -> Tensor:
    n = x.shape[0]
    d16, dmin16, scales, L = _k45_scales(x, 31, -0.5, 15)
    lo = L & 15  # [n, 8, 32]
    qs = (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(n, 128)  # groups 2g (low nibbles), 2g+1 (high) per 32 bytes
    hb = (L >> 4).to(torch.int32)  # the fifth bit of value i of group j: bit j of qh[i]
    qh = (hb << torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]).sum(dim=1).to(torch.uint8)
    return torch.cat((d16, dmin16, scales, qh, qs), dim=1)


@_chunked
def _q_q6_k(x: Tensor) -> Tensor:
    n = x.shape[0]
    L, sc = _make_qx_quants(x.reshape(n * 16, 16), 32)
    L, sc = L.view(n, 16, 16), sc.view(n, 16)
    at = _first_max(sc.abs())
    max_abs = sc.abs().gather(1, at)
    max_abs = torch.where(torch.isnan(max_abs), torch.zeros_like(max_abs), max_abs)
    zero = max_abs < _f32c(x, _GROUP_MAX_EPS)  # the whole block stored as zero bytes
    max_scale = torch.where(zero, -torch.ones_like(max_abs), sc.gather(1, at))
    iscale = torch.full_like(max_scale, -128.0) / max_scale
    d16 = _f16_bytes(torch.ones_like(iscale) / iscale)
    s8 = _as_u8(torch.minimum(_nearest_int(iscale * sc), torch.full_like(sc, 127, dtype=torch.int32)))
    d = (_f16(d16) * _f32(s8.view(torch.int8)))[:, :, None]
    q = _nearest_int(x.view(n, 16, 16) / torch.where(d != 0, d, torch.ones_like(d))).clamp(-32, 31) + 32
    L = torch.where(d != 0, q, L).to(torch.uint8).view(n, 2, 4, 32)  # 128-value halves, 32-value quarters
    ql = torch.cat(((L[:, :, 0] & 15) | ((L[:, :, 2] & 15) << 4), (L[:, :, 1] & 15) | ((L[:, :, 3] & 15) << 4)), dim=2)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = torch.cat((ql.reshape(n, 128), qh.reshape(n, 64), s8, d16), dim=1)
    return torch.where(zero, torch.zeros_like(out), out)


def _make_q3_quants(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """make_q3_quants with ``do_rmse = true`` on groups ``x [M, n]``: codes ``L = l + nmax`` (int32 ``[M, n]``; 0
    for a group below GROUP_MAX_EPS) and the scale ``[M]``. After the first guess (``l = nearest_int(-nmax / max
    * x)``), up to five passes revisit each value in turn, taking its re-rounded code where that raises
    ``sumlx^2 / suml2`` (weights ``x^2``): a pass changes the sums the later values of the same pass see, so the
    values are visited one after another, each over all groups. A pass that changes nothing leaves the state
    as it was (the reference's early ``break`` is then immaterial): the passes stop once one changes no group."""
    at = _first_max(x.abs())
    mx = x.gather(1, at).squeeze(1)
    zero = mx.abs() < _f32c(x, _GROUP_MAX_EPS)
    safe = torch.where(zero, torch.ones_like(mx), mx)
    iscale = torch.full_like(safe, float(-nmax)) / safe
    L = _nearest_int(iscale[:, None] * x).clamp(-nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = L.to(torch.float32)
    sumlx = _seq_sum(wx * lf)
    suml2 = _seq_sum((w * lf) * lf)
    L = [L[:, i] for i in range(x.shape[1])]
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(x.shape[1]):
            li = L[i].to(torch.float32)
            slx = sumlx - wx[:, i] * li
            sl2 = suml2 - (w[:, i] * li) * li
            pos = slx > 0
            new_l = _nearest_int((x[:, i] * sl2) / torch.where(pos, slx, torch.ones_like(slx))).clamp(-nmax, nmax - 1)
            nf = new_l.to(torch.float32)
            slx = slx + wx[:, i] * nf
            sl2 = sl2 + (w[:, i] * nf) * nf
            take = pos & (new_l != L[i]) & (sl2 > 0) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            L[i] = torch.where(take, new_l, L[i])
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
            changed |= take
        if not bool(changed.any()):
            break
    L = torch.stack(L, dim=1) + nmax
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(suml2))
    return torch.where(zero[:, None], torch.zeros_like(L), L), torch.where(zero, torch.zeros_like(scale), scale)


def _pack_2bit(L: Tensor) -> Tensor:
    """256 codes ``[n, 256]`` (0..3) -> 64 bytes: per 128-value half, byte ``l`` holds codes ``l``, ``l + 32``,
    ``l + 64``, ``l + 96`` in bits 0-1, 2-3, 4-5, 6-7."""
    q = L.view(L.shape[0], 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(L.shape[0], 64)


@_chunked
def _q_q2_k(x: Tensor) -> Tensor:
    """quantize_row_q2_K_ref: each 16-value group's scale and min searched (make_qkx2_quants, weights ``|x|``,
    the absolute error), both quantised to 4 bits against the block's largest (``nearest_int(15 / max * v)``,
    stored modulo 256 as C stores an int into a byte), then the codes 0..3 under the stored scales."""
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    L, sc, mins = _make_qkx2_quants(xs, xs.abs(), 3, -0.5, 0.1, 15, use_mad=True)
    sc, mins, L = sc.view(n, 16), mins.view(n, 16), L.view(n, 16, 16)
    zero = torch.zeros_like(sc)
    max_scale = torch.where(sc > 0, sc, zero).amax(dim=1, keepdim=True)  # ``if (scale > max_scale)`` from 0
    max_min = torch.where(mins > 0, mins, zero).amax(dim=1, keepdim=True)

    def four_bits(v: Tensor, top: Tensor) -> tuple[Tensor, Tensor]:  # (codes as int32, the f16 step's bytes)
        live = top > 0
        inv = torch.full_like(top, 15.0) / torch.where(live, top, torch.ones_like(top))
        codes = torch.where(live, _nearest_int(inv * v), torch.zeros_like(v, dtype=torch.int32))
        return codes, _f16_bytes(torch.where(live, _div(top, 15.0), torch.zeros_like(top)))

    ls, d16 = four_bits(sc, max_scale)
    lm, dmin16 = four_bits(mins, max_min)
    scales = _as_u8(ls) | _as_u8(lm << 4)
    d = (_f16(d16) * _f32(scales & 15))[:, :, None]
    dm = (_f16(dmin16) * _f32(scales >> 4))[:, :, None]
    q = _nearest_int((x.view(n, 16, 16) + dm) / torch.where(d != 0, d, torch.ones_like(d))).clamp(0, 3)
    L = torch.where(d != 0, q, L).to(torch.uint8).view(n, 256)  # ``if (!d) continue``: the search's codes stay
    return torch.cat((scales, _pack_2bit(L), d16, dmin16), dim=1)


@_chunked
def _q_q3_k(x: Tensor) -> Tensor:
    """quantize_row_q3_K_ref: each 16-value group's scale from make_q3_quants, the sixteen quantised to 6 bits
    against the one of largest magnitude (``nearest_int(-32 / max * s)``, clipped to -32..31, stored + 32),
    ``d = 1 / iscale``; then the codes -4..3 under the stored scales, their third bit in ``hmask``."""
    n = x.shape[0]
    L, sc = _make_q3_quants(x.reshape(n * 16, 16), 4)
    L, sc = L.view(n, 16, 16), sc.view(n, 16)
    at = _first_max(sc.abs())
    max_scale = sc.gather(1, at)
    live = (max_scale != 0) & ~torch.isnan(max_scale)  # ``if (max_scale)``, a NaN never chosen
    iscale = torch.full_like(max_scale, -32.0) / torch.where(live, max_scale, torch.ones_like(max_scale))
    ls = (_nearest_int(iscale * sc).to(torch.int8).to(torch.int32).clamp(-32, 31) + 32)  # ``int8_t l``
    ls = torch.where(live, ls, torch.zeros_like(ls)).to(torch.uint8)
    d16 = _f16_bytes(torch.where(live, torch.ones_like(iscale) / iscale, torch.zeros_like(iscale)))
    hi = ls >> 4  # scale j's top 2 bits: bits 2*(j//4) of byte 8 + j%4
    scales = torch.cat((
        (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4),
        hi[:, 0:4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:16] << 6),
    ), dim=1)
    d = (_f16(d16) * (_f32(ls) - 32))[:, :, None]
    q = _nearest_int(x.view(n, 16, 16) / torch.where(d != 0, d, torch.ones_like(d))).clamp(-4, 3) + 4
    L = torch.where(d != 0, q, L).to(torch.uint8).view(n, 256)  # ``if (!d) continue``: the search's codes stay
    hb = ((L >> 2) & 1).view(n, 8, 32).to(torch.int32)  # value j's third bit: bit j // 32 of hmask[j % 32]
    hmask = (hb << torch.arange(8, device=x.device, dtype=torch.int32)[None, :, None]).sum(dim=1).to(torch.uint8)
    return torch.cat((hmask, _pack_2bit(L & 3), scales, d16), dim=1)


def _best_index_iq4(v: Tensor) -> Tensor:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, v)``: the nearest of the 16 levels (ties to the upper one; below
    the first 0, above the last 15, NaN 15 as its binary search ends), int32."""
    lv = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=v.device)
    mu = torch.bucketize(v, lv, right=True).clamp(1, 15)  # val[mu - 1] <= v < val[mu] inside the range
    lo, hi = lv[mu - 1], lv[mu]
    idx = torch.where((v - lo) < (hi - v), mu - 1, mu)
    idx = torch.where(v <= lv[0], torch.zeros_like(idx), idx)
    idx = torch.where((v >= lv[15]) | torch.isnan(v), torch.full_like(idx, 15), idx)
    return idx.to(torch.int32)


def _iq4_sums(x: Tensor, w: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """``sumqx += w*q*x; sumq2 += w*q*q`` over each group's 32 values in order (q the chosen levels)."""
    q = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=x.device)[idx.long()]
    wq = w * q
    return _seq_sum(wq * x), _seq_sum(wq * q)


def _iq4_group_scales(x: Tensor) -> Tensor:
    """quantize_row_iq4_nl_impl's per-32 scale search (no importance matrix, ``ntry`` 7, as ggml's quantize tool runs it):
    ``x [G, 32]`` -> the scale ``d`` of each group (0 for a group whose largest magnitude is below 1e-15)."""
    w = x * x
    at = x.abs().argmax(dim=1, keepdim=True)  # ``if (ax > amax)`` from 0: the first largest magnitude
    mx = x.gather(1, at)
    amax = mx.abs().squeeze(1)
    live = amax >= _f32c(x, _GROUP_MAX_EPS)
    mxs = torch.where(live[:, None], mx, torch.ones_like(mx))
    d = (-mxs) / _f32c(x, -127.0)
    sqx, sq2 = _iq4_sums(x, w, _best_index_iq4((torch.ones_like(d) / d) * x))
    d = torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2)), torch.zeros_like(sq2))
    best = d * sqx
    for itry in range(-7, 8):
        idv = _f32c(x, float(itry - 127)) / mxs
        sqx, sq2 = _iq4_sums(x, w, _best_index_iq4(idv * x))
        take = (sq2 > 0) & (sqx * sqx > best * sq2)
        nd = sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2))
        d = torch.where(take, nd, d)
        best = torch.where(take, nd * sqx, best)
    return torch.where(live, d, torch.zeros_like(d))


def _iq4_pack(L: Tensor) -> Tensor:
    """Codes ``[N, 32 k]`` -> ``[N, 16 k]`` bytes, each 32 values nibble-packed as q4_0's (``_nibble_pack``)."""
    return _nibble_pack(L.to(torch.uint8).reshape(-1, 32)).reshape(L.shape[0], L.shape[1] // 2)


@_chunked
def _q_iq4_nl(x: Tensor) -> Tensor:
    """quantize_iq4_nl without an importance matrix (the quantize tool's IQ4_NL): the group's searched scale stored
    as f16, the codes the nearest levels of ``x / d`` (d the fp32 scale; 0 -> every code 8, the level 1)."""
    d = _iq4_group_scales(x)
    L = _best_index_iq4(_inv(d)[:, None] * x)
    return torch.cat((_f16_bytes(d[:, None]), _iq4_pack(L)), dim=1)


@_chunked
def _q_iq4_xs(x: Tensor) -> Tensor:
    """quantize_iq4_xs without an importance matrix (the quantize tool's IQ4_XS): each 32-value group's scale searched
    as iq4_nl's, then ``d = -max_scale / 32`` (max_scale the first of largest magnitude), each group's 6-bit scale
    ``l = clamp(nearest_int(s / d), -32, 31)``, its codes the nearest levels of ``x / (d l)``."""
    n = x.shape[0]
    if n == 0:
        return torch.zeros(0, 136, dtype=torch.uint8, device=x.device)
    sc = _iq4_group_scales(x.reshape(n * 8, 32)).view(n, 8)
    ms = sc.gather(1, _first_max(sc.abs()))  # ``if (abs_d > amax_scale)`` from 0: a NaN scale never chosen
    ms = torch.where(ms.abs() > 0, ms, torch.zeros_like(ms))
    d = (-ms) / _f32c(x, 32.0)
    ls = _nearest_int(_inv(d) * sc).clamp(-32, 31)
    L = _best_index_iq4((_inv(d * ls.to(torch.float32))[:, :, None] * x.view(n, 8, 32)).reshape(n, 256))
    u = (ls + 32).to(torch.int32)
    lo = (u & 15).to(torch.uint8)
    scales_l = lo[:, 0::2] | (lo[:, 1::2] << 4)
    hb = (u >> 4) << (2 * torch.arange(8, dtype=torch.int32, device=x.device))
    sh = hb.sum(dim=1, dtype=torch.int32)
    scales_h = torch.stack((sh & 255, sh >> 8), dim=1).to(torch.uint8)
    return torch.cat((_f16_bytes(d), scales_h, scales_l, _iq4_pack(L)), dim=1)


def _ternary(x: Tensor) -> tuple[Tensor, Tensor]:
    """tq1_0 / tq2_0 (gguf-py's encoders; ggml's ``quantize_row_tq*_0_ref``): ``d`` the block's absolute maximum,
    codes ``roundf(x / d) + 1`` (0..2, through ``x * (1 / d)``; all 1 where ``d = 0``)."""
    d = x.abs().amax(dim=1, keepdim=True)
    return d, (_roundf(x * _inv(d)).to(torch.int32) + 1).to(torch.uint8)


def _q_tq2_0(x: Tensor) -> Tensor:
    d, q = _ternary(x)
    return torch.cat((_pack_2bit(q), _f16_bytes(d)), dim=1)


def _tq1_pack(q: Tensor, k: int) -> Tensor:
    """Codes ``[N, 5 * L]`` (``k`` of the 5 digit planes present: ``[N, k * L]``) -> ``L`` bytes: the base-3
    number of each byte's digits (digit 0 most significant), stored as ``ceil(n * 256 / 243)``."""
    n = q.shape[0]
    w = torch.tensor(_POW3[::-1][:k], dtype=torch.int32, device=q.device).view(1, k, 1)
    v = (q.to(torch.int32).view(n, k, q.shape[1] // k) * w).sum(dim=1)
    return ((v * 256 + 242) // 243).to(torch.uint8)


def _q_tq1_0(x: Tensor) -> Tensor:
    d, q = _ternary(x)
    return torch.cat((_tq1_pack(q[:, :160], 5), _tq1_pack(q[:, 160:240], 5), _tq1_pack(q[:, 240:], 4),
                      _f16_bytes(d)), dim=1)


QUANTIZE: dict[str, Callable[[Tensor], Tensor]] = {
    "q8_0": _q_q8_0, "q4_0": _q_q4_0, "q4_1": _q_q4_1, "q5_0": _q_q5_0, "q5_1": _q_q5_1,
    "q2_k": _q_q2_k, "q3_k": _q_q3_k, "q4_k": _q_q4_k, "q5_k": _q_q5_k, "q6_k": _q_q6_k,
    "tq1_0": _q_tq1_0, "tq2_0": _q_tq2_0, "iq4_nl": _q_iq4_nl, "iq4_xs": _q_iq4_xs,
}


def quantize(encoding_name: str, x: Tensor) -> Tensor:
    """Encode ``x`` (floating ``[..., rows, cols]``, finite, taken as fp32; ``cols`` a whole number of blocks)
    to uint8 blocks ``[..., rows, row_bytes]`` on the input's device. The 32-value formats (q8_0, q4_0, q4_1,
    q5_0, q5_1) and the ternary tq1_0 / tq2_0 byte-for-byte what ``gguf.quants.quantize`` gives; q2_k, q3_k, q4_k, q5_k and q6_k what ggml's
    reference encoders (``quantize_row_q2_K_ref`` / ``q3_K_ref`` / ``q4_K_ref`` / ``q5_K_ref`` / ``q6_K_ref``, the
    ggml quantize tool without an importance matrix) write (gguf-py has no k-quant encoder;
    ``tests/ggml_quant_check.py`` compares with a ggml build); iq4_nl / iq4_xs what ggml's ``quantize_iq4_nl`` /
    ``quantize_iq4_xs`` write without an importance matrix (the quantize tool's IQ4_NL / IQ4_XS; checked there too)."""
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
