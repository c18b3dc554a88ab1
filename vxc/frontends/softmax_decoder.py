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

from ..ir.module import Module
from ..ir.roles import Role
from .common import Attrs, Builder, ConfigError, FrontendError, op
from .decoder import bind_norms, bind_swiglu, check_silu, finish, rmsnorm, sizes, swiglu_op, two_norm_layer


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: str | bool  # config key that switches q/k/v biases, or a fixed fact
    o_bias: str | bool
    qk_norm: bool
    head_dim_default: int | None = None  # None: hidden_size // heads


def rope_attrs(A: Attrs, head_dim: int) -> tuple[dict, set[str], str]:
    """Rotary attributes from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (hub)."""
    attrs, defaults = {}, set()
    if isinstance(A.raw("rope_parameters"), dict):
        rp, read = dict(A.raw("rope_parameters")), "rope_parameters"
    else:
        rp, read = dict(A.opt("rope_scaling", kind=dict) or {}), "rope_theta/rope_scaling"
        if "rope_theta" in A:
            rp["rope_theta"] = A.raw("rope_theta")
        if "type" in rp and "rope_type" not in rp:
            rp["rope_type"] = rp.pop("type")
    R = Attrs(rp, A.where, prefix="rope_parameters." if read == "rope_parameters" else "rope_scaling.")
    theta = R.opt("rope_theta", kind=float)
    factor = R.opt("partial_rotary_factor", kind=float) if "partial_rotary_factor" in R else A.opt("partial_rotary_factor", kind=float)
    rdim = head_dim if factor is None else int(head_dim * factor)
    attrs["rotary_dim"] = rdim
    if factor is None:
        defaults.add("rotary_dim")
    attrs["rotary_base"] = float(theta if theta is not None else 10000.0)
    if theta is None:
        defaults.add("rotary_base")
    attrs["rotary_layout"] = "half"
    defaults.add("rotary_layout")
    rtype = R.check("rope_type", rp["rope_type"], str) if "rope_type" in R else "default"
    if rtype not in ("default", "linear", "llama3"):
        raise FrontendError(f"{A.where}: rope_type {rtype!r} is not supported for this family yet")
    attrs["rope_type"] = rtype
    if "rope_type" not in R:
        defaults.add("rope_type")
    if rtype in ("linear", "llama3"):
        attrs["rope_factor"] = R.need("factor", kind=float)
    if rtype == "llama3":
        attrs["rope_low_freq_factor"] = R.need("low_freq_factor", kind=float)
        attrs["rope_high_freq_factor"] = R.need("high_freq_factor", kind=float)
        attrs["rope_original_max_position"] = R.need("original_max_position_embeddings", kind=int)
    return attrs, defaults, read


def bind_attention(b: Builder, p: str, i: int) -> None:
    """Softmax attention under ``p`` (``model.layers.{i}.self_attn.``): projections, their biases, q/k norms."""
    for name, role in (("q_proj.weight", Role.AttnQ), ("k_proj.weight", Role.AttnK), ("v_proj.weight", Role.AttnV),
                       ("o_proj.weight", Role.AttnO), ("q_proj.bias", Role.AttnQBias), ("k_proj.bias", Role.AttnKBias),
                       ("v_proj.bias", Role.AttnVBias), ("o_proj.bias", Role.AttnOBias),
                       ("q_norm.weight", Role.AttnQNorm), ("k_norm.weight", Role.AttnKNorm)):
        b.bind(p + name, role, i)


def lower_decoder(fam: Family, model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json ({fam.name})")
    d, n_layer, heads, vocab = sizes(A)
    inter = A.need("intermediate_size", kind=int)
    check_silu(A)
    if A.raw("mlp_bias"):
        raise FrontendError(f"{A.where}: mlp_bias=true is not supported")
    b = Builder(model_dir, "transformers", fam.name, sha, relative_to)
    defaults: set[str] = set()
    kv = A.opt("num_key_value_heads", kind=int)
    if kv is None:
        kv = heads
        defaults.add("kv_heads")
    hd = A.opt("head_dim", kind=int, min=1)
    if hd is None:
        hd = fam.head_dim_default or d // heads
        defaults.add("head_dim")
    eps = A.get("rms_norm_eps", default=1e-6, kind=float)

    def flag(spec: str | bool) -> tuple[bool, bool]:
        return (spec, False) if isinstance(spec, bool) else A.get(spec, default=False, kind=bool)

    qkv_b, qkv_d = flag(fam.qkv_bias)
    o_b, o_d = flag(fam.o_bias)
    rope, rope_defaults, read = rope_attrs(A, hd)
    b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    layer_types = A.opt("layer_types", kind=list)
    if A.raw("use_sliding_window") and not layer_types:
        raise FrontendError(f"{A.where}: use_sliding_window=true without layer_types is not supported")
    if layer_types is not None and len(layer_types) < n_layer:
        raise ConfigError(f"{A.where}: layer_types lists {len(layer_types)} entries for {n_layer} layers")
    layers = []
    for i in range(n_layer):
        lt = layer_types[i] if layer_types else "full_attention"
        if lt not in ("full_attention", "sliding_attention"):
            raise FrontendError(f"{A.where}: layer_types[{i}]={lt!r} is not supported")
        window = A.need("sliding_window", kind=int) if lt == "sliding_attention" else 0
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd,
                 "q_bias": qkv_b, "k_bias": qkv_b, "v_bias": qkv_b, "o_bias": o_b, "qk_norm": fam.qk_norm}
        ad = set(defaults) | ({"q_bias", "k_bias", "v_bias"} if qkv_d else set()) | ({"o_bias"} if o_d else set())
        if fam.qk_norm:
            attrs["qk_norm_eps"], attrs["qk_norm_zero_centred"] = eps[0], False
            ad |= {"qk_norm_zero_centred"} | ({"qk_norm_eps"} if eps[1] else set())
        attrs.update({"sinks": False, "output_gate": False, "window": window, "scale": 1.0 / math.sqrt(hd)})
        ad |= {"sinks", "output_gate", "scale"} | ({"window"} if not layer_types else set())
        attrs.update(rope)
        ad |= rope_defaults
        p = f"model.layers.{i}."
        bind_attention(b, p + "self_attn.", i)
        bind_norms(b, i)
        bind_swiglu(b, p + "mlp.", i)
        ffn = swiglu_op(d, inter, {"act"} if "hidden_act" not in A else set())
        layers.append(two_norm_layer(i, d, eps, op("softmax", attrs, ad), ffn))
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps[0], eps[1], Role.FinalNorm))
