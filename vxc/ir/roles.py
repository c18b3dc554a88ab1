"""Operand roles: the typed vocabulary every stored tensor is bound to.

A role names what a tensor *is* to a generic operator. It never names a
checkpoint spelling. Extend the vocabulary when a family needs more; never
reuse a role with a different meaning.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    # softmax attention
    AttnQ = "AttnQ"
    AttnK = "AttnK"
    AttnV = "AttnV"
    AttnO = "AttnO"
    AttnQBias = "AttnQBias"
    AttnKBias = "AttnKBias"
    AttnVBias = "AttnVBias"
    AttnOBias = "AttnOBias"
    AttnOutputGate = "AttnOutputGate"
    AttnSinks = "AttnSinks"
    AttnQNorm = "AttnQNorm"
    AttnKNorm = "AttnKNorm"
    # gated delta (linear attention)
    LinearAttnInProjQkv = "LinearAttnInProjQkv"
    LinearAttnInProjA = "LinearAttnInProjA"
    LinearAttnInProjB = "LinearAttnInProjB"
    LinearAttnInProjZ = "LinearAttnInProjZ"
    LinearAttnConv1d = "LinearAttnConv1d"
    LinearAttnALog = "LinearAttnALog"
    LinearAttnDtBias = "LinearAttnDtBias"
    LinearAttnNorm = "LinearAttnNorm"
    LinearAttnOutProj = "LinearAttnOutProj"
    # Mamba2
    Mamba2InProj = "Mamba2InProj"
    Mamba2InProjBias = "Mamba2InProjBias"
    Mamba2Conv1d = "Mamba2Conv1d"
    Mamba2Conv1dBias = "Mamba2Conv1dBias"
    Mamba2ALog = "Mamba2ALog"
    Mamba2D = "Mamba2D"
    Mamba2DtBias = "Mamba2DtBias"
    Mamba2GatedNorm = "Mamba2GatedNorm"
    Mamba2OutProj = "Mamba2OutProj"
    Mamba2OutProjBias = "Mamba2OutProjBias"
    Mamba2PreMixerNorm = "Mamba2PreMixerNorm"
    # conv-QKV attention
    ConvQkvInProj = "ConvQkvInProj"
    ConvQkvInProjBias = "ConvQkvInProjBias"
    ConvQkvConv1d = "ConvQkvConv1d"
    ConvQkvConv1dBias = "ConvQkvConv1dBias"
    ConvQkvOutProj = "ConvQkvOutProj"
    ConvQkvOutProjBias = "ConvQkvOutProjBias"
    # KDA
    KdaQProj = "KdaQProj"
    KdaKProj = "KdaKProj"
    KdaVProj = "KdaVProj"
    KdaQConv1d = "KdaQConv1d"
    KdaKConv1d = "KdaKConv1d"
    KdaVConv1d = "KdaVConv1d"
    KdaFAProj = "KdaFAProj"
    KdaFBProj = "KdaFBProj"
    KdaGAProj = "KdaGAProj"
    KdaGBProj = "KdaGBProj"
    KdaBProj = "KdaBProj"
    KdaALog = "KdaALog"
    KdaDtBias = "KdaDtBias"
    KdaONorm = "KdaONorm"
    KdaOutProj = "KdaOutProj"
    # MLA
    MlaQProj = "MlaQProj"
    MlaQAProj = "MlaQAProj"
    MlaQANorm = "MlaQANorm"
    MlaQBProj = "MlaQBProj"
    MlaKvAProj = "MlaKvAProj"
    MlaKvBProj = "MlaKvBProj"
    MlaKvANorm = "MlaKvANorm"
    MlaOutProj = "MlaOutProj"
    # dense FFN
    FfnGate = "FfnGate"
    FfnUp = "FfnUp"
    FfnDown = "FfnDown"
    # norms
    PreAttentionNorm = "PreAttentionNorm"
    PostAttentionNorm = "PostAttentionNorm"
    PreFfnNorm = "PreFfnNorm"
    PostFfnNorm = "PostFfnNorm"
    PreExpertsNorm = "PreExpertsNorm"
    PostDenseFfnNorm = "PostDenseFfnNorm"
    PostExpertsNorm = "PostExpertsNorm"
    # MoE
    MoeRouterWeight = "MoeRouterWeight"
    MoeRouterBias = "MoeRouterBias"
    MoeRouterSelectionBias = "MoeRouterSelectionBias"
    MoeRouterScale = "MoeRouterScale"
    MoeRouterPerExpertScale = "MoeRouterPerExpertScale"
    ExpertGateUp = "ExpertGateUp"
    ExpertGateUpScales = "ExpertGateUpScales"
    ExpertGateUpBias = "ExpertGateUpBias"
    ExpertDown = "ExpertDown"
    ExpertDownScales = "ExpertDownScales"
    ExpertDownBias = "ExpertDownBias"
    PerExpertGate = "PerExpertGate"
    PerExpertUp = "PerExpertUp"
    PerExpertDown = "PerExpertDown"
    SharedExpertGate = "SharedExpertGate"
    SharedExpertUp = "SharedExpertUp"
    SharedExpertDown = "SharedExpertDown"
    SharedExpertBranchGate = "SharedExpertBranchGate"
    LayerScalar = "LayerScalar"
    # model
    Embedding = "Embedding"
    FinalNorm = "FinalNorm"
    LmHead = "LmHead"

    def __str__(self) -> str:  # printed as its bare name
        return self.value


class Placement(str, enum.Enum):
    """Where a layer's norms sit around its sub-blocks."""

    PreOnly = "PreOnly"  # norm before the mixer and before the FFN
    PrePost = "PrePost"  # norm before and after each sub-block
    PreMixer = "PreMixer"  # a single norm before the mixer; no FFN sub-block

    def __str__(self) -> str:
        return self.value


# Which norm roles a placement requires, in program order, split by the
# sub-block they belong to (mixer side, FFN side).
PLACEMENT_NORMS: dict[Placement, tuple[tuple[Role, ...], tuple[Role, ...]]] = {
    Placement.PreMixer: ((Role.Mamba2PreMixerNorm,), ()),
    Placement.PreOnly: ((Role.PreAttentionNorm,), (Role.PreFfnNorm,)),
    Placement.PrePost: (
        (Role.PreAttentionNorm, Role.PostAttentionNorm),
        (Role.PreFfnNorm, Role.PostFfnNorm),
    ),
}
