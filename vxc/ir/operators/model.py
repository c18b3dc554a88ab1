"""Norm, embedding and head declarations."""

from __future__ import annotations

from .decl import BLOCK_SCALES, RoleSpec, OperatorDecl, attr, register

RMSNORM = OperatorDecl(
    kind="rmsnorm",
    slot="norm",
    doc="x·rsqrt(mean(x²)+eps)·w, or ·(1+w) when zero_centred; computed in fp32",
    attrs=(attr("dim", "int"), attr("eps", "float", min=0.0), attr("zero_centred", "bool")),
    roles=(RoleSpec(None, lambda a: (a["dim"],)),),
    partition="replicated",
    # the roles a norm instance declares as its own (placements name them: vxc.ir.roles.PLACEMENT_NORMS)
    extra_roles=("PreAttentionNorm", "PostAttentionNorm", "PreFfnNorm", "PostFfnNorm", "PreExpertsNorm",
                 "PostDenseFfnNorm", "PostExpertsNorm", "Mamba2PreMixerNorm", "FinalNorm"),
)

EMBEDDING = OperatorDecl(
    kind="embedding",
    slot="embedding",
    doc="token embedding table; rows beyond the logical vocab are padding; rows · scale when a scale is declared "
        "(the scale rounded to the compute dtype first)",
    attrs=(attr("vocab", "int"), attr("padded_vocab", "int"), attr("dim", "int"),
           attr("scale", "float", optional=True, doc="multiplier of the gathered rows (absent: none)"),
           # the rows times a multiplier held in fp32 (a number, as a Python float multiplies a tensor), the product
           # rounded once; applied by the generic lowering loop like any operator's output_scale
           BLOCK_SCALES[1]),
    roles=(RoleSpec("Embedding", lambda a: (a["padded_vocab"], a["dim"]), quantise=True, more_bits="embed"),),
    partition="replicated",
    rules=(("padded_vocab must be >= vocab", lambda a: a["padded_vocab"] >= a["vocab"]),),
)

HEAD = OperatorDecl(
    kind="head",
    slot="head",
    doc="logits = h·Wᵀ over the padded vocab; W is the embedding table when tied; logits · scale when a scale "
        "is declared (in fp32, rounded once to the compute dtype)",
    attrs=(attr("tied", "bool"), attr("padded_vocab", "int"), attr("dim", "int"),
           attr("scale", "float", optional=True, doc="multiplier of the logits (absent: none)")),
    roles=(RoleSpec("LmHead", lambda a: (a["padded_vocab"], a["dim"]), unless="tied", quantise=True, more_bits="head"),),
    partition="replicated",
)


register(RMSNORM, EMBEDDING, HEAD)
