"""transformers ``qwen3_moe`` (Qwen3-30B-A3B and kin): Qwen3 softmax attention (per-head q/k RMSNorm before
rotary, half-split rotary over the whole head), an MoE or dense SwiGLU FFN per layer.

What this frontend settles, as declared facts (checked against transformers 5.24's ``models/qwen3_moe``):

- Rotary: ``rope_parameters`` (5.24) or ``rope_theta``/``rope_scaling`` (hub); which was read is a fact.
- Expert count: ``num_experts`` (hub) or ``num_local_experts`` (what 5.24's ``save_pretrained`` writes,
  through Qwen3MoeConfig's attribute_map); which one was read is a fact.
- ``head_dim`` when absent is ``hidden_size // num_attention_heads`` (the attention's getattr fallback).
- FFN: MoE on layer i unless i ∈ ``mlp_only_layers``, ``num_experts`` = 0 or (i+1) % ``decoder_sparse_step``
  ≠ 0 (then a dense SwiGLU of ``intermediate_size``). Router: softmax over all experts in fp32 → top-k →
  renormalise iff ``norm_topk_prob`` (default false); SwiGLU experts; no shared expert.
- Experts on disk: one tensor per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, what 5.24's
  ``save_pretrained`` and the hub write; bound as banks) or the fused in-memory spelling
  ``mlp.experts.gate_up_proj [E, 2I, d]`` (gate = first I rows; bound through slice views) +
  ``mlp.experts.down_proj [E, d, I]``. Which one was read is a fact.
- Every RMSNorm is plain (``w·x̂``). ``use_sliding_window`` is refused: the 5.24 model builds a full causal
  mask for every layer while passing a window to the attention, so the reference's own behaviour is not
  one declared window.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module, Transform
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, FrontendError, compute_dtype, op
from .registry import by_model_type
from .softmax_decoder import rope_attrs

# Qwen3MoeConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key.
DEFAULTS = {
    "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "intermediate_size": 6144, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
    "mlp_only_layers": [], "use_sliding_window": False,
}


@by_model_type("qwen3_moe")
def lower_qwen3_moe(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    where = f"{model_dir}/config.json (qwen3_moe)"
    A = Attrs(cfg, where, DEFAULTS)
    d, n_layer, heads, vocab = (A.need(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
    filled, get = A.filled, A.take

    act = get("hidden_act")
    if act != "silu":
        raise FrontendError(f"{where}: hidden_act={act!r} is not supported (silu only)")
    if get("use_sliding_window"):
        raise FrontendError(f"{where}: use_sliding_window=true is not supported (the reference masks every layer "
                            f"fully causal while passing a window; no single declared window matches it)")
    kv, eps, bias = get("num_key_value_heads"), float(get("rms_norm_eps")), bool(get("attention_bias"))
    hd = cfg.get("head_dim")
    if hd is None:
        hd = d // heads
        filled.add("head_dim")
    # the expert count: hub configs spell it num_experts, 5.24's save_pretrained num_local_experts (attribute_map)
    experts_key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    E = get("num_experts") if experts_key == "num_experts" else cfg["num_local_experts"]
    top_k, I_moe = get("num_experts_per_tok"), get("moe_intermediate_size")
    sparse_step = get("decoder_sparse_step")
    mlp_only = set(get("mlp_only_layers") or [])
    if sparse_step < 1:
        raise FrontendError(f"{where}: decoder_sparse_step={sparse_step} must be >= 1")

    b = Builder(model_dir, "transformers", "qwen3_moe", sha, relative_to)
    rope, rope_defaults, rope_read = rope_attrs(cfg, where, hd)
    b.fact("rope_read_from", rope_read, "config spelling of the rotary parameters")
    b.fact("experts_count_read_from", experts_key, "config spelling of the expert count")

    def rms(dim: int, role: Role):
        return op("rmsnorm", {"dim": dim, "eps": eps, "zero_centred": False},
                  {"zero_centred"} | ({"eps"} if "rms_norm_eps" in filled else set()), role=role)

    attn_attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                  "q_bias": bias, "k_bias": bias, "v_bias": bias, "o_bias": bias,
                  "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": False,
                  "sinks": False, "output_gate": False, "window": 0, "scale": 1.0 / math.sqrt(hd), **rope}
    attn_defaults = ({"qk_norm_zero_centred", "sinks", "output_gate", "window", "scale"} | rope_defaults
                     | ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in filled else set())
                     | ({"qk_norm_eps"} if "rms_norm_eps" in filled else set())
                     | {a for a, key in (("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")) if key in filled})
    moe_attrs = {"d_model": d, "experts": E, "top_k": top_k, "intermediate": I_moe, "router": "softmax_topk",
                 "norm_topk_prob": bool(get("norm_topk_prob")), "routed_scaling": 1.0, "n_group": 1, "topk_group": 1,
                 "router_bias": False, "selection_bias": False, "expert_layout": "separate", "expert_bias": False,
                 "act": "silu", "shared_experts": False, "shared_intermediate": 0, "shared_gate": False}
    moe_defaults = ({"router", "routed_scaling", "n_group", "topk_group", "router_bias", "selection_bias",
                     "expert_bias", "shared_experts", "shared_intermediate", "shared_gate"}
                    | {a for a, key in (("experts", "num_experts"), ("top_k", "num_experts_per_tok"),
                                        ("intermediate", "moe_intermediate_size"), ("norm_topk_prob", "norm_topk_prob"),
                                        ("act", "hidden_act")) if key in filled})

    layers, n_moe, stored = [], 0, set()
    for i in range(n_layer):
        p = f"model.layers.{i}."
        b.bind(p + "input_layernorm.weight", Role.PreAttentionNorm, i)
        b.bind(p + "post_attention_layernorm.weight", Role.PreFfnNorm, i)
        sa = p + "self_attn."
        for name, role in (("q_proj.weight", Role.AttnQ), ("k_proj.weight", Role.AttnK), ("v_proj.weight", Role.AttnV),
                           ("o_proj.weight", Role.AttnO), ("q_proj.bias", Role.AttnQBias), ("k_proj.bias", Role.AttnKBias),
                           ("v_proj.bias", Role.AttnVBias), ("o_proj.bias", Role.AttnOBias),
                           ("q_norm.weight", Role.AttnQNorm), ("k_norm.weight", Role.AttnKNorm)):
            b.bind(sa + name, role, i)
        mixer = op("softmax", dict(attn_attrs), set(attn_defaults))
        if i not in mlp_only and E > 0 and (i + 1) % sparse_step == 0:
            n_moe += 1
            m = p + "mlp."
            b.bind(m + "gate.weight", Role.MoeRouterWeight, i)
            if b.has(m + "experts.gate_up_proj"):
                gu = m + "experts.gate_up_proj"
                b.bind(gu, Role.PerExpertGate, i, [Transform("slice", dim=1, start=0, stop=I_moe)])
                b.bind(gu, Role.PerExpertUp, i, [Transform("slice", dim=1, start=I_moe, stop=2 * I_moe)])
                b.bind(m + "experts.down_proj", Role.PerExpertDown, i)
                stored.add("fused gate_up_proj [E, 2I, d] (gate = first I rows) + down_proj [E, d, I]")
            else:
                for name, role in (("gate_proj", Role.PerExpertGate), ("up_proj", Role.PerExpertUp),
                                   ("down_proj", Role.PerExpertDown)):
                    b.bind_bank(m + "experts.{e}." + name + ".weight", E, role, i)
                stored.add("one tensor per expert (experts.{e}.{gate,up,down}_proj.weight)")
            ffn = op("moe", dict(moe_attrs), set(moe_defaults))
        else:
            for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
                b.bind(p + f"mlp.{name}.weight", role, i)
            ffn = op("swiglu", {"d_model": d, "intermediate": get("intermediate_size"), "act": "silu"},
                     {a for a, key in (("intermediate", "intermediate_size"), ("act", "hidden_act")) if key in filled})
        layers.append(Layer(i, "compute", Placement.PreOnly, [rms(d, Role.PreAttentionNorm), rms(d, Role.PreFfnNorm)],
                            mixer, ffn))
    b.fact("moe_layers", n_moe, f"MoE FFN unless in mlp_only_layers {sorted(mlp_only)}, num_experts {E} = 0 or "
                                f"(i+1) % decoder_sparse_step {sparse_step} != 0")
    if stored:
        b.fact("experts_read_from", "; ".join(sorted(stored)), "expert tensor spelling found in the checkpoint")
    b.source.dialect = ("qwen3_moe (transformers 5.24 save_pretrained)" if (rope_read, experts_key) == ("rope_parameters", "num_local_experts")
                        else "qwen3_moe (hub)" if (rope_read, experts_key) == ("rope_theta/rope_scaling", "num_experts")
                        else f"qwen3_moe ({rope_read}, {experts_key})")
    tied = get("tie_word_embeddings")
    b.bind("model.embed_tokens.weight", Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d},
              {"tied"} if "tie_word_embeddings" in filled else set())
    return b.module(model_dir.resolve().name, compute_dtype(cfg, b, "model.embed_tokens.weight"), emb, layers,
                    rms(d, Role.FinalNorm), head)
