"""Provisional torch view application (the full version replaces this)."""

from __future__ import annotations

import torch


def apply_view(t, transforms):
    for x in transforms:
        if x.kind == "slice":
            t = t.narrow(x.dim, x.start, x.stop - x.start)
        elif x.kind == "gather":
            n = t.shape[x.dim]
            g = t.unflatten(x.dim, (x.groups, n // x.groups))
            t = torch.cat([g.narrow(x.dim + 1, a, b - a).flatten(x.dim, x.dim + 1) for a, b in x.takes], dim=x.dim)
        elif x.kind == "reshape":
            t = t.reshape(x.shape)
        elif x.kind == "transpose":
            t = t.transpose(x.dim, x.dim2)
    return t


def stack_bank(ts):
    return torch.stack(ts)


def decode_mxfp4(blocks, scales, dtype):
    raise NotImplementedError
