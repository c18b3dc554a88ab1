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
Tensor parallelism (expert parallel): the experts are spread over the ranks — rank r of N holds the contiguous
experts [r·E/N, (r+1)·E/N) of every bank (and of the expert biases), declared by ``expert_ranks`` = N and
``expert_rank`` = r (set by the shard pass; ``experts`` stays the whole count); the router (weight, bias,
selection bias) is whole on every rank, so all ranks route alike over all E experts and each adds the
selected experts it holds; the shared expert is split like a SwiGLU over ``shared_intermediate`` (gate/up
rows, down columns) and its branch gate is whole. The output is a partial sum (one all-reduce after the op).
"""

from __future__ import annotations

from .decl import BLOCK_SCALES, Attrs, OperatorDecl, RoleSpec, attr, register


def _e(a: Attrs) -> int:
    return a["experts"]


def _held(a: Attrs) -> int:
    """The experts a bank holds: all of them, or this rank's range under tensor parallelism."""
    return a["experts"] // a.get("expert_ranks", 1)


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
        attr("expert_ranks", "int", optional=True, doc="tensor parallel: the ranks the experts are spread over (set by shard)"),
        attr("expert_rank", "int", optional=True, min=0,
             doc="tensor parallel: this rank, holding experts [rank·experts/expert_ranks, (rank+1)·experts/expert_ranks)"),
        *BLOCK_SCALES,
    ),
    roles=(
        RoleSpec("MoeRouterWeight", lambda a: (_e(a), a["d_model"])),  # (whole on every rank: shard None)
        RoleSpec("MoeRouterBias", lambda a: (_e(a),), when="router_bias"),
        RoleSpec("MoeRouterSelectionBias", lambda a: (_e(a),), when="selection_bias"),
        RoleSpec("PerExpertGate", lambda a: (_held(a), a["intermediate"], a["d_model"]), when="expert_layout=separate",
                 shard="experts"),
        RoleSpec("PerExpertUp", lambda a: (_held(a), a["intermediate"], a["d_model"]), when="expert_layout=separate",
                 shard="experts"),
        RoleSpec("PerExpertDown", lambda a: (_held(a), a["d_model"], a["intermediate"]), when="expert_layout=separate",
                 shard="experts"),
        RoleSpec("ExpertGateUp", lambda a: (_held(a), 2 * a["intermediate"], a["d_model"]),
                 when="expert_layout=fused_interleaved", shard="experts"),
        RoleSpec("ExpertDown", lambda a: (_held(a), a["d_model"], a["intermediate"]), when="expert_layout=fused_interleaved",
                 shard="experts"),
        RoleSpec("ExpertGateUpBias", lambda a: (_held(a), 2 * a["intermediate"]), when="expert_bias", shard="experts"),
        RoleSpec("ExpertDownBias", lambda a: (_held(a), a["d_model"]), when="expert_bias", shard="experts"),
        RoleSpec("SharedExpertGate", lambda a: (a["shared_intermediate"], a["d_model"]), when="shared_experts", quantise=True,
                 shard="out"),
        RoleSpec("SharedExpertUp", lambda a: (a["shared_intermediate"], a["d_model"]), when="shared_experts", quantise=True,
                 shard="out"),
        RoleSpec("SharedExpertDown", lambda a: (a["d_model"], a["shared_intermediate"]), when="shared_experts", quantise=True,
                 more_bits="down", shard="in"),
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
        ("expert_ranks and expert_rank are declared together, expert_rank < expert_ranks, and expert_ranks divides experts",
         lambda a: ("expert_ranks" in a) == ("expert_rank" in a)
         and ("expert_ranks" not in a or (a["expert_rank"] < a["expert_ranks"] and a["experts"] % a["expert_ranks"] == 0))),
    ),
    partition="tensor",
    divides=("shared_intermediate",),
    spreads=(("experts", "expert_ranks", "expert_rank"),),
)

register(MOE)
