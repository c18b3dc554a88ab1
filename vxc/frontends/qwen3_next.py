"""transformers ``qwen3_next`` (Qwen3-Next): gated-delta linear attention on most layers, output-gated softmax
attention on the others, an MoE (or dense SwiGLU) FFN on every layer.

What this frontend settles, as declared facts (checked against transformers 5.24's
``models/qwen3_next``):

- Layer map: transformers 5.24's ``save_pretrained`` writes a 0-based ``layer_types`` list; hub checkpoints
  carry ``full_attention_interval`` (softmax on layers i with (i+1) % interval == 0; 4 when absent).
  Rotary: ``rope_parameters`` (5.24) or ``rope_theta`` + top-level ``partial_rotary_factor`` (hub);
  the factor defaults to 0.25 (Qwen3NextConfig). Which spelling was read is a fact in the IR.
- Gated delta: ``in_proj_qkvz`` is grouped per key head — view it as ``[Hk, 2Dk + 2rDv]`` (r = Hv/Hk) with
  ``q Dk | k Dk | v rDv | z rDv`` inside each group; ``in_proj_ba`` as ``[Hk, 2r]`` with ``b r | a r``.
  Gather views turn them into the plain roles (q|k|v of all heads, z, b, a). The conv has no bias and
  uses ``hidden_act``; q,k are l2-normalised with eps 1e-6 and q scaled by Dk^-½; the gated norm is
  normalise-then-gate with silu and a plain weight; the prefill chunk is 64 (the reference's).
- Softmax: ``q_proj`` emits query and gate interleaved per head (``[H, 2·Dh]``: query then gate): gather
  views bind AttnQ and AttnOutputGate; per-head q/k RMSNorms are zero-centred (1+w); partial rotary,
  half-split; ``attn · σ(gate)`` before o_proj.
- Every decoder RMSNorm (input, post-attention, final) is zero-centred: ``x̂·(1+w)``.
- FFN: MoE on layer i unless i ∈ ``mlp_only_layers``, ``num_experts`` = 0 or (i+1) % ``decoder_sparse_step``
  ≠ 0 (then a dense SwiGLU of ``intermediate_size``). Router: softmax over all experts (fp32) → top-k →
  renormalise iff ``norm_topk_prob``; SwiGLU experts; a shared expert scaled by σ(x·w_shared_gate).
  Experts are one tensor per expert on disk (``mlp.experts.{e}.{gate,up,down}_proj.weight``, bound as
  banks); a fused ``mlp.experts.gate_up_proj [E, 2I, d]`` (gate = first I rows) + ``down_proj`` is
  accepted too.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Module, Transform
from ..ir.roles import Role
from .common import Attrs, Builder, FrontendError, op
from .decoder import bind_norms, bind_swiglu, check_silu, finish, rmsnorm, sizes, swiglu_op, two_norm_layer
from .moe import bind_shared_experts, bind_swiglu_experts, softmax_topk_moe_op
from .registry import by_model_type
from .softmax_decoder import rope_attrs

# Qwen3NextConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key.
DEFAULTS = {
    "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "intermediate_size": 5632,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": [],
}
FULL_ATTENTION_INTERVAL = 4  # Qwen3NextConfig.__post_init__'s default
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3NextConfig.__post_init__'s default
DELTA_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size
L2_EPS = 1e-6  # l2norm(eps=1e-6), use_qk_l2norm_in_kernel=True


def _layer_map(A: Attrs, n: int, b: Builder) -> tuple[list[str], str]:
    lt = A.raw("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != n:
            raise FrontendError(f"{A.where}: layer_types must be a list of {n} entries (num_hidden_layers)")
        for i, t in enumerate(lt):
            if t not in ("linear_attention", "full_attention"):
                raise FrontendError(f"{A.where}: layer_types[{i}]={t!r} is not supported (linear_attention, full_attention)")
        b.fact("layer_map_read_from", "layer_types",
               "0-based layer_types list (transformers 5.24 save_pretrained spelling)")
        return list(lt), "layer_types"
    interval, filled = A.get("full_attention_interval", default=FULL_ATTENTION_INTERVAL, kind=int)
    if interval < 1:
        raise FrontendError(f"{A.where}: full_attention_interval={interval} must be >= 1")
    b.fact("layer_map_read_from", "full_attention_interval",
           f"{'no layer_types and no full_attention_interval: the default ' if filled else 'full_attention_interval '}"
           f"{interval}; softmax on layers i with (i+1) % {interval} == 0 (hub spelling)")
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)], "full_attention_interval"


def _rope(A: Attrs, head_dim: int) -> tuple[dict, set[str], str]:
    """rope_attrs, with Qwen3-Next's partial_rotary_factor default (0.25) where neither spelling gives one."""
    has_factor = "partial_rotary_factor" in A or "rope_parameters.partial_rotary_factor" in A
    c = dict(A.cfg)
    if not has_factor:
        c["partial_rotary_factor"] = PARTIAL_ROTARY_FACTOR
    attrs, defaults, read = rope_attrs(Attrs(c, A.where), head_dim)
    if not has_factor:
        defaults.add("rotary_dim")
    return attrs, defaults, read


@by_model_type("qwen3_next")
def lower_qwen3_next(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (qwen3_next)", DEFAULTS)
    where = A.where
    d, n_layer, heads, vocab = sizes(A)
    filled, get = A.filled, A.take

    check_silu(A)
    if get("attention_bias", bool):
        raise FrontendError(f"{where}: attention_bias=true is not supported (the output gate's bias has no role)")
    kv, hd, eps = get("num_key_value_heads", int), get("head_dim", int, 1), get("rms_norm_eps", float)
    Hk, Hv = get("linear_num_key_heads", int), get("linear_num_value_heads", int)
    Dk, Dv, K = get("linear_key_head_dim", int, 1), get("linear_value_head_dim", int), get("linear_conv_kernel_dim", int)
    if Hk < 1 or Hv % Hk:
        raise FrontendError(f"{where}: linear_num_value_heads={Hv} is not a multiple of linear_num_key_heads={Hk}")
    r = Hv // Hk
    E, top_k, I_moe = get("num_experts", int), get("num_experts_per_tok", int), get("moe_intermediate_size", int)
    I_shared, sparse_step = get("shared_expert_intermediate_size", int), get("decoder_sparse_step", int, 1)
    mlp_only = set(get("mlp_only_layers", list[int]))

    b = Builder(model_dir, "transformers", "qwen3_next", sha, relative_to)
    types, layer_read = _layer_map(A, n_layer, b)
    rope, rope_defaults, rope_read = _rope(A, hd)
    b.fact("rope_read_from", rope_read, "config spelling of the rotary parameters")
    b.source.dialect = ("qwen3_next (transformers 5.24 save_pretrained)" if (layer_read, rope_read) == ("layer_types", "rope_parameters")
                        else "qwen3_next (hub)" if (layer_read, rope_read) == ("full_attention_interval", "rope_theta/rope_scaling")
                        else f"qwen3_next ({layer_read}, {rope_read})")

    eps_d = {"norm_eps"} if "rms_norm_eps" in filled else set()
    delta_attrs = {"d_model": d, "k_heads": Hk, "v_heads": Hv, "k_head_dim": Dk, "v_head_dim": Dv, "conv_kernel": K,
                   "conv_act": "silu", "chunk_size": DELTA_CHUNK, "scale": 1.0 / math.sqrt(Dk), "l2_eps": L2_EPS,
                   "norm_eps": eps, "norm_order": "norm_then_gate", "norm_act": "silu"}
    delta_defaults = ({"chunk_size", "scale", "l2_eps", "norm_order", "norm_act"} | eps_d
                      | {a for a, key in (("k_heads", "linear_num_key_heads"), ("v_heads", "linear_num_value_heads"),
                                          ("k_head_dim", "linear_key_head_dim"), ("v_head_dim", "linear_value_head_dim"),
                                          ("conv_kernel", "linear_conv_kernel_dim"), ("conv_act", "hidden_act"))
                         if key in filled})
    attn_attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                  "q_bias": False, "k_bias": False, "v_bias": False, "o_bias": False,
                  "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": True,
                  "sinks": False, "output_gate": True, "window": 0, "scale": 1.0 / math.sqrt(hd), **rope}
    attn_defaults = ({"qk_norm_zero_centred", "sinks", "window", "scale"} | rope_defaults
                     | ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in filled else set())
                     | ({"qk_norm_eps"} if "rms_norm_eps" in filled else set())
                     | {a for a, key in (("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")) if key in filled})
    moe_op = softmax_topk_moe_op(A, d, E, top_k, I_moe, I_shared)

    layers = []
    n_moe = 0
    for i in range(n_layer):
        p = f"model.layers.{i}."
        bind_norms(b, i)
        if types[i] == "linear_attention":
            la = p + "linear_attn."
            group = 2 * Dk + 2 * r * Dv

            def grouped(*takes: tuple[int, int], groups: int = Hk) -> list[Transform]:
                return [Transform("gather", dim=0, groups=groups, takes=list(takes))]

            qkvz = la + "in_proj_qkvz.weight"
            b.bind(qkvz, Role.LinearAttnInProjQkv, i, grouped((0, Dk), (Dk, 2 * Dk), (2 * Dk, 2 * Dk + r * Dv)))
            b.bind(qkvz, Role.LinearAttnInProjZ, i, grouped((2 * Dk + r * Dv, group)))
            b.bind(la + "in_proj_ba.weight", Role.LinearAttnInProjB, i, grouped((0, r)))
            b.bind(la + "in_proj_ba.weight", Role.LinearAttnInProjA, i, grouped((r, 2 * r)))
            b.bind_reshaped(la + "conv1d.weight", Role.LinearAttnConv1d, i, (2 * Hk * Dk + Hv * Dv, K))
            b.bind(la + "dt_bias", Role.LinearAttnDtBias, i)
            b.bind_reshaped(la + "A_log", Role.LinearAttnALog, i, (Hv,))
            b.bind(la + "norm.weight", Role.LinearAttnNorm, i)
            b.bind(la + "out_proj.weight", Role.LinearAttnOutProj, i)
            mixer = op("gated_delta", dict(delta_attrs), set(delta_defaults))
        else:
            sa = p + "self_attn."
            # q_proj rows per head: [query Dh | gate Dh]
            b.bind(sa + "q_proj.weight", Role.AttnQ, i, [Transform("gather", dim=0, groups=heads, takes=[(0, hd)])])
            b.bind(sa + "q_proj.weight", Role.AttnOutputGate, i, [Transform("gather", dim=0, groups=heads, takes=[(hd, 2 * hd)])])
            for name, role in (("k_proj.weight", Role.AttnK), ("v_proj.weight", Role.AttnV), ("o_proj.weight", Role.AttnO),
                               ("q_norm.weight", Role.AttnQNorm), ("k_norm.weight", Role.AttnKNorm)):
                b.bind(sa + name, role, i)
            mixer = op("softmax", dict(attn_attrs), set(attn_defaults))
        moe = i not in mlp_only and E > 0 and (i + 1) % sparse_step == 0
        if moe:
            n_moe += 1
            m = p + "mlp."
            b.bind(m + "gate.weight", Role.MoeRouterWeight, i)
            bind_swiglu_experts(b, m, i, E, I_moe)
            bind_shared_experts(b, m + "shared_expert.", i)
            b.bind(m + "shared_expert_gate.weight", Role.SharedExpertBranchGate, i)
            ffn = op("moe", dict(moe_op.attrs), set(moe_op.defaults))
        else:
            bind_swiglu(b, p + "mlp.", i)
            ffn = swiglu_op(d, get("intermediate_size", int),
                            {a for a, key in (("intermediate", "intermediate_size"), ("act", "hidden_act")) if key in filled})
        # every ordinary Qwen3-Next RMSNorm is zero-centred: the reference's convention, recorded as filled in
        layers.append(two_norm_layer(i, d, (eps, "rms_norm_eps" in filled), mixer, ffn, zero_centred=True))
    b.fact("moe_layers", n_moe, f"MoE FFN unless in mlp_only_layers {sorted(mlp_only)}, num_experts {E} = 0 or "
                                f"(i+1) % decoder_sparse_step {sparse_step} != 0")
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps, "rms_norm_eps" in filled, Role.FinalNorm, zero_centred=True))
