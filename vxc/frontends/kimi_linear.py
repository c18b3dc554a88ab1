"""transformers ``kimi_linear`` (Kimi-Linear): KDA layers and MLA layers without rotary (NoPE) in one
stack; a dense SwiGLU FFN on the first ``first_k_dense_replace`` layers, MoE after (the grouped
sigmoid router with a selection-only bias and shared experts, as deepseek_v3).

Two dialects, both read, the one read recorded:

- hub checkpoints: ``linear_attn_config`` with **1-based** ``full_attn_layers`` / ``kda_layers`` (and the
  KDA geometry ``head_dim``, ``num_heads``, ``short_conv_kernel_size``), ``first_k_dense_replace``, the
  dense layer-0 FFN spelled ``mlp.{gate,up,down}_proj``;
- transformers 5 ``save_pretrained``: a 0-based ``layer_types`` list, ``linear_head_dim`` /
  ``linear_num_heads`` / ``linear_conv_kernel_dim``, ``mlp_layer_types`` (dense / sparse), the dense FFN
  spelled ``block_sparse_moe.{gate,up,down}_proj``.

Either way the MLA layers are checked against the tensors (a layer holding ``kv_a_proj_with_mqa``) and
the index base is recorded with that evidence. A config declaring no layer map at all is refused
(the reference would invent one).

Reference conventions the config does not state, recorded as defaults: KDA's short convs take
``hidden_act`` (SiLU), q/k l2 eps 1e-6, query scale head_dim^−½, a sigmoid output gate, chunk 64,
the output RMSNorm eps ``rms_norm_eps``; MLA applies no rotary at all and uses eps 1e-6 for its
kv_a RMSNorm.
"""

from __future__ import annotations

from pathlib import Path

from ..ir.module import Module, Op
from ..ir.roles import Role
from .common import Attrs, Builder, FrontendError, op
from .decoder import bind_norms, bind_swiglu, check_silu, finish, rmsnorm, sizes, swiglu_op, two_norm_layer
from .mla import NOPE_ROTARY, bind_mla, mla_op
from .moe import bind_grouped_sigmoid_moe, grouped_sigmoid_moe_op
from .registry import by_model_type


def _layer_map(A: Attrs, n: int) -> tuple[list[str], str]:
    """Per layer ``"mla"`` or ``"kda"``, and which spelling said so."""
    lt = A.raw("layer_types")
    if isinstance(lt, list):
        if len(lt) != n or any(t not in ("full_attention", "linear_attention") for t in lt):
            raise FrontendError(f"{A.where}: layer_types must list {n} entries of full_attention / linear_attention")
        return ["mla" if t == "full_attention" else "kda" for t in lt], "layer_types (0-based)"
    if "linear_attn_config.full_attn_layers" in A and "linear_attn_config.kda_layers" in A:
        full, kda = (A.need("linear_attn_config." + k, kind=list[int]) for k in ("full_attn_layers", "kda_layers"))
        if sorted(full + kda) != list(range(1, n + 1)):
            raise FrontendError(f"{A.where}: linear_attn_config full_attn_layers {full} and kda_layers {kda} must together "
                                f"name layers 1..{n} (1-based) exactly once")
        kinds = ["kda"] * n
        for i in full:
            kinds[i - 1] = "mla"
        return kinds, "linear_attn_config (1-based)"
    raise FrontendError(f"{A.where}: neither layer_types nor linear_attn_config.full_attn_layers/kda_layers is declared; "
                        f"refusing to guess which layers are KDA and which are MLA")


def _kda_geometry(A: Attrs) -> tuple[dict[str, int], set[str]]:
    """KDA's head_dim / heads / conv kernel: the hub's ``linear_attn_config`` keys, else the flat transformers 5 ones."""
    out, defaults = {}, set()
    for name, hub, flat, default in (("head_dim", "head_dim", "linear_head_dim", 128), ("heads", "num_heads", "linear_num_heads", 32),
                                     ("conv_kernel", "short_conv_kernel_size", "linear_conv_kernel_dim", 4)):
        out[name], filled = A.get("linear_attn_config." + hub, flat, default=default, kind=int, min=1)
        if filled:
            defaults.add(name)
    return out, defaults


def _kda_op(A: Attrs, geo: dict[str, int], geo_defaults: set[str], eps: tuple[float, bool]) -> Op:
    D = geo["head_dim"]
    attrs = {"d_model": A.need("hidden_size", kind=int), "heads": geo["heads"], "head_dim": D, "conv_kernel": geo["conv_kernel"],
             "conv_act": "silu", "norm_eps": eps[0], "l2_eps": 1e-6, "scale": D ** -0.5, "out_gate_act": "sigmoid", "chunk_size": 64}
    defaults = set(geo_defaults) | {"l2_eps", "scale", "out_gate_act", "chunk_size"}
    if "hidden_act" not in A:
        defaults.add("conv_act")
    if eps[1]:
        defaults.add("norm_eps")
    return op("kda", attrs, defaults)


def _bind_kda(b: Builder, p: str, i: int, geo: dict[str, int]) -> None:
    """``p`` = ``model.layers.{i}.self_attn.``"""
    C, k = geo["heads"] * geo["head_dim"], geo["conv_kernel"]
    for name, role in (("q_proj", Role.KdaQProj), ("k_proj", Role.KdaKProj), ("v_proj", Role.KdaVProj), ("f_a_proj", Role.KdaFAProj),
                       ("f_b_proj", Role.KdaFBProj), ("b_proj", Role.KdaBProj), ("g_a_proj", Role.KdaGAProj),
                       ("g_b_proj", Role.KdaGBProj), ("o_norm", Role.KdaONorm), ("o_proj", Role.KdaOutProj)):
        b.bind(p + name + ".weight", role, i)
    for name, role in (("q_conv1d", Role.KdaQConv1d), ("k_conv1d", Role.KdaKConv1d), ("v_conv1d", Role.KdaVConv1d)):
        b.bind_reshaped(p + name + ".weight", role, i, (C, k))  # stored [C, 1, k]
    b.bind_reshaped(p + "A_log", Role.KdaALog, i, (geo["heads"],))  # stored [1, 1, H, 1]
    b.bind(p + "dt_bias", Role.KdaDtBias, i)


@by_model_type("kimi_linear")
def lower_kimi_linear(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json (kimi_linear)")
    d, n, _, vocab = sizes(A)
    check_silu(A)
    if "moe_router_activation_func" in A and A.raw("moe_router_activation_func") != "sigmoid":
        raise FrontendError(f"{A.where}: moe_router_activation_func={A.raw('moe_router_activation_func')!r} is not supported "
                            f"(sigmoid only)")
    if A.raw("mla_use_nope") is False:
        raise FrontendError(f"{A.where}: mla_use_nope=false (rotary MLA) is not what the reference implements; not supported")
    kinds, read = _layer_map(A, n)
    hub = read.startswith("linear_attn_config")
    b = Builder(model_dir, "transformers", "kimi_linear/" + ("hub" if hub else "transformers-5"), sha, relative_to)
    b.fact("layer_map_read_from", read, "the config's layer map spelling")
    mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
    evidence = [i for i in range(n) if b.has(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight")]
    if evidence and evidence != mla_layers:
        raise FrontendError(f"{A.where}: the layer map ({read}) puts MLA on layers {mla_layers}, but the checkpoint holds "
                            f"kv_a_proj_with_mqa on layers {evidence}")
    b.fact("mla_layers", mla_layers, f"{read}; kv_a_proj_with_mqa present on exactly these 0-based layers" if evidence
           else f"{read}; no MLA tensor in the checkpoint to confirm it")
    # dense vs MoE FFN per layer
    mlt = A.raw("mlp_layer_types")
    if isinstance(mlt, list):
        if len(mlt) != n or any(t not in ("dense", "sparse") for t in mlt):
            raise FrontendError(f"{A.where}: mlp_layer_types must list {n} entries of dense / sparse")
        dense = [t == "dense" for t in mlt]
        b.fact("ffn_map_read_from", "mlp_layer_types", "the config's dense/sparse list")
    else:
        k, filled = A.get("first_k_dense_replace", default=1, kind=int)
        dense = [i < k for i in range(n)]
        b.fact("ffn_map_read_from", "first_k_dense_replace" + (" (absent: the reference's default 1)" if filled else ""),
               f"dense FFN on layers 0..{k - 1}")
    eps = A.get("rms_norm_eps", default=1e-5, kind=float)
    geo, geo_defaults = _kda_geometry(A)
    nope_defaults = set(NOPE_ROTARY) if "mla_use_nope" not in A else {"rotary_base", "rope_type", "rotary_output"}
    experts = A.need("num_experts", "num_local_experts", kind=int) if not all(dense) else 0
    spellings = set()
    layers = []
    for i in range(n):
        p = f"model.layers.{i}."
        if kinds[i] == "mla":
            mixer = mla_op(A, dict(NOPE_ROTARY), nope_defaults)
            bind_mla(b, p + "self_attn.", i)
        else:
            mixer = _kda_op(A, geo, geo_defaults, eps)
            _bind_kda(b, p + "self_attn.", i, geo)
        if dense[i]:
            ffn = swiglu_op(d, A.need("intermediate_size", kind=int), {"act"} if "hidden_act" not in A else set())
            # hub: mlp.*; transformers 5 save_pretrained: block_sparse_moe.* (its mlp → block_sparse_moe rename)
            spell = "mlp." if b.has(p + "mlp.gate_proj.weight") else "block_sparse_moe."
            spellings.add(spell)
            bind_swiglu(b, p + spell, i)
        else:
            ffn = grouped_sigmoid_moe_op(
                A, experts=experts, top_k=A.need("num_experts_per_token", "num_experts_per_tok", kind=int),
                shared=A.get("num_shared_experts", "n_shared_experts", default=1, kind=int)[0],
                renorm=A.get("moe_renormalize", "norm_topk_prob", default=True, kind=bool),
                groups=A.get("num_expert_group", "n_group", default=1, kind=int), topk_group=A.get("topk_group", default=1, kind=int),
                router_declared=A.raw("moe_router_activation_func") == "sigmoid" and A.raw("use_grouped_topk") is True)
            bind_grouped_sigmoid_moe(b, p + "block_sparse_moe.", i, experts, ("w1", "w3", "w2"))
        bind_norms(b, i)
        layers.append(two_norm_layer(i, d, eps, mixer, ffn))
    if spellings:
        b.fact("dense_ffn_spelling", " ".join(sorted(s + "{gate,up,down}_proj" for s in spellings)), "tensor names of the dense FFN layers")
    return finish(b, A, model_dir, d, vocab, layers, rmsnorm(d, eps[0], eps[1], Role.FinalNorm))
