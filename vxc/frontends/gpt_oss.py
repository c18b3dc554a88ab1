"""transformers ``gpt_oss`` (gpt-oss-20b / -120b): softmax attention with q/k/v/o biases and per-head
sinks, alternating sliding-window / full layers, YaRN rotary; an MoE FFN on every layer with a biased
top-k → softmax router and clamped-GLU experts with biases.

What this frontend settles, as declared facts (checked against transformers 5.24's ``models/gpt_oss``):

- Layer map: ``layer_types`` (both dialects write it); when absent, GptOssConfig's default: sliding on even
  layers, full on odd. Sliding layers attend to keys with position > q − ``sliding_window``.
- Rotary: ``rope_parameters`` (5.24 ``save_pretrained``) or ``rope_theta`` + ``rope_scaling`` (hub); when
  neither is given, GptOssConfig's default (YaRN, factor 32, β 32/1, original 4096, truncate false, θ 150000).
  YaRN: ``beta_fast``/``beta_slow`` default 32/1, ``truncate`` true, ``original_max_position_embeddings``
  the ``max_position_embeddings``, ``factor`` the ratio of the two when null, and the attention factor
  (multiplying cos and sin) ``0.1·ln(factor) + 1`` unless given (or the mscale / mscale_all_dim ratio).
  The rotation is half-split over the whole head.
- Attention: biases on all four projections iff ``attention_bias`` (default true); ``sinks [H]`` — one
  learned logit per head added to every softmax row and dropped after; scale ``head_dim^-½``.
- MoE: router logits ``x·Wᵀ + b``, top-k on the logits, softmax over the k; experts
  ``gate_up [E, 2I, d]`` with gate = even rows, up = odd rows, ``gate = min(gate, limit)``,
  ``up = clamp(up, −limit, limit)``, ``(up + 1)·gate·σ(alpha·gate)``, down + bias (alpha ``swiglu_alpha``
  1.702, limit ``swiglu_limit`` 7.0).
- Expert storage, two spellings (which one was read is a fact): transformers' fused input-major tensors
  ``mlp.experts.gate_up_proj [E, d, 2I]`` / ``down_proj [E, I, d]`` (bound through a transpose view to the
  ``[E, out, in]`` contracts); or the hub's MXFP4 packing ``*_blocks [E, out, in/32, 16]`` u8 +
  ``*_scales [E, out, in/32]`` u8 — an encoded operand whose decode is already ``[E, out, in]``.
- Every RMSNorm is plain (``w·x̂``), eps ``rms_norm_eps``.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Module, Transform
from ..ir.roles import Role
from .common import Attrs, Builder, FrontendError, op
from .decoder import bind_norms, finish, rmsnorm, sizes, two_norm_layer
from .registry import by_model_type

# GptOssConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key.
DEFAULTS = {
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "attention_bias": True,
    "sliding_window": 128, "num_experts_per_tok": 4, "num_local_experts": 128,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "intermediate_size": 2880, "max_position_embeddings": 131072,
}
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # GptOssConfig.__post_init__


def _rope(A: Attrs, head_dim: int, max_pos: int) -> tuple[dict, set[str], str]:
    """Rotary attributes (all declared; the ones filled from a convention are returned as defaults)."""
    defaults: set[str] = set()
    where = A.where
    if isinstance(A.raw("rope_parameters"), dict):
        rp, read = dict(A.raw("rope_parameters")), "rope_parameters"
    elif isinstance(A.raw("rope_scaling"), dict) or "rope_theta" in A:
        rp, read = dict(A.opt("rope_scaling", kind=dict) or {}), "rope_theta/rope_scaling"
        if "rope_theta" in A:
            rp["rope_theta"] = A.raw("rope_theta")
    else:
        rp, read = dict(DEFAULT_ROPE), "default (GptOssConfig)"
        defaults |= {"rope_type", "rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_original_max_position"}
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    R = Attrs(rp, where, prefix="rope_parameters." if read == "rope_parameters" else "rope_scaling.")
    if (A.raw("partial_rotary_factor") if "partial_rotary_factor" in A else R.raw("partial_rotary_factor")) not in (None, 1.0):
        raise FrontendError(f"{where}: partial_rotary_factor is not supported for gpt_oss")
    theta = R.opt("rope_theta", kind=float)
    if theta is None:
        theta = DEFAULT_THETA
        defaults.add("rotary_base")
    attrs = {"rotary_dim": head_dim, "rotary_base": float(theta), "rotary_layout": "half"}
    defaults |= {"rotary_dim", "rotary_layout"}
    kind = R.opt("rope_type", kind=str)
    if kind is None:
        kind = "default"
        defaults.add("rope_type")
    if kind not in ("default", "yarn"):
        raise FrontendError(f"{where}: rope_type {kind!r} is not supported for gpt_oss (default, yarn)")
    attrs["rope_type"] = kind
    if kind == "yarn":
        orig = R.opt("original_max_position_embeddings", kind=int, min=1)
        if orig is None:
            orig = max_pos
            defaults.add("rope_original_max_position")
        factor = R.opt("factor", kind=float)
        if factor is None:
            factor = max_pos / orig
            defaults.add("rope_factor")
        attn = R.opt("attention_factor", kind=float)
        if attn is None:
            defaults.add("rope_attention_factor")
            mscale, mscale_all = R.opt("mscale", kind=float), R.opt("mscale_all_dim", kind=float)

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)
        fast, slow = R.opt("beta_fast", kind=float) or None, R.opt("beta_slow", kind=float) or None
        if fast is None:
            defaults.add("rope_beta_fast")
        if slow is None:
            defaults.add("rope_beta_slow")
        truncate = R.opt("truncate", kind=bool)
        if truncate is None:
            truncate = True
            defaults.add("rope_truncate")
        attrs.update({"rope_factor": float(factor), "rope_beta_fast": float(fast or 32.0), "rope_beta_slow": float(slow or 1.0),
                      "rope_original_max_position": int(orig), "rope_attention_factor": float(attn),
                      "rope_truncate": bool(truncate)})
    return attrs, defaults, read


@by_model_type("gpt_oss")
def lower_gpt_oss(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (gpt_oss)", DEFAULTS)
    where = A.where
    d, n_layer, heads, vocab = sizes(A)
    filled, get = A.filled, A.take

    # an explicit null means "as many as the query heads" / "hidden_size // heads" (GptOssConfig.__post_init__)
    kv = heads if "num_key_value_heads" in A and A.raw("num_key_value_heads") is None else get("num_key_value_heads", int)
    hd = d // heads if "head_dim" in A and A.raw("head_dim") is None else get("head_dim", int, 1)
    filled.update(k for k in ("num_key_value_heads", "head_dim") if A.raw(k) is None)
    eps, bias = get("rms_norm_eps", float), get("attention_bias", bool)
    E, top_k, I = get("num_local_experts", int), get("num_experts_per_tok", int), get("intermediate_size", int)
    alpha, limit = get("swiglu_alpha", float), get("swiglu_limit", float)
    window = get("sliding_window")

    b = Builder(model_dir, "transformers", "gpt_oss", sha, relative_to)
    rope, rope_defaults, rope_read = _rope(A, hd, get("max_position_embeddings", int))
    b.fact("rope_read_from", rope_read, "config spelling of the rotary parameters")
    types = A.raw("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)]
        b.fact("layer_map_read_from", "default", "no layer_types: GptOssConfig's default, sliding on even layers")
    else:
        if not isinstance(types, list) or len(types) != n_layer:
            raise FrontendError(f"{where}: layer_types must be a list of {n_layer} entries (num_hidden_layers)")
        b.fact("layer_map_read_from", "layer_types", "0-based layer_types list")
    for i, t in enumerate(types):
        if t not in ("sliding_attention", "full_attention"):
            raise FrontendError(f"{where}: layer_types[{i}]={t!r} is not supported (sliding_attention, full_attention)")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise FrontendError(f"{where}: sliding layers need a positive integer sliding_window, got {window!r}")
    quant = A.raw("quantization_config")
    if isinstance(quant, dict):
        b.fact("quantization_config", str(quant.get("quant_method")), "config.json quantization_config.quant_method")

    attn_defaults = ({"qk_norm", "output_gate", "sinks", "scale"} | rope_defaults
                     | ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in filled else set())
                     | {a for a, key in (("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")) if key in filled})
    moe_attrs = {"d_model": d, "experts": E, "top_k": top_k, "intermediate": I, "router": "topk_softmax",
                 "norm_topk_prob": False, "routed_scaling": 1.0, "n_group": 1, "topk_group": 1,
                 "router_bias": True, "selection_bias": False, "expert_layout": "fused_interleaved", "expert_bias": True,
                 "act": "clamped_glu", "glu_alpha": alpha, "glu_limit": limit,
                 "shared_experts": False, "shared_intermediate": 0, "shared_gate": False}
    moe_defaults = ({"router", "norm_topk_prob", "routed_scaling", "n_group", "topk_group", "router_bias", "selection_bias",
                     "expert_layout", "expert_bias", "act", "shared_experts", "shared_intermediate", "shared_gate"}
                    | {a for a, key in (("experts", "num_local_experts"), ("top_k", "num_experts_per_tok"),
                                        ("intermediate", "intermediate_size"), ("glu_alpha", "swiglu_alpha"),
                                        ("glu_limit", "swiglu_limit")) if key in filled})

    layers, stored = [], set()
    for i in range(n_layer):
        p = f"model.layers.{i}."
        bind_norms(b, i)
        sa = p + "self_attn."
        for name, role in (("q_proj.weight", Role.AttnQ), ("k_proj.weight", Role.AttnK), ("v_proj.weight", Role.AttnV),
                           ("o_proj.weight", Role.AttnO), ("q_proj.bias", Role.AttnQBias), ("k_proj.bias", Role.AttnKBias),
                           ("v_proj.bias", Role.AttnVBias), ("o_proj.bias", Role.AttnOBias), ("sinks", Role.AttnSinks)):
            b.bind(sa + name, role, i)
        sliding = types[i] == "sliding_attention"
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                 "q_bias": bias, "k_bias": bias, "v_bias": bias, "o_bias": bias, "qk_norm": False,
                 "sinks": True, "output_gate": False, "window": int(window) if sliding else 0,
                 "scale": 1.0 / math.sqrt(hd), **rope}
        ad = set(attn_defaults) | ({"window"} if A.raw("layer_types") is None else set())
        mixer = op("softmax", attrs, ad)
        m = p + "mlp."
        b.bind(m + "router.weight", Role.MoeRouterWeight, i)
        b.bind(m + "router.bias", Role.MoeRouterBias, i)
        ex = m + "experts."
        for proj, role in (("gate_up_proj", Role.ExpertGateUp), ("down_proj", Role.ExpertDown)):
            if b.has(ex + proj + "_blocks"):
                b.bind_encoded("mxfp4", {"blocks": ex + proj + "_blocks", "scales": ex + proj + "_scales"}, role, i)
                stored.add("mxfp4 (*_blocks [E, out, in/32, 16] + *_scales [E, out, in/32])")
            else:
                b.bind(ex + proj, role, i, [Transform("transpose", dim=1, dim2=2)])
                if b.has(ex + proj):
                    stored.add("fused input-major [E, in, out] (transformers' spelling)")
        b.bind(ex + "gate_up_proj_bias", Role.ExpertGateUpBias, i)
        b.bind(ex + "down_proj_bias", Role.ExpertDownBias, i)
        ffn = op("moe", dict(moe_attrs), set(moe_defaults))
        layers.append(two_norm_layer(i, d, (eps, "rms_norm_eps" in filled), mixer, ffn))
    if stored:
        b.fact("experts_read_from", "; ".join(sorted(stored)), "expert tensor spelling found in the checkpoint")
    b.source.dialect = ("gpt_oss (transformers 5.24 save_pretrained)" if rope_read == "rope_parameters"
                        else "gpt_oss (hub)" if rope_read == "rope_theta/rope_scaling" else f"gpt_oss ({rope_read})")
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps, "rms_norm_eps" in filled, Role.FinalNorm))
