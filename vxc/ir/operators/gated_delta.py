"""The ``gated_delta`` mixer (Gated DeltaNet linear attention, Qwen3-Next).

Program, per token t (q, k per key head; v, z, a, b per value head; value head h
reads key head ``h // (v_heads / k_heads)``)::

    qkv   = x·LinearAttnInProjQkvᵀ                       [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)]
    qkv   = conv_act(causal depthwise conv(qkv; LinearAttnConv1d))     (no bias)
    q, k  = l2norm(q), l2norm(k)       l2norm(x) = x·rsqrt(Σx² + l2_eps)
    q     = q · scale
    β     = σ(x·LinearAttnInProjBᵀ)
    g     = −exp(LinearAttnALog) · softplus(x·LinearAttnInProjAᵀ + LinearAttnDtBias)     (fp32)
    S     ← e^g·S;   S ← S + k·(β·(v − Sᵀk))ᵀ;   o = Sᵀq            S ∈ R^{Dk×Dv} per value head
    o     = gated rmsnorm per value head (norm_order, norm_act, plain weight LinearAttnNorm, norm_eps)
            with gate z = x·LinearAttnInProjZᵀ
    out   = o·LinearAttnOutProjᵀ

Prefill computes the recurrence chunked (``chunk_size`` tokens per chunk, WY form);
decode runs it one token at a time. Roles are plain: a checkpoint's fused,
per-key-head-grouped projections are split by the frontend with views (gather by
group), so nothing here knows why.

Tensor parallel: split by heads. Rank r of N holds value heads [r·Hv/N, (r+1)·Hv/N) (z, b, a, dt_bias,
A_log, v, the state, out_proj's input columns) and the key heads they read: value head h reads key head
``h // (Hv/Hk)`` (a contiguous run of Hv/Hk value heads per key head, the kernels' ``repeat_interleave``), so
the rank's contiguous block of value heads reads a contiguous block of key heads — Hk/N of them when N divides
Hk, else (N a multiple of Hk) the one key head its value heads share (``shares``: held by N/Hk ranks; any
other N would make a rank's value heads read another rank's key heads, and is refused by ``k_heads``).
The fused q|k|v projection and the conv over it are cut segment by segment; the gated norm's weight (one
head's width) is whole; out_proj is row-parallel.
"""

from __future__ import annotations

from .decl import Attrs, OperatorDecl, RegionSpec, RoleSpec, attr, register


def _key_dim(a: Attrs) -> int:
    return a["k_heads"] * a["k_head_dim"]


def _value_dim(a: Attrs) -> int:
    return a["v_heads"] * a["v_head_dim"]


def _conv_dim(a: Attrs) -> int:
    return 2 * _key_dim(a) + _value_dim(a)


def _derive(a: Attrs) -> dict[str, int]:
    """The conv runs over q (key_dim) | k (key_dim) | v (value_dim)."""
    return {"key_dim": _key_dim(a), "value_dim": _value_dim(a), "conv_dim": _conv_dim(a)}


def _qkv(a: Attrs) -> tuple[tuple[str, int], ...]:
    """q | k | v rows of the fused projection (and channels of the conv): key heads, key heads, value heads."""
    return (("k_heads", a["k_head_dim"]), ("k_heads", a["k_head_dim"]), ("v_heads", a["v_head_dim"]))


GATED_DELTA = OperatorDecl(
    kind="gated_delta",
    slot="mixer",
    surfaces=(),
    derive=_derive,
    doc="q|k|v projection → causal conv + act → l2-normalised q,k, q·scale; β=σ(b), g=−exp(A_log)·softplus(a+dt_bias); "
        "delta rule S←e^g S + kβ(v−Sᵀk)ᵀ; o=Sᵀq; per-head gated rmsnorm(o, z)·w; out_proj",
    attrs=(
        attr("d_model", "int"),
        attr("k_heads", "int"),
        attr("v_heads", "int"),
        attr("k_head_dim", "int"),
        attr("v_head_dim", "int"),
        attr("conv_kernel", "int"),
        attr("conv_act", "enum", "silu", "none", doc="activation after the causal conv"),
        attr("chunk_size", "int", doc="prefill chunk (WY form)"),
        attr("scale", "float", doc="q ← q·scale after the l2 norm"),
        attr("l2_eps", "float", doc="q,k ← x·rsqrt(Σx²+l2_eps)"),
        attr("norm_eps", "float", min=0.0),
        attr("norm_order", "enum", "norm_then_gate", "gate_then_norm"),
        attr("norm_act", "enum", "silu", "sigmoid", doc="activation of the output gate z"),
    ),
    # tensor parallel: heads split (see the module docstring); the key heads shared when N is a multiple of them
    partition="tensor",
    divides=("v_heads",),
    shares=("k_heads",),
    roles=(
        RoleSpec("LinearAttnInProjQkv", lambda a: (_conv_dim(a), a["d_model"]), quantise=True, more_bits="value",
                 shard="out", segments=_qkv),
        RoleSpec("LinearAttnInProjZ", lambda a: (_value_dim(a), a["d_model"]), quantise=True, shard="out"),
        RoleSpec("LinearAttnInProjB", lambda a: (a["v_heads"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("LinearAttnInProjA", lambda a: (a["v_heads"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("LinearAttnConv1d", lambda a: (_conv_dim(a), a["conv_kernel"]), shard="out", segments=_qkv),
        RoleSpec("LinearAttnDtBias", lambda a: (a["v_heads"],), shard="out"),
        RoleSpec("LinearAttnALog", lambda a: (a["v_heads"],), shard="out"),
        RoleSpec("LinearAttnNorm", lambda a: (a["v_head_dim"],)),
        RoleSpec("LinearAttnOutProj", lambda a: (a["d_model"], _value_dim(a)), quantise=True, shard="in"),
    ),
    regions=(
        RegionSpec("delta", "recurrent", lambda a: (a["v_heads"], a["k_head_dim"], a["v_head_dim"]), "f32", "fixed"),
        # k columns: the k most recent raw (pre-conv) q|k|v inputs, as the references allocate it
        RegionSpec("conv", "conv_history", lambda a: (_conv_dim(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("v_heads must be a multiple of k_heads", lambda a: a["k_heads"] >= 1 and a["v_heads"] % a["k_heads"] == 0),
        ("chunk_size must be >= 1", lambda a: a["chunk_size"] >= 1),
        ("conv_kernel must be >= 1", lambda a: a["conv_kernel"] >= 1),
    ),
)

register(GATED_DELTA)
