"""Operator declarations, as data: one place per operator kind.

Each :class:`OperatorDecl` names the attributes (geometry) an instance must
declare, the roles it binds (always, or only under a declared attribute),
the shape contract of each role as a function of the attributes, and the
continuation-state regions it requires. Passes (bind, closure, state) are
single generic walks over these declarations; nothing else in vxc knows
what an operator needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .roles import Role

Attrs = Mapping[str, Any]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Attr:
    name: str
    type: str  # "int" | "float" | "bool" | "enum" | "str" | "ints"
    choices: tuple[str, ...] = ()
    optional: bool = False  # may be left undeclared (an absent feature)
    doc: str = ""

    def accepts(self, value: Any) -> bool:
        if self.type == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if self.type == "float":
            return isinstance(value, float)
        if self.type == "bool":
            return isinstance(value, bool)
        if self.type == "enum":
            return isinstance(value, str) and value in self.choices
        if self.type == "str":
            return isinstance(value, str)
        if self.type == "ints":
            return isinstance(value, list) and all(isinstance(v, int) for v in value)
        raise AssertionError(self.type)


@dataclass(frozen=True)
class RoleSpec:
    """A role the operator binds; ``role=None`` means the instance's own declared role (norms)."""

    role: Role | None
    shape: Callable[[Attrs], Shape]
    when: str | None = None  # name of a bool attribute; required iff it is true
    unless: str | None = None  # name of a bool attribute; required iff it is false

    def required(self, attrs: Attrs) -> bool:
        if self.when is not None:
            return bool(attrs.get(self.when))
        if self.unless is not None:
            return not attrs.get(self.unless)
        return True

    def condition_text(self) -> str:
        if self.when:
            return f"{self.when}=true"
        if self.unless:
            return f"{self.unless}=false"
        return "always"


# Region kinds a state provider may be asked to hold.
REGION_KINDS = ("recurrent", "conv_history", "kv_rows", "latent_rows")
PRECISIONS = ("f32", "compute")  # fixed fp32, or follows the compute dtype
GROWTHS = ("fixed", "per_token")


@dataclass(frozen=True)
class RegionSpec:
    name: str
    kind: str
    shape: Callable[[Attrs], Shape]  # for per_token regions: the shape of one position
    precision: str
    growth: str
    window: Callable[[Attrs], int] | None = None  # bound on per-token growth (0 = unbounded)
    when: str | None = None

    def required(self, attrs: Attrs) -> bool:
        return self.when is None or bool(attrs.get(self.when))


@dataclass(frozen=True)
class OperatorDecl:
    kind: str
    slot: str  # "mixer" | "ffn" | "norm" | "embedding" | "head"
    attrs: tuple[Attr, ...]
    roles: tuple[RoleSpec, ...] = ()
    regions: tuple[RegionSpec, ...] = ()
    # consistency rules between attributes: (message, predicate)
    rules: tuple[tuple[str, Callable[[Attrs], bool]], ...] = ()
    surfaces: tuple[str, ...] = ()  # what a layer running it reports: "attention", "ffn", "moe"
    doc: str = ""

    def attr(self, name: str) -> Attr | None:
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    def role_specs(self, attrs: Attrs, own_role: Role | None = None) -> list[tuple[Role, RoleSpec]]:
        out = []
        for spec in self.roles:
            role = spec.role if spec.role is not None else own_role
            if role is not None:
                out.append((role, spec))
        return out

    def required_roles(self, attrs: Attrs, own_role: Role | None = None) -> list[Role]:
        return [r for r, s in self.role_specs(attrs, own_role) if s.required(attrs)]

    def region_specs(self, attrs: Attrs) -> list[RegionSpec]:
        return [r for r in self.regions if r.required(attrs)]


def _a(name: str, type_: str, *choices: str, optional: bool = False, doc: str = "") -> Attr:
    return Attr(name, type_, tuple(choices), optional, doc)


# ---------------------------------------------------------------- mamba2


def _mamba2_conv_dim(a: Attrs) -> int:
    return a["d_inner"] + 2 * a["groups"] * a["state_size"]


def _mamba2_in_rows(a: Attrs) -> int:
    return 2 * a["d_inner"] + 2 * a["groups"] * a["state_size"] + a["heads"]


MAMBA2 = OperatorDecl(
    kind="mamba2",
    slot="mixer",
    doc="Mamba2 SSD mixer: in_proj → z|xBC|dt, causal conv + SiLU on xBC, selective scan, gated RMSNorm, out_proj",
    attrs=(
        _a("d_model", "int"),
        _a("d_inner", "int"),
        _a("heads", "int"),
        _a("head_dim", "int"),
        _a("state_size", "int", doc="d_state N"),
        _a("groups", "int", doc="B/C groups G"),
        _a("conv_kernel", "int"),
        _a("conv_bias", "bool"),
        _a("proj_bias", "bool"),
        _a("chunk_size", "int"),
        _a("dt_min", "float"),
        _a("dt_max", "float"),
        _a("norm_eps", "float"),
        _a("norm_order", "enum", "gate_then_norm", "norm_then_gate"),
        _a("norm_act", "enum", "silu", "sigmoid"),
        _a("norm_group", "int", doc="channels per RMS group"),
    ),
    roles=(
        RoleSpec(Role.Mamba2InProj, lambda a: (_mamba2_in_rows(a), a["d_model"])),
        RoleSpec(Role.Mamba2InProjBias, lambda a: (_mamba2_in_rows(a),), when="proj_bias"),
        RoleSpec(Role.Mamba2Conv1d, lambda a: (_mamba2_conv_dim(a), a["conv_kernel"])),
        RoleSpec(Role.Mamba2Conv1dBias, lambda a: (_mamba2_conv_dim(a),), when="conv_bias"),
        RoleSpec(Role.Mamba2DtBias, lambda a: (a["heads"],)),
        RoleSpec(Role.Mamba2ALog, lambda a: (a["heads"],)),
        RoleSpec(Role.Mamba2D, lambda a: (a["heads"],)),
        RoleSpec(Role.Mamba2GatedNorm, lambda a: (a["d_inner"],)),
        RoleSpec(Role.Mamba2OutProj, lambda a: (a["d_model"], a["d_inner"])),
        RoleSpec(Role.Mamba2OutProjBias, lambda a: (a["d_model"],), when="proj_bias"),
    ),
    regions=(
        RegionSpec("ssm", "recurrent", lambda a: (a["heads"], a["head_dim"], a["state_size"]), "f32", "fixed"),
        # k columns: the k most recent raw inputs, as the references allocate it
        RegionSpec("conv", "conv_history", lambda a: (_mamba2_conv_dim(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("d_inner must equal heads*head_dim", lambda a: a["d_inner"] == a["heads"] * a["head_dim"]),
        ("heads must be a multiple of groups", lambda a: a["heads"] % a["groups"] == 0),
        ("norm_group must divide d_inner", lambda a: a["norm_group"] > 0 and a["d_inner"] % a["norm_group"] == 0),
    ),
)

# ---------------------------------------------------------------- rotary (shared attribute block)

ROTARY_ATTRS = (
    _a("rotary_dim", "int", doc="leading dims of each head that rotate (0 = none)"),
    _a("rotary_base", "float"),
    _a("rotary_layout", "enum", "half", "interleaved", "none"),
    _a("rope_type", "enum", "default", "linear", "llama3", "yarn"),
    _a("rope_factor", "float", optional=True),
    _a("rope_low_freq_factor", "float", optional=True),
    _a("rope_high_freq_factor", "float", optional=True),
    _a("rope_original_max_position", "int", optional=True),
    _a("rope_beta_fast", "float", optional=True),
    _a("rope_beta_slow", "float", optional=True),
    _a("rope_attention_factor", "float", optional=True),
)

# ---------------------------------------------------------------- conv-QKV attention


def _qkv_rows(a: Attrs) -> int:
    return (a["heads"] + 2 * a["kv_heads"]) * a["head_dim"]


CONV_QKV = OperatorDecl(
    kind="conv_qkv",
    slot="mixer",
    surfaces=("attention",),
    doc="fused QKV projection, causal depthwise conv over the fused QKV (no activation), rotary, causal GQA softmax",
    attrs=(
        _a("d_model", "int"),
        _a("heads", "int"),
        _a("kv_heads", "int"),
        _a("head_dim", "int"),
        _a("conv_kernel", "int"),
        _a("conv_bias", "bool"),
        _a("qkv_bias", "bool"),
        _a("out_bias", "bool"),
        _a("causal", "bool"),
        _a("scale", "float"),
        *ROTARY_ATTRS,
    ),
    roles=(
        RoleSpec(Role.ConvQkvInProj, lambda a: (_qkv_rows(a), a["d_model"])),
        RoleSpec(Role.ConvQkvInProjBias, lambda a: (_qkv_rows(a),), when="qkv_bias"),
        RoleSpec(Role.ConvQkvConv1d, lambda a: (_qkv_rows(a), a["conv_kernel"])),
        RoleSpec(Role.ConvQkvConv1dBias, lambda a: (_qkv_rows(a),), when="conv_bias"),
        RoleSpec(Role.ConvQkvOutProj, lambda a: (a["d_model"], a["heads"] * a["head_dim"])),
        RoleSpec(Role.ConvQkvOutProjBias, lambda a: (a["d_model"],), when="out_bias"),
    ),
    regions=(
        RegionSpec("kv", "kv_rows", lambda a: (2, a["kv_heads"], a["head_dim"]), "compute", "per_token"),
        RegionSpec("conv", "conv_history", lambda a: (_qkv_rows(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("heads must be a multiple of kv_heads", lambda a: a["heads"] % a["kv_heads"] == 0),
        ("rotary_dim must be even and at most head_dim", lambda a: a["rotary_dim"] % 2 == 0 and a["rotary_dim"] <= a["head_dim"]),
        ("only causal attention is defined", lambda a: a["causal"] is True),
    ),
)

# ---------------------------------------------------------------- softmax attention

SOFTMAX = OperatorDecl(
    kind="softmax",
    slot="mixer",
    surfaces=("attention",),
    doc="softmax attention: q/k/v projections (+biases), optional per-head q/k RMSNorm, rotary, causal GQA softmax, o projection",
    attrs=(
        _a("d_model", "int"),
        _a("heads", "int"),
        _a("kv_heads", "int"),
        _a("head_dim", "int"),
        _a("q_bias", "bool"),
        _a("k_bias", "bool"),
        _a("v_bias", "bool"),
        _a("o_bias", "bool"),
        _a("qk_norm", "bool"),
        _a("qk_norm_eps", "float", optional=True),
        _a("qk_norm_zero_centred", "bool", optional=True),
        _a("sinks", "bool"),
        _a("output_gate", "bool"),
        _a("window", "int", doc="sliding window in positions (0 = full causal)"),
        _a("scale", "float"),
        *ROTARY_ATTRS,
    ),
    roles=(
        RoleSpec(Role.AttnQ, lambda a: (a["heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.AttnK, lambda a: (a["kv_heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.AttnV, lambda a: (a["kv_heads"] * a["head_dim"], a["d_model"])),
        RoleSpec(Role.AttnO, lambda a: (a["d_model"], a["heads"] * a["head_dim"])),
        RoleSpec(Role.AttnQBias, lambda a: (a["heads"] * a["head_dim"],), when="q_bias"),
        RoleSpec(Role.AttnKBias, lambda a: (a["kv_heads"] * a["head_dim"],), when="k_bias"),
        RoleSpec(Role.AttnVBias, lambda a: (a["kv_heads"] * a["head_dim"],), when="v_bias"),
        RoleSpec(Role.AttnOBias, lambda a: (a["d_model"],), when="o_bias"),
        RoleSpec(Role.AttnQNorm, lambda a: (a["head_dim"],), when="qk_norm"),
        RoleSpec(Role.AttnKNorm, lambda a: (a["head_dim"],), when="qk_norm"),
        RoleSpec(Role.AttnSinks, lambda a: (a["heads"],), when="sinks"),
        RoleSpec(Role.AttnOutputGate, lambda a: (a["heads"] * a["head_dim"], a["d_model"]), when="output_gate"),
    ),
    regions=(
        RegionSpec(
            "kv", "kv_rows", lambda a: (2, a["kv_heads"], a["head_dim"]), "compute", "per_token",
            window=lambda a: a["window"],
        ),
    ),
    rules=(
        ("heads must be a multiple of kv_heads", lambda a: a["heads"] % a["kv_heads"] == 0),
        ("rotary_dim must be even and at most head_dim", lambda a: a["rotary_dim"] % 2 == 0 and a["rotary_dim"] <= a["head_dim"]),
        ("qk_norm needs qk_norm_eps and qk_norm_zero_centred", lambda a: not a["qk_norm"] or ("qk_norm_eps" in a and "qk_norm_zero_centred" in a)),
        ("window must be >= 0", lambda a: a["window"] >= 0),
    ),
)

# ---------------------------------------------------------------- dense FFN

SWIGLU = OperatorDecl(
    kind="swiglu",
    slot="ffn",
    surfaces=("ffn",),
    doc="dense gated FFN: down(act(x·gateᵀ) * (x·upᵀ))",
    attrs=(_a("d_model", "int"), _a("intermediate", "int"), _a("act", "enum", "silu")),
    roles=(
        RoleSpec(Role.FfnGate, lambda a: (a["intermediate"], a["d_model"])),
        RoleSpec(Role.FfnUp, lambda a: (a["intermediate"], a["d_model"])),
        RoleSpec(Role.FfnDown, lambda a: (a["d_model"], a["intermediate"])),
    ),
)

# ---------------------------------------------------------------- norms, embedding, head

RMSNORM = OperatorDecl(
    kind="rmsnorm",
    slot="norm",
    doc="x·rsqrt(mean(x²)+eps)·w, or ·(1+w) when zero_centred; computed in fp32",
    attrs=(_a("dim", "int"), _a("eps", "float"), _a("zero_centred", "bool")),
    roles=(RoleSpec(None, lambda a: (a["dim"],)),),
)

EMBEDDING = OperatorDecl(
    kind="embedding",
    slot="embedding",
    doc="token embedding table; rows beyond the logical vocab are padding",
    attrs=(_a("vocab", "int"), _a("padded_vocab", "int"), _a("dim", "int")),
    roles=(RoleSpec(Role.Embedding, lambda a: (a["padded_vocab"], a["dim"])),),
    rules=(("padded_vocab must be >= vocab", lambda a: a["padded_vocab"] >= a["vocab"]),),
)

HEAD = OperatorDecl(
    kind="head",
    slot="head",
    doc="logits = h·Wᵀ over the padded vocab; W is the embedding table when tied",
    attrs=(_a("tied", "bool"), _a("padded_vocab", "int"), _a("dim", "int")),
    roles=(RoleSpec(Role.LmHead, lambda a: (a["padded_vocab"], a["dim"]), unless="tied"),),
)

OPERATORS: dict[str, OperatorDecl] = {
    d.kind: d for d in (MAMBA2, CONV_QKV, SOFTMAX, SWIGLU, RMSNORM, EMBEDDING, HEAD)
}

NORM_KINDS = tuple(k for k, d in OPERATORS.items() if d.slot == "norm")


def declared(kind: str) -> OperatorDecl | None:
    return OPERATORS.get(kind)


def role_owner(role: Role) -> list[str]:
    """Operator kinds whose declaration names this role."""
    return [d.kind for d in OPERATORS.values() for s in d.roles if s.role == role]
