"""The ``gated_delta`` mixer (Gated DeltaNet linear attention, Qwen3-Next).

Roles are plain: the checkpoint's fused, per-key-head-grouped projections are
split by the frontend with views (gather by group), so nothing here knows why.
"""

from __future__ import annotations

from ..roles import Role
from . import Attrs, OperatorDecl, RegionSpec, RoleSpec, attr, register


def _conv_dim(a: Attrs) -> int:
    return 2 * a["k_heads"] * a["k_head_dim"] + a["v_heads"] * a["v_head_dim"]


GATED_DELTA = OperatorDecl(
    kind="gated_delta",
    slot="mixer",
    surfaces=(),
    doc="q|k|v projection → causal conv + SiLU → l2-normalised q,k; β=σ(b), g=−exp(A_log)·softplus(a+dt_bias); "
        "delta rule S←e^g S + kβ(v−Sᵀk)ᵀ; o=Sᵀq; per-head rmsnorm(o)·w·silu(z); out_proj",
    attrs=(
        attr("d_model", "int"),
        attr("k_heads", "int"),
        attr("v_heads", "int"),
        attr("k_head_dim", "int"),
        attr("v_head_dim", "int"),
        attr("conv_kernel", "int"),
        attr("chunk_size", "int", doc="prefill chunk (WY form)"),
        attr("norm_eps", "float"),
        attr("l2_eps", "float", doc="q,k ← x·rsqrt(Σx²+l2_eps)"),
    ),
    roles=(
        RoleSpec(Role.LinearAttnInProjQkv, lambda a: (_conv_dim(a), a["d_model"])),
        RoleSpec(Role.LinearAttnInProjZ, lambda a: (a["v_heads"] * a["v_head_dim"], a["d_model"])),
        RoleSpec(Role.LinearAttnInProjB, lambda a: (a["v_heads"], a["d_model"])),
        RoleSpec(Role.LinearAttnInProjA, lambda a: (a["v_heads"], a["d_model"])),
        RoleSpec(Role.LinearAttnConv1d, lambda a: (_conv_dim(a), a["conv_kernel"])),
        RoleSpec(Role.LinearAttnDtBias, lambda a: (a["v_heads"],)),
        RoleSpec(Role.LinearAttnALog, lambda a: (a["v_heads"],)),
        RoleSpec(Role.LinearAttnNorm, lambda a: (a["v_head_dim"],)),
        RoleSpec(Role.LinearAttnOutProj, lambda a: (a["d_model"], a["v_heads"] * a["v_head_dim"])),
    ),
    regions=(
        RegionSpec("delta", "recurrent", lambda a: (a["v_heads"], a["k_head_dim"], a["v_head_dim"]), "f32", "fixed"),
        RegionSpec("conv", "conv_history", lambda a: (_conv_dim(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(("v_heads must be a multiple of k_heads", lambda a: a["v_heads"] % a["k_heads"] == 0),),
)

register(GATED_DELTA)
