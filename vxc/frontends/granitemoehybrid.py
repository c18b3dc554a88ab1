"""transformers ``granitemoehybrid`` (IBM Granite 4.0 hybrid, ``GraniteMoeHybridForCausalLM``): Mamba2 and
softmax-attention layers by ``layer_types``, an MoE with a shared expert (or the shared MLP alone), µP multipliers.

What this frontend settles, as declared attributes and facts (checked against transformers 5.24's
``models/granitemoehybrid``):

- The layer map: ``layer_types`` (``layers_block_type`` is its alias): ``linear_attention`` (the hub's ``mamba``)
  is a Mamba2 layer, ``full_attention`` (the hub's ``attention``) a softmax one; transformers 5.24 remaps the hub
  spellings (``_LEGACY_LAYER_TYPE_REMAP``). Absent: every layer Mamba2 (GraniteMoeHybridConfig's default).
- Every layer is a two-norm pre-norm layer: ``input_layernorm`` → mixer → ``residual + out · residual_multiplier``;
  ``post_attention_layernorm`` → FFN → ``residual + out · residual_multiplier`` (plain RMSNorms, eps
  ``rms_norm_eps``). The residual multiplier is the ``output_scale`` of each mixer and each FFN.
- The other µP multipliers: ``embedding_multiplier`` → the embedding's ``output_scale`` (rows times a number
  held in fp32, as transformers multiplies the embedded tensor by a Python float); ``attention_multiplier`` IS the
  attention's ``scale`` (GraniteMoeHybridAttention.scaling; no head_dim^-½); ``logits_scaling`` divides the
  logits → the head's ``scale`` = 1 / logits_scaling. Absent ones are the config's 1.0, declared and marked.
- FFN with ``num_local_experts`` > 0: a ``moe`` of ``num_local_experts`` SwiGLU experts of ``intermediate_size``,
  router ``topk_softmax`` (GraniteMoeHybridTopKRouter: top-k of the fp32 logits, softmax over the k chosen; no
  bias, no renormalisation or scaling beyond it), plus the shared MLP (``shared_mlp``: one fused ``input_linear``
  [2·S, d] whose first S rows are the gate, second S the up, then ``output_linear``) as the moe's shared expert of
  width ``shared_intermediate_size``, ungated, added to the routed sum. With ``num_local_experts`` = 0 the FFN is
  the shared MLP alone, a dense ``swiglu``.
- Experts on disk: the hub's (and 5.24's ``save_pretrained``'s) ``block_sparse_moe.input_linear`` [E, 2I, d]
  (gate = first I rows), ``output_linear`` [E, d, I], ``router.layer``; or 5.24's in-memory spelling
  ``experts.gate_up_proj`` / ``experts.down_proj`` / ``router.weight``. Gate and up are bound through slice views.
- Mamba2 (GraniteMoeHybridMambaLayer, Bamba's mixer): ``mamba_expand · hidden_size`` inner width,
  ``mamba_n_heads`` × ``mamba_d_head`` (``"auto"``: inner / heads), ``mamba_n_groups`` B/C groups and as many
  groups of the gated RMSNorm (gate then normalise: y·silu(z) first), ``mamba_d_state``, ``mamba_d_conv``,
  ``mamba_conv_bias``, ``mamba_proj_bias`` (in_proj and out_proj), ``mamba_chunk_size``, dt limited to
  ``time_step_limit``.
- Attention: GQA, ``head_dim`` when the config spells it (else hidden_size / heads), biases on q/k/v/o from
  ``attention_bias``; rotary (halves of the whole head, ``rope_parameters`` or ``rope_theta``) only when
  ``position_embedding_type`` is ``rope`` — ``nope`` or null: no position signal at all.
- Head: tied to the embedding iff ``tie_word_embeddings`` (default false).
- Refused by name: an activation other than silu (``hidden_act`` drives the conv, the experts and the shared MLP),
  an unknown layer type or position embedding type, a partial rotary factor.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Module, Transform
from ..ir.roles import Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op
from .decoder import EMBEDDING, bind_norms, rmsnorm, sizes, two_norm_layer
from .registry import by_model_type
from .softmax_decoder import bind_attention, rope_attrs

# GraniteMoeHybridConfig's defaults (transformers 5.24), filled in — and marked — when a config omits a key
DEFAULTS = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 11008, "shared_intermediate_size": 1024,
    "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "time_step_limit": [0.0, math.inf],
}
# the layer map's spellings: transformers 5's and the hub's legacy ones (remapped by transformers on load)
LAYER_TYPES = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "softmax", "attention": "softmax"}
POSITIONS = {None: False, "nope": False, "rope": True}  # position_embedding_type → rotary


def _mult(A: Attrs, key: str) -> tuple[float, bool]:
    value = A.take(key, float)
    return value, key in A.filled


def _layer_types(A: Attrs, b: Builder, n_layer: int) -> list[str]:
    key = A.which("layer_types", "layers_block_type")
    if key is None:
        b.fact("layer_map_read_from", "GraniteMoeHybridConfig's default (no layer_types): every layer Mamba2",
               "which layers are Mamba2 or attention")
        return ["mamba2"] * n_layer
    types = A.check(key, A.raw(key), list[str])
    if len(types) != n_layer:
        raise ConfigError(f"{A.where}: {key} has {len(types)} entries, num_hidden_layers={n_layer}")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise FrontendError(f"{A.where}: {key}[{i}]={t!r} is not a Granite 4.0 hybrid layer type "
                                f"({', '.join(LAYER_TYPES)})")
    b.fact("layer_map_read_from", key, "which layers are Mamba2 or attention")
    return [LAYER_TYPES[t] for t in types]


def _mamba(A: Attrs, d: int, eps: float, eps_default: bool, out_scale: tuple[float, bool]):
    expand = A.take("mamba_expand", int, 1)
    d_inner = expand * d
    heads = A.take("mamba_n_heads", int, 1)
    hd_raw = A.take("mamba_d_head")
    hd_default = hd_raw == "auto"
    hd = d_inner // heads if hd_default else A.check("mamba_d_head", hd_raw, int, 1)
    if heads * hd != d_inner:
        raise ConfigError(f"{A.where}: mamba_n_heads={heads} x mamba_d_head={hd} != mamba_expand x hidden_size="
                          f"{d_inner} (GraniteMoeHybridConfig requires them equal)")
    G = A.take("mamba_n_groups", int, 1)
    if heads % G or d_inner % G:
        raise FrontendError(f"{A.where}: mamba_n_groups={G} must divide mamba_n_heads={heads} and the inner width {d_inner}")
    limit = A.take("time_step_limit", list[float])
    if len(limit) != 2:
        raise ConfigError(f"{A.where}: time_step_limit must be [min, max], not {limit!r}")
    filled = A.filled
    rows = (("d_model", d, False), ("d_inner", d_inner, "mamba_expand" in filled), ("heads", heads, "mamba_n_heads" in filled),
            ("head_dim", hd, hd_default), ("state_size", A.take("mamba_d_state", int, 1), "mamba_d_state" in filled),
            ("groups", G, "mamba_n_groups" in filled), ("conv_kernel", A.take("mamba_d_conv", int, 1), "mamba_d_conv" in filled),
            ("conv_bias", A.take("mamba_conv_bias", bool), "mamba_conv_bias" in filled),
            ("proj_bias", A.take("mamba_proj_bias", bool), "mamba_proj_bias" in filled),
            ("chunk_size", A.take("mamba_chunk_size", int, 1), "mamba_chunk_size" in filled),
            ("dt_min", float(limit[0]), "time_step_limit" in filled), ("dt_max", float(limit[1]), "time_step_limit" in filled),
            ("norm_eps", eps, eps_default), ("norm_order", "gate_then_norm", True), ("norm_act", "silu", True),
            ("norm_group", d_inner // G, True), ("output_scale", out_scale[0], out_scale[1]))
    return lambda: op("mamba2", {k: v for k, v, _ in rows}, {k for k, _, f in rows if f})


def _attention(A: Attrs, b: Builder, d: int, heads: int, out_scale: tuple[float, bool]):
    kv = A.opt("num_key_value_heads", kind=int, min=1)
    kv_default = kv is None
    if kv is None:  # GraniteMoeHybridConfig: None → num_attention_heads
        kv = heads
    if heads % kv:
        raise ConfigError(f"{A.where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    hd = A.opt("head_dim", kind=int, min=1)
    hd_default = hd is None
    if hd is None:
        hd = d // heads  # GraniteMoeHybridAttention: getattr(config, "head_dim", hidden_size // num_attention_heads)
    pos = A.raw("position_embedding_type")
    if pos not in POSITIONS:
        raise FrontendError(f"{A.where}: position_embedding_type={pos!r} is not supported (rope, nope or null)")
    if POSITIONS[pos]:
        rope, rope_defaults, read = rope_attrs(A, hd)
        if rope["rotary_dim"] != hd:
            raise FrontendError(f"{A.where}: a partial rotary factor is not supported (the rotary covers the whole head)")
        b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    else:
        rope = {"rotary_dim": 0, "rotary_base": 10000.0, "rotary_layout": "none", "rope_type": "default"}
        rope_defaults = set(rope)
        b.fact("position_embedding", "none", f"position_embedding_type={pos!r}: GraniteMoeHybridModel builds no "
               f"rotary embedding and the attention gets none")
    bias = A.take("attention_bias", bool)
    scale, scale_default = _mult(A, "attention_multiplier")
    attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": bias, "k_bias": bias,
             "v_bias": bias, "o_bias": bias, "qk_norm": False, "sinks": False, "output_gate": False, "window": 0,
             "scale": scale, **rope, "output_scale": out_scale[0]}
    defaults = {"qk_norm", "sinks", "output_gate", "window"} | rope_defaults
    defaults |= ({"kv_heads"} if kv_default else set()) | ({"head_dim"} if hd_default else set())
    defaults |= ({"q_bias", "k_bias", "v_bias", "o_bias"} if "attention_bias" in A.filled else set())
    defaults |= ({"scale"} if scale_default else set()) | ({"output_scale"} if out_scale[1] else set())
    return lambda: op("softmax", dict(attrs), set(defaults))


def _ffn(A: Attrs, d: int, out_scale: tuple[float, bool]):
    filled = A.filled
    E = A.take("num_local_experts", int, 0)
    S = A.take("shared_intermediate_size", int, 1)
    if E == 0:  # GraniteMoeHybridDecoderLayer: no block_sparse_moe, the shared MLP alone
        attrs = {"d_model": d, "intermediate": S, "act": "silu", "output_scale": out_scale[0]}
        defaults = {"act"} | ({"intermediate"} if "shared_intermediate_size" in filled else set())
        defaults |= {"output_scale"} if out_scale[1] else set()
        return E, 0, lambda: op("swiglu", dict(attrs), set(defaults))
    k = A.take("num_experts_per_tok", int, 1)
    inter = A.take("intermediate_size", int, 1)
    attrs = {"d_model": d, "experts": E, "top_k": k, "intermediate": inter, "router": "topk_softmax",
             "norm_topk_prob": False, "routed_scaling": 1.0, "n_group": 1, "topk_group": 1, "router_bias": False,
             "selection_bias": False, "expert_layout": "separate", "expert_bias": False, "act": "silu",
             "shared_experts": True, "shared_intermediate": S, "shared_gate": False, "output_scale": out_scale[0]}
    defaults = {"norm_topk_prob", "routed_scaling", "n_group", "topk_group", "router_bias", "selection_bias",
                "expert_bias", "shared_experts", "shared_gate", "act"}
    defaults |= {a for a, key in (("experts", "num_local_experts"), ("top_k", "num_experts_per_tok"),
                                  ("intermediate", "intermediate_size"), ("shared_intermediate", "shared_intermediate_size"))
                 if key in filled}
    defaults |= {"output_scale"} if out_scale[1] else set()
    return E, inter, lambda: op("moe", dict(attrs), set(defaults))


@by_model_type("granitemoehybrid")
def lower_granitemoehybrid(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (granitemoehybrid)", DEFAULTS)
    d, n_layer, heads, vocab = sizes(A)
    act = A.take("hidden_act", str)
    if act != "silu":
        raise FrontendError(f"{A.where}: hidden_act={act!r} is not supported (silu only: it is the Mamba2 conv's, "
                            f"the experts' and the shared MLP's activation)")
    eps = A.take("rms_norm_eps", float, 0.0)
    eps_default = "rms_norm_eps" in A.filled
    b = Builder(model_dir, "transformers", "granitemoehybrid", sha, relative_to)
    types = _layer_types(A, b, n_layer)
    residual = _mult(A, "residual_multiplier")  # every mixer's and FFN's output_scale
    mamba = _mamba(A, d, eps, eps_default, residual) if "mamba2" in types else None
    attention = _attention(A, b, d, heads, residual) if "softmax" in types else None
    E, inter, ffn = _ffn(A, d, residual)
    S = A.take("shared_intermediate_size", int, 1)
    b.fact("residual_multiplier_on", "mixer+ffn", "GraniteMoeHybridDecoderLayer: residual + out * residual_multiplier "
           "after the mixer and after the FFN: each one's output_scale")
    b.fact("shared_mlp_input_linear", "gate|up", f"GraniteMoeHybridMLP: input_linear [2*{S}, d].chunk(2): gate = "
           f"first {S} rows, up = the rest")

    layers, spellings = [], set()
    for i, t in enumerate(types):
        p = f"model.layers.{i}."
        bind_norms(b, i)
        if t == "mamba2":
            _bind_mamba2(b, p + "mamba.", i)
            mixer = mamba()
        else:
            bind_attention(b, p + "self_attn.", i)
            mixer = attention()
        sh = p + "shared_mlp."
        roles = ((Role.FfnGate, Role.FfnUp, Role.FfnDown) if E == 0
                 else (Role.SharedExpertGate, Role.SharedExpertUp, Role.SharedExpertDown))
        b.bind(sh + "input_linear.weight", roles[0], i, [Transform("slice", dim=0, start=0, stop=S)])
        b.bind(sh + "input_linear.weight", roles[1], i, [Transform("slice", dim=0, start=S, stop=2 * S)])
        b.bind(sh + "output_linear.weight", roles[2], i)
        if E:
            spellings.add(_bind_experts(b, p + "block_sparse_moe.", i, inter))
        layers.append(two_norm_layer(i, d, (eps, eps_default), mixer, ffn()))
    if spellings:
        b.fact("experts_read_from", "; ".join(sorted(spellings)), "expert tensor spelling found in the checkpoint")

    tied, tied_default = A.get("tie_word_embeddings", default=False, kind=bool)
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb_scale, emb_default = _mult(A, "embedding_multiplier")
    logits_scaling, ls_default = _mult(A, "logits_scaling")
    if logits_scaling == 0:
        raise ConfigError(f"{A.where}: logits_scaling=0 (the logits are divided by it)")
    b.fact("logits_scaling", logits_scaling, "GraniteMoeHybridForCausalLM: logits / logits_scaling: the head's scale "
           "is its reciprocal")
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d, "output_scale": emb_scale},
             {"output_scale"} if emb_default else set())
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d, "scale": 1.0 / logits_scaling},
              ({"tied"} if tied_default else set()) | ({"scale"} if ls_default else set()))
    final = rmsnorm(d, eps, eps_default, Role.FinalNorm)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final, head)


IN_MEMORY = "experts.gate_up_proj [E, 2I, d] (gate = first I rows) + experts.down_proj + router.weight"
HUB = "input_linear [E, 2I, d] (gate = first I rows) + output_linear [E, d, I] + router.layer"


def _bind_experts(b: Builder, m: str, i: int, inter: int) -> str:
    """The routed experts and the router under ``m`` (``...block_sparse_moe.``), either spelling; returns it."""
    if b.has(m + "experts.gate_up_proj"):
        gate_up, down, router, found = m + "experts.gate_up_proj", m + "experts.down_proj", m + "router.weight", IN_MEMORY
    else:
        gate_up, down, router, found = m + "input_linear.weight", m + "output_linear.weight", m + "router.layer.weight", HUB
    b.bind(router, Role.MoeRouterWeight, i)
    b.bind(gate_up, Role.PerExpertGate, i, [Transform("slice", dim=1, start=0, stop=inter)])
    b.bind(gate_up, Role.PerExpertUp, i, [Transform("slice", dim=1, start=inter, stop=2 * inter)])
    b.bind(down, Role.PerExpertDown, i)
    return found


def _bind_mamba2(b: Builder, p: str, i: int) -> None:
    for name, role in (("in_proj.weight", Role.Mamba2InProj), ("in_proj.bias", Role.Mamba2InProjBias),
                       ("conv1d.bias", Role.Mamba2Conv1dBias), ("norm.weight", Role.Mamba2GatedNorm),
                       ("out_proj.weight", Role.Mamba2OutProj), ("out_proj.bias", Role.Mamba2OutProjBias),
                       ("A_log", Role.Mamba2ALog), ("D", Role.Mamba2D), ("dt_bias", Role.Mamba2DtBias)):
        b.bind(p + name, role, i)
    conv = b.shape(p + "conv1d.weight")
    if conv is not None and len(conv) == 3 and conv[1] == 1:
        b.bind_reshaped(p + "conv1d.weight", Role.Mamba2Conv1d, i, (conv[0], conv[2]))
    else:
        b.bind(p + "conv1d.weight", Role.Mamba2Conv1d, i)
