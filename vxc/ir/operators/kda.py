"""The ``kda`` mixer (Kimi Delta Attention): per-channel decay, sigmoid output gate."""

from __future__ import annotations

from ..roles import Role
from . import OperatorDecl, RegionSpec, RoleSpec, attr, register

KDA = OperatorDecl(
    kind="kda",
    slot="mixer",
    surfaces=(),
    doc="q,k,v projections → three short convs + SiLU → l2-normalised q,k; g=−exp(A_log)·softplus(f_b(f_a x)+dt_bias) per channel; "
        "β=σ(b x); S←diag(e^g)S + βk(v−Sᵀk)ᵀ; o=Sᵀq; rmsnorm_per_head(o)·w·σ(g_b(g_a x)); out_proj",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("head_dim", "int"),
        attr("conv_kernel", "int"),
        attr("norm_eps", "float"),
        attr("l2_eps", "float"),
        attr("chunk_size", "int"),
    ),
    roles=(
        RoleSpec(Role.KdaQProj, lambda a: (a["heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.KdaKProj, lambda a: (a["heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.KdaVProj, lambda a: (a["heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.KdaQConv1d, lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"])),
        RoleSpec(Role.KdaKConv1d, lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"])),
        RoleSpec(Role.KdaVConv1d, lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"])),
        RoleSpec(Role.KdaFAProj, lambda a: (a["head_dim"], a["d_model"])),
        RoleSpec(Role.KdaFBProj, lambda a: (a["heads"] * a["head_dim"], a["head_dim"])),
        RoleSpec(Role.KdaBProj, lambda a: (a["heads"], a["d_model"])),
        RoleSpec(Role.KdaGAProj, lambda a: (a["head_dim"], a["d_model"])),
        RoleSpec(Role.KdaGBProj, lambda a: (a["heads"] * a["head_dim"], a["head_dim"])),
        RoleSpec(Role.KdaALog, lambda a: (a["heads"],)),
        RoleSpec(Role.KdaDtBias, lambda a: (a["heads"] * a["head_dim"],)),
        RoleSpec(Role.KdaONorm, lambda a: (a["head_dim"],)),
        RoleSpec(Role.KdaOutProj, lambda a: (a["d_model"], a["heads"] * a["head_dim"])),
    ),
    regions=(
        RegionSpec("delta", "recurrent", lambda a: (a["heads"], a["head_dim"], a["head_dim"]), "f32", "fixed"),
        RegionSpec("conv_q", "conv_history", lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"]), "compute", "fixed"),
        RegionSpec("conv_k", "conv_history", lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"]), "compute", "fixed"),
        RegionSpec("conv_v", "conv_history", lambda a: (a["heads"] * a["head_dim"], a["conv_kernel"]), "compute", "fixed"),
    ),
)

register(KDA)
