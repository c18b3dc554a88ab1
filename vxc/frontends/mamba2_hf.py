"""transformers ``mamba2`` (``Mamba2ForCausalLM``): ``backbone.embeddings.weight``,
``backbone.layers.{i}.{norm,mixer.*}``, ``backbone.norm_f.weight``, ``lm_head.weight``.
Defaults are ``Mamba2Config``'s (n_groups=8, tie_word_embeddings=False, …)."""

from __future__ import annotations

from pathlib import Path

from ..ir.module import Module
from .common import Attrs, Builder, FrontendError, compute_dtype
from .mamba_ssm import _layers, _model_ops, _read_mamba2, mamba2_op
from .registry import by_model_type

# transformers 5.24 Mamba2Config defaults
CONFIG_DEFAULTS = {
    "state_size": 128, "conv_kernel": 4, "expand": 2, "n_groups": 8, "use_bias": False, "use_conv_bias": True,
    "chunk_size": 256, "time_step_limit": [0.0, float("inf")], "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
    "tie_word_embeddings": False, "head_dim": 64, "norm_before_gate": False,
}


@by_model_type("mamba2")
def lower_mamba2(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (mamba2)", CONFIG_DEFAULTS)
    d_model, n_layer = A.need("hidden_size", kind=int), A.layers("num_hidden_layers")
    vocab, heads = A.need("vocab_size", kind=int), A.need("num_heads", kind=int)
    b = Builder(model_dir, "transformers", "mamba2", sha, relative_to)
    spell = {"expand": "expand", "headdim": "head_dim", "d_state": "state_size", "ngroups": "n_groups", "d_conv": "conv_kernel",
             "conv_bias": "use_conv_bias", "bias": "use_bias", "chunk_size": "chunk_size", "dt_limit": "time_step_limit",
             "norm_before_gate": "norm_before_gate"}
    g, gfilled = _read_mamba2(A, spell, CONFIG_DEFAULTS)
    g["d_inner"] = None
    d_inner = g["expand"] * d_model
    if heads * g["headdim"] != d_inner:
        raise FrontendError(f"{A.where}: hidden_size*expand={d_inner} but num_heads*head_dim={heads * g['headdim']}")
    eps, eps_default = A.get("layer_norm_epsilon", default=CONFIG_DEFAULTS["layer_norm_epsilon"], kind=float)
    mamba = mamba2_op(d_model, g, gfilled, eps, eps_default)
    residual = "fp32" if A.take("residual_in_fp32", bool) else "compute"
    layers = _layers(b, n_layer, set(), d_model, mamba, None, residual, eps, eps_default)
    emb_key = "backbone.embeddings.weight"
    emb, final, head = _model_ops(b, emb_key, vocab, vocab, d_model, A.take("tie_word_embeddings", bool), eps, eps_default)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, emb_key), emb, layers, final, head)
