"""What a lowering is written with: the values a fused call reads, the emitter, the registry.

A lowering (one module per operator kind in this package) is a function
``(emitter, plan op, input hidden) -> output hidden`` registered with
``@lowering("<kind>")``. It appends :class:`Call`s through :class:`Emitter`:
a call whose ``kernel`` is set is one fused group — exactly one
``torch.ops.vxc.<kernel>`` call in the generated graph (kernels are named by
string, never imported); calls with ``glue`` set are shape-only tensor
methods (split, view) between groups. A lowering reads only roles
(:func:`weight`), declared attributes and the geometry the declaration
derives (``p.derived``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ...ir.roles import Role
from ...passes.plan import PlanOp, region_id


@dataclass
class Weight:
    sym: str  # operand symbol
    encoded: bool = False  # the operand's stored blocks, as stored (a kernel reading its declared encoding)

    def __str__(self) -> str:
        return f"%{self.sym}" + (" (encoded)" if self.encoded else "")


@dataclass
class StateRef:
    op_id: str
    region: str
    part: int | None = None  # kv_rows: 0 = K rows, 1 = V rows

    @property
    def id(self) -> str:
        return region_id(self.op_id, self.region)

    def __str__(self) -> str:
        return f"state:{self.id}" + (f"[{self.part}]" if self.part is not None else "")


@dataclass
class RopeRef:
    key: tuple  # the rotary attributes that define a table
    which: str  # "cos" | "sin"

    def __str__(self) -> str:
        return f"rope{hash(self.key) & 0xffff:04x}.{self.which}"


@dataclass
class Val:
    name: str

    def __str__(self) -> str:
        return f"%{self.name}"


START = Val("start")
TOKENS = Val("tokens")


@dataclass
class Call:
    outs: list[str]
    kernel: str | None  # vxc kernel name: one fused group
    args: list[Any]
    plan_op: str
    note: str = ""
    glue: str | None = None  # tensor method for shape-only glue
    group: int = -1


@dataclass
class Lowered:
    variant: str
    calls: list[Call] = field(default_factory=list)
    output: str = ""
    ropes: dict[tuple, dict[str, Any]] = field(default_factory=dict)

    def groups(self) -> list[Call]:
        return [c for c in self.calls if c.kernel is not None]


ROPE_KEYS = ("rotary_dim", "rotary_base", "rope_type", "rope_factor", "rope_low_freq_factor",
             "rope_high_freq_factor", "rope_original_max_position", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor",
             "rope_truncate")


# plain kernel -> its form over ggml block-encoded weights, and which arguments are weights
ENCODED_FORMS = {"linear": ("qlinear", (1,)), "swiglu": ("qswiglu", (1, 2, 3)), "embedding": ("qembedding", (1,)),
                 "moe_experts": ("qmoe_experts", (3, 4, 5)), "moe_shared": ("qmoe_shared", (2, 3, 4))}


class Emitter:
    def __init__(self, variant: str, encoded_weights: bool = False, compute: str = "fp32"):
        self.encoded_weights = encoded_weights  # keep ggml-encoded operands as stored blocks
        if compute not in ("fp32", "bf16"):
            raise ValueError(f"encoded kernel forms compute in fp32 or bf16 sessions, not {compute}")
        self.compute = compute
        self.out = Lowered(variant)
        self.n = 0
        self.decode = variant == "decode"
        self.residual: Val | None = None  # the residual stream, carried by the norms

    def fresh(self, hint: str) -> str:
        self.n += 1
        return f"{hint}{self.n}"

    def kernel(self, p: PlanOp, kernel: str, args: list, note: str, nouts: int = 1, hint: str = "v") -> list[Val]:
        if self.encoded_weights and kernel in ENCODED_FORMS:  # (each sums in fp32; its output in the session's dtype)
            kernel, args, note = self._encoded(p, kernel, args, note)
        outs = [self.fresh(hint) for _ in range(nouts)]
        self.out.calls.append(Call(outs, kernel, args, p.id, note))
        return [Val(o) for o in outs]

    def _encoded(self, p: PlanOp, kernel: str, args: list, note: str) -> tuple[str, list, str]:
        """The encoded form of a projection / FFN / gather whose weights all declare a ggml encoding: each weight
        argument becomes (its encoding, its stored blocks). Anything else is emitted as written."""
        from ...ir.views import _ggml, selects_rows

        form, positions = ENCODED_FORMS[kernel]
        by_sym = {o.sym: o for o in p.operands.values()}
        encs, acts = [], set()
        for i in positions:
            w = args[i]
            o = by_sym.get(w.sym) if isinstance(w, Weight) else None
            # (a view selecting rows stays encoded: the runtime selects the same rows of the blocks)
            if o is None or o.encoding not in _ggml() or (o.transforms and not selects_rows(o.transforms, len(o.shape))):
                return kernel, args, note
            encs.append(o.encoding)
            acts.add(o.activations)
        out: list = []
        for i, a in enumerate(args):
            if i in positions:
                out += [encs[positions.index(i)], Weight(a.sym, encoded=True)]
            else:
                out.append(a)
        if form == "qembedding" and self.compute != "fp32":  # a gather has no input dtype to follow: told
            out.append(self.compute)
        if form != "qembedding":  # a gather takes no activations; the products take what their weights declare
            if len(acts) > 1:
                raise ValueError(f"{p.id}: the weights of one {kernel} declare different activation precisions "
                                 f"({', '.join(sorted(a or 'fp32' for a in acts))}); they share their input")
            act = acts.pop()
            if act is not None:
                out.append(act)
                return form, out, f"{note} ({', '.join(encs)} blocks, {act} activations)"
        return form, out, f"{note} ({', '.join(encs)} blocks)"

    def glue(self, p: PlanOp, method: str, args: list, nouts: int = 1, hint: str = "g") -> list[Val]:
        outs = [self.fresh(hint) for _ in range(nouts)]
        self.out.calls.append(Call(outs, None, args, p.id, glue=method))
        return [Val(o) for o in outs]

    def rope(self, attrs: dict) -> tuple[RopeRef, RopeRef]:
        key = tuple((k, attrs[k]) for k in ROPE_KEYS if k in attrs)
        self.out.ropes.setdefault(key, {k: v for k, v in key})
        return RopeRef(key, "cos"), RopeRef(key, "sin")


def weight(p: PlanOp, role: Role) -> Weight | None:
    """The operand bound to ``role`` on this op (``None`` when the role is not bound)."""
    o = p.operands.get(role)
    return Weight(o.sym) if o is not None else None


Lowering = Callable[[Emitter, PlanOp, Val | None], Val | None]
LOWERINGS: dict[str, Lowering] = {}
"""plan-op kind → its lowering (filled by the modules of this package, imported by its ``__init__``)."""


def lowering(kind: str) -> Callable[[Lowering], Lowering]:
    """Register the lowering of one plan-op kind."""
    def deco(fn: Lowering) -> Lowering:
        assert kind not in LOWERINGS, kind
        LOWERINGS[kind] = fn
        return fn
    return deco


