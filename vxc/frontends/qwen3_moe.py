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

from ..ir.module import Module
from ..ir.roles import Role
from .common import Attrs, Builder, FrontendError, op
from .decoder import bind_norms, bind_swiglu, check_silu, finish, rmsnorm, sizes, swiglu_op, two_norm_layer
from .moe import bind_swiglu_experts, softmax_topk_moe_op
from .registry import by_model_type
from .softmax_decoder import bind_attention, rope_attrs

# Qwen3MoeConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key.
DEFAULTS = {
    "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "intermediate_size": 6144, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
    "mlp_only_layers": [], "use_sliding_window": False,
}


@by_model_type("qwen3_moe")
def lower_qwen3_moe(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (qwen3_moe)", DEFAULTS)
    d, n_layer, heads, vocab = sizes(A)
    filled, get = A.filled, A.take

    check_silu(A)
    if get("use_sliding_window", bool):
        raise FrontendError(f"{A.where}: use_sliding_window=true is not supported (the reference masks every layer "
                            f"fully causal while passing a window; no single declared window matches it)")
    kv, eps, bias = get("num_key_value_heads", int), get("rms_norm_eps", float), get("attention_bias", bool)
    hd = A.opt("head_dim", kind=int, min=1)
    if hd is None:
        hd = d // heads
        filled.add("head_dim")
    # the expert count: hub configs spell it num_experts, 5.24's save_pretrained num_local_experts (attribute_map)
    experts_key = "num_local_experts" if A.raw("num_local_experts") is not None else "num_experts"
    E = get("num_experts", int) if experts_key == "num_experts" else A.need("num_local_experts", kind=int)
    top_k, I_moe = get("num_experts_per_tok", int), get("moe_intermediate_size", int)
    sparse_step = get("decoder_sparse_step", int)
    mlp_only = set(get("mlp_only_layers", list[int]))
    if sparse_step < 1:
        raise FrontendError(f"{A.where}: decoder_sparse_step={sparse_step} must be >= 1")

    b = Builder(model_dir, "transformers", "qwen3_moe", sha, relative_to)
    rope, rope_defaults, rope_read = rope_attrs(A, hd)
    b.fact("rope_read_from", rope_read, "config spelling of the rotary parameters")
    b.fact("experts_count_read_from", experts_key, "config spelling of the expert count")
    eps_filled = (eps, "rms_norm_eps" in filled)

    attn_attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                  "q_bias": bias, "k_bias": bias, "v_bias": bias, "o_bias": bias,
                  "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": False,
                  "sinks": False, "output_gate": False, "window": 0, "scale": 1.0 / math.sqrt(hd), **rope}
    attn_defaults = ({"qk_norm_zero_centred", "sinks", "output_gate", "window", "scale"} | rope_defaults
                     | ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in filled else set())
                     | ({"qk_norm_eps"} if "rms_norm_eps" in filled else set())
                     | {a for a, key in (("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")) if key in filled})
    moe_op = softmax_topk_moe_op(A, d, E, top_k, I_moe, None)

    layers, n_moe, stored = [], 0, set()
    for i in range(n_layer):
        p = f"model.layers.{i}."
        bind_norms(b, i)
        bind_attention(b, p + "self_attn.", i)
        mixer = op("softmax", dict(attn_attrs), set(attn_defaults))
        if i not in mlp_only and E > 0 and (i + 1) % sparse_step == 0:
            n_moe += 1
            b.bind(p + "mlp.gate.weight", Role.MoeRouterWeight, i)
            stored.add(bind_swiglu_experts(b, p + "mlp.", i, E, I_moe))
            ffn = op("moe", dict(moe_op.attrs), set(moe_op.defaults))
        else:
            bind_swiglu(b, p + "mlp.", i)
            ffn = swiglu_op(d, get("intermediate_size", int),
                            {a for a, key in (("intermediate", "intermediate_size"), ("act", "hidden_act")) if key in filled})
        layers.append(two_norm_layer(i, d, eps_filled, mixer, ffn))
    b.fact("moe_layers", n_moe, f"MoE FFN unless in mlp_only_layers {sorted(mlp_only)}, num_experts {E} = 0 or "
                                f"(i+1) % decoder_sparse_step {sparse_step} != 0")
    if stored:
        b.fact("experts_read_from", "; ".join(sorted(stored)), "expert tensor spelling found in the checkpoint")
    b.source.dialect = ("qwen3_moe (transformers 5.24 save_pretrained)" if (rope_read, experts_key) == ("rope_parameters", "num_local_experts")
                        else "qwen3_moe (hub)" if (rope_read, experts_key) == ("rope_theta/rope_scaling", "num_experts")
                        else f"qwen3_moe ({rope_read}, {experts_key})")
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps, "rms_norm_eps" in filled, Role.FinalNorm))
