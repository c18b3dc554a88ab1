"""Lowerings of the model-level plan ops: the embedding gather, the norms (the pre-block norm adds the
previous block's output to the residual stream first), and the head."""

from __future__ import annotations

from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import TOKENS, Emitter, Val, lowering, weight


@lowering("embedding")
def lower_embedding(e: Emitter, p: PlanOp, x: Val | None) -> Val:
    (hidden,) = e.kernel(p, "embedding", [TOKENS, weight(p, Role.Embedding)], "token embedding gather")
    if "scale" in p.attrs:
        (hidden,) = e.kernel(p, "scale", [hidden, p.attrs["scale"]], f"embedding rows · {p.attrs['scale']:g}")
    return hidden


@lowering("add_rmsnorm")
def lower_add_rmsnorm(e: Emitter, p: PlanOp, x: Val) -> Val:
    fp32 = p.residual == "fp32"
    normed, e.residual = e.kernel(p, "add_rmsnorm", [x, e.residual, weight(p, p.role), p.attrs["eps"], p.attrs["zero_centred"], fp32],
                                  f"residual add{' (fp32)' if fp32 else ''} + rmsnorm", nouts=2)
    return normed


@lowering("rmsnorm")
def lower_rmsnorm(e: Emitter, p: PlanOp, x: Val) -> Val:
    (hidden, _) = e.kernel(p, "add_rmsnorm", [x, None, weight(p, p.role), p.attrs["eps"], p.attrs["zero_centred"], False],
                           "rmsnorm (post-block)", nouts=2)
    return hidden


@lowering("head")
def lower_head(e: Emitter, p: PlanOp, x: Val) -> Val:
    if e.out.variant == "prefill_last":
        (x,) = e.glue(p, "narrow", [x, 0, -1, 1])  # the last position's row (a view)
    (logits,) = e.kernel(p, "linear", [x, weight(p, Role.LmHead), None], "lm head over the padded vocab")
    if "scale" in p.attrs:
        (logits,) = e.kernel(p, "scale_segments", [logits, [], [p.attrs["scale"]]], f"logits · {p.attrs['scale']:g}")
    e.out.output = logits.name
    return logits
