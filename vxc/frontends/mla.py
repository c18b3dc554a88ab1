"""Multi-head latent attention (MLA) as transformers' ``deepseek_v3`` and ``kimi_linear`` spell it:
the rotary attributes (either config spelling), the ``mla`` operator and its tensor bindings.

Reference conventions the config does not state, recorded as defaults: the q_a / kv_a RMSNorms use
eps 1e-6 (the norm class default, not ``rms_norm_eps``); ``rope_interleave`` defaults to true, and
then the reference rotates adjacent pairs and writes the rotated evens, then the rotated odds
(``rotary_layout=interleaved rotary_output=split``); YaRN's beta_fast/beta_slow default to 32/1,
truncation to true, original_max_position to max_position_embeddings, its cos/sin attention factor
to mscale(factor, mscale)/mscale(factor, mscale_all_dim) (mscale(factor) without both), and the
softmax scale is (nope+rope)^−½ · mscale(factor, mscale_all_dim)².
"""

from __future__ import annotations

import math
from typing import Any

from ..ir.module import Op
from ..ir.roles import Role
from .common import Attrs, Builder, ConfigError, FrontendError, op

MLA_NORM_EPS = 1e-6  # the reference's RMSNorm default, used for q_a_layernorm / kv_a_layernorm
NOPE_ROTARY = {"rotary_dim": 0, "rotary_base": 10000.0, "rotary_layout": "none", "rope_type": "default", "rotary_output": "in_place"}


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_rotary(A: Attrs, rope_dim: int) -> tuple[dict, set[str], str]:
    """Rotary attributes of a rotating MLA (+ the softmax scale), from either spelling."""
    if isinstance(A.raw("rope_parameters"), dict):
        rp, read = dict(A.raw("rope_parameters")), "rope_parameters"
    else:
        rp, read = dict(A.opt("rope_scaling", kind=dict) or {}), "rope_theta/rope_scaling"
        if A.raw("rope_theta") is not None:
            rp["rope_theta"] = A.raw("rope_theta")
    R = Attrs(rp, A.where, prefix="rope_parameters." if read == "rope_parameters" else "rope_scaling.")
    a: dict[str, Any] = {}
    d: set[str] = set()
    if R.raw("partial_rotary_factor") not in (None, 1, 1.0):
        raise FrontendError(f"{A.where}: partial_rotary_factor {rp['partial_rotary_factor']} is not supported for MLA")
    rtype = R.opt("rope_type" if "rope_type" in R else "type", kind=str)  # an explicit null rope_type is the default
    if rtype is None:
        rtype = "default"
        d.add("rope_type")
    if rtype not in ("default", "linear", "llama3", "yarn"):
        raise FrontendError(f"{A.where}: rope_type {rtype!r} is not supported for MLA")
    a["rotary_dim"] = rope_dim
    d.add("rotary_dim")  # the reference rotates the whole rope part (head_dim := qk_rope_head_dim)
    theta = R.opt("rope_theta", kind=float)
    a["rotary_base"] = float(theta or 10000.0)
    if theta is None:
        d.add("rotary_base")
    interleave, filled = A.get("rope_interleave", default=True, kind=bool)
    a["rotary_layout"] = "interleaved" if interleave else "half"
    a["rope_type"] = rtype
    a["rotary_output"] = "split" if interleave else "in_place"
    if filled:
        d |= {"rotary_layout", "rotary_output"}
    else:
        d.add("rotary_output")  # the reference's choice of where the rotated pairs go
    maxpos = A.opt("max_position_embeddings", kind=int)
    old = R.opt("original_max_position_embeddings", kind=int)
    if rtype in ("linear", "llama3", "yarn"):
        factor = R.opt("factor", kind=float)
        if factor is None and rtype == "yarn" and old and maxpos:
            factor = maxpos / old
            d.add("rope_factor")
        if factor is None:
            raise FrontendError(f"{A.where}: rope_type {rtype} without a factor")
        a["rope_factor"] = float(factor)
    if rtype == "llama3":
        a["rope_low_freq_factor"] = R.need("low_freq_factor", kind=float)
        a["rope_high_freq_factor"] = R.need("high_freq_factor", kind=float)
        a["rope_original_max_position"] = R.need("original_max_position_embeddings", kind=int)
    qk_head = A.need("qk_nope_head_dim", kind=int, min=0) + rope_dim
    if qk_head < 1:
        raise ConfigError(f"{A.where}: cannot read this config: qk_nope_head_dim + qk_rope_head_dim = {qk_head}, a query head needs >= 1")
    scale = qk_head ** -0.5
    if rtype == "yarn":
        f = a["rope_factor"]
        if old is None:
            if maxpos is None:
                raise FrontendError(f"{A.where}: yarn without original_max_position_embeddings or max_position_embeddings")
            old = maxpos
            d.add("rope_original_max_position")
        a["rope_original_max_position"] = int(old)
        for key, name, default in (("beta_fast", "rope_beta_fast", 32.0), ("beta_slow", "rope_beta_slow", 1.0)):
            beta = R.opt(key, kind=float)
            a[name] = float(beta or default)
            if not beta:
                d.add(name)
        truncate = R.opt("truncate", kind=bool)
        a["rope_truncate"] = truncate if truncate is not None else "truncate" not in R  # as the reference: null is false
        if "truncate" not in R:
            d.add("rope_truncate")
        m, m_all = R.opt("mscale", kind=float), R.opt("mscale_all_dim", kind=float)
        if m is not None:
            a["rope_mscale"] = float(m)
        if m_all is not None:
            a["rope_mscale_all_dim"] = float(m_all)
        attention_factor = R.opt("attention_factor", kind=float)
        if attention_factor is not None:
            a["rope_attention_factor"] = float(attention_factor)
        else:
            a["rope_attention_factor"] = float(_yarn_mscale(f, m) / _yarn_mscale(f, m_all)) if (m and m_all) else float(_yarn_mscale(f))
            d.add("rope_attention_factor")
        if m_all:
            scale *= _yarn_mscale(f, m_all) ** 2
    m_all = R.opt("mscale_all_dim", kind=float)
    if rtype == "default" and m_all:
        raise FrontendError(f"{A.where}: mscale_all_dim {m_all} with rope_type default (no rope factor) is not supported")
    if rtype != "yarn" and m_all:
        # the reference folds mscale_all_dim into the softmax scale for every non-default rope type
        a["rope_mscale_all_dim"] = float(m_all)
        scale *= _yarn_mscale(a["rope_factor"], m_all) ** 2
    a["scale"] = scale
    d.add("scale")
    return a, d, read


def mla_op(A: Attrs, rotary: dict, rotary_defaults: set[str]) -> Op:
    d, heads = A.need("hidden_size", kind=int), A.need("num_attention_heads", kind=int, min=1)
    kvh = A.opt("num_key_value_heads", kind=int)
    if kvh is not None and kvh != heads:
        raise FrontendError(f"{A.where}: num_key_value_heads {kvh} != num_attention_heads {heads}: kv_b_proj expands one latent "
                            f"into every head, grouped MLA heads are not supported")
    if A.raw("attention_bias"):
        raise FrontendError(f"{A.where}: attention_bias=true (biases on q_a/kv_a/o projections) is not supported")
    q_rank = A.opt("q_lora_rank", kind=int)
    attrs = {"d_model": d, "heads": heads, "q_lora": q_rank is not None, "q_lora_rank": int(q_rank or 0),
             "kv_lora_rank": A.need("kv_lora_rank", kind=int), "qk_nope_head_dim": A.need("qk_nope_head_dim", kind=int),
             "qk_rope_head_dim": A.need("qk_rope_head_dim", kind=int), "v_head_dim": A.need("v_head_dim", kind=int),
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
