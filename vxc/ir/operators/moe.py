"""The ``moe`` FFN: a router and a bank of gated experts, optional shared experts.

Router variants (``router``; logits ``x·Wᵀ`` in fp32, + MoeRouterBias when ``router_bias``):
- ``softmax_topk``: softmax over all experts → top-k → divided by their sum iff ``norm_topk_prob``;
- ``sigmoid_grouped``: sigmoid scores; experts *chosen* on score + MoeRouterSelectionBias (when
  ``selection_bias``) with grouped top-k: ``n_group`` contiguous groups ranked by the sum of their two
  largest choice scores, the best ``topk_group`` kept, top-k among their experts; weights are the
  unbiased scores, divided by ``sum + 1e-20`` iff ``norm_topk_prob``;
- ``topk_softmax``: top-k on the logits, softmax over the k chosen.
Every variant then multiplies the weights by ``routed_scaling`` (1.0 where the reference has none).
Expert layouts (``expert_layout``): ``separate`` binds PerExpertGate/Up/Down banks [E,I,d],[E,I,d],[E,d,I];
``fused_interleaved`` binds ExpertGateUp [E,2I,d] (gate = even rows, up = odd) and ExpertDown [E,d,I],
with their biases (ExpertGateUpBias [E,2I] in the same interleaved row order, ExpertDownBias [E,d]) when
``expert_bias``. Stored input-major banks ([E,in,out]) reach these [E,out,in] contracts through a transpose
view; a concatenated gate|up bank through slice views; encoded (MXFP4) banks are encoded operands.
Activations (``act``): ``silu`` — silu(g)·u; ``clamped_glu`` — g = min(g, glu_limit),
u = clamp(u, −glu_limit, glu_limit), (u + 1)·g·σ(glu_alpha·g).
Shared experts (``shared_experts``): a SwiGLU of width ``shared_intermediate`` added to the routed sum,
scaled by σ(x·SharedExpertBranchGate) when ``shared_gate``.
"""

from __future__ import annotations

from .decl import BLOCK_SCALES, Attrs, OperatorDecl, RoleSpec, attr, register


def _e(a: Attrs) -> int:
    return a["experts"]


MOE = OperatorDecl(
    kind="moe",
    slot="ffn",
    surfaces=("ffn", "moe"),
    doc="router → top-k experts (SwiGLU or clamped GLU) → weighted sum; + shared experts (optionally gated by σ(x·w))",
    attrs=(
        attr("d_model", "int"),
        attr("experts", "int"),
        attr("top_k", "int"),
        attr("intermediate", "int", doc="per-expert intermediate width"),
        attr("router", "enum", "softmax_topk", "sigmoid_grouped", "topk_softmax"),
        attr("norm_topk_prob", "bool"),
        attr("routed_scaling", "float"),
        attr("n_group", "int"),
        attr("topk_group", "int"),
        attr("router_bias", "bool"),
        attr("selection_bias", "bool"),
        attr("expert_layout", "enum", "separate", "fused_interleaved"),
        attr("expert_bias", "bool"),
        attr("act", "enum", "silu", "clamped_glu"),
        attr("glu_alpha", "float", optional=True),
        attr("glu_limit", "float", optional=True),
        attr("shared_experts", "bool"),
        attr("shared_intermediate", "int", min=0, doc="0 when shared_experts is false"),
        attr("shared_gate", "bool", doc="shared-expert branch scaled by σ(x·SharedExpertBranchGate)"),
        *BLOCK_SCALES,
    ),
    roles=(
        RoleSpec("MoeRouterWeight", lambda a: (_e(a), a["d_model"])),
        RoleSpec("MoeRouterBias", lambda a: (_e(a),), when="router_bias"),
        RoleSpec("MoeRouterSelectionBias", lambda a: (_e(a),), when="selection_bias"),
        RoleSpec("PerExpertGate", lambda a: (_e(a), a["intermediate"], a["d_model"]), when="expert_layout=separate"),
        RoleSpec("PerExpertUp", lambda a: (_e(a), a["intermediate"], a["d_model"]), when="expert_layout=separate"),
        RoleSpec("PerExpertDown", lambda a: (_e(a), a["d_model"], a["intermediate"]), when="expert_layout=separate"),
        RoleSpec("ExpertGateUp", lambda a: (_e(a), 2 * a["intermediate"], a["d_model"]), when="expert_layout=fused_interleaved"),
        RoleSpec("ExpertDown", lambda a: (_e(a), a["d_model"], a["intermediate"]), when="expert_layout=fused_interleaved"),
        RoleSpec("ExpertGateUpBias", lambda a: (_e(a), 2 * a["intermediate"]), when="expert_bias"),
        RoleSpec("ExpertDownBias", lambda a: (_e(a), a["d_model"]), when="expert_bias"),
        RoleSpec("SharedExpertGate", lambda a: (a["shared_intermediate"], a["d_model"]), when="shared_experts", quantise=True),
        RoleSpec("SharedExpertUp", lambda a: (a["shared_intermediate"], a["d_model"]), when="shared_experts", quantise=True),
        RoleSpec("SharedExpertDown", lambda a: (a["d_model"], a["shared_intermediate"]), when="shared_experts", quantise=True,
                 more_bits="down"),
        RoleSpec("SharedExpertBranchGate", lambda a: (1, a["d_model"]), when="shared_gate"),
    ),
    # reserved in the vocabulary (VINDEX3), bound by no frontend yet
    extra_roles=("MoeRouterScale", "MoeRouterPerExpertScale", "ExpertGateUpScales", "ExpertDownScales", "LayerScalar"),
    rules=(
        ("top_k must be between 1 and experts", lambda a: 1 <= a["top_k"] <= a["experts"]),
        ("shared_intermediate must be > 0 exactly when shared_experts", lambda a: (a["shared_intermediate"] > 0) == a["shared_experts"]),
        ("n_group must divide experts and topk_group ≤ n_group", lambda a: a["n_group"] >= 1 and a["experts"] % a["n_group"] == 0 and 1 <= a["topk_group"] <= a["n_group"]),
        ("expert_bias needs expert_layout fused_interleaved", lambda a: not a["expert_bias"] or a["expert_layout"] == "fused_interleaved"),
        ("shared_gate needs shared_experts", lambda a: not a["shared_gate"] or a["shared_experts"]),
        ("clamped_glu needs glu_alpha and glu_limit", lambda a: a["act"] != "clamped_glu" or ("glu_alpha" in a and "glu_limit" in a)),
    ),
)

register(MOE)
