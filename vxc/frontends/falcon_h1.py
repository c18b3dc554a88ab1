"""transformers ``falcon_h1`` (TII Falcon-H1, ``FalconH1ForCausalLM``): attention and Mamba2 side by side in every
layer, then a SwiGLU FFN, with µP multipliers throughout.

What this frontend settles, as declared attributes and facts (checked against transformers 5.24's
``models/falcon_h1``):

- Every layer is a ``Parallel`` layer: ``input_layernorm`` → the Mamba2 mixer (``mamba.``) and the attention
  (``self_attn.``) both read its output → their outputs summed → residual add; ``pre_ff_layernorm`` → SwiGLU
  (``feed_forward.``) → residual add (in the compute dtype). RMSNorms plain ``x̂ · w``, eps ``rms_norm_eps``.
- The µP multipliers, each declared where FalconH1 applies it (never folded into a weight):
  ``embedding_multiplier`` → the embedding's ``scale``; ``lm_head_multiplier`` → the head's ``scale``;
  ``attention_in_multiplier`` / ``attention_out_multiplier`` → the attention's ``input_scale`` /
  ``output_scale``; ``key_multiplier`` → its ``key_scale`` (k after k_proj, before rotary and the cache);
  ``ssm_in_multiplier`` / ``ssm_out_multiplier`` → the Mamba2 mixer's ``input_scale`` / ``output_scale``;
  ``ssm_multipliers`` (five: FalconH1's ``mup_vector`` over in_proj's output z | x | B | C | dt) → its
  ``z_scale``, ``x_scale``, ``b_scale``, ``c_scale``, ``dt_scale``; ``mlp_multipliers`` (gate, down) → the
  FFN's ``gate_scale`` (the gate projection's output, before SiLU) and ``output_scale`` (after down_proj).
  Absent ones are FalconH1Config's 1.0, declared and marked ``(default)``.
- Mamba2 (FalconH1Mixer): ``mamba_d_ssm`` inner width (null: ``mamba_expand · hidden_size``),
  ``mamba_n_heads`` × ``mamba_d_head`` (``"auto"``: d_ssm / heads), ``mamba_n_groups`` B/C groups,
  ``mamba_d_state``, ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_chunk_size``, dt limited to
  ``time_step_limit``; ``mamba_rms_norm`` switches the gated RMSNorm (groups of d_ssm / n_groups, order from
  ``mamba_norm_before_gate``, silu gate) — without it the output is ``y · silu(z)``. ``mamba_proj_bias`` is
  in_proj's bias, ``projectors_bias`` out_proj's: the mamba2 operator declares one flag for both, so differing
  values are refused by name.
- Attention (FalconH1Attention): GQA, ``head_dim`` (else hidden_size / heads, as the class reads it), rotary on
  halves of the whole head (``rope_parameters`` or ``rope_theta``), biases on q/k/v/o from ``attention_bias``,
  scale head_dim^-½.
- Head: ``lm_head.weight`` unless ``tie_word_embeddings`` (default false).
- Refused by name: an activation other than silu (``hidden_act`` is both the conv's and the MLP's), ``mlp_bias``,
  ssm_multipliers / mlp_multipliers of the wrong length, a partial rotary factor.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op
from .decoder import EMBEDDING, rmsnorm, sizes
from .registry import by_model_type
from .softmax_decoder import bind_attention, rope_attrs

# FalconH1Config's defaults (transformers 5.24), filled in — and marked — when a config omits a key
DEFAULTS = {
    "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5, "intermediate_size": 14336,
    "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "mamba_norm_before_gate": True, "mamba_rms_norm": False, "time_step_limit": [0.0, math.inf],
    "projectors_bias": False, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "lm_head_multiplier": 1.0, "embedding_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0], "key_multiplier": 1.0,
    "attention_out_multiplier": 1.0, "attention_in_multiplier": 1.0, "ssm_multipliers": [1.0] * 5,
    "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
}
SEGMENTS = ("z", "x", "b", "c", "dt")  # ssm_multipliers' order: in_proj's output segments


def _mult(A: Attrs, key: str) -> tuple[float, bool]:
    value = A.take(key, float)
    return value, key in A.filled


def _mults(A: Attrs, key: str, n: int) -> tuple[list[float], bool]:
    values = A.take(key, list[float])
    if len(values) != n:
        raise ConfigError(f"{A.where}: {key} must hold {n} multipliers, not {len(values)}")
    return [float(v) for v in values], key in A.filled


def _mamba(A: Attrs, b: Builder, d: int, eps: float, eps_default: bool):
    d_ssm = A.opt("mamba_d_ssm", kind=int, min=1)
    d_ssm_default = False
    if d_ssm is None:
        if "mamba_d_ssm" in A:  # null: mamba_expand · hidden_size, as FalconH1Mixer computes it
            d_ssm = int(A.take("mamba_expand", int, 1) * d)
        else:
            d_ssm = DEFAULTS["mamba_d_ssm"]
        d_ssm_default = True
    heads = A.take("mamba_n_heads", int, 1)
    hd_raw = A.take("mamba_d_head")
    hd_default = hd_raw == "auto"
    hd = d_ssm // heads if hd_default else A.check("mamba_d_head", hd_raw, int, 1)
    if heads * hd != d_ssm:
        raise ConfigError(f"{A.where}: mamba_n_heads={heads} x mamba_d_head={hd} != mamba_d_ssm={d_ssm} "
                          f"(FalconH1Config requires them equal)")
    G = A.take("mamba_n_groups", int, 1)
    if heads % G or d_ssm % G:
        raise FrontendError(f"{A.where}: mamba_n_groups={G} must divide mamba_n_heads={heads} and mamba_d_ssm={d_ssm}")
    in_bias, out_bias = A.take("mamba_proj_bias", bool), A.take("projectors_bias", bool)
    if in_bias != out_bias:
        raise FrontendError(f"{A.where}: mamba_proj_bias={in_bias} and projectors_bias={out_bias} differ: the mamba2 "
                            f"operator declares one bias flag for in_proj and out_proj; not supported")
    limit = A.take("time_step_limit", list[float])
    if len(limit) != 2:
        raise ConfigError(f"{A.where}: time_step_limit must be [min, max], not {limit!r}")
    rms = A.take("mamba_rms_norm", bool)
    filled = A.filled
    attrs = {"d_model": d, "d_inner": d_ssm, "heads": heads, "head_dim": hd, "state_size": A.take("mamba_d_state", int, 1),
             "groups": G, "conv_kernel": A.take("mamba_d_conv", int, 1), "conv_bias": A.take("mamba_conv_bias", bool),
             "proj_bias": in_bias, "chunk_size": A.take("mamba_chunk_size", int, 1), "dt_min": float(limit[0]),
             "dt_max": float(limit[1])}
    defaults = {a for a, key in (("heads", "mamba_n_heads"), ("state_size", "mamba_d_state"), ("groups", "mamba_n_groups"),
                                 ("conv_kernel", "mamba_d_conv"), ("conv_bias", "mamba_conv_bias"),
                                 ("proj_bias", "mamba_proj_bias"), ("chunk_size", "mamba_chunk_size"),
                                 ("dt_min", "time_step_limit"), ("dt_max", "time_step_limit")) if key in filled}
    defaults |= ({"d_inner"} if d_ssm_default else set()) | ({"head_dim"} if hd_default else set())
    if rms:
        before = A.take("mamba_norm_before_gate", bool)
        attrs.update(norm_eps=eps, norm_order="norm_then_gate" if before else "gate_then_norm", norm_act="silu",
                     norm_group=d_ssm // G)
        defaults |= {"norm_act", "norm_group"} | ({"norm_eps"} if eps_default else set())
        defaults |= {"norm_order"} if "mamba_norm_before_gate" in filled else set()
    else:
        attrs.update(gated_norm=False, norm_act="silu")
        defaults |= {"norm_act"} | ({"gated_norm"} if "mamba_rms_norm" in filled else set())
    seg, seg_default = _mults(A, "ssm_multipliers", 5)
    for name, value in zip(SEGMENTS, seg):
        attrs[f"{name}_scale"] = value
        if seg_default:
            defaults.add(f"{name}_scale")
    for attr, key in (("input_scale", "ssm_in_multiplier"), ("output_scale", "ssm_out_multiplier")):
        attrs[attr], filled_in = _mult(A, key)
        if filled_in:
            defaults.add(attr)
    return lambda: op("mamba2", dict(attrs), set(defaults))


def _attention(A: Attrs, b: Builder, d: int, heads: int):
    kv = A.opt("num_key_value_heads", kind=int, min=1)
    kv_default = kv is None
    if kv is None:  # FalconH1Config: null → num_attention_heads; absent → its default 8
        kv = heads if "num_key_value_heads" in A else DEFAULTS["num_key_value_heads"]
    if heads % kv:
        raise ConfigError(f"{A.where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    hd = A.opt("head_dim", kind=int, min=1)
    hd_default = hd is None
    if hd is None:
        hd = d // heads  # FalconH1Attention: getattr(config, "head_dim", hidden_size // num_attention_heads)
    rope, rope_defaults, read = rope_attrs(A, hd)
    if rope["rotary_dim"] != hd:
        raise FrontendError(f"{A.where}: a partial rotary factor is not supported (FalconH1 rotates the whole head)")
    b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    bias = A.take("attention_bias", bool)
    attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": bias, "k_bias": bias,
             "v_bias": bias, "o_bias": bias, "qk_norm": False, "sinks": False, "output_gate": False, "window": 0,
             "scale": hd ** -0.5, **rope}
    defaults = {"qk_norm", "sinks", "output_gate", "window", "scale"} | rope_defaults
    defaults |= ({"kv_heads"} if kv_default else set()) | ({"head_dim"} if hd_default else set())
    defaults |= {"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in A.filled else set()
    for attr, key in (("key_scale", "key_multiplier"), ("input_scale", "attention_in_multiplier"),
                      ("output_scale", "attention_out_multiplier")):
        attrs[attr], filled_in = _mult(A, key)
        if filled_in:
            defaults.add(attr)
    return lambda: op("softmax", dict(attrs), set(defaults))


@by_model_type("falcon_h1")
def lower_falcon_h1(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (falcon_h1)", DEFAULTS)
    d, n_layer, heads, vocab = sizes(A)
    act = A.take("hidden_act", str)
    if act != "silu":
        raise FrontendError(f"{A.where}: hidden_act={act!r} is not supported (silu only: FalconH1 uses it for the "
                            f"Mamba2 conv and the MLP gate)")
    if A.take("mlp_bias", bool):
        raise FrontendError(f"{A.where}: mlp_bias=true is not supported (the swiglu operator declares no biases)")
    eps = A.take("rms_norm_eps", float, 0.0)
    eps_default = "rms_norm_eps" in A.filled
    inter = A.take("intermediate_size", int, 1)
    b = Builder(model_dir, "transformers", "falcon_h1", sha, relative_to)
    mamba = _mamba(A, b, d, eps, eps_default)
    attention = _attention(A, b, d, heads)
    (gate_m, down_m), mlp_default = _mults(A, "mlp_multipliers", 2)
    ffn_attrs = {"d_model": d, "intermediate": inter, "act": "silu", "gate_scale": gate_m, "output_scale": down_m}
    ffn_defaults = {"act"} | ({"intermediate"} if "intermediate_size" in A.filled else set())
    ffn_defaults |= {"gate_scale", "output_scale"} if mlp_default else set()
    b.fact("parallel_mixers", "mamba2+softmax", "FalconH1DecoderLayer: mamba(h) * ssm_out + self_attn(h * attention_in) "
           "* attention_out, both from input_layernorm's output, summed, then the residual add")
    b.fact("ssm_multipliers_segments", "z|x|B|C|dt", "compute_mup_vector: ssm_multipliers[0..4] over in_proj's "
           "output segments d_ssm | d_ssm | groups*state | groups*state | heads")

    layers = []
    for i in range(n_layer):
        p = f"model.layers.{i}."
        b.bind(p + "input_layernorm.weight", Role.PreAttentionNorm, i)  # the one norm both mixers read
        b.bind(p + "pre_ff_layernorm.weight", Role.PreFfnNorm, i)
        _bind_mamba2(b, p + "mamba.", i)
        bind_attention(b, p + "self_attn.", i)
        for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
            b.bind(p + f"feed_forward.{name}.weight", role, i)
        norms = [rmsnorm(d, eps, eps_default, role) for role in (Role.PreAttentionNorm, Role.PreFfnNorm)]
        ffn = op("swiglu", dict(ffn_attrs), set(ffn_defaults))
        layers.append(Layer(i, "compute", Placement.Parallel, norms, mamba(), ffn, parallel=attention()))

    tied, tied_default = A.get("tie_word_embeddings", default=False, kind=bool)
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("model.final_layernorm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb_scale, emb_default = _mult(A, "embedding_multiplier")
    head_scale, head_default = _mult(A, "lm_head_multiplier")
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d, "scale": emb_scale},
             {"scale"} if emb_default else set())
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d, "scale": head_scale},
              ({"tied"} if tied_default else set()) | ({"scale"} if head_default else set()))
    final = rmsnorm(d, eps, eps_default, Role.FinalNorm)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final, head)


def _bind_mamba2(b: Builder, p: str, i: int) -> None:
    for name, role in (("in_proj.weight", Role.Mamba2InProj), ("in_proj.bias", Role.Mamba2InProjBias),
                       ("conv1d.bias", Role.Mamba2Conv1dBias), ("norm.weight", Role.Mamba2GatedNorm),
                       ("out_proj.weight", Role.Mamba2OutProj), ("out_proj.bias", Role.Mamba2OutProjBias),
                       ("A_log", Role.Mamba2ALog), ("D", Role.Mamba2D), ("dt_bias", Role.Mamba2DtBias)):
        b.bind(p + name, role, i)
    conv = b.shape(p + "conv1d.weight")
    if conv is not None and len(conv) == 3:
        b.bind_reshaped(p + "conv1d.weight", Role.Mamba2Conv1d, i, (conv[0], conv[2]))
    else:
        b.bind(p + "conv1d.weight", Role.Mamba2Conv1d, i)
