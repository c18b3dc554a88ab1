"""transformers ``gemma3_text`` (Gemma 3 text checkpoints, e.g. gemma-3-270m / -1b; Gemma3ForCausalLM).

What this frontend settles, as declared attributes and facts (checked against transformers 5.24's
``models/gemma3``):

- Norms: every RMSNorm is zero-centred (``x̂ · (1 + w)``, computed in fp32), eps ``rms_norm_eps`` (1e-6); a
  layer has four (sandwich, ``PrePost``): ``input_layernorm`` → attention → ``post_attention_layernorm`` →
  residual add; ``pre_feedforward_layernorm`` → MLP → ``post_feedforward_layernorm`` → residual add. The
  per-head q/k norms are zero-centred too, same eps.
- Embedding: rows · √hidden_size (Gemma3TextScaledWordEmbedding; the scale is held as a tensor of the
  weights' dtype, so at bf16 it is bf16(√d)): the embedding's declared ``scale``. Head tied by default.
- Attention: scale ``query_pre_attn_scalar^-½`` (default 256); biases iff ``attention_bias`` (default false);
  ``layer_types`` (or, in configs without it, ``sliding_window_pattern`` — default 6: every sixth layer full)
  picks sliding layers, which attend to keys with position > q − ``sliding_window``. Rotary on halves of the
  whole head; two thetas: ``rope_parameters`` per layer type (transformers 5) or ``rope_theta`` (full layers,
  default 1e6, with ``rope_scaling``) and ``rope_local_base_freq`` (sliding layers, default 1e4).
- MLP: ``down(gelu_tanh(gate) · up)`` for ``hidden_activation`` ``gelu_pytorch_tanh`` (the only one accepted).
- Refused by name: logit soft-capping (``final_logit_softcapping``, ``attn_logit_softcapping``) and
  ``use_bidirectional_attention``, which no operator declares.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op
from .decoder import EMBEDDING, rmsnorm, sizes, swiglu_op
from .registry import by_model_type
from .softmax_decoder import bind_attention, rope_attrs

# Gemma3TextConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key
DEFAULTS = {"rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "attention_bias": False,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "head_dim": 256,
            "num_key_value_heads": 4, "sliding_window": 4096, "sliding_window_pattern": 6}
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("sliding_attention", "full_attention")


def _rope_by_type(A: Attrs, hd: int) -> tuple[dict[str, tuple[dict, set[str]]], str]:
    """Rotary attributes per layer type, and which spelling they were read from."""
    out = {}
    rp = A.raw("rope_parameters")
    if isinstance(rp, dict) and any(t in rp for t in LAYER_TYPES):
        read = "rope_parameters (per layer type)"
        for t in LAYER_TYPES:
            sub = rp.get(t)
            if sub is not None and not isinstance(sub, dict):
                raise ConfigError(f"{A.where}: rope_parameters.{t} must be a JSON object")
            sub = dict(sub or {})
            filled = "rope_theta" not in sub
            sub.setdefault("rope_theta", DEFAULT_THETA[t])
            attrs, defaults, _ = rope_attrs(Attrs({"rope_parameters": sub}, A.where), hd)
            out[t] = (attrs, defaults | ({"rotary_base"} if filled else set()))
    else:
        read = "rope_theta/rope_local_base_freq/rope_scaling"
        if isinstance(rp, dict):
            raise ConfigError(f"{A.where}: rope_parameters must name its layer types ({', '.join(LAYER_TYPES)})")
        for t, key in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
            theta = A.opt(key, kind=float)
            cfg = {"rope_theta": DEFAULT_THETA[t] if theta is None else theta}
            if t == "full_attention" and A.raw("rope_scaling") is not None:
                cfg["rope_scaling"] = A.opt("rope_scaling", kind=dict)
            attrs, defaults, _ = rope_attrs(Attrs(cfg, A.where), hd)
            out[t] = (attrs, defaults | ({"rotary_base"} if theta is None else set()))
    return out, read


def _layer_types(A: Attrs, n_layer: int) -> tuple[list[str], str]:
    types = A.raw("layer_types")
    if types is None:
        pattern = A.take("sliding_window_pattern", int, 1)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
        return types, f"sliding_window_pattern {pattern} (every {pattern}th layer full)"
    if not isinstance(types, list) or len(types) != n_layer:
        raise ConfigError(f"{A.where}: layer_types must be a list of {n_layer} entries (num_hidden_layers)")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise FrontendError(f"{A.where}: layer_types[{i}]={t!r} is not supported ({', '.join(LAYER_TYPES)})")
    return list(types), "layer_types"


@by_model_type("gemma3_text")
def lower_gemma3(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (gemma3_text)", DEFAULTS)
    d, n_layer, heads, vocab = sizes(A)
    inter = A.need("intermediate_size", kind=int, min=1)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if A.raw(key) is not None:
            raise FrontendError(f"{A.where}: {key}={A.raw(key)!r} is not supported (no operator declares logit soft-capping)")
    if A.raw("use_bidirectional_attention"):
        raise FrontendError(f"{A.where}: use_bidirectional_attention=true is not supported (causal attention only)")
    act_name = A.take("hidden_activation", str)
    if act_name not in ACTIVATIONS:
        raise FrontendError(f"{A.where}: hidden_activation={act_name!r} is not supported ({', '.join(ACTIVATIONS)})")
    kv, hd = A.take("num_key_value_heads", int, 1), A.take("head_dim", int, 1)
    eps, bias = A.take("rms_norm_eps", float, 0.0), A.take("attention_bias", bool)
    qpas = A.take("query_pre_attn_scalar", float, 0.0)
    if qpas <= 0:
        raise ConfigError(f"{A.where}: query_pre_attn_scalar must be positive, got {qpas!r}")
    filled = A.filled

    b = Builder(model_dir, "transformers", "gemma3_text", sha, relative_to)
    ropes, read = _rope_by_type(A, hd)
    b.fact("rope_read_from", read, "config spelling of the two rotary parameter sets")
    types, map_read = _layer_types(A, n_layer)
    b.fact("layer_map_read_from", map_read, "which layers slide")
    window = A.take("sliding_window", int, 1) if "sliding_attention" in types else 0
    b.fact("norm_convention", "zero_centred", "Gemma3RMSNorm: x̂ · (1 + w), in fp32")

    attn_defaults = ({"sinks", "output_gate", "qk_norm_zero_centred"}
                     | {a for a, key in (("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                                         ("qk_norm_eps", "rms_norm_eps"), ("scale", "query_pre_attn_scalar"))
                        if key in filled}
                     | ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in filled else set()))
    norm_default = "rms_norm_eps" in filled
    layers = []
    for i in range(n_layer):
        p = f"model.layers.{i}."
        bind_attention(b, p + "self_attn.", i)
        for name, role in (("input_layernorm", Role.PreAttentionNorm), ("post_attention_layernorm", Role.PostAttentionNorm),
                           ("pre_feedforward_layernorm", Role.PreFfnNorm), ("post_feedforward_layernorm", Role.PostFfnNorm)):
            b.bind(p + name + ".weight", role, i)
        for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
            b.bind(p + f"mlp.{name}.weight", role, i)
        rope, rope_defaults = ropes[types[i]]
        sliding = types[i] == "sliding_attention"
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": bias, "k_bias": bias,
                 "v_bias": bias, "o_bias": bias, "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": True,
                 "sinks": False, "output_gate": False, "window": window if sliding else 0,
                 "scale": 1.0 / math.sqrt(qpas), **rope}
        mixer = op("softmax", attrs, attn_defaults | rope_defaults | ({"window"} if "layer_types" not in A else set()))
        ffn = swiglu_op(d, inter, {"act"} if "hidden_activation" in filled else set())
        ffn.attrs["act"] = ACTIVATIONS[act_name]
        norms = [rmsnorm(d, eps, norm_default, role, zero_centred=True)
                 for role in (Role.PreAttentionNorm, Role.PostAttentionNorm, Role.PreFfnNorm, Role.PostFfnNorm)]
        layers.append(Layer(i, "compute", Placement.PrePost, norms, mixer, ffn))

    tied = A.take("tie_word_embeddings", bool)
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d, "scale": math.sqrt(d)})
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d}, {"tied"} if "tie_word_embeddings" in filled else set())
    final = rmsnorm(d, eps, norm_default, Role.FinalNorm, zero_centred=True)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final, head)
