"""transformers ``nemotron_h`` (NVIDIA Nemotron-H, ``NemotronHForCausalLM``): a per-layer pattern of Mamba2,
attention and MLP-only layers.

What this frontend settles, as declared attributes and facts (checked against transformers 5.24's
``models/nemotron_h``):

- The layer map: ``layers_block_type`` (transformers 5's spelling, also read as ``layer_types``) or the hub's
  ``hybrid_override_pattern`` string (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE); the list wins when
  both are given, as in NemotronHConfig. The layer count is the map's length (``num_hidden_layers`` is ignored
  by the reference; a disagreeing value is recorded as a fact).
- Every layer has exactly one block: ``norm`` (an RMSNorm, eps ``layer_norm_epsilon``) → mixer or MLP →
  residual add, the residual in the compute dtype (``residual_in_fp32`` is not read by NemotronHBlock). Mamba2
  and attention layers are ``PreMixer`` layers with no FFN; MLP layers are ``PreFfn`` layers with no mixer.
- Mamba2: ``mamba_num_heads`` × ``mamba_head_dim`` (d_inner; ``expand`` is not read by the mixer),
  ``ssm_state_size``, ``n_groups`` B/C groups and as many groups of the gated RMSNorm (gate then normalise,
  silu), ``conv_kernel``, ``use_conv_bias``, ``use_bias`` (in/out projections), ``chunk_size``; dt clamped below
  at ``time_step_min`` with no upper bound (the mixer's ``time_step_limit`` is ``(time_step_min, inf)``, whatever
  the config's ``time_step_limit`` says). The ``mamba_*`` aliases (``mamba_n_groups``, ``mamba_d_conv``,
  ``mamba_dt_min``, ``mamba_conv_bias``, ``mamba_chunk_size``) win over the plain keys, as in NemotronHConfig.
- Attention: no rotary and no position signal at all (NemotronHAttention never applies its rotary helper),
  no biases (the class builds its projections without them), GQA, scale ``head_dim^-½``; ``head_dim`` read as
  ``head_dim`` or the hub's ``attention_head_dim``.
- MLP: ``down(relu²(up(x)))``, non-gated (the ``mlp`` operator), ``mlp_hidden_act`` ``relu2`` only.
- Head: never tied — NemotronHForCausalLM declares no tied weights, so even ``tie_word_embeddings: true`` runs
  (and saves) a separate ``lm_head.weight``; such a config is recorded as a fact.
- Refused by name: MoE layers (``E`` / ``moe``: non-gated relu² experts, which the ``moe`` operator — gated
  experts only — does not declare), multi-token-prediction layers, ``mlp_bias``, ``attention_bias`` and
  ``sliding_window`` (the reference builds neither), a conv activation other than silu.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op
from .decoder import rmsnorm
from .registry import by_model_type
from .softmax_decoder import bind_attention

# NemotronHConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key
DEFAULTS = {
    "tie_word_embeddings": False, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mlp_bias": False, "attention_bias": False,
    "ssm_state_size": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8,
    "conv_kernel": 4, "time_step_min": 0.001, "use_conv_bias": True, "chunk_size": 128, "use_bias": False,
    "layer_norm_epsilon": 1e-5, "num_nextn_predict_layers": 0,
}
DEFAULT_TYPES = ["linear_attention", "moe", "full_attention", "mlp"]  # NemotronHConfig's map when none is given
PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# the config key and its mamba_* alias (the alias wins, as NemotronHConfig.__post_init__ pops it over the key)
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
           "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}

BLOCK = "backbone.layers.{i}."
EMBEDDING = "backbone.embeddings.weight"


def _layer_types(A: Attrs, b: Builder) -> list[str]:
    key = A.which("layers_block_type", "layer_types")
    if key is not None:
        types = A.check(key, A.raw(key), list[str])
        read = key
    elif A.raw("hybrid_override_pattern") is not None:
        pattern = A.check("hybrid_override_pattern", A.raw("hybrid_override_pattern"), str)
        bad = sorted({c for c in pattern if c not in PATTERN})
        if bad:
            raise ConfigError(f"{A.where}: hybrid_override_pattern has characters {''.join(bad)!r} "
                              f"(known: {', '.join(f'{c} {t}' for c, t in PATTERN.items())})")
        types = [PATTERN[c] for c in pattern]
        read = "hybrid_override_pattern"
    else:
        types, read = list(DEFAULT_TYPES), "NemotronHConfig's default layer map (no layers_block_type / hybrid_override_pattern)"
    for i, t in enumerate(types):
        if t not in PATTERN.values():
            raise ConfigError(f"{A.where}: {read}[{i}]={t!r} is not a Nemotron-H layer type ({', '.join(PATTERN.values())})")
    if not types:
        raise ConfigError(f"{A.where}: the layer map ({read}) is empty")
    b.fact("layer_map_read_from", read, "which layers are Mamba2, attention or MLP")
    n = A.opt("num_hidden_layers", kind=int, min=0)
    if n is not None and n != len(types):
        b.fact("num_hidden_layers_ignored", n, f"the layer map has {len(types)} layers; NemotronHConfig uses its length")
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if moe:
        raise FrontendError(
            f"{A.where}: layers {', '.join(map(str, moe))} are MoE layers ('E' / moe): Nemotron-H's experts are "
            f"non-gated relu² MLPs (up/down only, optional latent projections), which the moe operator (gated "
            f"experts: silu, clamped_glu) does not declare; not supported")
    return types


def _mamba(A: Attrs, b: Builder, d: int, eps: float, eps_default: bool):
    def read(key: str, kind, min=None):
        alias = ALIASES.get(key)
        if alias is not None and alias in A and A.raw(alias) is not None:
            return A.check(alias, A.raw(alias), kind, min), False
        return A.get(key, default=DEFAULTS[key], kind=kind, min=min)

    act = A.take("mamba_hidden_act", str)
    if act != "silu":
        raise FrontendError(f"{A.where}: mamba_hidden_act={act!r} is not supported (the mamba2 conv activation is silu)")
    heads, heads_d = read("mamba_num_heads", int, 1)
    hd, hd_d = read("mamba_head_dim", int, 1)
    N, N_d = read("ssm_state_size", int, 1)
    G, G_d = read("n_groups", int, 1)
    K, K_d = read("conv_kernel", int, 1)
    conv_bias, conv_bias_d = read("use_conv_bias", bool)
    bias, bias_d = read("use_bias", bool)
    chunk, chunk_d = read("chunk_size", int, 1)
    dt_min, dt_min_d = read("time_step_min", float, 0.0)
    d_inner = heads * hd
    if heads % G:
        raise FrontendError(f"{A.where}: mamba_num_heads={heads} is not a multiple of n_groups={G}")
    b.fact("mamba2_dt_limit", "time_step_min..inf",
           "NemotronHMamba2Mixer.time_step_limit = (time_step_min, inf): dt_min, no dt_max; the config's time_step_limit is not read")
    rows = (("d_model", d, False), ("d_inner", d_inner, heads_d and hd_d), ("heads", heads, heads_d),
            ("head_dim", hd, hd_d), ("state_size", N, N_d), ("groups", G, G_d), ("conv_kernel", K, K_d),
            ("conv_bias", conv_bias, conv_bias_d), ("proj_bias", bias, bias_d), ("chunk_size", chunk, chunk_d),
            ("dt_min", float(dt_min), dt_min_d), ("dt_max", math.inf, True), ("norm_eps", eps, eps_default),
            ("norm_order", "gate_then_norm", True), ("norm_act", "silu", True), ("norm_group", d_inner // G, True))
    return lambda: op("mamba2", {k: v for k, v, _ in rows}, {k for k, _, filled in rows if filled})


def _attention(A: Attrs, d: int):
    heads = A.take("num_attention_heads", int, 1)
    kv = A.opt("num_key_value_heads", kind=int, min=1)
    kv_d = kv is None
    if kv is None:  # NemotronHConfig: null → num_attention_heads; absent → its default 8
        kv = heads if "num_key_value_heads" in A else DEFAULTS["num_key_value_heads"]
        A.filled.add("num_key_value_heads")
    hd_key = A.which("head_dim", "attention_head_dim")
    if A.raw("head_dim") is not None and A.raw("attention_head_dim") is not None and A.raw("head_dim") != A.raw("attention_head_dim"):
        raise ConfigError(f"{A.where}: head_dim={A.raw('head_dim')!r} and attention_head_dim={A.raw('attention_head_dim')!r} disagree")
    hd = A.check(hd_key, A.raw(hd_key), int, 1) if hd_key else DEFAULTS["head_dim"]
    if A.take("attention_bias", bool):
        raise FrontendError(f"{A.where}: attention_bias=true is not supported (NemotronHAttention builds q/k/v/o without biases)")
    if A.raw("sliding_window") is not None:
        raise FrontendError(f"{A.where}: sliding_window={A.raw('sliding_window')!r} is not supported "
                            f"(NemotronHAttention attends over the whole causal prefix)")
    # scale: NemotronHAttention.scaling = head_dim**-0.5 (spelled as the reference computes it)
    attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": False, "k_bias": False,
             "v_bias": False, "o_bias": False, "qk_norm": False, "sinks": False, "output_gate": False, "window": 0,
             "scale": hd ** -0.5, "rotary_dim": 0, "rotary_base": 10000.0, "rotary_layout": "none",
             "rope_type": "default"}
    defaults = {"q_bias", "k_bias", "v_bias", "o_bias", "qk_norm", "sinks", "output_gate", "window", "scale",
                "rotary_dim", "rotary_base", "rotary_layout", "rope_type"}
    defaults |= ({"kv_heads"} if kv_d else set()) | ({"head_dim"} if hd_key is None else set())
    return lambda: op("softmax", dict(attrs), set(defaults))


@by_model_type("nemotron_h")
def lower_nemotron_h(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (nemotron_h)", DEFAULTS)
    d, vocab = A.need("hidden_size", kind=int, min=1), A.need("vocab_size", kind=int, min=1)
    b = Builder(model_dir, "transformers", "nemotron_h", sha, relative_to)
    types = _layer_types(A, b)
    if A.take("num_nextn_predict_layers", int, 0):
        raise FrontendError(f"{A.where}: num_nextn_predict_layers={A.raw('num_nextn_predict_layers')} "
                            f"(multi-token-prediction layers, mtp.*) is not supported")
    eps = A.take("layer_norm_epsilon", float, 0.0)
    eps_default = "layer_norm_epsilon" in A.filled
    b.fact("residual", "compute", "NemotronHBlock adds the residual in the compute dtype (residual_in_fp32 is not read)")
    mamba = _mamba(A, b, d, eps, eps_default) if "linear_attention" in types else None
    attention = _attention(A, d) if "full_attention" in types else None
    mlp = None
    if "mlp" in types:
        act = A.take("mlp_hidden_act", str)
        if act != "relu2":
            raise FrontendError(f"{A.where}: mlp_hidden_act={act!r} is not supported (relu2 only)")
        if A.take("mlp_bias", bool):
            raise FrontendError(f"{A.where}: mlp_bias=true is not supported (the mlp operator declares no biases)")
        inter = A.take("intermediate_size", int, 1)
        mlp_defaults = {"act"} if "mlp_hidden_act" in A.filled else set()
        mlp_defaults |= {"intermediate"} if "intermediate_size" in A.filled else set()
        mlp = lambda: op("mlp", {"d_model": d, "intermediate": inter, "act": "relu2"}, set(mlp_defaults))  # noqa: E731

    layers = []
    for i, t in enumerate(types):
        p = BLOCK.format(i=i)
        if t == "mlp":
            b.bind(p + "norm.weight", Role.PreFfnNorm, i)
            b.bind(p + "mixer.up_proj.weight", Role.FfnUp, i)
            b.bind(p + "mixer.down_proj.weight", Role.FfnDown, i)
            norm = rmsnorm(d, eps, eps_default, Role.PreFfnNorm)
            layers.append(Layer(i, "compute", Placement.PreFfn, [norm], None, mlp()))
            continue
        b.bind(p + "norm.weight", Role.Mamba2PreMixerNorm, i)
        norm = rmsnorm(d, eps, eps_default, Role.Mamba2PreMixerNorm)
        if t == "full_attention":
            bind_attention(b, p + "mixer.", i)
            layers.append(Layer(i, "compute", Placement.PreMixer, [norm], attention()))
            continue
        _bind_mamba2(b, p + "mixer.", i)
        layers.append(Layer(i, "compute", Placement.PreMixer, [norm], mamba()))

    if A.take("tie_word_embeddings", bool):
        b.fact("tie_word_embeddings_not_applied", True,
               "NemotronHForCausalLM declares no tied weights (_tied_weights_keys is empty): the head reads lm_head.weight")
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("backbone.norm_f.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    head = op("head", {"tied": False, "padded_vocab": vocab, "dim": d}, {"tied"})
    final = rmsnorm(d, eps, eps_default, Role.FinalNorm)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final, head)


def _bind_mamba2(b: Builder, p: str, i: int) -> None:
    for name, role in (("in_proj.weight", Role.Mamba2InProj), ("in_proj.bias", Role.Mamba2InProjBias),
                       ("conv1d.bias", Role.Mamba2Conv1dBias), ("norm.weight", Role.Mamba2GatedNorm),
                       ("out_proj.weight", Role.Mamba2OutProj), ("out_proj.bias", Role.Mamba2OutProjBias)):
        b.bind(p + name, role, i)
    conv = b.shape(p + "conv1d.weight")
    if conv is not None and len(conv) == 3 and conv[1] == 1:
        b.bind_reshaped(p + "conv1d.weight", Role.Mamba2Conv1d, i, (conv[0], conv[2]))
    else:
        b.bind(p + "conv1d.weight", Role.Mamba2Conv1d, i)
    for name, role in (("A_log", Role.Mamba2ALog), ("D", Role.Mamba2D), ("dt_bias", Role.Mamba2DtBias)):
        shape = b.shape(p + name)
        if shape is not None and len(shape) != 1:
            b.bind_reshaped(p + name, role, i, (math.prod(shape),))
        else:
            b.bind(p + name, role, i)
