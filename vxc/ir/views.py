"""The binding model's view algebra: shapes only, pure Python (no torch).

An operand is a declared view of stored tensors (VINDEX3.md, "Binding"): an
optional decoding of several stored parts into one logical tensor, then a
chain of transforms applied in order. This module computes the shape every
step produces and refuses, with :class:`ViewError`, a step that does not
apply. ``vxc.runtime.views`` applies the same steps to tensors; both follow
the semantics written here.

Transforms (``vxc.ir.module.Transform``; dims are 0-based and never negative):

``slice dim [a:b]``
    keep indices ``a .. b-1`` of ``dim``; needs ``0 <= a < b <= size``.
``gather dim groups G [a0:b0, a1:b1, …]``
    view ``dim`` (size ``G*S``) as ``[G, S]``; for each take in order collect
    rows ``[a:b)`` of every group, group-major inside a take (group 0's rows,
    then group 1's, …), and concatenate the takes. Result size
    ``G * Σ(b-a)``. Needs ``G >= 1``, ``size % G == 0``, at least one take and
    ``0 <= a < b <= S`` for each. Takes may overlap or repeat.
    Examples: a fused per-key-head ``q|k|v|z`` block of ``Hk`` heads is
    ``gather 0 groups Hk [0:Dk, Dk:2Dk, 2Dk:2Dk+rDv]`` for q|k|v of all heads;
    the even columns of an interleaved gate/up ``[.., 2I]`` are
    ``gather 1 groups I [0:1]``, the odd ones ``[1:2]``.
``reshape [d0, d1, …]``
    same elements, new shape; one entry may be ``-1`` (inferred), the others
    must be positive.
``transpose d1 d2``
    swap two dims (``d1 == d2`` is the identity).
``log_neg``
    elementwise ``log(-x)``, shape unchanged (a float tensor; computed in fp64, then rounded back): a decay
    rate stored as ``A = -exp(A_log)`` (as a container may store it) read as the ``A_log`` its role means.

Concatenation (``concat DIM (part, part, …)``, ``Operand.parts``): each part is a source (plain or encoded)
with its own chain of transforms; the parts' views, of equal rank and equal in every dim but ``DIM``, are
concatenated along ``DIM``, then the operand's own transforms apply. Example: a latent attention's
per-head key up-projection stored transposed ``[H, R, N]`` and its value one ``[H, V, R]`` as the fused
``[H·(N+V), R]``: ``concat 1 ($k | transpose 1 2, $v) | reshape [H·(N+V), R]``.

Encodings (``Operand.encoding``) turn stored parts into one logical tensor:

``mxfp4`` (parts ``blocks``, ``scales``)
    ``blocks`` u8 ``[..., out, G, 16]`` (32 FP4 values per block, two per
    byte) and ``scales`` u8 ``[..., out, G]`` (one E8M0 exponent per block)
    decode to ``[..., out, G*32]``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .module import Operand, Tensor, Transform

Shape = tuple[int, ...]

TRANSFORM_KINDS = ("slice", "gather", "reshape", "transpose", "log_neg")

# encoding -> its parts, in the order an unnamed sequence of part shapes gives them
ENCODINGS: dict[str, tuple[str, ...]] = {"mxfp4": ("blocks", "scales")}


def _ggml() -> dict:
    """The ggml block formats (vxc.ir.ggml): each one part, the blocks."""
    from .ggml import ENCODINGS as GGML

    return GGML


def encoding_parts(encoding: str) -> tuple[str, ...] | None:
    """The part names of a known encoding, None for an unknown one."""
    if encoding in ENCODINGS:
        return ENCODINGS[encoding]
    return ("blocks",) if encoding in _ggml() else None
MXFP4_BLOCK = 32  # FP4 values per scale
MXFP4_BLOCK_BYTES = 16  # two values per byte


class ViewError(ValueError):
    """A declared view does not apply to the shape it is applied to."""


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def describe(t: Transform) -> str:
    """The transform as the IR writes it (without the leading ``|``)."""
    if t.kind == "slice":
        return f"slice {t.dim} [{t.start}:{t.stop}]"
    if t.kind == "gather":
        return f"gather {t.dim} groups {t.groups} [" + ", ".join(f"{a}:{b}" for a, b in t.takes) + "]"
    if t.kind == "reshape":
        return f"reshape {_fmt_shape(t.shape)}"
    if t.kind == "transpose":
        return f"transpose {t.dim} {t.dim2}"
    if t.kind == "log_neg":
        return "log_neg"
    return f"{t.kind} (unknown transform)"


def _check_shape(shape: Sequence[int], what: str) -> Shape:
    out = tuple(shape)
    for s in out:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ViewError(f"{what} {_fmt_shape(out)}: dims must be non-negative ints")
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_dim(dim: int, shape: Shape, name: str = "dim") -> None:
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(shape):
        raise ViewError(f"{name} {dim} is out of range for rank {len(shape)}")


def reshape_target(shape: Shape, target: Sequence[int]) -> Shape:
    """The concrete shape ``reshape target`` gives a tensor of ``shape`` (``-1`` resolved)."""
    target = tuple(target)
    if sum(1 for s in target if s == -1) > 1:
        raise ViewError("at most one reshape dim may be -1")
    for s in target:
        if not isinstance(s, int) or isinstance(s, bool) or (s != -1 and s < 1):
            raise ViewError(f"reshape dims must be positive ints or a single -1, not {s!r}")
    n = _numel(shape)
    known = _numel(s for s in target if s != -1)
    if -1 in target:
        if n % known:
            raise ViewError(f"cannot infer the -1 dim: {n} elements are not a multiple of {known}")
        target = tuple(n // known if s == -1 else s for s in target)
    elif known != n:
        raise ViewError(f"element count differs: {n} elements cannot be viewed as {known}")
    return target


def transform_shape(shape: Shape, t: Transform) -> Shape:
    """The shape one transform produces from ``shape`` (unlabelled ViewError if it does not apply)."""
    if t.kind == "slice":
        _check_dim(t.dim, shape)
        size = shape[t.dim]
        if not (0 <= t.start < t.stop):
            raise ViewError(f"slice needs 0 <= start < stop, got [{t.start}:{t.stop}]")
        if t.stop > size:
            raise ViewError(f"stop {t.stop} exceeds dim {t.dim} of size {size}")
        return shape[: t.dim] + (t.stop - t.start,) + shape[t.dim + 1:]
    if t.kind == "gather":
        _check_dim(t.dim, shape)
        size = shape[t.dim]
        if not isinstance(t.groups, int) or t.groups < 1:
            raise ViewError(f"groups must be >= 1, got {t.groups}")
        if size % t.groups:
            raise ViewError(f"dim {t.dim} of size {size} is not divisible by {t.groups} groups")
        if not t.takes:
            raise ViewError("gather needs at least one take")
        group = size // t.groups
        rows = 0
        for a, b in t.takes:
            if not (0 <= a < b):
                raise ViewError(f"take [{a}:{b}] is empty or negative (needs 0 <= start < stop)")
            if b > group:
                raise ViewError(f"take [{a}:{b}] exceeds the group size {group} ({size} / {t.groups} groups)")
            rows += b - a
        return shape[: t.dim] + (t.groups * rows,) + shape[t.dim + 1:]
    if t.kind == "reshape":
        return reshape_target(shape, t.shape)
    if t.kind == "transpose":
        _check_dim(t.dim, shape, "dim")
        _check_dim(t.dim2, shape, "dim2")
        out = list(shape)
        out[t.dim], out[t.dim2] = out[t.dim2], out[t.dim]
        return tuple(out)
    if t.kind == "log_neg":
        return tuple(shape)
    raise ViewError(f"unknown transform kind {t.kind!r} (known: {', '.join(TRANSFORM_KINDS)})")


def view_shape(stored_shape: Sequence[int], transforms: Sequence[Transform]) -> Shape:
    """The shape of ``stored_shape`` seen through ``transforms``, applied in order.

    Raises :class:`ViewError` naming the failing transform, its position in
    the chain and the shape it met.
    """
    shape = _check_shape(stored_shape, "stored shape")
    for i, t in enumerate(transforms):
        try:
            shape = transform_shape(shape, t)
        except ViewError as e:
            raise ViewError(f"transform {i} ({describe(t)}) on shape {_fmt_shape(shape)}: {e}") from None
    return shape


def selects_rows(transforms: Sequence[Transform], rank: int) -> bool:
    """Whether ``transforms`` only pick indices of outer dims (slices / gathers of a dim before the last) of a
    rank-``rank`` view: of a ggml-encoded operand, the same picks of its stored blocks (a row is a run of
    independent blocks), so the view can stay encoded. No transforms: False (nothing to select)."""
    return bool(transforms) and all(t.kind in ("slice", "gather") and 0 <= t.dim < rank - 1 for t in transforms)


def encoded_shape(encoding: str, part_shapes: Mapping[str, Sequence[int]] | Sequence[Sequence[int]]) -> Shape:
    """The logical shape an encoded operand decodes to.

    ``part_shapes`` maps part name to stored shape, or lists the shapes in
    the encoding's part order (:data:`ENCODINGS`).
    """
    names = encoding_parts(encoding)
    if names is None:
        raise ViewError(f"unknown encoding {encoding!r} (known: {', '.join(list(ENCODINGS) + list(_ggml()))})")
    if isinstance(part_shapes, Mapping):
        if set(part_shapes) != set(names):
            raise ViewError(f"{encoding} needs parts {', '.join(names)}, got {', '.join(part_shapes) or 'none'}")
        parts = {n: _check_shape(part_shapes[n], f"{encoding} {n}") for n in names}
    else:
        if len(part_shapes) != len(names):
            raise ViewError(f"{encoding} needs {len(names)} parts ({', '.join(names)}), got {len(part_shapes)}")
        parts = {n: _check_shape(s, f"{encoding} {n}") for n, s in zip(names, part_shapes)}
    if encoding in _ggml():
        return _ggml_shape(encoding, parts["blocks"])
    blocks, scales = parts["blocks"], parts["scales"]
    if len(blocks) < 3:
        raise ViewError(f"mxfp4 blocks {_fmt_shape(blocks)} must be [..., out, blocks, {MXFP4_BLOCK_BYTES}]")
    if blocks[-1] != MXFP4_BLOCK_BYTES:
        raise ViewError(f"mxfp4 blocks {_fmt_shape(blocks)}: last dim must be {MXFP4_BLOCK_BYTES} bytes (32 FP4 values)")
    if scales != blocks[:-1]:
        raise ViewError(f"mxfp4 scales {_fmt_shape(scales)} must be {_fmt_shape(blocks[:-1])} (one per block of blocks {_fmt_shape(blocks)})")
    return blocks[:-2] + (blocks[-2] * MXFP4_BLOCK,)


def _ggml_shape(encoding: str, blocks: Shape) -> Shape:
    """``u8 [..., rows, row_bytes]`` (each row whole blocks) decodes to ``[..., rows, row_bytes / type_size * block_size]``."""
    spec = _ggml()[encoding]
    if len(blocks) < 2:
        raise ViewError(f"{encoding} blocks {_fmt_shape(blocks)} must be [..., rows, row_bytes]")
    if blocks[-1] % spec.type_size:
        raise ViewError(f"{encoding} blocks {_fmt_shape(blocks)}: a row of {blocks[-1]} bytes is not whole blocks of {spec.type_size} bytes")
    return tuple(blocks[:-1]) + (blocks[-1] // spec.type_size * spec.block_size,)


def concat_shape(shapes: Sequence[Sequence[int]], dim: int) -> Shape:
    """The shape of ``shapes`` concatenated along ``dim`` (ViewError if they do not fit)."""
    shapes = [tuple(s) for s in shapes]
    if not shapes:
        raise ViewError("concat needs at least one part")
    _check_dim(dim, shapes[0], "concat dim")
    for i, s in enumerate(shapes[1:], 1):
        if len(s) != len(shapes[0]) or any(a != b for k, (a, b) in enumerate(zip(s, shapes[0])) if k != dim):
            raise ViewError(f"concat {dim}: part {i} {_fmt_shape(s)} does not fit part 0 {_fmt_shape(shapes[0])} "
                            f"(equal rank, equal dims but {dim})")
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]


def operand_shape(operand: Operand, tensors: Mapping[str, Tensor]) -> Shape:
    """The shape an operand's declared view produces from its stored tensors.

    Stored shapes are :attr:`Tensor.stored_shape` (a bank is ``[experts, …]``);
    an encoded operand is decoded first, then its transforms apply.
    """
    missing = [s for s in operand.sources if s not in tensors]
    if missing:
        raise ViewError(f"operand %{operand.sym}: unknown tensor {', '.join('$' + s for s in missing)}")
    try:
        if operand.parts:
            shapes = []
            for i, p in enumerate(operand.parts):
                try:
                    shapes.append(operand_shape(p, tensors))
                except ViewError as e:
                    raise ViewError(f"concat part {i}: {str(e).split(': ', 1)[-1]}") from None
            return view_shape(concat_shape(shapes, operand.concat_dim), operand.transforms)
        if operand.encoding is None:
            if len(operand.sources) != 1:
                raise ViewError(f"{len(operand.sources)} sources but no encoding")
            base = tensors[operand.sources[0]].stored_shape
        else:
            if len(operand.part_names) != len(operand.sources):
                raise ViewError(f"parts {operand.part_names} do not match sources {operand.sources}")
            base = encoded_shape(operand.encoding, {n: tensors[s].stored_shape for n, s in zip(operand.part_names, operand.sources)})
        return view_shape(base, operand.transforms)
    except ViewError as e:
        raise ViewError(f"operand %{operand.sym}: {e}") from None
