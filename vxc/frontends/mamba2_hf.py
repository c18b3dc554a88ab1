"""transformers ``mamba2`` (``Mamba2ForCausalLM``): ``backbone.embeddings.weight``,
``backbone.layers.{i}.{norm,mixer.*}``, ``backbone.norm_f.weight``, ``lm_head.weight``.
Defaults are ``Mamba2Config``'s (n_groups=8, tie_word_embeddings=False, …)."""

from __future__ import annotations

from pathlib import Path

from ..ir.module import Module
from .common import Builder, FrontendError, compute_dtype
from .mamba_ssm import _layers, _model_ops, mamba2_op
from .registry import by_model_type

# transformers 5.24 Mamba2Config defaults
CONFIG_DEFAULTS = {
    "state_size": 128, "conv_kernel": 4, "expand": 2, "n_groups": 8, "use_bias": False, "use_conv_bias": True,
    "chunk_size": 256, "time_step_limit": [0.0, float("inf")], "layer_norm_epsilon": 1e-5, "residual_in_fp32": True,
    "tie_word_embeddings": False, "head_dim": 64, "norm_before_gate": False,
}


@by_model_type("mamba2")
def lower_mamba2(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    where = f"{model_dir}/config.json (mamba2)"
    for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_heads"):
        if k not in cfg:
            raise FrontendError(f"{where}: missing {k!r}")
    b = Builder(model_dir, "transformers", "mamba2", sha, relative_to)
    got, filled = {}, set()
    for k, v in CONFIG_DEFAULTS.items():
        if k in cfg and cfg[k] is not None:
            got[k] = cfg[k]
        else:
            got[k], _ = v, filled.add(k)
    d_model = cfg["hidden_size"]
    d_inner = got["expand"] * d_model
    if cfg["num_heads"] * got["head_dim"] != d_inner:
        raise FrontendError(f"{where}: hidden_size*expand={d_inner} but num_heads*head_dim={cfg['num_heads'] * got['head_dim']}")
    g = {"d_inner": None, "expand": got["expand"], "headdim": got["head_dim"], "d_state": got["state_size"],
         "ngroups": got["n_groups"], "d_conv": got["conv_kernel"], "conv_bias": got["use_conv_bias"], "bias": got["use_bias"],
         "chunk_size": got["chunk_size"], "dt_limit": list(got["time_step_limit"]), "norm_before_gate": got["norm_before_gate"]}
    spell = {"expand": "expand", "headdim": "head_dim", "d_state": "state_size", "ngroups": "n_groups", "d_conv": "conv_kernel",
             "conv_bias": "use_conv_bias", "bias": "use_bias", "chunk_size": "chunk_size", "dt_limit": "time_step_limit",
             "norm_before_gate": "norm_before_gate"}
    gfilled = {k for k, ck in spell.items() if ck in filled}
    eps, eps_default = float(got["layer_norm_epsilon"]), "layer_norm_epsilon" in filled
    mamba = mamba2_op(d_model, g, gfilled, eps, eps_default)
    residual = "fp32" if got["residual_in_fp32"] else "compute"
    layers = _layers(b, cfg["num_hidden_layers"], set(), d_model, mamba, None, residual, eps, eps_default)
    vocab = cfg["vocab_size"]
    emb_key = "backbone.embeddings.weight"
    emb, final, head = _model_ops(b, emb_key, vocab, vocab, d_model, bool(got["tie_word_embeddings"]), eps, eps_default)
    return b.module(model_dir.resolve().name, compute_dtype(cfg, b, emb_key), emb, layers, final, head)
