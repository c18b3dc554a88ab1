"""The ``mlp`` FFN: a dense, non-gated MLP ``down(act(x·upᵀ))`` — two projections and an elementwise activation
between them, no gate projection (``swiglu`` is the gated form).

Activations (``act``): ``relu2`` — ``max(h, 0)²`` (squared ReLU).
"""

from __future__ import annotations

from .decl import OperatorDecl, RoleSpec, attr, register

MLP = OperatorDecl(
    kind="mlp",
    slot="ffn",
    surfaces=("ffn",),
    doc="dense non-gated FFN: down(act(x·upᵀ)); act relu2 (max(h, 0)²)",
    attrs=(attr("d_model", "int"), attr("intermediate", "int"), attr("act", "enum", "relu2")),
    # tensor parallel: up column-parallel, down row-parallel over the intermediate width
    partition="tensor",
    divides=("intermediate",),
    roles=(
        RoleSpec("FfnUp", lambda a: (a["intermediate"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("FfnDown", lambda a: (a["d_model"], a["intermediate"]), quantise=True, more_bits="down", shard="in"),
    ),
)


register(MLP)
