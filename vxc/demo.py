"""The built-in miniature witness: a small mamba_ssm checkpoint (native
dialect) with Mamba2 layers and one conv-QKV attention layer, random weights,
and a character-level tokenizer — created locally, never downloaded."""

from __future__ import annotations

import json
import string
from pathlib import Path

DEMO_CONFIG = {
    "d_model": 64,
    "d_intermediate": 0,
    "n_layer": 4,
    "vocab_size": 100,
    "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "d_conv": 4, "expand": 2, "headdim": 16, "ngroups": 1, "chunk_size": 32},
    "attn_layer_idx": [2],
    "attn_cfg": {"causal": True, "d_conv": 4, "head_dim": 16, "num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 8,
                 "qkv_proj_bias": True, "out_proj_bias": False},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 16,
    "tie_embeddings": True,
}


def _tokenizer_json(vocab: list[str]) -> dict:
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": "<unk>"},
    }


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = DEMO_CONFIG
    g = torch.Generator().manual_seed(seed)
    d, s = cfg["d_model"], cfg["ssm_cfg"]
    d_inner = s["expand"] * d
    heads = d_inner // s["headdim"]
    conv_dim = d_inner + 2 * s["ngroups"] * s["d_state"]
    in_rows = 2 * d_inner + 2 * s["ngroups"] * s["d_state"] + heads
    a = cfg["attn_cfg"]
    qkv = (a["num_heads"] + 2 * a["num_heads_kv"]) * a["head_dim"]
    mult = cfg["pad_vocab_size_multiple"]
    padded = (cfg["vocab_size"] + mult - 1) // mult * mult

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t = {"backbone.embedding.weight": rnd(padded, d, scale=1.0), "backbone.norm_f.weight": 1 + rnd(d, scale=0.05)}
    for i in range(cfg["n_layer"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = 1 + rnd(d, scale=0.05)
        m = p + "mixer."
        if i in cfg["attn_layer_idx"]:
            t[m + "in_proj.weight"] = rnd(qkv, d, scale=d ** -0.5)
            t[m + "in_proj.bias"] = rnd(qkv, scale=0.02)
            t[m + "conv1d.weight"] = rnd(qkv, 1, a["d_conv"], scale=0.5)
            t[m + "conv1d.bias"] = rnd(qkv, scale=0.02)
            t[m + "out_proj.weight"] = rnd(d, a["num_heads"] * a["head_dim"], scale=0.5)
        else:
            t[m + "in_proj.weight"] = rnd(in_rows, d, scale=d ** -0.5)
            t[m + "conv1d.weight"] = rnd(conv_dim, 1, s["d_conv"], scale=0.5)
            t[m + "conv1d.bias"] = rnd(conv_dim, scale=0.02)
            t[m + "dt_bias"] = torch.log(torch.expm1(torch.empty(heads).uniform_(1e-3, 1e-1, generator=g)))
            t[m + "A_log"] = torch.log(torch.empty(heads).uniform_(1, 16, generator=g))
            t[m + "D"] = 1 + rnd(heads, scale=0.1)
            t[m + "norm.weight"] = 1 + rnd(d_inner, scale=0.05)
            t[m + "out_proj.weight"] = rnd(d, d_inner, scale=0.5)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"][: cfg["vocab_size"] - 1]
    (out_dir / "tokenizer.json").write_text(json.dumps(_tokenizer_json(["<unk>"] + chars)))
    return out_dir
