"""Provisional view algebra (shape only); the full version replaces this."""

from __future__ import annotations

import math


class ViewError(ValueError):
    pass


def view_shape(stored, transforms):
    shape = list(stored)
    for t in transforms:
        if t.kind == "slice":
            if not (0 <= t.start < t.stop <= shape[t.dim]):
                raise ViewError(f"slice {t.dim} [{t.start}:{t.stop}] out of bounds for {shape}")
            shape[t.dim] = t.stop - t.start
        elif t.kind == "gather":
            n = shape[t.dim]
            if n % t.groups:
                raise ViewError(f"gather: dim {t.dim} of size {n} is not divisible by {t.groups} groups")
            size = n // t.groups
            for a, b in t.takes:
                if not (0 <= a < b <= size):
                    raise ViewError(f"gather: take {a}:{b} outside group size {size}")
            shape[t.dim] = t.groups * sum(b - a for a, b in t.takes)
        elif t.kind == "reshape":
            if math.prod(t.shape) != math.prod(shape):
                raise ViewError(f"reshape {list(t.shape)} of {shape}: element counts differ")
            shape = list(t.shape)
        elif t.kind == "transpose":
            shape[t.dim], shape[t.dim2] = shape[t.dim2], shape[t.dim]
    return tuple(shape)


def encoded_shape(encoding, parts):
    if encoding != "mxfp4":
        raise ViewError(f"unknown encoding {encoding}")
    b = parts["blocks"]
    return tuple(b[:-2]) + (b[-2] * b[-1] * 2,)
