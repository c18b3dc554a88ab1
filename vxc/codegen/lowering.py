"""``fuse``: plan ops → fused kernel groups.

Each plan op is lowered, by operator kind, to a short list of :class:`Call`s.
A call whose ``kernel`` is set is one fused group — exactly one
``torch.ops.vxc.<kernel>`` call in the generated graph (e.g. residual add +
rmsnorm; conv + activation + conv-state write; gate + norm). Calls with
``glue`` set are shape-only tensor methods (split, view) between groups.

Variants lowered from the same plan: ``prefill`` over ``T`` tokens from
position ``start``; ``prefill_last``, the same with the head applied to the
last position only (what generation needs: no [T, vocab] logits); and
``decode``, one token with fixed shapes. Only operator kinds, roles and
declared attributes are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx

from ..ir.roles import Role
from ..passes.plan import PlanOp, plan_ops


@dataclass
class Weight:
    sym: str  # operand symbol

    def __str__(self) -> str:
        return f"%{self.sym}"


@dataclass
class StateRef:
    op_id: str
    region: str
    part: int | None = None  # kv_rows: 0 = K rows, 1 = V rows

    @property
    def id(self) -> str:
        return f"{self.op_id}.state.{self.region}"

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


class _Emitter:
    def __init__(self, variant: str):
        self.out = Lowered(variant)
        self.n = 0
        self.decode = variant == "decode"

    def fresh(self, hint: str) -> str:
        self.n += 1
        return f"{hint}{self.n}"

    def kernel(self, p: PlanOp, kernel: str, args: list, note: str, nouts: int = 1, hint: str = "v") -> list[Val]:
        outs = [self.fresh(hint) for _ in range(nouts)]
        self.out.calls.append(Call(outs, kernel, args, p.id, note))
        return [Val(o) for o in outs]

    def glue(self, p: PlanOp, method: str, args: list, nouts: int = 1, hint: str = "g") -> list[Val]:
        outs = [self.fresh(hint) for _ in range(nouts)]
        self.out.calls.append(Call(outs, None, args, p.id, glue=method))
        return [Val(o) for o in outs]

    def rope(self, attrs: dict) -> tuple[RopeRef, RopeRef]:
        key = tuple((k, attrs[k]) for k in ROPE_KEYS if k in attrs)
        self.out.ropes.setdefault(key, {k: v for k, v in key})
        return RopeRef(key, "cos"), RopeRef(key, "sin")


def _w(p: PlanOp, role: Role) -> Weight | None:
    o = p.operands.get(role)
    return Weight(o.sym) if o is not None else None


# ------------------------------------------------------------------ per-kind lowerings
# Each takes (emitter, plan op, input hidden [T, d]) and returns the output hidden.


def _mamba2(e: _Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    di, H, P, N, G = a["d_inner"], a["heads"], a["head_dim"], a["state_size"], a["groups"]
    conv_dim = di + 2 * G * N
    (zxbcdt,) = e.kernel(p, "linear", [x, _w(p, Role.Mamba2InProj), _w(p, Role.Mamba2InProjBias)], "in_proj")
    z, xbc, dt = e.glue(p, "split", [zxbcdt, [di, conv_dim, H], -1], 3)
    conv_state, ssm_state = StateRef(p.id, "conv"), StateRef(p.id, "ssm")
    w_conv, b_conv = _w(p, Role.Mamba2Conv1d), _w(p, Role.Mamba2Conv1dBias)
    common = [_w(p, Role.Mamba2ALog)]
    if e.decode:
        (xbc1,) = e.glue(p, "reshape", [xbc, [conv_dim]])
        (xbc2,) = e.kernel(p, "conv1d_step", [xbc1, w_conv, b_conv, "silu", conv_state], "conv + silu + conv-state roll/write")
        xs, B, C = e.glue(p, "split", [xbc2, [di, G * N, G * N], -1], 3)
        (xh,) = e.glue(p, "reshape", [xs, [H, P]])
        (Bh,) = e.glue(p, "reshape", [B, [G, N]])
        (Ch,) = e.glue(p, "reshape", [C, [G, N]])
        (dt1,) = e.glue(p, "reshape", [dt, [H]])
        (y,) = e.kernel(p, "ssd_step", [xh, dt1, *common, Bh, Ch, _w(p, Role.Mamba2D), _w(p, Role.Mamba2DtBias),
                                        a["dt_min"], a["dt_max"], ssm_state], "softplus(dt) + state update + readout + D skip")
    else:
        (xbc2,) = e.kernel(p, "conv1d_prefill", [xbc, w_conv, b_conv, "silu", conv_state], "causal conv + silu + conv-state write")
        xs, B, C = e.glue(p, "split", [xbc2, [di, G * N, G * N], -1], 3)
        (xh,) = e.glue(p, "reshape", [xs, [-1, H, P]])
        (Bh,) = e.glue(p, "reshape", [B, [-1, G, N]])
        (Ch,) = e.glue(p, "reshape", [C, [-1, G, N]])
        (y,) = e.kernel(p, "ssd_prefill", [xh, dt, *common, Bh, Ch, _w(p, Role.Mamba2D), _w(p, Role.Mamba2DtBias),
                                           a["dt_min"], a["dt_max"], ssm_state, a["chunk_size"]],
                        "softplus(dt) + chunked SSD scan + D skip + final-state write")
    (y2,) = e.glue(p, "reshape", [y, [-1, di]])
    (z2,) = e.glue(p, "reshape", [z, [-1, di]])
    (yn,) = e.kernel(p, "gated_rmsnorm", [y2, z2, _w(p, Role.Mamba2GatedNorm), a["norm_eps"], a["norm_group"],
                                           a["norm_order"] == "norm_then_gate", a["norm_act"]], "gate + grouped rmsnorm")
    (out,) = e.kernel(p, "linear", [yn, _w(p, Role.Mamba2OutProj), _w(p, Role.Mamba2OutProjBias)], "out_proj")
    return out


def _attend(e: _Emitter, p: PlanOp, q: Val, k: Val, v: Val, heads: int, kv_heads: int, hd: int, sinks=None) -> Val:
    a = p.attrs
    (qh,) = e.glue(p, "reshape", [q, [-1, heads, hd]])
    (kh,) = e.glue(p, "reshape", [k, [-1, kv_heads, hd]])
    (vh,) = e.glue(p, "reshape", [v, [-1, kv_heads, hd]])
    if a["rotary_dim"] and a["rotary_layout"] != "none":
        cos, sin = e.rope(a)
        inter = a["rotary_layout"] == "interleaved"
        (qh,) = e.kernel(p, "rotary", [qh, cos, sin, inter], f"rotary q ({a['rotary_layout']}, {a['rotary_dim']} dims)")
        (kh,) = e.kernel(p, "rotary", [kh, cos, sin, inter], f"rotary k ({a['rotary_layout']}, {a['rotary_dim']} dims)")
    kv = StateRef(p.id, "kv")
    (o,) = e.kernel(p, "attention", [qh, kh, vh, StateRef(p.id, "kv", 0), StateRef(p.id, "kv", 1), START, a["scale"],
                                     a.get("window", 0), sinks], "kv-row write + causal GQA softmax attention")
    del kv
    (o2,) = e.glue(p, "reshape", [o, [-1, heads * hd]])
    return o2


def _conv_qkv(e: _Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    H, Hkv, hd = a["heads"], a["kv_heads"], a["head_dim"]
    rows = (H + 2 * Hkv) * hd
    (qkv,) = e.kernel(p, "linear", [x, _w(p, Role.ConvQkvInProj), _w(p, Role.ConvQkvInProjBias)], "fused qkv projection")
    conv_state = StateRef(p.id, "conv")
    w, b = _w(p, Role.ConvQkvConv1d), _w(p, Role.ConvQkvConv1dBias)
    if e.decode:
        (q1,) = e.glue(p, "reshape", [qkv, [rows]])
        (c,) = e.kernel(p, "conv1d_step", [q1, w, b, "none", conv_state], "conv (no activation) + conv-state roll/write")
        (c,) = e.glue(p, "reshape", [c, [1, rows]])
    else:
        (c,) = e.kernel(p, "conv1d_prefill", [qkv, w, b, "none", conv_state], "causal conv over fused qkv (no activation) + conv-state write")
    q, k, v = e.glue(p, "split", [c, [H * hd, Hkv * hd, Hkv * hd], -1], 3)
    o = _attend(e, p, q, k, v, H, Hkv, hd)
    (out,) = e.kernel(p, "linear", [o, _w(p, Role.ConvQkvOutProj), _w(p, Role.ConvQkvOutProjBias)], "out_proj")
    return out


def _softmax(e: _Emitter, p: PlanOp, x: Val) -> Val:
    a = p.attrs
    H, Hkv, hd = a["heads"], a["kv_heads"], a["head_dim"]
    (q,) = e.kernel(p, "linear", [x, _w(p, Role.AttnQ), _w(p, Role.AttnQBias)], "q projection")
    (k,) = e.kernel(p, "linear", [x, _w(p, Role.AttnK), _w(p, Role.AttnKBias)], "k projection")
    (v,) = e.kernel(p, "linear", [x, _w(p, Role.AttnV), _w(p, Role.AttnVBias)], "v projection")
    if a["qk_norm"]:
        (qf,) = e.glue(p, "reshape", [q, [-1, hd]])
        (kf,) = e.glue(p, "reshape", [k, [-1, hd]])
        qn, _ = e.kernel(p, "add_rmsnorm", [qf, None, _w(p, Role.AttnQNorm), a["qk_norm_eps"], a["qk_norm_zero_centred"], False],
                         "per-head q rmsnorm", nouts=2)
        kn, _ = e.kernel(p, "add_rmsnorm", [kf, None, _w(p, Role.AttnKNorm), a["qk_norm_eps"], a["qk_norm_zero_centred"], False],
                         "per-head k rmsnorm", nouts=2)
        q, k = qn, kn
    o = _attend(e, p, q, k, v, H, Hkv, hd, _w(p, Role.AttnSinks))
    if a["output_gate"]:
        (gate,) = e.kernel(p, "linear", [x, _w(p, Role.AttnOutputGate), None], "output-gate projection")
        (o,) = e.kernel(p, "sigmoid_gate_mul", [o, gate], "attn · sigmoid(gate)")
    (out,) = e.kernel(p, "linear", [o, _w(p, Role.AttnO), _w(p, Role.AttnOBias)], "o projection")
    return out


def _swiglu(e: _Emitter, p: PlanOp, x: Val) -> Val:
    (out,) = e.kernel(p, "swiglu", [x, _w(p, Role.FfnGate), _w(p, Role.FfnUp), _w(p, Role.FfnDown)], "gate/up GEMM + silu·mul + down GEMM")
    return out


BLOCKS: dict[str, Callable[[_Emitter, PlanOp, Val], Val]] = {
    "mamba2": _mamba2,
    "conv_qkv": _conv_qkv,
    "softmax": _softmax,
    "swiglu": _swiglu,
}


def register_block(kind: str):
    """Register the lowering of one operator kind (modules under vxc/codegen/blocks/)."""
    def deco(fn: Callable[[_Emitter, PlanOp, Val], Val]):
        assert kind not in BLOCKS, kind
        BLOCKS[kind] = fn
        return fn
    return deco


VARIANTS = ("prefill", "prefill_last", "decode")


class Unsupported(Exception):
    pass


def lower_plan(g: nx.DiGraph, variant: str) -> Lowered:
    from . import blocks  # noqa: F401  (registers the lowerings of further operator kinds)

    assert variant in VARIANTS
    e = _Emitter(variant)
    hidden: Val | None = None  # output of the last block, not yet added to the residual
    residual: Val | None = None
    for p in plan_ops(g):
        if p.kind == "embedding":
            (hidden,) = e.kernel(p, "embedding", [TOKENS, _w(p, Role.Embedding)], "token embedding gather")
        elif p.kind == "add_rmsnorm":
            normed, residual = e.kernel(p, "add_rmsnorm", [hidden, residual, _w(p, p.role), p.attrs["eps"], p.attrs["zero_centred"],
                                                          p.residual == "fp32"],
                                        f"residual add{' (fp32)' if p.residual == 'fp32' else ''} + rmsnorm", nouts=2)
            hidden = normed
        elif p.kind == "rmsnorm":
            (hidden, _) = e.kernel(p, "add_rmsnorm", [hidden, None, _w(p, p.role), p.attrs["eps"], p.attrs["zero_centred"], False],
                                   "rmsnorm (post-block)", nouts=2)
        elif p.kind == "head":
            if variant == "prefill_last":
                (hidden,) = e.glue(p, "narrow", [hidden, 0, -1, 1])  # the last position's row (a view)
            (logits,) = e.kernel(p, "linear", [hidden, _w(p, Role.LmHead), None], "lm head over the padded vocab")
            e.out.output = logits.name
        elif p.kind in BLOCKS:
            hidden = BLOCKS[p.kind](e, p, hidden)
        else:
            raise Unsupported(f"{p.id}: no kernel lowering for operator kind {p.kind}")
    for i, c in enumerate(e.out.groups()):
        c.group = i
    return e.out


def fmt_arg(a: Any) -> str:
    if a is None:
        return "none"
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, list):
        return "[" + ",".join(str(x) for x in a) + "]"
    if isinstance(a, str):
        return f'"{a}"'
    return str(a)


def print_groups(lw: Lowered) -> str:
    lines = [f"fuse {lw.variant}: {len(lw.groups())} fused groups"]
    for c in lw.calls:
        if c.kernel is not None:
            lines.append(f"  g{c.group:<4d} vxc.{c.kernel:<15} {c.plan_op:<32} {c.note}")
    return "\n".join(lines) + "\n"


def print_listing(lw: Lowered) -> str:
    """A normalised, deterministic listing of the graph (stable across torch releases)."""
    lines = [f"graph {lw.variant}(tokens, start):"]
    for c in lw.calls:
        outs = ", ".join(f"%{o}" for o in c.outs)
        args = ", ".join(fmt_arg(a) for a in c.args)
        fn = f"vxc.{c.kernel}" if c.kernel else c.glue
        lines.append(f"  {outs} = {fn}({args})")
    lines.append(f"  return %{lw.output}")
    return "\n".join(lines) + "\n"
