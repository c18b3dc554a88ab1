"""The ``kda`` mixer (Kimi Delta Attention): a gated delta rule whose decay is per key
channel, with a low-rank forget gate, a sigmoid output gate and three short convs.

Math, per head h (``D = head_dim``; all of the recurrence in fp32):

- ``q, k, v = SiLU(conv_q(x Wqᵀ)), SiLU(conv_k(x Wkᵀ)), SiLU(conv_v(x Wvᵀ))`` — three causal
  depthwise convs (no bias), each with its own history;
- ``g = −exp(A_log_h) · softplus(f_b(f_a(x)) + dt_bias)`` — ``[H, D]``, one log-decay per key channel;
- ``β = σ(x Wbᵀ)`` — one per head;
- ``q ← q / √(Σq² + l2_eps) · scale``, ``k ← k / √(Σk² + l2_eps)``;
- ``S ← diag(e^{g}) S``; ``S ← S + β k (v − Sᵀk)ᵀ``; ``o = Sᵀq`` with ``S ∈ R^{D×D}``;
- ``y = rmsnorm(o; norm_eps) · w · σ(g_b(g_a(x)))`` per head (``out_gate_act``), then ``out_proj``.

State: the matrix ``S`` ``[H, D, D]`` (fixed fp32) and the three conv histories ``[H·D, conv_kernel]``
of raw pre-conv inputs (compute dtype). ``chunk_size`` is the prefill chunk of the reference's
chunked form; any chunking computes the same recurrence.

Tensor parallel: split by heads — nothing mixes heads (the output norm is per head, over ``head_dim``). Rank r
of N holds heads [r·H/N, (r+1)·H/N): the rows of the q/k/v projections and of their conv taps, of the low-rank
gates' second factors (``KdaFBProj``, ``KdaGBProj``: ``H·D`` rows over the ``D``-wide first factor), of the beta
projection, ``A_log`` and ``dt_bias``; the out projection's input columns (row-parallel). The gates' first factors
(``KdaFAProj``, ``KdaGAProj``) and the output norm's weight (one head's width) are whole; the state and the conv
histories hold the rank's heads.
"""

from __future__ import annotations

from .decl import Attrs, OperatorDecl, RegionSpec, RoleSpec, attr, register


def _hd(a: Attrs) -> int:
    return a["heads"] * a["head_dim"]


def _derive(a: Attrs) -> dict[str, int]:
    """channels: the width of q, k, v (and of each conv and its history), heads·head_dim."""
    return {"channels": _hd(a)}


KDA = OperatorDecl(
    kind="kda",
    slot="mixer",
    surfaces=(),
    derive=_derive,
    doc="q,k,v projections → three short convs + SiLU → l2-normalised q,k; g=−exp(A_log)·softplus(f_b(f_a x)+dt_bias) per channel; "
        "β=σ(b x); S←diag(e^g)S + βk(v−Sᵀk)ᵀ; o=Sᵀq; rmsnorm_per_head(o)·w·σ(g_b(g_a x)); out_proj",
    attrs=(
        attr("d_model", "int"),
        attr("heads", "int"),
        attr("head_dim", "int", doc="key and value head dim (one D for both)"),
        attr("conv_kernel", "int"),
        attr("conv_act", "enum", "silu", doc="activation after each short conv"),
        attr("norm_eps", "float", min=0.0, doc="eps of the per-head output RMSNorm"),
        attr("l2_eps", "float", doc="q,k ← x / √(Σx² + l2_eps)"),
        attr("scale", "float", doc="query scale after the l2 norm"),
        attr("out_gate_act", "enum", "sigmoid", doc="activation of the output gate g_b(g_a x)"),
        attr("chunk_size", "int", doc="prefill chunk of the reference's chunked form"),
    ),
    # tensor parallel: heads split (see the module docstring)
    partition="tensor",
    divides=("heads",),
    roles=(
        RoleSpec("KdaQProj", lambda a: (_hd(a), a["d_model"]), quantise=True, shard="out"),
        RoleSpec("KdaKProj", lambda a: (_hd(a), a["d_model"]), quantise=True, shard="out"),
        RoleSpec("KdaVProj", lambda a: (_hd(a), a["d_model"]), quantise=True, more_bits="value", shard="out"),
        RoleSpec("KdaQConv1d", lambda a: (_hd(a), a["conv_kernel"]), shard="out"),
        RoleSpec("KdaKConv1d", lambda a: (_hd(a), a["conv_kernel"]), shard="out"),
        RoleSpec("KdaVConv1d", lambda a: (_hd(a), a["conv_kernel"]), shard="out"),
        RoleSpec("KdaFAProj", lambda a: (a["head_dim"], a["d_model"]), quantise=True),
        RoleSpec("KdaFBProj", lambda a: (_hd(a), a["head_dim"]), quantise=True, shard="out"),
        RoleSpec("KdaBProj", lambda a: (a["heads"], a["d_model"]), quantise=True, shard="out"),
        RoleSpec("KdaGAProj", lambda a: (a["head_dim"], a["d_model"]), quantise=True),
        RoleSpec("KdaGBProj", lambda a: (_hd(a), a["head_dim"]), quantise=True, shard="out"),
        RoleSpec("KdaALog", lambda a: (a["heads"],), shard="out"),
        RoleSpec("KdaDtBias", lambda a: (_hd(a),), shard="out"),
        RoleSpec("KdaONorm", lambda a: (a["head_dim"],)),
        RoleSpec("KdaOutProj", lambda a: (a["d_model"], _hd(a)), quantise=True, more_bits="attn_out", shard="in"),
    ),
    regions=(
        RegionSpec("delta", "recurrent", lambda a: (a["heads"], a["head_dim"], a["head_dim"]), "f32", "fixed"),
        RegionSpec("conv_q", "conv_history", lambda a: (_hd(a), a["conv_kernel"]), "compute", "fixed"),
        RegionSpec("conv_k", "conv_history", lambda a: (_hd(a), a["conv_kernel"]), "compute", "fixed"),
        RegionSpec("conv_v", "conv_history", lambda a: (_hd(a), a["conv_kernel"]), "compute", "fixed"),
    ),
    rules=(
        ("conv_kernel must be >= 1", lambda a: a["conv_kernel"] >= 1),
        ("chunk_size must be >= 1", lambda a: a["chunk_size"] >= 1),
    ),
)

register(KDA)
