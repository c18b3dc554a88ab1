"""Shared lowering for transformers' Llama-shaped decoders (llama, qwen2, qwen3):
``model.embed_tokens``, ``model.layers.{i}.{input_layernorm, self_attn.*,
post_attention_layernorm, mlp.*}``, ``model.norm``, ``lm_head``.

Each family file states only how it differs (biases, q/k norms); the same
math lowers to the same operator kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Builder, FrontendError, compute_dtype, op


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: str | bool  # config key that switches q/k/v biases, or a fixed fact
    o_bias: str | bool
    qk_norm: bool
    head_dim_default: int | None = None  # None: hidden_size // heads


def rope_attrs(cfg: dict, where: str, head_dim: int) -> tuple[dict, set[str], str]:
    """Rotary attributes from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (hub)."""
    attrs, defaults = {}, set()
    if isinstance(cfg.get("rope_parameters"), dict):
        rp, read = dict(cfg["rope_parameters"]), "rope_parameters"
    else:
        rp, read = dict(cfg.get("rope_scaling") or {}), "rope_theta/rope_scaling"
        if "rope_theta" in cfg:
            rp["rope_theta"] = cfg["rope_theta"]
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
    theta = rp.get("rope_theta")
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rdim = head_dim if factor is None else int(head_dim * factor)
    attrs["rotary_dim"] = rdim
    if factor is None:
        defaults.add("rotary_dim")
    attrs["rotary_base"] = float(theta if theta is not None else 10000.0)
    if theta is None:
        defaults.add("rotary_base")
    attrs["rotary_layout"] = "half"
    defaults.add("rotary_layout")
    rtype = rp.get("rope_type", "default")
    if rtype not in ("default", "linear", "llama3"):
        raise FrontendError(f"{where}: rope_type {rtype!r} is not supported for this family yet")
    attrs["rope_type"] = rtype
    if "rope_type" not in rp:
        defaults.add("rope_type")
    if rtype in ("linear", "llama3"):
        attrs["rope_factor"] = float(rp["factor"])
    if rtype == "llama3":
        attrs["rope_low_freq_factor"] = float(rp["low_freq_factor"])
        attrs["rope_high_freq_factor"] = float(rp["high_freq_factor"])
        attrs["rope_original_max_position"] = int(rp["original_max_position_embeddings"])
    return attrs, defaults, read


def lower_decoder(fam: Family, model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    where = f"{model_dir}/config.json ({fam.name})"
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if cfg.get(k) is None:
            raise FrontendError(f"{where}: missing {k!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise FrontendError(f"{where}: hidden_act={act!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise FrontendError(f"{where}: mlp_bias=true is not supported")
    b = Builder(model_dir, "transformers", fam.name, sha, relative_to)
    d, n_layer, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    defaults: set[str] = set()
    kv = cfg.get("num_key_value_heads")
    if kv is None:
        kv = heads
        defaults.add("kv_heads")
    hd = cfg.get("head_dim")
    if hd is None:
        hd = fam.head_dim_default or d // heads
        defaults.add("head_dim")
    eps = cfg.get("rms_norm_eps")
    eps_default = eps is None
    eps = float(eps if eps is not None else 1e-6)

    def flag(spec: str | bool) -> tuple[bool, bool]:
        if isinstance(spec, bool):
            return spec, False
        v = cfg.get(spec)
        return (bool(v), False) if v is not None else (False, True)

    qkv_b, qkv_d = flag(fam.qkv_bias)
    o_b, o_d = flag(fam.o_bias)
    rope, rope_defaults, read = rope_attrs(cfg, where, hd)
    b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    layer_types = cfg.get("layer_types")
    window_size = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and not layer_types:
        raise FrontendError(f"{where}: use_sliding_window=true without layer_types is not supported")
    layers = []
    for i in range(n_layer):
        lt = layer_types[i] if layer_types else "full_attention"
        if lt not in ("full_attention", "sliding_attention"):
            raise FrontendError(f"{where}: layer_types[{i}]={lt!r} is not supported")
        window = int(window_size) if lt == "sliding_attention" else 0
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                 "q_bias": qkv_b, "k_bias": qkv_b, "v_bias": qkv_b, "o_bias": o_b, "qk_norm": fam.qk_norm}
        ad = set(defaults) | ({"q_bias", "k_bias", "v_bias"} if qkv_d else set()) | ({"o_bias"} if o_d else set())
        if fam.qk_norm:
            attrs["qk_norm_eps"], attrs["qk_norm_zero_centred"] = eps, False
            ad |= {"qk_norm_zero_centred"} | ({"qk_norm_eps"} if eps_default else set())
        attrs.update({"sinks": False, "output_gate": False, "window": window, "scale": 1.0 / math.sqrt(hd)})
        ad |= {"sinks", "output_gate", "scale"} | ({"window"} if not layer_types else set())
        attrs.update(rope)
        ad |= rope_defaults
        p = f"model.layers.{i}."
        for name, role in (("q_proj.weight", Role.AttnQ), ("k_proj.weight", Role.AttnK), ("v_proj.weight", Role.AttnV),
                           ("o_proj.weight", Role.AttnO), ("q_proj.bias", Role.AttnQBias), ("k_proj.bias", Role.AttnKBias),
                           ("v_proj.bias", Role.AttnVBias), ("o_proj.bias", Role.AttnOBias),
                           ("q_norm.weight", Role.AttnQNorm), ("k_norm.weight", Role.AttnKNorm)):
            b.bind(p + "self_attn." + name, role, i)
        b.bind(p + "input_layernorm.weight", Role.PreAttentionNorm, i)
        b.bind(p + "post_attention_layernorm.weight", Role.PreFfnNorm, i)  # the pre-FFN norm of a two-norm layer
        for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
            b.bind(p + f"mlp.{name}.weight", role, i)
        norms = [op("rmsnorm", {"dim": d, "eps": eps, "zero_centred": False}, ({"eps"} if eps_default else set()) | {"zero_centred"}, role=r)
                 for r in (Role.PreAttentionNorm, Role.PreFfnNorm)]
        layers.append(Layer(i, "compute", Placement.PreOnly, norms, op("softmax", attrs, ad),
                            op("swiglu", {"d_model": d, "intermediate": cfg["intermediate_size"], "act": "silu"},
                               {"act"} if "hidden_act" not in cfg else set())))
    vocab = cfg["vocab_size"]
    tied = cfg.get("tie_word_embeddings")
    b.bind("model.embed_tokens.weight", Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    final = op("rmsnorm", {"dim": d, "eps": eps, "zero_centred": False}, ({"eps"} if eps_default else set()) | {"zero_centred"}, role=Role.FinalNorm)
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d}, {"tied"} if tied is None else set())
    return b.module(model_dir.resolve().name, compute_dtype(cfg, b, "model.embed_tokens.weight"), emb, layers, final, head)
