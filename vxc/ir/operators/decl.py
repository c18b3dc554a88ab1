"""What an operator declaration is made of (imported by every operator module).

Each :class:`OperatorDecl` names the attributes (geometry) an instance must
declare, the roles it binds (always, or only under a declared attribute) by
name, the shape contract of each role as a function of the attributes, the
geometry derived from the attributes, and the continuation-state regions it
requires. The role vocabulary (:class:`vxc.ir.roles.Role`) is assembled from
these declarations.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:
    from ..roles import Role

Attrs = Mapping[str, Any]
Shape = tuple[int, ...]

# The largest int attribute: no dimension, count or position of a model is larger (the frontends bound config
# ints the same way). An IR can spell any int; past this, derived sizes meet float arithmetic (a softmax scale,
# a YaRN factor) that overflows, and nothing could be allocated anyway.
MAX_INT = 2**31 - 1


@dataclass(frozen=True)
class Attr:
    name: str
    type: str  # "int" | "float" | "bool" | "enum" | "str" | "ints"
    choices: tuple[str, ...] = ()
    optional: bool = False  # may be left undeclared (an absent feature)
    doc: str = ""
    min: Optional[float] = None  # the least valid value: ints are positive unless the declaration says min=0;
    # a float with a min is at least that (e.g. an eps >= 0), one without is any non-NaN value

    @property
    def least(self) -> Optional[int]:
        return (1 if self.min is None else self.min) if self.type == "int" else None

    def expects(self, value: Any = None) -> str:
        """What a valid value is, in words (for a refusal of ``value``)."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.type == "int":
            too_big = isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT
            return f"an int in {self.least}..{MAX_INT}" if too_big else f"an int >= {self.least}"
        if self.type == "float":
            return "a float (not NaN)" if self.min is None else f"a float >= {self.min:g}"
        return self.type

    def accepts(self, value: Any) -> bool:
        if self.type == "int":
            return isinstance(value, int) and not isinstance(value, bool) and self.least <= value <= MAX_INT
        if self.type == "float":
            ok = isinstance(value, float) and not math.isnan(value)  # (inf is a declared "no bound", e.g. dt_max)
            return ok and (self.min is None or value >= self.min)
        if self.type == "bool":
            return isinstance(value, bool)
        if self.type == "enum":
            return isinstance(value, str) and value in self.choices
        if self.type == "str":
            return isinstance(value, str)
        if self.type == "ints":
            return isinstance(value, list) and all(isinstance(v, int) for v in value)
        raise AssertionError(self.type)


MORE_BITS = (None, "head", "embed", "down", "value", "attn_out")  # RoleSpec.more_bits
# RoleSpec.shard: how tensor parallelism over N ranks splits a role (vxc.passes.shard reads it, nothing else):
#   None     replicated: every rank holds it whole (its shape must not depend on the divided attributes);
#   "out"    split along its output dimension (a matrix's rows, dim -2; a vector's only dim): column-parallel;
#   "in"     split along its input dimension (the last): row-parallel, each rank's product is a partial sum;
#   "experts" split along dim 0 of an expert bank;
#   "once"   whole, added by rank 0 only (the bias of a row-parallel projection: added once to the summed output).
SHARDS = (None, "out", "in", "experts", "once")
# OperatorDecl.partition: "replicated" (every operand whole, computed redundantly on every rank), "tensor" (the roles
# declare their split; the output is a partial sum, all-reduced once), None: no declared partition (refused).
PARTITIONS = (None, "replicated", "tensor")


@dataclass(frozen=True)
class RoleSpec:
    """A role the operator binds, by name; ``name=None`` means the instance's own declared role (norms)."""

    name: str | None
    shape: Callable[[Attrs], Shape]
    when: str | None = None  # "flag" or "name=value": required iff it holds
    unless: str | None = None  # required iff it does not hold
    # a weight matrix multiplied against the activations (a projection, the embedding / head table): what
    # ``vxc quantize`` encodes by default. Norms, biases, decay rates, conv taps and routers stay as stored.
    quantise: bool = False
    # the class by which a mixed scheme (``vxc quantize --scheme q4_k_m``) gives a quantised role more bits:
    # "head" the output table (always), "embed" the token-embedding table (a tied one takes "head"), "down" an FFN's output projection, "value" an attention's value
    # projection (fused QKV ones included), "attn_out" an attention's output projection; each as the scheme's
    # rule for the class picks (vxc.quantize.SCHEMES). None: its base format.
    more_bits: str | None = None
    shard: str | None = None  # how tensor parallelism splits it (SHARDS); only read under an op's partition "tensor"
    # a cut role whose cut dimension is a concatenation of segments (a fused projection: z | x | B | C | dt): the
    # segments in order, each ``(attribute, unit)`` = ``attrs[attribute]`` blocks of ``unit`` rows. A rank takes its
    # blocks of every segment (its range of a divided attribute; of a shared one, the one block it holds), in order.
    # None: the dimension is cut as one piece into N equal contiguous parts.
    segments: Callable[[Attrs], tuple[tuple[str, int], ...]] | None = None

    def __post_init__(self) -> None:
        assert self.more_bits in MORE_BITS, self.more_bits
        assert self.shard in SHARDS, self.shard
        assert self.more_bits is None or self.quantise, (self.name, "more_bits needs quantise=True")

    @property
    def role(self) -> Role | None:
        from ..roles import Role  # assembled from the declarations once they are all registered

        return None if self.name is None else Role(self.name)

    def required(self, attrs: Attrs) -> bool:
        if self.when is not None:
            return condition(self.when, attrs)
        if self.unless is not None:
            return not condition(self.unless, attrs)
        return True

    def condition_text(self) -> str:
        if self.when:
            return self.when if "=" in self.when else f"{self.when}=true"
        if self.unless:
            return f"not {self.unless}" if "=" in self.unless else f"{self.unless}=false"
        return "always"

    def off_text(self) -> str:
        """How the attributes switch this role off (for a role bound while not declared)."""
        if self.when:
            return f"{self.when.split('=')[0]}={_a_repr(self.when)}" if "=" in self.when else f"{self.when}=false"
        return f"{self.unless}" if "=" in self.unless else f"{self.unless}=true"


def condition(text: str, attrs: Attrs) -> bool:
    """``"flag"``: a bool attribute is true; ``"name=value"``: an enum/int attribute equals value."""
    if "=" in text:
        name, value = text.split("=", 1)
        return str(attrs.get(name)).lower() == value.lower()
    return bool(attrs.get(text))


def _a_repr(text: str) -> str:
    return "other than " + text.split("=", 1)[1]


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
        return self.when is None or condition(self.when, attrs)


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
    # geometry derived from the attributes (conv widths, inner sizes): computed here only, read by the
    # shape contracts and, through the plan op, by the lowering
    derive: Callable[[Attrs], dict[str, int]] | None = None
    # role names this operator adds to the vocabulary beyond its role specs: the roles a norm instance
    # may declare as its own, or a name reserved for a feature not bound yet
    extra_roles: tuple[str, ...] = ()
    doc: str = ""
    # tensor parallelism (vxc.passes.shard): how the operator splits over N ranks (PARTITIONS), and the attributes
    # that divide by N under "tensor" (each rank runs the operator at attrs // N; shapes follow from the contracts)
    partition: str | None = None
    divides: tuple[str, ...] = ()
    # attributes divided by N when N divides them, else shared: when N is a multiple of the value, each rank holds
    # one (the block its part of the divided attributes belongs to: Mamba2's B/C groups over split heads); else refused
    shares: tuple[str, ...] = ()
    # the operator's own adjustment of a rank's attributes (``local``, already divided) beyond division, from the
    # whole attributes and N: returns refusal messages (empty: fine). Mamba2's gated norm whose groups span ranks.
    localise: Callable[[Attrs, dict, int], list[str]] | None = None
    # attributes spread over the ranks rather than divided (an expert bank): ``(attribute, ranks, rank)``. The
    # attribute keeps its whole value on every rank (the router scores all the experts); rank r of N holds the
    # contiguous range [r·v/N, (r+1)·v/N) of them, which the shard pass declares by setting the optional attributes
    # ``ranks`` = N and ``rank`` = r (the contracts of what the rank holds read them). v must divide by N.
    spreads: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        assert self.partition in PARTITIONS, self.partition
        assert not (self.divides or self.shares) or self.partition == "tensor", (self.kind, "divides needs partition tensor")
        assert not self.spreads or self.partition == "tensor", (self.kind, "spreads needs partition tensor")

    def attr(self, name: str) -> Attr | None:
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    def role_specs(self, own_role: Role | None = None) -> list[tuple[Role, RoleSpec]]:
        out = []
        for spec in self.roles:
            role = spec.role if spec.role is not None else own_role
            if role is not None:
                out.append((role, spec))
        return out

    def required_roles(self, attrs: Attrs, own_role: Role | None = None) -> list[Role]:
        return [r for r, s in self.role_specs(own_role) if s.required(attrs)]

    def region_specs(self, attrs: Attrs) -> list[RegionSpec]:
        return [r for r in self.regions if r.required(attrs)]

    def derived(self, attrs: Attrs) -> dict[str, int]:
        return dict(self.derive(attrs)) if self.derive is not None else {}

    def role_names(self) -> list[str]:
        """The role names this declaration contributes to the vocabulary, in declaration order."""
        return [s.name for s in self.roles if s.name is not None] + list(self.extra_roles)


def attr(name: str, type_: str, *choices: str, optional: bool = False, doc: str = "", min: Optional[float] = None) -> Attr:
    return Attr(name, type_, tuple(choices), optional, doc, min)


# Multipliers of a sub-block's input and output (µP-style), declared on the mixer / FFN instance that has them and
# applied around its lowering by the generic lowering loop (vxc.codegen.lower.lower_plan), in fp32: x·s before the
# operator reads its input, y·s on its output. Absent: no multiplication.
BLOCK_SCALES = (
    Attr("input_scale", "float", optional=True, doc="the operator's input times this (absent: none)"),
    Attr("output_scale", "float", optional=True, doc="the operator's output times this (absent: none)"),
)

OPERATORS: dict[str, OperatorDecl] = {}


def register(*decls: OperatorDecl) -> None:
    for d in decls:
        assert d.kind not in OPERATORS, d.kind
        OPERATORS[d.kind] = d
