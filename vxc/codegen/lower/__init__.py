"""``fuse``: plan ops → fused kernel groups.

Each plan op is lowered, by its kind, to a short list of :class:`Call`s by the
lowering registered for that kind: one module per operator kind in this
package, each registering with ``@lowering("<kind>")`` (``emitter.py`` is what
they are written with). Every module here is imported below, so a new
operator's lowering is one new file.

Variants lowered from the same plan: ``prefill`` over ``T`` tokens from
position ``start``; ``prefill_last``, the same with the head applied to the
last position only (what generation needs: no [T, vocab] logits); and
``decode``, one token with fixed shapes. Only operator kinds, roles, declared
attributes and the geometry the declarations derive are read.
"""

from __future__ import annotations

import importlib
import pkgutil

import networkx as nx

from ...passes.plan import plan_ops
from .emitter import (  # noqa: F401  (the public lowering vocabulary)
    LOWERINGS, START, TOKENS, Call, Emitter, Lowered, Lowering, RopeRef, StateRef, Val, Weight, lowering, weight,
)

VARIANTS = ("prefill", "prefill_last", "decode")


class Unsupported(Exception):
    pass


def lower_plan(g: nx.DiGraph, variant: str, encoded_weights: bool = False, compute: str = "fp32") -> Lowered:
    """``encoded_weights``: operands declaring a ggml encoding stay as stored blocks, read by the encoded
    kernel forms (qlinear, qswiglu, qembedding, qmoe_experts, qmoe_shared); otherwise they are decoded at load.
    ``compute``: the session's dtype name (fp32 or bf16; the encoded forms' outputs take it)."""
    assert variant in VARIANTS
    e = Emitter(variant, encoded_weights, compute)
    hidden: Val | None = None  # output of the last op; the norms carry the residual stream (e.residual)
    branch_in: Val | None = None  # the input of the last op that was not beside another (what a parallel op reads)
    for p in plan_ops(g):
        fn = LOWERINGS.get(p.kind)
        if fn is None:
            raise Unsupported(f"{p.id}: no kernel lowering for operator kind {p.kind}")
        if p.parallel:  # beside the op before it: the same input, the two outputs summed
            x = branch_in
        else:
            x = branch_in = hidden
        if "input_scale" in p.attrs:  # the declared block multipliers (vxc.ir.operators.BLOCK_SCALES)
            (x,) = e.kernel(p, "scale_segments", [x, [], [p.attrs["input_scale"]]], f"input · {p.attrs['input_scale']:g}")
        out = fn(e, p, x)
        if "output_scale" in p.attrs:
            (out,) = e.kernel(p, "scale_segments", [out, [], [p.attrs["output_scale"]]], f"output · {p.attrs['output_scale']:g}")
        if p.parallel:
            (out,) = e.kernel(p, "add", [hidden, out], "sum of the outputs of the mixers side by side")
        hidden = out
    for i, c in enumerate(e.out.groups()):
        c.group = i
    return e.out


def print_groups(lw: Lowered) -> str:
    lines = [f"fuse {lw.variant}: {len(lw.groups())} fused groups"]
    for c in lw.calls:
        if c.kernel is not None:
            lines.append(f"  g{c.group:<4d} vxc.{c.kernel:<15} {c.plan_op:<32} {c.note}")
    return "\n".join(lines) + "\n"


# one module per operator kind; each registers its lowering
for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")
