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
``iq4_nl`` ``d * kv[nib[i]]``                               (as q4_0's nibbles; ``kv``: ggml's 16 non-linear int8 levels)
``iq4_xs`` ``(d * (s_j - 32)) * kv[nib[i]]``                (8 groups of 32, each as an iq4_nl block; 6-bit ``s_j``:
                                                            4 low bits from ``scales_l``, 2 high from ``scales_h``)
"""

from __future__ import annotations

from dataclasses import dataclass

from .diagnostics import VxcError

__all__ = ["ACTIVATION_PRECISIONS", "ENCODINGS", "BlockEncoding", "GGMLError", "encoding", "logical_cols", "row_bytes"]

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
)}
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
