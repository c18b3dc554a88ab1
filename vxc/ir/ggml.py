"""ggml block encodings: the table of block-quantised formats vxc decodes, pure Python (no torch, no numpy).

A ggml block-quantised row of ``n`` values is stored as ``n / block_size`` blocks of ``type_size`` bytes
each, laid end to end; a tensor of them is ``u8 [..., rows, row_bytes]`` with
``row_bytes = n / block_size * type_size``. Every multi-byte field is little-endian; ``f16`` is IEEE
half precision. The block layouts (field order, bytes) follow ggml's ``ggml-common.h``; block sizes,
type sizes and type ids are those of gguf-py's ``constants.py`` (``GGML_QUANT_SIZES``,
``GGMLQuantizationType``). ``vxc.runtime.ggml_blocks`` decodes (and for some, encodes) them.

Decoded value of element ``i`` (all arithmetic in fp32, in the order written):

``q8_0``  ``qs[i] * d``                                    (``qs`` int8)
``q4_0``  ``d * (nib[i] - 8)``                             (nibble ``i % 16`` of ``qs``, low nibbles first)
``q4_1``  ``(d * nib[i]) + m``
``q5_0``  ``d * ((nib[i] | hbit[i] << 4) - 16)``           (``hbit[i]``: bit ``i`` of the 32-bit ``qh``)
``q5_1``  ``(d * (nib[i] | hbit[i] << 4)) + m``
``q2_k``  ``(d * sc_j) * q - (dmin * m_j)``                (16 groups of 16; 2-bit ``q``)
``q3_k``  ``(d * (s_j - 32)) * q``                         (16 groups of 16; ``q`` in -4..3, 6-bit ``s_j``)
``q4_k``  ``(d * sc_j) * q - (dmin * m_j)``                (8 groups of 32; 6-bit ``sc_j``, ``m_j``)
``q5_k``  ``(d * sc_j) * q - (dmin * m_j)``                (as q4_k with a fifth bit from ``qh``)
``q6_k``  ``(d * s_j) * (q - 32)``                         (16 groups of 16; int8 ``s_j``, 6-bit ``q``)
``tq2_0``  ``d * (q - 1)``                              (one f16 ``d`` per 256; 2-bit ``q`` in 0..2, q2_k's order)
``tq1_0``  ``d * (q - 1)``                              (one f16 ``d`` per 256; base-3 digits ``q``, 5 a byte in
                                                            ``qs``, 4 a byte in ``qh``: ``((b 3^k mod 256) 3) >> 8``)
``iq4_nl`` ``d * kv[nib[i]]``                               (as q4_0's nibbles; ``kv``: ggml's 16 non-linear int8 levels)
``iq4_xs`` ``(d * (s_j - 32)) * kv[nib[i]]``                (8 groups of 32, each as an iq4_nl block; 6-bit ``s_j``:
                                                            4 low bits from ``scales_l``, 2 high from ``scales_h``)

The grid formats (ggml's "i-quants" below 4 bits): values come 8 (4 for iq3) at a time as one entry of a fixed
grid of small positive integers (ggml's ``iq2xxs_grid`` … ``iq1s_grid``; vxc reads the grids from gguf-py's
``gguf.quants``, never a copy of its own), with a sign per value for the iq2 / iq3 ones:

``iq2_xxs`` ``((d * (0.5 + s_j)) * 0.25) * grid[k] * sign``  (8 groups of 32, each two u32: 4 grid bytes; 4 x 7-bit sign
                                                            indices into ggml's ``ksigns_iq2xs``, 4-bit ``s_j`` on top)
``iq2_xs``  ``((d * (0.5 + s_j)) * 0.25) * grid[k] * sign``  (16 groups of 16; u16 codes: 9-bit grid index, 7-bit sign
                                                            index; 4-bit ``s_j`` from ``scales``)
``iq2_s``   ``((d * (0.5 + s_j)) * 0.25) * grid[k] * sign``  (as iq2_xs with a 10-bit index: 8 bits in ``qs``, 2 in
                                                            ``qh``; one explicit sign bit per value in ``signs``)
``iq3_xxs`` ``((d * (0.5 + s_j)) * 0.5) * grid[k] * sign``   (8 groups of 32: 8-bit indices into a grid of 4-value
                                                            entries; a u32 per group of 4 x 7-bit sign indices and ``s_j``)
``iq3_s``   ``(d * (1 + 2 s_j)) * grid[k] * sign``           (8 groups of 32: 9-bit indices, 8 bits in ``qs``, 1 in ``qh``;
                                                            explicit sign bits; 4-bit ``s_j``)
``iq1_s``   ``(d * (2 s_j + 1)) * (grid[k] + delta_j)``      (8 groups of 32; u16 ``qh`` per group: 3 high bits of each
                                                            of 4 11-bit indices, 3-bit ``s_j``, the sign of
                                                            ``delta_j = +-0.125``; grid values -1, 0, 1)
``iq1_m``   ``(d * (2 s_j + 1)) * (grid[k] + delta_k)``      (16 groups of 16; ``d`` an f16 spread over the top nibbles of
                                                            the four u16 ``scales``; a ``delta`` sign per grid entry)
"""

from __future__ import annotations

from dataclasses import dataclass

from .diagnostics import VxcError

__all__ = ["ACTIVATION_PRECISIONS", "ENCODINGS", "GRID_ENCODINGS", "BlockEncoding", "GGMLError", "encoding", "logical_cols", "row_bytes"]

# what a ggml-encoded operand may declare as the precision of the activations its products take (``activations``
# in the IR; absent: x as given): "int8_block32" — each row of x quantised per 32-value block to int8 with an fp32
# scale d = amax / 127, q = round-half-even(x / d) (0 for an all-zero block): ggml's q8_0 dot-product operand,
# with an fp32 d
ACTIVATION_PRECISIONS = ("int8_block32",)

QK_K = 256  # values per k-quant super-block


class GGMLError(VxcError, ValueError):
    """A shape or name that no ggml block encoding accepts (a user-facing refusal, and a ValueError)."""


@dataclass(frozen=True)
class BlockEncoding:
    name: str  # lowercase, as the IR writes it: "q4_k"
    ggml_type: int  # GGMLQuantizationType value
    block_size: int  # values per block
    type_size: int  # bytes per block
    fields: tuple[tuple[str, int], ...]  # the block's fields in storage order: (name, bytes)

    def __post_init__(self) -> None:
        assert sum(b for _, b in self.fields) == self.type_size, self.name


def _enc(name: str, ggml_type: int, block_size: int, *fields: tuple[str, int]) -> BlockEncoding:
    return BlockEncoding(name, ggml_type, block_size, sum(b for _, b in fields), tuple(fields))


ENCODINGS: dict[str, BlockEncoding] = {e.name: e for e in (
    _enc("q4_0", 2, 32, ("d:f16", 2), ("qs", 16)),
    _enc("q4_1", 3, 32, ("d:f16", 2), ("m:f16", 2), ("qs", 16)),
    _enc("q5_0", 6, 32, ("d:f16", 2), ("qh", 4), ("qs", 16)),
    _enc("q5_1", 7, 32, ("d:f16", 2), ("m:f16", 2), ("qh", 4), ("qs", 16)),
    _enc("q8_0", 8, 32, ("d:f16", 2), ("qs:i8", 32)),
    _enc("q2_k", 10, QK_K, ("scales", QK_K // 16), ("qs", QK_K // 4), ("d:f16", 2), ("dmin:f16", 2)),
    _enc("q3_k", 11, QK_K, ("hmask", QK_K // 8), ("qs", QK_K // 4), ("scales", 12), ("d:f16", 2)),
    _enc("q4_k", 12, QK_K, ("d:f16", 2), ("dmin:f16", 2), ("scales", 12), ("qs", QK_K // 2)),
    _enc("q5_k", 13, QK_K, ("d:f16", 2), ("dmin:f16", 2), ("scales", 12), ("qh", QK_K // 8), ("qs", QK_K // 2)),
    _enc("q6_k", 14, QK_K, ("ql", QK_K // 2), ("qh", QK_K // 4), ("scales:i8", QK_K // 16), ("d:f16", 2)),
    _enc("iq4_nl", 20, 32, ("d:f16", 2), ("qs", 16)),
    _enc("iq4_xs", 23, QK_K, ("d:f16", 2), ("scales_h", 2), ("scales_l", QK_K // 64), ("qs", QK_K // 2)),
    _enc("iq2_xxs", 16, QK_K, ("d:f16", 2), ("qs", QK_K // 4)),
    _enc("iq2_xs", 17, QK_K, ("d:f16", 2), ("qs", QK_K // 4), ("scales", QK_K // 32)),
    _enc("iq2_s", 22, QK_K, ("d:f16", 2), ("qs", QK_K // 8), ("signs", QK_K // 8), ("qh", QK_K // 32), ("scales", QK_K // 32)),
    _enc("iq3_xxs", 18, QK_K, ("d:f16", 2), ("qs", QK_K // 4), ("scales_signs", QK_K // 8)),
    _enc("iq3_s", 21, QK_K, ("d:f16", 2), ("qs", QK_K // 4), ("qh", QK_K // 32), ("signs", QK_K // 8), ("scales", QK_K // 64)),
    _enc("iq1_s", 19, QK_K, ("d:f16", 2), ("qs", QK_K // 8), ("qh", QK_K // 16)),
    _enc("iq1_m", 29, QK_K, ("qs", QK_K // 8), ("qh", QK_K // 16), ("scales_d", QK_K // 32)),
    _enc("tq1_0", 34, QK_K, ("qs", (QK_K - 4 * QK_K // 64) // 5), ("qh", QK_K // 64), ("d:f16", 2)),
    _enc("tq2_0", 35, QK_K, ("qs", QK_K // 4), ("d:f16", 2)),
)}
# the formats whose values are entries of a fixed grid (decoded with gguf-py's grids)
GRID_ENCODINGS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
# iq4_nl / iq4_xs: the value of each 4-bit code (ggml-common.h kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def is_block_encoded(name: str | None) -> bool:
    """Whether ``name`` is one of the ggml block encodings (not None, not MXFP4)."""
    return name in ENCODINGS


def encoding(name: str) -> BlockEncoding:
    """The table entry for ``name``; an unknown name is refused, listing the known ones."""
    e = ENCODINGS.get(name) if isinstance(name, str) else None
    if e is None:
        raise GGMLError(f"unknown ggml block encoding {name!r} (known: {', '.join(ENCODINGS)})")
    return e


def _count(what: str, v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GGMLError(f"{name}: {what} must be an int >= 0, not {v!r}")
    return v


def row_bytes(name: str, n: int) -> int:
    """Bytes of one stored row of ``n`` values; refused unless ``n`` is a whole number of blocks."""
    e = encoding(name)
    n = _count("the row length", n, name)
    if n % e.block_size:
        raise GGMLError(f"{name}: a row of {n} values is not a whole number of {e.block_size}-value blocks")
    return n // e.block_size * e.type_size


def logical_cols(name: str, row_bytes: int) -> int:
    """Values in one stored row of ``row_bytes`` bytes; refused unless it is a whole number of blocks."""
    e = encoding(name)
    nb = _count("the row's byte count", row_bytes, name)
    if nb % e.type_size:
        raise GGMLError(f"{name}: a row of {nb} bytes is not a whole number of {e.type_size}-byte blocks")
    return nb // e.type_size * e.block_size
