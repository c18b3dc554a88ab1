"""Kimi-Linear as a GGUF file, spelled as llama.cpp's ``convert_hf_to_gguf.py`` (class KimiLinearModel) writes it:
the miniature checkpoint in the hub's dialect (what the converter reads), the writer, and the reference on the
file's weights.

The converter (conversion/kimi_linear.py) on a hub-dialect checkpoint: ``num_key_value_heads`` set to 1 before the
common keys (so ``attention.head_count_kv`` is 1, then the per-layer array: 0 on KDA layers, 1 on MLA layers); the
q / k / v short convs reshaped to ``(1, C, 1, kernel)`` and kept F32; ``A_log -> -exp(A_log)`` as ``ssm_a``;
``dt_bias`` renamed ``ssm_dt.bias``; the per-expert ``w1 / w2 / w3`` stacked into ``ffn_{gate,down,up}_exps``;
``kv_b_proj`` viewed ``[H, N + V, R]``, split into ``k_b [H, N, R]`` (transposed to ``[H, R, N]``: ``attn_k_b``) and
``v_b [H, V, R]`` (``attn_v_b``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.gguf_support import _gguf_arrays, _gpt2_vocab, converter_qtype

# Every quantisable row whole 32-blocks: hidden 64, KDA 2 heads x 32, MLA 2 heads (kv_lora 32, nope 32, rope 16,
# v 32: k_b / v_b rows of 32), experts of 32, dense 96. Layers KDA, MLA, KDA, KDA, MLA (1-based full [2, 5]).
MINI_KIMI_HUB = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 301, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2,
    "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "mla_use_nope": True, "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "linear_attn_config": {"full_attn_layers": [2, 5], "kda_layers": [1, 3, 4], "head_dim": 32, "num_heads": 2,
                           "short_conv_kernel_size": 4},
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "model_max_length": 4096, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
MINI_KIMI_TOKENS = 290
# the same model as transformers 5's flat config spells it (the miniature is built from this, then saved as the hub
# writes it)
_FLAT = {k: v for k, v in MINI_KIMI_HUB.items() if k not in ("linear_attn_config", "first_k_dense_replace",
                                                            "architectures", "model_type")}
_FLAT.update(linear_head_dim=32, linear_num_heads=2, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
_DENSE_T5 = ("block_sparse_moe.gate_proj", "block_sparse_moe.up_proj", "block_sparse_moe.down_proj")


def write_kimi_hf_dir(out_dir: Path, seed: int = 0, tokens: int = MINI_KIMI_TOKENS) -> Path:
    """A random Kimi-Linear checkpoint in the hub's dialect in ``out_dir``: ``linear_attn_config`` (1-based layer
    lists), ``first_k_dense_replace``, the dense FFN spelled ``mlp.*`` (transformers 5's save_pretrained writes
    ``block_sparse_moe.*``), norms off 1, spread decay rates and a nonzero selection bias (as
    tests/families/latent_support builds them), with a trained byte-level BPE tokenizer."""
    from safetensors.torch import load_file, save_file

    from tests.builders import HF_INITIALIZER_RANGE, hf_config
    from tests.gguf_convert import write_bpe_tokenizer
    from tests.hf_random import random_hf_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = random_hf_model(hf_config("kimi_linear", {"initializer_range": HF_INITIALIZER_RANGE, **_FLAT}), seed,
                            norm_std=0.2, dt_bias="set")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for f in out_dir.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({_hub_name(k): v for k, v in t.items()}, str(f), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**MINI_KIMI_HUB, "torch_dtype": "float32"}, indent=2))
    write_bpe_tokenizer(out_dir, tokens)
    return out_dir


def _hub_name(k: str) -> str:
    for t5 in _DENSE_T5:
        k = k.replace(t5, "mlp." + t5.split(".")[1])
    return k


def load_reference(hf_dir: Path, dtype=torch.float32):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    m.set_experts_implementation("eager")  # the grouped matmul refuses fp64
    return m


_NAMES = {  # hub name under model.layers.{i}. -> GGUF name under blk.{i}. (kv_b, conv, experts apart)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight", "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight", "self_attn.g_a_proj.weight": "ssm_g_a.weight",
    "self_attn.g_b_proj.weight": "ssm_g_b.weight", "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.A_log": "ssm_a", "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_EXPERTS = (("w1", "ffn_gate_exps.weight"), ("w2", "ffn_down_exps.weight"), ("w3", "ffn_up_exps.weight"))


def _checkpoint(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def kimi_gguf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array as KimiLinearModel.modify_tensors makes them from the hub checkpoint in ``hf_dir``."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    H, N, V = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    E = cfg["num_experts"]
    ckpt = _checkpoint(hf_dir)
    out: dict[str, np.ndarray] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, t in ckpt.items():
        t = t.detach().to(torch.float32)
        if name in _TOP:
            out[_TOP[name]] = t.numpy()
            continue
        parts = name.split(".")
        i, rest = parts[2], ".".join(parts[3:])
        pre = f"blk.{i}."
        if ".experts." in rest and "shared" not in rest:
            experts[name] = t
            continue
        if rest.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
            x = rest.split(".")[1][0]
            C, k = t.shape[0], t.shape[-1]
            out[pre + f"ssm_conv1d_{x}.weight"] = t.reshape(1, C, 1, k).numpy()
            continue
        if rest == "self_attn.kv_b_proj.weight":
            kv_b = t.view(H, N + V, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [N, V], dim=1)
            out[pre + "attn_k_b.weight"] = k_b.transpose(1, 2).contiguous().numpy()
            out[pre + "attn_v_b.weight"] = v_b.contiguous().numpy()
            continue
        if rest == "self_attn.A_log":
            t = -torch.exp(t)
        out[pre + _NAMES[rest]] = t.numpy()
    for i in sorted({n.split(".")[2] for n in experts}, key=int):
        for wid, gname in _EXPERTS:
            out[f"blk.{i}.{gname}"] = torch.stack(
                [experts[f"model.layers.{i}.block_sparse_moe.experts.{x}.{wid}.weight"] for x in range(E)]).numpy()
    return out


_F32_ALWAYS = ("ffn_gate_inp.weight",)  # FFN_GATE_INP: F32 (the conv: SSM_CONV1D_{Q,K,V}, 4-D here, handled below)


def write_kimi_gguf(path: Path, hf_dir: Path, outtype: str = "f32", *, override: dict[str, str] | None = None,
                    name: str = "Hf", drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                    legacy: bool = False) -> Path:
    """The hub checkpoint in ``hf_dir`` as ``convert_hf_to_gguf.py DIR --outtype OUTTYPE`` writes it (``override``:
    see converter_qtype; ``legacy``: ``attn_kv_b`` unsplit, as converters before the MLA KV-cache split wrote it).
    ``drop`` / ``extra``: for refusal tests."""
    import gguf

    hf_dir, path = Path(hf_dir), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    la = cfg["linear_attn_config"]
    n = cfg["num_hidden_layers"]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    w = gguf.GGUFWriter(str(path), "kimi-linear")
    w.add_type("model")
    w.add_name(name)
    # TextModel.set_gguf_parameters, with num_key_value_heads already set to 1
    w.add_block_count(n)
    w.add_context_length(cfg["model_max_length"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_token"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    # the converter reads hparams through transformers' config, whose head_dim is qk_rope_head_dim: the common keys
    # write it as key and value length (the key length is overwritten below)
    w.add_key_length(cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["qk_rope_head_dim"])
    w.add_file_type(ftype)
    # KimiLinearModel.set_gguf_parameters
    w.add_vocab_size(cfg["vocab_size"])
    w.add_head_count_kv([1 if i + 1 in la["full_attn_layers"] else 0 for i in range(n)])
    w.add_ssm_conv_kernel(la["short_conv_kernel_size"])
    w.add_kda_head_dim(la["head_dim"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["num_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = _gpt2_vocab(hf_dir, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    for key, fn in (("eos", w.add_eos_token_id), ("bos", w.add_bos_token_id), ("pad", w.add_pad_token_id)):
        named = tc.get(f"{key}_token")
        v = tokens.index(named) if isinstance(named, str) and named in tokens else cfg.get(f"{key}_token_id")
        if v is not None:
            fn(int(v))
    tensors = kimi_gguf_tensors(hf_dir)
    if legacy:  # the unsplit kv_b of older converters
        H, N, V = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        for i in range(n):
            kb = tensors.pop(f"blk.{i}.attn_k_b.weight", None)
            if kb is None:
                continue
            vb = tensors.pop(f"blk.{i}.attn_v_b.weight")
            tensors[f"blk.{i}.attn_kv_b.weight"] = np.concatenate(
                [np.swapaxes(kb, 1, 2), vb], axis=1).reshape(H * (N + V), -1)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update(extra or {})
    T = gguf.GGMLQuantizationType
    for gname, arr in tensors.items():
        if gname.endswith(_F32_ALWAYS) or "ssm_conv1d_" in gname:
            qt = T.F32
        else:
            qt = converter_qtype(gname, arr.shape, outtype, override)
        w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_on_gguf_weights(hf_dir: Path, gguf_path: Path, out_dir: Path, dtype=torch.float32):
    """transformers' KimiLinearForCausalLM on the file's weights: every tensor decoded by gguf.quants.dequantize,
    the converter's transforms undone (k_b / v_b joined back into kv_b_proj, the banks unstacked, -exp(A_log) read
    back), written as a checkpoint beside the hub config and loaded. Checked on the way: every checkpoint tensor
    comes from the file, and every F32 one equals the checkpoint's (through the converter's transform). Returns
    (model, {ggml type: count})."""
    import shutil

    from safetensors.torch import save_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    H, N, V, E = cfg["num_key_value_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["num_experts"]
    orig = _checkpoint(hf_dir)
    arrays = {k: (tn, torch.from_numpy(a.copy())) for k, (tn, a) in _gguf_arrays(gguf_path).items()}
    types: dict[str, int] = {}
    for tn, _ in arrays.values():
        types[tn] = types.get(tn, 0) + 1
    inv_top = {v: k for k, v in _TOP.items()}
    inv = {v: k for k, v in _NAMES.items()}
    new: dict[str, torch.Tensor] = {}

    def put(hname: str, t: torch.Tensor, exact: bool) -> None:
        t = t.reshape(orig[hname].shape).contiguous()
        if exact:
            assert torch.equal(t, orig[hname].float()), f"{hname}: the file's F32 tensor differs from the checkpoint"
        new[hname] = t

    for gname, (tn, t) in arrays.items():
        if gname in inv_top:
            put(inv_top[gname], t, tn == "F32")
            continue
        _, i, rest = gname.split(".", 2)
        pre = f"model.layers.{i}."
        if rest.startswith("ssm_conv1d_"):
            put(pre + f"self_attn.{rest[11]}_conv1d.weight", t, True)
        elif rest == "attn_k_b.weight":
            vtn, vb = arrays[f"blk.{i}.attn_v_b.weight"]
            kv_b = torch.cat([t.transpose(1, 2), vb], dim=1).reshape(H * (N + V), -1)
            put(pre + "self_attn.kv_b_proj.weight", kv_b, tn == vtn == "F32")
        elif rest == "attn_v_b.weight":
            continue
        elif rest == "attn_kv_b.weight":
            put(pre + "self_attn.kv_b_proj.weight", t, tn == "F32")
        elif rest in dict((g, w) for w, g in _EXPERTS):
            wid = dict((g, w) for w, g in _EXPERTS)[rest]
            for x in range(E):
                put(f"{pre}block_sparse_moe.experts.{x}.{wid}.weight", t[x], tn == "F32")
        elif rest == "ssm_a":
            want = -torch.exp(orig[pre + "self_attn.A_log"].float())
            assert tn == "F32" and torch.equal(t.reshape(want.shape), want), f"{gname}: not -exp(A_log)"
            new[pre + "self_attn.A_log"] = orig[pre + "self_attn.A_log"].float()
        else:
            put(pre + inv[rest], t, tn == "F32")
    missing = sorted(set(orig) - set(new))
    assert not missing, f"checkpoint tensors the file does not hold: {missing}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(hf_dir) / f).exists():
            shutil.copy(Path(hf_dir) / f, out_dir / f)
    save_file(new, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return load_reference(out_dir, dtype), types

