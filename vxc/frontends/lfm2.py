"""transformers ``lfm2`` (Liquid LFM2, e.g. LFM2-350M / -700M / -1.2B; Lfm2ForCausalLM).

What this frontend settles, as declared attributes and facts (checked against transformers 5.24's
``models/lfm2``):

- Layer map: ``layer_types`` (``conv`` / ``full_attention``, 0-based; what transformers 5.24 writes), else the
  hub's ``full_attn_idxs`` (0-based indices of the attention layers; every other layer is a conv layer), else —
  as Lfm2Config does — every layer attention (recorded as a default).
- Conv layers (``conv.``): a gated short convolution, the ``short_conv`` operator. ``in_proj`` [3d, d] emits the
  input gate B, the output gate C and the value x in that order (``BCx.chunk(3)``); the conv (``conv.weight``
  [d, 1, L_cache], depthwise, no activation) runs over B·x and its output is multiplied by C before
  ``out_proj``. ``conv_bias`` switches the biases of all three (in_proj, conv, out_proj). The conv history holds
  the last ``conv_L_cache`` gated inputs.
- Attention layers (``self_attn.``): GQA with per-head q/k RMSNorms (``q_layernorm`` / ``k_layernorm``, plain
  weight, eps ``norm_eps``) before rotary, no biases, scale head_dim^-½, the output projection spelled
  ``out_proj``. Rotary on halves of the whole head, theta from ``rope_parameters`` (transformers 5) or
  ``rope_theta`` (hub), default 1e6 (Lfm2Config.default_theta).
- Every layer: ``operator_norm`` → mixer → residual add; ``ffn_norm`` → SwiGLU (``w1`` gate, ``w3`` up, ``w2``
  down) → residual add (two-norm, PreOnly). RMSNorms are plain ``x̂ · w`` with eps ``norm_eps`` (1e-5).
- FFN width (Lfm2MLP): from ``block_ff_dim`` (hub; it overrides ``intermediate_size`` as Lfm2Config does) or
  ``intermediate_size``: when ``block_auto_adjust_ff_dim`` (default true), ``int(2·ff/3)``, then — only when
  ``block_ffn_dim_multiplier`` is not null (default 1.0) — ``int(multiplier · ff)`` rounded up to a multiple of
  ``block_multiple_of`` (default 256). The rule and its result are a fact in the IR.
- ``model.embedding_norm`` is, despite its name, the final norm (applied after the last layer). The head is
  tied unless ``tie_embedding`` (hub) / ``tie_word_embeddings`` says otherwise (default tied).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op
from .decoder import EMBEDDING, rmsnorm, sizes, swiglu_op
from .registry import by_model_type
from .softmax_decoder import rope_attrs

# Lfm2Config's defaults (transformers 5.24), filled in — and marked — when a config omits a key
DEFAULTS = {"num_key_value_heads": 8, "norm_eps": 1e-5, "intermediate_size": 12288, "conv_bias": False,
            "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True, "tie_word_embeddings": True}
DEFAULT_THETA = 1_000_000.0  # Lfm2Config.default_theta
LAYER_TYPES = ("conv", "full_attention")


def _layer_types(A: Attrs, n_layer: int) -> tuple[list[str], str]:
    types = A.raw("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layer:
            raise ConfigError(f"{A.where}: layer_types must be a list of {n_layer} entries (num_hidden_layers)")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise FrontendError(f"{A.where}: layer_types[{i}]={t!r} is not supported ({', '.join(LAYER_TYPES)})")
        return list(types), "layer_types"
    idxs = A.opt("full_attn_idxs", kind=list[int], min=0)
    if idxs is None:
        return ["full_attention"] * n_layer, "no layer_types and no full_attn_idxs: every layer attention (Lfm2Config's default)"
    for j in idxs:
        if j >= n_layer:
            raise ConfigError(f"{A.where}: full_attn_idxs names layer {j}, past num_hidden_layers={n_layer}")
    return ["full_attention" if i in idxs else "conv" for i in range(n_layer)], "full_attn_idxs (0-based attention layers)"


def _ffn_width(A: Attrs) -> tuple[int, str, set[str]]:
    """Lfm2MLP's intermediate size, the rule in words, and which inputs were defaults."""
    ff, ff_default = A.get("block_ff_dim", "intermediate_size", default=DEFAULTS["intermediate_size"], kind=int, min=1)
    key = A.which("block_ff_dim", "intermediate_size") or "intermediate_size (default)"
    defaults = {"intermediate"} if ff_default else set()
    if not A.take("block_auto_adjust_ff_dim", bool):
        return ff, f"{key} {ff} as is (block_auto_adjust_ff_dim false)", defaults
    width = int(2 * ff / 3)
    rule = f"int(2 * {key} {ff} / 3) = {width}"
    if "block_ffn_dim_multiplier" in A and A.raw("block_ffn_dim_multiplier") is None:
        return width, rule + " (block_ffn_dim_multiplier null: no multiplier, no rounding)", defaults | {"intermediate"}
    mult = A.take("block_ffn_dim_multiplier", float)
    m = A.take("block_multiple_of", int, 1)
    scaled = int(mult * width)
    width = m * ((scaled + m - 1) // m)
    rule += f", int({mult!r} * it) = {scaled}, rounded up to a multiple of {m}: {width}"
    if A.filled & {"block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of"}:
        defaults.add("intermediate")
    return width, rule, defaults


def _rope(A: Attrs, hd: int) -> tuple[dict, set[str], str]:
    """rope_attrs with Lfm2's default theta (1e6) where neither spelling gives one; rotary covers the whole head."""
    if A.raw("partial_rotary_factor") is not None:
        raise FrontendError(f"{A.where}: partial_rotary_factor is not supported (Lfm2 rotates the whole head)")
    c, filled = dict(A.cfg), False
    rp = A.raw("rope_parameters")
    if isinstance(rp, dict):
        if rp.get("rope_theta") is None:
            c["rope_parameters"], filled = {**rp, "rope_theta": DEFAULT_THETA}, True
    elif A.raw("rope_theta") is None:
        c["rope_theta"], filled = DEFAULT_THETA, True
    attrs, defaults, read = rope_attrs(Attrs(c, A.where), hd)
    if attrs["rotary_dim"] != hd:
        raise FrontendError(f"{A.where}: a partial rotary factor is not supported (Lfm2 rotates the whole head)")
    return attrs, defaults | ({"rotary_base"} if filled else set()), read


@by_model_type("lfm2")
def lower_lfm2(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (lfm2)", DEFAULTS)
    d, n_layer, heads, vocab = sizes(A)
    kv = A.take("num_key_value_heads", int, 1)
    hd = A.opt("head_dim", kind=int, min=1)
    hd_default = hd is None
    if hd is None:
        hd = d // heads
    if hd < 1:
        raise ConfigError(f"{A.where}: hidden_size={d} // num_attention_heads={heads} leaves no head dimension")
    eps = A.take("norm_eps", float, 0.0)
    eps_default = "norm_eps" in A.filled
    bias = A.take("conv_bias", bool)
    K = A.take("conv_L_cache", int, 1)
    inter, ffn_rule, ffn_defaults = _ffn_width(A)

    b = Builder(model_dir, "transformers", "lfm2", sha, relative_to)
    types, map_read = _layer_types(A, n_layer)
    b.fact("layer_map_read_from", map_read, "which layers are conv layers and which attention layers")
    rope, rope_defaults, rope_read = _rope(A, hd)
    b.fact("rope_read_from", rope_read, "config spelling of the rotary parameters")
    b.fact("ffn_intermediate", inter, f"Lfm2MLP's rule: {ffn_rule}")
    b.fact("conv_in_proj_order", "B|C|x", "Lfm2ShortConv: B, C, x = in_proj(h).chunk(3); conv over B*x; C*conv")

    attn = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": False, "k_bias": False,
            "v_bias": False, "o_bias": False, "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": False,
            "sinks": False, "output_gate": False, "window": 0, "scale": 1.0 / math.sqrt(hd), **rope}
    attn_defaults = ({"sinks", "output_gate", "window", "scale", "qk_norm_zero_centred"} | rope_defaults
                     | ({"kv_heads"} if "num_key_value_heads" in A.filled else set())
                     | ({"head_dim"} if hd_default else set()) | ({"qk_norm_eps"} if eps_default else set()))
    conv = {"d_model": d, "conv_kernel": K, "conv_bias": bias, "proj_bias": bias}
    conv_defaults = {a for a, key in (("conv_kernel", "conv_L_cache"), ("conv_bias", "conv_bias"), ("proj_bias", "conv_bias"))
                     if key in A.filled}

    layers = []
    for i in range(n_layer):
        p = f"model.layers.{i}."
        if types[i] == "conv":
            c = p + "conv."
            b.bind(c + "in_proj.weight", Role.ShortConvInProj, i)
            b.bind(c + "in_proj.bias", Role.ShortConvInProjBias, i)
            b.bind_reshaped(c + "conv.weight", Role.ShortConvConv1d, i, (d, K))
            b.bind(c + "conv.bias", Role.ShortConvConv1dBias, i)
            b.bind(c + "out_proj.weight", Role.ShortConvOutProj, i)
            b.bind(c + "out_proj.bias", Role.ShortConvOutProjBias, i)
            mixer = op("short_conv", dict(conv), set(conv_defaults))
        else:
            sa = p + "self_attn."
            for name, role in (("q_proj", Role.AttnQ), ("k_proj", Role.AttnK), ("v_proj", Role.AttnV),
                               ("out_proj", Role.AttnO), ("q_layernorm", Role.AttnQNorm), ("k_layernorm", Role.AttnKNorm)):
                b.bind(sa + name + ".weight", role, i)
            mixer = op("softmax", dict(attn), set(attn_defaults))
        b.bind(p + "operator_norm.weight", Role.PreAttentionNorm, i)  # the pre-mixer norm, conv layers too
        b.bind(p + "ffn_norm.weight", Role.PreFfnNorm, i)
        for name, role in (("w1", Role.FfnGate), ("w3", Role.FfnUp), ("w2", Role.FfnDown)):
            b.bind(p + f"feed_forward.{name}.weight", role, i)
        ffn = swiglu_op(d, inter, ffn_defaults | {"act"})  # Lfm2MLP: F.silu, not configurable
        norms = [rmsnorm(d, eps, eps_default, role) for role in (Role.PreAttentionNorm, Role.PreFfnNorm)]
        layers.append(Layer(i, "compute", Placement.PreOnly, norms, mixer, ffn))

    tied, tied_default = A.get("tie_embedding", "tie_word_embeddings", default=True, kind=bool)
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("model.embedding_norm.weight", Role.FinalNorm)  # the final norm, after the last layer
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d}, {"tied"} if tied_default else set())
    final = rmsnorm(d, eps, eps_default, Role.FinalNorm)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final, head)
