"""The ``mla`` mixer (multi-head latent attention, DeepSeek-V3 / Kimi): its state is a
latent row per position — ``kv_lora_rank + qk_rope_head_dim`` values — its own
region species, not a K/V pair."""

from __future__ import annotations

from ..roles import Role
from . import Attrs, OperatorDecl, RegionSpec, RoleSpec, attr, register
from .rotary import ROTARY_ATTRS


def _qk(a: Attrs) -> int:
    return a["qk_nope_head_dim"] + a["qk_rope_head_dim"]


MLA = OperatorDecl(
    kind="mla",
    slot="mixer",
    surfaces=("attention",),
    doc="q (direct or q-LoRA a→norm→b) split nope|rope; [c|k_pe]=kv_a(x), c=rmsnorm(c); kv_b(c) per head k_nope|v; "
        "rotary on q_pe and the shared k_pe as declared; causal softmax; o_proj. Decode attends on latent rows (absorbed kv_b).",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("q_lora", "bool"),
        attr("q_lora_rank", "int", doc="0 when q_lora is false"),
        attr("kv_lora_rank", "int"),
        attr("qk_nope_head_dim", "int"),
        attr("qk_rope_head_dim", "int"),
        attr("v_head_dim", "int"),
        attr("norm_eps", "float", doc="eps of the q_a / kv_a RMSNorms"),
        attr("scale", "float"),
        *ROTARY_ATTRS,
    ),
    roles=(
        RoleSpec(Role.MlaQProj, lambda a: (a["heads"] * _qk(a), a["d_model"]), unless="q_lora"),
        RoleSpec(Role.MlaQAProj, lambda a: (a["q_lora_rank"], a["d_model"]), when="q_lora"),
        RoleSpec(Role.MlaQANorm, lambda a: (a["q_lora_rank"],), when="q_lora"),
        RoleSpec(Role.MlaQBProj, lambda a: (a["heads"] * _qk(a), a["q_lora_rank"]), when="q_lora"),
        RoleSpec(Role.MlaKvAProj, lambda a: (a["kv_lora_rank"] + a["qk_rope_head_dim"], a["d_model"])),
        RoleSpec(Role.MlaKvANorm, lambda a: (a["kv_lora_rank"],)),
        RoleSpec(Role.MlaKvBProj, lambda a: (a["heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"]), a["kv_lora_rank"])),
        RoleSpec(Role.MlaOutProj, lambda a: (a["d_model"], a["heads"] * a["v_head_dim"])),
    ),
    regions=(
        RegionSpec("latent", "latent_rows", lambda a: (a["kv_lora_rank"] + a["qk_rope_head_dim"],), "compute", "per_token"),
    ),
    rules=(
        ("q_lora_rank must be > 0 exactly when q_lora", lambda a: (a["q_lora_rank"] > 0) == a["q_lora"]),
        ("rotary_dim must be 0 or qk_rope_head_dim", lambda a: a["rotary_dim"] in (0, a["qk_rope_head_dim"])),
    ),
)

register(MLA)
