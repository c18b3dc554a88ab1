"""The ``mla`` mixer (multi-head latent attention).

Its state is one **latent row** per position — ``kv_lora_rank + qk_rope_head_dim`` values,
``[c | k_pe]`` — its own region species, not a K/V pair.

Math (``R = kv_lora_rank``, ``P = qk_rope_head_dim``, ``N = qk_nope_head_dim``, ``V = v_head_dim``):

- ``q = x Wqᵀ`` (direct), or with ``q_lora``: ``q = rmsnorm(x Wq_aᵀ; norm_eps)·w_qa · Wq_bᵀ``;
  per head ``[q_nope N | q_pe P]``;
- ``[c | k_pe] = x Wkv_aᵀ``; ``c = rmsnorm(c; norm_eps)·w_kva`` — k_pe is one vector shared by all heads;
- rotary on q_pe and k_pe as declared (``rotary_dim`` 0 = none: both pass through). ``rotary_layout``
  names the pairs (``half``: (i, i+P/2); ``interleaved``: (2i, 2i+1)); ``rotary_output`` where each
  rotated pair is written: ``in_place``, or ``split`` (first members of all pairs, then the second
  members — for interleaved pairs: the rotated evens, then the rotated odds). q and k are rotated
  alike, so the scores do not depend on it; it fixes the order of k_pe inside the latent rows;
- ``Wkv_b`` per head ``[k_nope N | v V]`` rows over ``c``; scores ``scale·(q_nope·k_nope + q_pe·k_pe)``,
  causal softmax; the output projection.
- Decode absorbs ``Wkv_b`` into the query (``q_nope·Wk_b[h]``, ``R`` wide) and into the output
  (``Wv_b[h]·Σ p c``), attending directly on the latent rows.

``scale`` is declared in full; with YaRN it includes the softmax mscale, recorded in
``rope_mscale`` / ``rope_mscale_all_dim`` (``scale = (N+P)^−½ · m²``,
``m = 0.1·mscale_all_dim·ln(factor) + 1``).

Tensor parallel: split by heads. Rank r of N holds heads [r·H/N, (r+1)·H/N): the per-head projections' rows
(``MlaQProj`` / ``MlaQBProj``, ``[q_nope | q_pe]`` per head, and ``MlaKvBProj``, ``[k_nope | v]`` per head — both
head-major, so a contiguous cut is a run of whole heads) and the output projection's input columns (row-parallel).
The latent path does not depend on the heads and is whole on every rank: the q-LoRA down-projection and its
norm, the ``[c | k_pe]`` projection and the latent norm, and the latent rows themselves (every rank writes the
same rows). The absorbed decode folds each held head's own ``Wk_b`` / ``Wv_b`` rows into its query and output, so
it runs unchanged on the rank's heads.
"""

from __future__ import annotations

import math

from .decl import Attrs, OperatorDecl, RegionSpec, RoleSpec, attr, register
from .rotary import ROTARY_ATTRS


def _qk(a: Attrs) -> int:
    return a["qk_nope_head_dim"] + a["qk_rope_head_dim"]


def _o_dim(a: Attrs) -> int:
    return a["heads"] * a["v_head_dim"]


def _derive(a: Attrs) -> dict[str, int]:
    """qk_head_dim: one query head, nope | rope; o_dim: the attention output, heads·v_head_dim."""
    return {"qk_head_dim": _qk(a), "o_dim": _o_dim(a)}


def yarn_softmax_mscale(factor: float, mscale_all_dim: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0


def _scale_consistent(a: Attrs) -> bool:
    if "rope_mscale_all_dim" not in a or _qk(a) < 1:
        return True  # nothing declared to check the scale against (an empty query head is its own rule)
    m = yarn_softmax_mscale(a.get("rope_factor", 1.0), a["rope_mscale_all_dim"]) if a["rope_mscale_all_dim"] else 1.0
    return math.isclose(a["scale"], _qk(a) ** -0.5 * m * m, rel_tol=1e-9)


MLA = OperatorDecl(
    kind="mla",
    slot="mixer",
    surfaces=("attention",),
    derive=_derive,
    doc="q (direct or q-LoRA a→norm→b) split nope|rope; [c|k_pe]=kv_a(x), c=rmsnorm(c); kv_b(c) per head k_nope|v; "
        "rotary on q_pe and the shared k_pe as declared; causal softmax; output projection. Decode attends on latent rows (absorbed kv_b).",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("q_lora", "bool"),
        attr("q_lora_rank", "int", min=0, doc="0 when q_lora is false"),
        attr("kv_lora_rank", "int"),
        attr("qk_nope_head_dim", "int", min=0),
        attr("qk_rope_head_dim", "int", min=0),
        attr("v_head_dim", "int"),
        attr("norm_eps", "float", min=0.0, doc="eps of the q_a / kv_a RMSNorms"),
        attr("scale", "float", doc="softmax scale, in full (YaRN's mscale² included)"),
        *ROTARY_ATTRS,
        attr("rotary_output", "enum", "in_place", "split", doc="where each rotated pair is written (see module doc)"),
        attr("rope_mscale", "float", optional=True, doc="YaRN mscale (the cos/sin attention factor's numerator)"),
        attr("rope_mscale_all_dim", "float", optional=True, doc="YaRN mscale_all_dim (its square is folded into scale)"),
    ),
    # tensor parallel: heads split (see the module docstring); the latent path and the latent rows whole
    partition="tensor",
    divides=("heads",),
    roles=(
        RoleSpec("MlaQProj", lambda a: (a["heads"] * _qk(a), a["d_model"]), unless="q_lora", quantise=True, shard="out"),
        RoleSpec("MlaQAProj", lambda a: (a["q_lora_rank"], a["d_model"]), when="q_lora", quantise=True),
        RoleSpec("MlaQANorm", lambda a: (a["q_lora_rank"],), when="q_lora"),
        RoleSpec("MlaQBProj", lambda a: (a["heads"] * _qk(a), a["q_lora_rank"]), when="q_lora", quantise=True, shard="out"),
        RoleSpec("MlaKvAProj", lambda a: (a["kv_lora_rank"] + a["qk_rope_head_dim"], a["d_model"]), quantise=True),
        RoleSpec("MlaKvANorm", lambda a: (a["kv_lora_rank"],)),
        RoleSpec("MlaKvBProj", lambda a: (a["heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"]), a["kv_lora_rank"]), quantise=True,
                 more_bits="value", shard="out"),
        RoleSpec("MlaOutProj", lambda a: (a["d_model"], _o_dim(a)), quantise=True, more_bits="attn_out", shard="in"),
    ),
    regions=(
        RegionSpec("latent", "latent_rows", lambda a: (a["kv_lora_rank"] + a["qk_rope_head_dim"],), "compute", "per_token"),
    ),
    rules=(
        ("q_lora_rank must be > 0 exactly when q_lora", lambda a: (a["q_lora_rank"] > 0) == a["q_lora"]),
        ("rotary_dim must be 0 or qk_rope_head_dim", lambda a: a["rotary_dim"] in (0, a["qk_rope_head_dim"])),
        ("rotary_layout must be none exactly when rotary_dim is 0",
         lambda a: (a["rotary_layout"] == "none") == (a["rotary_dim"] == 0)),
        ("qk_rope_head_dim must be even", lambda a: a["qk_rope_head_dim"] % 2 == 0),
        ("a query head must have a dim: qk_nope_head_dim + qk_rope_head_dim >= 1", lambda a: _qk(a) >= 1),
        ("with rope_mscale_all_dim declared, scale must be (qk_nope_head_dim+qk_rope_head_dim)^-0.5 times the YaRN mscale²",
         _scale_consistent),
    ),
)

register(MLA)
