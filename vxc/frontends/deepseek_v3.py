"""transformers ``deepseek_v3``: MLA (direct q or the q-LoRA triple) on every layer, dense SwiGLU
FFNs on the first ``first_k_dense_replace`` layers, then MoE (sigmoid scores, expert choice on
score + ``e_score_correction_bias`` with grouped top-k, unbiased weights renormalised ×
``routed_scaling_factor``, shared experts).

Dialects: hub configs spell the rotary ``rope_theta`` + ``rope_scaling`` (``type``), transformers 5
writes ``rope_parameters`` (``rope_type``); both are read and the spelling is recorded. Per-expert
tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` on disk are bound as expert banks.

Reference conventions the config does not state, recorded as defaults: the q_a / kv_a RMSNorms use
eps 1e-6 (the norm class default, not ``rms_norm_eps``); ``rope_interleave`` defaults to true, and
then the reference rotates adjacent pairs and writes the rotated evens, then the rotated odds
(``rotary_layout=interleaved rotary_output=split``); YaRN's beta_fast/beta_slow default to 32/1,
truncation to true, original_max_position to max_position_embeddings, its cos/sin attention factor
to mscale(factor, mscale)/mscale(factor, mscale_all_dim) (mscale(factor) without both), and the
softmax scale is (nope+rope)^−½ · mscale(factor, mscale_all_dim)².

The helpers here (MLA attributes and bindings, the grouped sigmoid MoE, the Llama-shaped norms) are
shared with the ``kimi_linear`` frontend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..ir.module import Layer, Module, Op
from ..ir.roles import Placement, Role
from .common import Builder, FrontendError, compute_dtype, op
from .registry import by_model_type

MLA_NORM_EPS = 1e-6  # the reference's RMSNorm default, used for q_a_layernorm / kv_a_layernorm


def need(cfg: dict, where: str, *keys: str) -> Any:
    """The first of ``keys`` the config sets (aliases of one fact); refuses when none is set."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise FrontendError(f"{where}: config.json lacks required key {' / '.join(repr(k) for k in keys)}")


def get(cfg: dict, default: Any, *keys: str) -> tuple[Any, bool]:
    """(value, filled_by_default) for the first of ``keys`` the config sets."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k], False
    return default, True


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_rotary(cfg: dict, where: str, rope_dim: int) -> tuple[dict, set[str], str]:
    """Rotary attributes of a rotating MLA (+ the softmax scale), from either spelling."""
    if isinstance(cfg.get("rope_parameters"), dict):
        rp, read = dict(cfg["rope_parameters"]), "rope_parameters"
    else:
        rp, read = dict(cfg.get("rope_scaling") or {}), "rope_theta/rope_scaling"
        if cfg.get("rope_theta") is not None:
            rp["rope_theta"] = cfg["rope_theta"]
    a: dict[str, Any] = {}
    d: set[str] = set()
    if rp.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise FrontendError(f"{where}: partial_rotary_factor {rp['partial_rotary_factor']} is not supported for MLA")
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype is None:
        rtype = "default"
        d.add("rope_type")
    if rtype not in ("default", "linear", "llama3", "yarn"):
        raise FrontendError(f"{where}: rope_type {rtype!r} is not supported for MLA")
    a["rotary_dim"] = rope_dim
    d.add("rotary_dim")  # the reference rotates the whole rope part (head_dim := qk_rope_head_dim)
    a["rotary_base"], filled = float(rp.get("rope_theta") or 10000.0), rp.get("rope_theta") is None
    if filled:
        d.add("rotary_base")
    interleave, filled = get(cfg, True, "rope_interleave")
    a["rotary_layout"] = "interleaved" if interleave else "half"
    a["rope_type"] = rtype
    a["rotary_output"] = "split" if interleave else "in_place"
    if filled:
        d |= {"rotary_layout", "rotary_output"}
    else:
        d.add("rotary_output")  # the reference's choice of where the rotated pairs go
    maxpos = cfg.get("max_position_embeddings")
    if rtype in ("linear", "llama3", "yarn"):
        factor = rp.get("factor")
        if factor is None and rtype == "yarn" and rp.get("original_max_position_embeddings") and maxpos:
            factor = maxpos / rp["original_max_position_embeddings"]
            d.add("rope_factor")
        if factor is None:
            raise FrontendError(f"{where}: rope_type {rtype} without a factor")
        a["rope_factor"] = float(factor)
    if rtype == "llama3":
        a["rope_low_freq_factor"] = float(rp["low_freq_factor"])
        a["rope_high_freq_factor"] = float(rp["high_freq_factor"])
        a["rope_original_max_position"] = int(rp["original_max_position_embeddings"])
    scale = (cfg["qk_nope_head_dim"] + rope_dim) ** -0.5
    if rtype == "yarn":
        f = a["rope_factor"]
        old = rp.get("original_max_position_embeddings")
        if old is None:
            if maxpos is None:
                raise FrontendError(f"{where}: yarn without original_max_position_embeddings or max_position_embeddings")
            old = maxpos
            d.add("rope_original_max_position")
        a["rope_original_max_position"] = int(old)
        for key, name, default in (("beta_fast", "rope_beta_fast", 32.0), ("beta_slow", "rope_beta_slow", 1.0)):
            a[name] = float(rp.get(key) or default)
            if not rp.get(key):
                d.add(name)
        a["rope_truncate"] = bool(rp.get("truncate", True))
        if "truncate" not in rp:
            d.add("rope_truncate")
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if m is not None:
            a["rope_mscale"] = float(m)
        if m_all is not None:
            a["rope_mscale_all_dim"] = float(m_all)
        if rp.get("attention_factor") is not None:
            a["rope_attention_factor"] = float(rp["attention_factor"])
        else:
            a["rope_attention_factor"] = float(_yarn_mscale(f, m) / _yarn_mscale(f, m_all)) if (m and m_all) else float(_yarn_mscale(f))
            d.add("rope_attention_factor")
        if m_all:
            scale *= _yarn_mscale(f, m_all) ** 2
    if rtype != "yarn" and rp.get("mscale_all_dim"):
        # the reference folds mscale_all_dim into the softmax scale for every non-default rope type
        a["rope_mscale_all_dim"] = float(rp["mscale_all_dim"])
        scale *= _yarn_mscale(a["rope_factor"], rp["mscale_all_dim"]) ** 2
    a["scale"] = scale
    d.add("scale")
    return a, d, read


NOPE_ROTARY = {"rotary_dim": 0, "rotary_base": 10000.0, "rotary_layout": "none", "rope_type": "default", "rotary_output": "in_place"}


def mla_op(cfg: dict, where: str, rotary: dict, rotary_defaults: set[str]) -> Op:
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads")
    if kvh is not None and kvh != heads:
        raise FrontendError(f"{where}: num_key_value_heads {kvh} != num_attention_heads {heads}: kv_b_proj expands one latent "
                            f"into every head, grouped MLA heads are not supported")
    if cfg.get("attention_bias"):
        raise FrontendError(f"{where}: attention_bias=true (biases on q_a/kv_a/o projections) is not supported")
    q_rank = cfg.get("q_lora_rank")
    attrs = {"d_model": d, "heads": heads, "q_lora": q_rank is not None, "q_lora_rank": int(q_rank or 0),
             "kv_lora_rank": need(cfg, where, "kv_lora_rank"), "qk_nope_head_dim": need(cfg, where, "qk_nope_head_dim"),
             "qk_rope_head_dim": need(cfg, where, "qk_rope_head_dim"), "v_head_dim": need(cfg, where, "v_head_dim"),
             "norm_eps": MLA_NORM_EPS}
    defaults = {"norm_eps"}
    if "scale" not in rotary:
        attrs["scale"] = (attrs["qk_nope_head_dim"] + attrs["qk_rope_head_dim"]) ** -0.5
        defaults.add("scale")
    attrs.update(rotary)
    return op("mla", attrs, defaults | rotary_defaults)


def bind_mla(b: Builder, p: str, i: int) -> None:
    """``p`` = ``model.layers.{i}.self_attn.``"""
    for name, role in (("q_proj.weight", Role.MlaQProj), ("q_a_proj.weight", Role.MlaQAProj), ("q_a_layernorm.weight", Role.MlaQANorm),
                       ("q_b_proj.weight", Role.MlaQBProj), ("kv_a_proj_with_mqa.weight", Role.MlaKvAProj),
                       ("kv_a_layernorm.weight", Role.MlaKvANorm), ("kv_b_proj.weight", Role.MlaKvBProj), ("o_proj.weight", Role.MlaOutProj)):
        b.bind(p + name, role, i)


def moe_op(cfg: dict, where: str, *, experts: int, top_k: int, shared: int, renorm: tuple[bool, bool], groups: tuple[int, bool],
           topk_group: tuple[int, bool], router_declared: bool = False) -> Op:
    """The grouped sigmoid router with a selection-only bias and shared experts."""
    inter = need(cfg, where, "moe_intermediate_size")
    scaling, sd = get(cfg, 1.0, "routed_scaling_factor")
    attrs = {"d_model": cfg["hidden_size"], "experts": int(experts), "top_k": int(top_k), "intermediate": int(inter),
             "router": "sigmoid_grouped", "norm_topk_prob": bool(renorm[0]), "routed_scaling": float(scaling),
             "n_group": int(groups[0]), "topk_group": int(topk_group[0]), "router_bias": False, "selection_bias": True,
             "expert_layout": "separate", "expert_bias": False, "act": "silu", "shared_experts": shared > 0,
             "shared_intermediate": int(inter * shared), "shared_gate": False}
    defaults = {"router_bias", "selection_bias", "expert_layout", "expert_bias", "shared_gate"} | (set() if router_declared else {"router"})
    defaults |= {n for n, filled in (("norm_topk_prob", renorm[1]), ("routed_scaling", sd), ("n_group", groups[1]),
                                      ("topk_group", topk_group[1])) if filled}
    if "hidden_act" not in cfg:
        defaults.add("act")
    return op("moe", attrs, defaults)


def bind_moe(b: Builder, p: str, i: int, experts: int, expert_names: tuple[str, str, str]) -> None:
    """``p`` = the MoE module prefix (``...mlp.`` / ``...block_sparse_moe.``); expert_names = gate, up, down."""
    b.bind(p + "gate.weight", Role.MoeRouterWeight, i)
    b.bind(p + "gate.e_score_correction_bias", Role.MoeRouterSelectionBias, i)
    for name, role in zip(expert_names, (Role.PerExpertGate, Role.PerExpertUp, Role.PerExpertDown)):
        b.bind_bank(p + "experts.{e}." + name + ".weight", experts, role, i)
    for name, role in (("gate_proj", Role.SharedExpertGate), ("up_proj", Role.SharedExpertUp), ("down_proj", Role.SharedExpertDown)):
        b.bind(p + f"shared_experts.{name}.weight", role, i)


def bind_dense(b: Builder, p: str, i: int) -> None:
    for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
        b.bind(p + f"{name}.weight", role, i)


def dense_op(cfg: dict, where: str) -> Op:
    return op("swiglu", {"d_model": cfg["hidden_size"], "intermediate": need(cfg, where, "intermediate_size"), "act": "silu"},
              {"act"} if "hidden_act" not in cfg else set())


def check_act(cfg: dict, where: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise FrontendError(f"{where}: hidden_act={act!r} is not supported (silu only)")


def norm_eps(cfg: dict, default: float) -> tuple[float, bool]:
    eps, filled = get(cfg, default, "rms_norm_eps")
    return float(eps), filled


def layer(b: Builder, cfg: dict, i: int, eps: tuple[float, bool], mixer: Op, ffn: Op) -> Layer:
    p = f"model.layers.{i}."
    b.bind(p + "input_layernorm.weight", Role.PreAttentionNorm, i)
    b.bind(p + "post_attention_layernorm.weight", Role.PreFfnNorm, i)  # the pre-FFN norm of a two-norm layer
    norms = [op("rmsnorm", {"dim": cfg["hidden_size"], "eps": eps[0], "zero_centred": False},
                ({"eps"} if eps[1] else set()) | {"zero_centred"}, role=r) for r in (Role.PreAttentionNorm, Role.PreFfnNorm)]
    return Layer(i, "compute", Placement.PreOnly, norms, mixer, ffn)


def finish(b: Builder, cfg: dict, model_dir: Path, eps: tuple[float, bool], layers: list[Layer]) -> Module:
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    tied, tied_default = get(cfg, False, "tie_word_embeddings")
    b.bind("model.embed_tokens.weight", Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    final = op("rmsnorm", {"dim": d, "eps": eps[0], "zero_centred": False}, ({"eps"} if eps[1] else set()) | {"zero_centred"},
               role=Role.FinalNorm)
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d}, {"tied"} if tied_default else set())
    return b.module(model_dir.resolve().name, compute_dtype(cfg, b, "model.embed_tokens.weight"), emb, layers, final, head)


@by_model_type("deepseek_v3")
def lower_deepseek_v3(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    where = f"{model_dir}/config.json (deepseek_v3)"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        need(cfg, where, k)
    check_act(cfg, where)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise FrontendError(f"{where}: scoring_func={cfg['scoring_func']!r} is not supported (sigmoid only)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise FrontendError(f"{where}: topk_method={cfg['topk_method']!r} is not supported (noaux_tc only)")
    n = cfg["num_hidden_layers"]
    rotary, rotary_defaults, read = mla_rotary(cfg, where, need(cfg, where, "qk_rope_head_dim"))
    b = Builder(model_dir, "transformers", "deepseek_v3/" + ("transformers-5" if read == "rope_parameters" else "hub"), sha, relative_to)
    b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    eps = norm_eps(cfg, 1e-6)
    dense_k, dense_filled = get(cfg, 3, "first_k_dense_replace")
    b.fact("dense_layers", int(min(dense_k, n)), "first_k_dense_replace" + (" (absent: the reference's default 3)" if dense_filled else ""))
    experts = need(cfg, where, "n_routed_experts", "num_local_experts") if dense_k < n else 0
    layers = []
    for i in range(n):
        p = f"model.layers.{i}."
        mixer = mla_op(cfg, where, rotary, rotary_defaults)
        bind_mla(b, p + "self_attn.", i)
        if i < dense_k:
            ffn = dense_op(cfg, where)
            bind_dense(b, p + "mlp.", i)
        else:
            ffn = moe_op(cfg, where, experts=experts, top_k=need(cfg, where, "num_experts_per_tok"),
                         shared=get(cfg, 1, "n_shared_experts")[0], renorm=get(cfg, True, "norm_topk_prob"),
                         groups=get(cfg, 8, "n_group"), topk_group=get(cfg, 4, "topk_group"),
                         router_declared=cfg.get("scoring_func") == "sigmoid" and cfg.get("topk_method") == "noaux_tc")
            bind_moe(b, p + "mlp.", i, experts, ("gate_proj", "up_proj", "down_proj"))
        layers.append(layer(b, cfg, i, eps, mixer, ffn))
    return finish(b, cfg, model_dir, eps, layers)
