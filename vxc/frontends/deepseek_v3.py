"""transformers ``deepseek_v3``: MLA (direct q or the q-LoRA triple) on every layer, dense SwiGLU
FFNs on the first ``first_k_dense_replace`` layers, then MoE (sigmoid scores, expert choice on
score + ``e_score_correction_bias`` with grouped top-k, unbiased weights renormalised ×
``routed_scaling_factor``, shared experts).

Dialects: hub configs spell the rotary ``rope_theta`` + ``rope_scaling`` (``type``), transformers 5
writes ``rope_parameters`` (``rope_type``); both are read and the spelling is recorded. Per-expert
tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` on disk are bound as expert banks.

The MLA attributes and the conventions the reference leaves unstated are in ``mla``; the grouped
sigmoid MoE in ``moe`` (both shared with ``kimi_linear``).
"""

from __future__ import annotations

from pathlib import Path

from ..ir.module import Module
from ..ir.roles import Role
from .common import Attrs, Builder, FrontendError
from .decoder import bind_norms, bind_swiglu, check_silu, finish, rmsnorm, sizes, swiglu_op, two_norm_layer
from .mla import bind_mla, mla_op, mla_rotary
from .moe import bind_grouped_sigmoid_moe, grouped_sigmoid_moe_op
from .registry import by_model_type


@by_model_type("deepseek_v3")
def lower_deepseek_v3(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (deepseek_v3)")
    d, n, _, vocab = sizes(A)
    check_silu(A)
    if "scoring_func" in A and A.raw("scoring_func") != "sigmoid":
        raise FrontendError(f"{A.where}: scoring_func={A.raw('scoring_func')!r} is not supported (sigmoid only)")
    if "topk_method" in A and A.raw("topk_method") != "noaux_tc":
        raise FrontendError(f"{A.where}: topk_method={A.raw('topk_method')!r} is not supported (noaux_tc only)")
    rotary, rotary_defaults, read = mla_rotary(A, A.need("qk_rope_head_dim", kind=int))
    b = Builder(model_dir, "transformers", "deepseek_v3/" + ("transformers-5" if read == "rope_parameters" else "hub"), sha, relative_to)
    b.fact("rope_read_from", read, "config spelling of the rotary parameters")
    eps = A.get("rms_norm_eps", default=1e-6, kind=float)
    dense_k, dense_filled = A.get("first_k_dense_replace", default=3, kind=int)
    b.fact("dense_layers", int(min(dense_k, n)), "first_k_dense_replace" + (" (absent: the reference's default 3)" if dense_filled else ""))
    experts = A.need("n_routed_experts", "num_local_experts", kind=int) if dense_k < n else 0
    layers = []
    for i in range(n):
        p = f"model.layers.{i}."
        mixer = mla_op(A, rotary, rotary_defaults)
        bind_mla(b, p + "self_attn.", i)
        if i < dense_k:
            ffn = swiglu_op(d, A.need("intermediate_size", kind=int), {"act"} if "hidden_act" not in A else set())
            bind_swiglu(b, p + "mlp.", i)
        else:
            ffn = grouped_sigmoid_moe_op(
                A, experts=experts, top_k=A.need("num_experts_per_tok", kind=int),
                shared=A.get("n_shared_experts", default=1, kind=int)[0], renorm=A.get("norm_topk_prob", default=True, kind=bool),
                groups=A.get("n_group", default=8, kind=int), topk_group=A.get("topk_group", default=4, kind=int),
                router_declared=A.raw("scoring_func") == "sigmoid" and A.raw("topk_method") == "noaux_tc")
            bind_grouped_sigmoid_moe(b, p + "mlp.", i, experts, ("gate_proj", "up_proj", "down_proj"))
        bind_norms(b, i)
        layers.append(two_norm_layer(i, d, eps, mixer, ffn))
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps[0], eps[1], Role.FinalNorm))
