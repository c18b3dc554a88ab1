"""Head geometry shared by the attention operators (``softmax``, ``conv_qkv``)."""

from __future__ import annotations

from .decl import Attrs


def q_dim(a: Attrs) -> int:
    return a["heads"] * a["head_dim"]


def kv_dim(a: Attrs) -> int:
    return a["kv_heads"] * a["head_dim"]
