"""Test fixtures: miniature and header-only model directories.

Everything here is written from public facts (shared/design/OPERATORS.md for the
mamba_ssm dialects, transformers itself for the transformers families) and never
from the vxc package, so a vxc bug cannot be copied into the fixtures that judge
it.  Nothing in this module imports vxc.

Contract used by other tests:

- ``write_safetensors(path, tensors)``, ``write_header_only(path, specs)``
- ``native_mamba_specs(cfg)``, ``oute_specs(cfg, index_base=0)``
- ``build_native_mamba(dir, cfg, ...)``, ``build_oute(dir, cfg, index_base=...)``
- ``build_hf(dir, model_type, overrides, ...)``, ``hf_header_only(dir, model_type_or_cfg)``
- ``witness_header_only(name, out_dir)``
- the miniature geometries ``MINI_NATIVE_MAMBA2``, ``MINI_NATIVE_MAMBA2ATTN``,
  ``MINI_OUTE``, ``MINI_HF``.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

WITNESS_DIR = Path("/work/shared/witnesses")

# safetensors dtype string -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}


# ---------------------------------------------------------------------------
# Miniature geometries.  Every width distinct and mostly not a power of two, so
# a transposed or mis-split tensor cannot pass by accident.
# ---------------------------------------------------------------------------

# Pure Mamba2, native mamba_ssm dialect.
#   d_model 48, d_inner 96, heads 12 x headdim 8, d_state 10, ngroups 2, conv 4
#   conv_dim 96 + 2*2*10 = 136; in_proj rows 2*96 + 40 + 12 = 244
#   vocab 101 padded to 112 (multiple 16); tied head (like mamba2-780m)
MINI_NATIVE_MAMBA2 = {
    "d_model": 48,
    "d_intermediate": 0,
    "n_layer": 3,
    "vocab_size": 101,
    "ssm_cfg": {
        "layer": "Mamba2",
        "d_state": 10,
        "d_conv": 4,
        "expand": 2,
        "headdim": 8,
        "ngroups": 2,
        "chunk_size": 16,
    },
    "attn_layer_idx": [],
    "attn_cfg": {},
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 16,
    "tie_embeddings": True,
}

# Native mamba2attn: Mamba2 on layers 0 and 2, conv-QKV attention on layer 1.
#   d_model 52, d_inner 104, heads 13 x 8, d_state 14, ngroups 1, conv 4
#   conv_dim 104 + 28 = 132; in_proj rows 208 + 28 + 13 = 249
#   attention: 6 q heads, 2 kv heads, head_dim 10, conv 3, rotary 6 of 10
#   qkv rows (6 + 2*2)*10 = 100, out_proj in 60; both biases on
#   vocab 97 padded to 112; untied head (lm_head.weight present)
MINI_NATIVE_MAMBA2ATTN = {
    "d_model": 52,
    "d_intermediate": 0,
    "n_layer": 3,
    "vocab_size": 97,
    "ssm_cfg": {
        "layer": "Mamba2",
        "d_state": 14,
        "d_conv": 4,
        "expand": 2,
        "headdim": 8,
        "ngroups": 1,
        "chunk_size": 16,
    },
    "attn_layer_idx": [1],
    "attn_cfg": {
        "causal": True,
        "d_conv": 3,
        "head_dim": 10,
        "num_heads": 6,
        "num_heads_kv": 2,
        "out_proj_bias": True,
        "qkv_proj_bias": True,
        "rotary_emb_dim": 6,
    },
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 16,
    "tie_embeddings": False,
}

# OuteAI mamba2attn dialect.  5 layers; attention_layers_idx [2, 4] lands on
# physical layers 2, 4 (index_base 0) or 1, 3 (index_base 1).
#   hidden 56, mamba2 heads 14 x 8 = 112 = 2*56, state 12, n_groups 2, conv 4
#   conv_dim 112 + 48 = 160; in_proj rows 224 + 48 + 14 = 286; mamba2 bias on
#   attention: 6 q heads, 3 kv heads, head_dim 9, conv 3, rotary 4 of 9,
#   rope_theta 500; qkv rows (6 + 6)*9 = 108, out_proj in 54;
#   qkv bias on, out bias off; vocab 131 (no padding in this dialect); untied
MINI_OUTE = {
    "model_type": "mamba2attn",
    "vocab_size": 131,
    "hidden_size": 56,
    "num_hidden_layers": 5,
    "intermediate_size": 112,
    "state_size": 12,
    "mamba2_num_heads": 14,
    "mamba2_head_dim": 8,
    "expand": 2,
    "n_groups": 2,
    "mamba2_conv_kernel": 4,
    "chunk_size": 16,
    "time_step_limit": [0.0, math.inf],
    "use_mamba2_bias": True,
    "use_conv_bias": True,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "attention_head_dim": 9,
    "attention_conv_kernel": 3,
    "rope_emb_dim": 4,
    "rope_theta": 500.0,
    "rope_scaling": None,
    "use_attention_qkv_bias": True,
    "use_attention_out_bias": False,
    "attention_layers_idx": [2, 4],
    "mlp_intermediate_size": 0,
    "mlp_padding_size": 128,
    "use_mlp_bias": False,
    "hidden_act": "silu",
    "layer_norm_epsilon": 1e-05,
    "residual_in_fp32": True,
    "max_position_embeddings": 256,
    "tie_embedding_weights": False,
}

# transformers families (overrides for AutoConfig.for_model).
#   llama : hidden 40, ffn 72, 4 q heads x 12 (q 48), 2 kv heads (kv 24), vocab 103
#   qwen2 : hidden 60, ffn 84, 6 q heads x 10, 2 kv heads (kv 20), vocab 107
#           (qwen2 has no head_dim field, so q_proj is square as in real Qwen2)
#   qwen3 : hidden 36, ffn 68, 4 q heads x 14 (q 56), 2 kv heads (kv 28), vocab 109
#   mamba2: hidden 40, 10 heads x 8 (= 2*40), state 12, n_groups 2, conv 4,
#           conv_dim 128, in_proj rows 218, vocab 113, untied
MINI_HF = {
    "llama": {
        "vocab_size": 103,
        "hidden_size": 40,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        "vocab_size": 107,
        "hidden_size": 60,
        "intermediate_size": 84,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen3": {
        "vocab_size": 109,
        "hidden_size": 36,
        "intermediate_size": 68,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 14,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mamba2": {
        "vocab_size": 113,
        "hidden_size": 40,
        "num_hidden_layers": 2,
        "num_heads": 10,
        "head_dim": 8,
        "expand": 2,
        "state_size": 12,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

# Default initializer_range for build_hf: transformers' default (0.02) gives
# logits of magnitude < 1 and near-ties at argmax.
HF_INITIALIZER_RANGE = 0.25


# ---------------------------------------------------------------------------
# safetensors writers
# ---------------------------------------------------------------------------

def write_safetensors(path, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` to ``path`` (contiguous copies, metadata format=pt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    return path


def _nbytes(dtype: str, shape) -> int:
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown safetensors dtype {dtype!r}")
    return DTYPE_SIZES[dtype] * math.prod(int(s) for s in shape)


def header_bytes(specs: dict[str, tuple[str, tuple]]) -> tuple[bytes, int]:
    """The safetensors header (JSON, space-padded to 8 bytes) and data size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in sorted(specs):
        dtype, shape = specs[key]
        n = _nbytes(dtype, shape)
        header[key] = {"dtype": dtype, "shape": [int(s) for s in shape],
                       "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, offset


def write_header_only(path, specs: dict[str, tuple[str, tuple]]) -> Path:
    """A valid safetensors file with the data region left sparse.

    ``specs`` maps key -> (dtype string, shape).  The file is exactly
    8 + header + data bytes long, but the data region is a hole
    (``truncate``), so a multi-GB checkpoint costs no disk and reads as zeros.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw, data_size = header_bytes(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + data_size)
    return path


def _entry_bytes(v, header_only: bool) -> int:
    return _nbytes(*v) if header_only else v.numel() * v.element_size()


def _write_checkpoint(out_dir: Path, tensors_or_specs: dict, *, header_only: bool,
                      shards: int = 1, max_shard_bytes: int | None = None) -> list[Path]:
    """model.safetensors, or shards + model.safetensors.index.json.

    ``shards=N`` splits the sorted keys into N files of about equal key count;
    ``max_shard_bytes`` instead fills shards greedily up to that size (the way
    hub checkpoints are split), which keeps each file mmap-able.
    """
    writer = write_header_only if header_only else write_safetensors
    keys = sorted(tensors_or_specs)
    groups: list[list[str]]
    if max_shard_bytes:
        groups, size = [[]], 0
        for k in keys:
            n = _entry_bytes(tensors_or_specs[k], header_only)
            if groups[-1] and size + n > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += n
    elif shards > 1:
        if shards > len(keys):
            raise ValueError(f"cannot split {len(keys)} tensors into {shards} shards")
        per = math.ceil(len(keys) / shards)
        groups = [keys[i * per:(i + 1) * per] for i in range(shards)]
        groups = [g for g in groups if g]
    else:
        groups = [keys]
    if len(groups) == 1:
        return [writer(out_dir / "model.safetensors", tensors_or_specs)]
    n = len(groups)
    paths, weight_map, total = [], {}, 0
    for i, part in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        paths.append(writer(out_dir / name, {k: tensors_or_specs[k] for k in part}))
        for k in part:
            weight_map[k] = name
            total += _entry_bytes(tensors_or_specs[k], header_only)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths


def _write_config(out_dir: Path, cfg: dict) -> None:
    # json.dumps writes math.inf as a bare ``Infinity`` (the OuteAI spelling).
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------
# mamba_ssm native dialect (MambaLMHeadModel)
# ---------------------------------------------------------------------------

def _padded_vocab(vocab: int, multiple: int) -> int:
    multiple = int(multiple or 1)
    return vocab + (-vocab % multiple)


def _mamba2_mixer_specs(prefix: str, dtype: str, *, d_model: int, d_inner: int,
                        n_heads: int, d_state: int, ngroups: int, d_conv: int,
                        bias: bool, conv_bias: bool) -> dict:
    conv_dim = d_inner + 2 * ngroups * d_state
    rows = 2 * d_inner + 2 * ngroups * d_state + n_heads
    s = {
        f"{prefix}in_proj.weight": (dtype, (rows, d_model)),
        f"{prefix}conv1d.weight": (dtype, (conv_dim, 1, d_conv)),
        f"{prefix}dt_bias": (dtype, (n_heads,)),
        f"{prefix}A_log": (dtype, (n_heads,)),
        f"{prefix}D": (dtype, (n_heads,)),
        f"{prefix}norm.weight": (dtype, (d_inner,)),
        f"{prefix}out_proj.weight": (dtype, (d_model, d_inner)),
    }
    if conv_bias:
        s[f"{prefix}conv1d.bias"] = (dtype, (conv_dim,))
    if bias:
        s[f"{prefix}in_proj.bias"] = (dtype, (rows,))
        s[f"{prefix}out_proj.bias"] = (dtype, (d_model,))
    return s


def _conv_qkv_specs(prefix: str, dtype: str, *, d_model: int, n_heads: int,
                    n_heads_kv: int, head_dim: int, d_conv: int, qkv_bias: bool,
                    out_bias: bool, mlp_dim: int = 0) -> dict:
    qkv = (n_heads + 2 * n_heads_kv) * head_dim
    s = {
        f"{prefix}in_proj.weight": (dtype, (qkv + mlp_dim, d_model)),
        f"{prefix}out_proj.weight": (dtype, (d_model, n_heads * head_dim + mlp_dim // 2)),
    }
    if d_conv > 0:  # MHA's nn.Conv1d always carries a bias
        s[f"{prefix}conv1d.weight"] = (dtype, (qkv, 1, d_conv))
        s[f"{prefix}conv1d.bias"] = (dtype, (qkv,))
    if qkv_bias:
        s[f"{prefix}in_proj.bias"] = (dtype, (qkv + mlp_dim,))
    if out_bias:
        s[f"{prefix}out_proj.bias"] = (dtype, (d_model,))
    return s


def native_geometry(cfg: dict) -> dict:
    """The native config with mamba_ssm's defaults filled in (Mamba2 + MHA)."""
    d = int(cfg["d_model"])
    if int(cfg.get("d_intermediate", 0) or 0) != 0:
        raise ValueError("native builder: d_intermediate > 0 (MLP blocks) is not supported")
    ssm = dict(cfg.get("ssm_cfg") or {})
    layer = ssm.get("layer", "Mamba1")
    if layer != "Mamba2":
        raise ValueError(f"native builder: ssm_cfg layer {layer!r} is not Mamba2")
    expand = ssm.get("expand", 2)
    d_inner = int(expand * d)
    headdim = int(ssm.get("headdim", 64))
    if ssm.get("d_ssm") not in (None, d_inner):
        raise ValueError("native builder: d_ssm != d_inner is not supported")
    if d_inner % headdim:
        raise ValueError(f"d_inner {d_inner} not divisible by headdim {headdim}")
    attn = dict(cfg.get("attn_cfg") or {})
    attn_idx = [int(i) for i in (cfg.get("attn_layer_idx") or [])]
    g = {
        "d_model": d,
        "n_layer": int(cfg["n_layer"]),
        "vocab_size": int(cfg["vocab_size"]),
        "padded_vocab": _padded_vocab(int(cfg["vocab_size"]), cfg.get("pad_vocab_size_multiple", 8)),
        "tie": bool(cfg.get("tie_embeddings", True)),
        "d_inner": d_inner,
        "headdim": headdim,
        "n_heads": d_inner // headdim,
        "d_state": int(ssm.get("d_state", 128)),
        "d_conv": int(ssm.get("d_conv", 4)),
        "ngroups": int(ssm.get("ngroups", 1)),
        "bias": bool(ssm.get("bias", False)),
        "conv_bias": bool(ssm.get("conv_bias", True)),
        "attn_layers": sorted(set(attn_idx)),
    }
    if attn_idx:
        nh = int(attn["num_heads"])
        g["attn"] = {
            "num_heads": nh,
            "num_heads_kv": int(attn.get("num_heads_kv") or nh),
            "head_dim": int(attn.get("head_dim") or d // nh),
            "d_conv": int(attn.get("d_conv", 0)),
            "qkv_bias": bool(attn.get("qkv_proj_bias", True)),
            "out_bias": bool(attn.get("out_proj_bias", True)),
            "mlp_dim": math.ceil(int(attn.get("mlp_dim", 0)) / 256) * 256,
            "rotary_dim": int(attn.get("rotary_emb_dim", 0)),
        }
    for i in attn_idx:
        if not 0 <= i < g["n_layer"]:
            raise ValueError(f"attn_layer_idx {i} outside 0..{g['n_layer'] - 1}")
    return g


def native_mamba_specs(cfg: dict, dtype: str = "F32") -> dict[str, tuple[str, tuple]]:
    """Tensor names/shapes of a mamba_ssm MambaLMHeadModel checkpoint."""
    g = native_geometry(cfg)
    d = g["d_model"]
    specs = {"backbone.embedding.weight": (dtype, (g["padded_vocab"], d))}
    for i in range(g["n_layer"]):
        p = f"backbone.layers.{i}."
        specs[p + "norm.weight"] = (dtype, (d,))
        if i in g["attn_layers"]:
            a = g["attn"]
            specs.update(_conv_qkv_specs(
                p + "mixer.", dtype, d_model=d, n_heads=a["num_heads"],
                n_heads_kv=a["num_heads_kv"], head_dim=a["head_dim"], d_conv=a["d_conv"],
                qkv_bias=a["qkv_bias"], out_bias=a["out_bias"], mlp_dim=a["mlp_dim"]))
        else:
            specs.update(_mamba2_mixer_specs(
                p + "mixer.", dtype, d_model=d, d_inner=g["d_inner"], n_heads=g["n_heads"],
                d_state=g["d_state"], ngroups=g["ngroups"], d_conv=g["d_conv"],
                bias=g["bias"], conv_bias=g["conv_bias"]))
    specs["backbone.norm_f.weight"] = (dtype, (d,))
    if not g["tie"]:
        specs["lm_head.weight"] = (dtype, (g["padded_vocab"], d))
    return specs


# ---------------------------------------------------------------------------
# OuteAI mamba2attn dialect
# ---------------------------------------------------------------------------

def oute_geometry(cfg: dict, index_base: int = 0) -> dict:
    if index_base not in (0, 1):
        raise ValueError(f"index_base must be 0 or 1, not {index_base!r}")
    if int(cfg.get("mlp_intermediate_size", 0) or 0) != 0:
        raise ValueError("oute builder: mlp_intermediate_size > 0 is not supported")
    n = int(cfg["num_hidden_layers"])
    phys = sorted({int(i) - index_base for i in cfg.get("attention_layers_idx") or []})
    for p in phys:
        if not 0 <= p < n:
            raise ValueError(f"attention layer {p + index_base} (base {index_base}) "
                             f"outside the {n} layers")
    nh = int(cfg["num_attention_heads"])
    return {
        "d_model": int(cfg["hidden_size"]),
        "n_layer": n,
        "vocab_size": int(cfg["vocab_size"]),
        "padded_vocab": int(cfg["vocab_size"]),
        "tie": bool(cfg.get("tie_embedding_weights", True)),
        "n_heads": int(cfg["mamba2_num_heads"]),
        "headdim": int(cfg["mamba2_head_dim"]),
        "d_inner": int(cfg["mamba2_num_heads"]) * int(cfg["mamba2_head_dim"]),
        "d_state": int(cfg["state_size"]),
        "d_conv": int(cfg["mamba2_conv_kernel"]),
        "ngroups": int(cfg.get("n_groups", 1)),
        "bias": bool(cfg.get("use_mamba2_bias", False)),
        "conv_bias": bool(cfg.get("use_conv_bias", True)),
        "attn_layers": phys,
        "attn": {
            "num_heads": nh,
            "num_heads_kv": int(cfg.get("num_key_value_heads") or nh),
            "head_dim": int(cfg["attention_head_dim"]),
            "d_conv": int(cfg["attention_conv_kernel"]),
            "qkv_bias": bool(cfg.get("use_attention_qkv_bias", False)),
            "out_bias": bool(cfg.get("use_attention_out_bias", False)),
            "mlp_dim": 0,
            "rotary_dim": int(cfg.get("rope_emb_dim", 0)),
        },
    }


def oute_specs(cfg: dict, index_base: int = 0, dtype: str = "BF16") -> dict[str, tuple[str, tuple]]:
    """Tensor names/shapes of an OuteAI mamba2attn checkpoint.

    Attention tensors are placed on physical layers ``idx - index_base``.
    """
    g = oute_geometry(cfg, index_base)
    d = g["d_model"]
    specs = {"backbone.embeddings.weight": (dtype, (g["padded_vocab"], d))}
    for i in range(g["n_layer"]):
        p = f"backbone.layers.{i}."
        specs[p + "norm.weight"] = (dtype, (d,))
        if i in g["attn_layers"]:
            a = g["attn"]
            specs.update(_conv_qkv_specs(
                p + "mixer.", dtype, d_model=d, n_heads=a["num_heads"],
                n_heads_kv=a["num_heads_kv"], head_dim=a["head_dim"], d_conv=a["d_conv"],
                qkv_bias=a["qkv_bias"], out_bias=a["out_bias"]))
        else:
            specs.update(_mamba2_mixer_specs(
                p + "mixer.", dtype, d_model=d, d_inner=g["d_inner"], n_heads=g["n_heads"],
                d_state=g["d_state"], ngroups=g["ngroups"], d_conv=g["d_conv"],
                bias=g["bias"], conv_bias=g["conv_bias"]))
    specs["backbone.norm_f.weight"] = (dtype, (d,))
    if not g["tie"]:
        specs["lm_head.weight"] = (dtype, (g["padded_vocab"], d))
    return specs


# ---------------------------------------------------------------------------
# Random weights for the mamba dialects
# ---------------------------------------------------------------------------

def _random_tensor(key: str, shape: tuple, gen: torch.Generator, scale: float) -> torch.Tensor:
    """Reasonable random init by the role the (opaque to vxc) name plays."""
    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    def rand(*s):
        return torch.rand(*s, generator=gen, dtype=torch.float64)

    leaf = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 2)[-2] if key.count(".") >= 1 else ""
    if key.endswith("embedding.weight") or key.endswith("embeddings.weight") or key == "lm_head.weight":
        # logits = <rms-normalised h, row>  ->  std ~ 3 * scale
        return randn(*shape) * (3.0 * scale / math.sqrt(shape[1]))
    if leaf == "A_log":
        return torch.log(1.0 + 15.0 * rand(*shape))
    if leaf == "dt_bias":
        dt = torch.exp(rand(*shape) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "D":
        return 1.0 + 0.1 * randn(*shape)
    if parent == "conv1d":
        if leaf == "weight":
            return rand(*shape) - 0.5
        return 0.2 * (rand(*shape) - 0.5)
    if parent == "norm" or parent == "norm_f":
        return 1.0 + 0.1 * randn(*shape)
    if leaf == "bias":
        return 0.1 * randn(*shape)
    if leaf == "weight" and len(shape) == 2:
        return randn(*shape) * (scale / math.sqrt(shape[1]))
    raise ValueError(f"no init rule for {key} {shape}")


def _random_tensors(specs: dict, seed: int, dtype: torch.dtype, scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: _random_tensor(k, tuple(specs[k][1]), gen, scale).to(dtype)
            for k in sorted(specs)}


def build_native_mamba(out_dir, cfg: dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       header_only: bool = False, scale: float = 1.0, shards: int = 1) -> Path:
    """config.json (exactly ``cfg``) + random-weight (or header-only) checkpoint."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_config(out_dir, cfg)
    specs = native_mamba_specs(cfg, TORCH_TO_ST[dtype])
    payload = specs if header_only else _random_tensors(specs, seed, dtype, scale)
    _write_checkpoint(out_dir, payload, header_only=header_only, shards=shards)
    return out_dir


def build_oute(out_dir, cfg: dict, *, index_base: int, seed: int = 0,
               dtype: torch.dtype = torch.float32, header_only: bool = False,
               scale: float = 1.0, shards: int = 1) -> Path:
    """OuteAI-dialect directory; attention tensors on layers ``idx - index_base``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_config(out_dir, cfg)
    specs = oute_specs(cfg, index_base, TORCH_TO_ST[dtype])
    payload = specs if header_only else _random_tensors(specs, seed, dtype, scale)
    _write_checkpoint(out_dir, payload, header_only=header_only, shards=shards)
    return out_dir


# ---------------------------------------------------------------------------
# transformers families
# ---------------------------------------------------------------------------

_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_special_floats(obj):
    """transformers 5.24 writes inf as ``{"__float__": "Infinity"}`` in config.json
    (e.g. mamba2's ``time_step_limit``); turn those back into floats."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def hf_config(model_type: str, overrides: dict | None = None):
    import transformers
    kw = decode_special_floats(copy.deepcopy(dict(overrides or {})))
    return transformers.AutoConfig.for_model(model_type, **kw)


def build_hf(out_dir, model_type: str, overrides: dict | None = None, *, seed: int = 0,
             dtype: torch.dtype = torch.float32,
             initializer_range: float | None = None) -> Path:
    """A tiny random transformers model saved with ``save_pretrained``.

    ``initializer_range`` defaults to ``HF_INITIALIZER_RANGE`` unless the
    overrides set it, so logits spread over several units.
    """
    import transformers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov = dict(overrides or {})
    if initializer_range is not None:
        ov["initializer_range"] = initializer_range
    ov.setdefault("initializer_range", HF_INITIALIZER_RANGE)
    cfg = hf_config(model_type, ov)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to(dtype).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def hf_disk_specs(model, dtype: str = "BF16") -> dict[str, tuple[str, tuple]]:
    """On-disk names/shapes transformers' save_pretrained would write.

    Floating tensors are written as ``dtype``; others keep their own dtype.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    sd = model.state_dict()
    sd = remove_tied_weights_from_state_dict(sd, model)
    sd = revert_weight_conversion(model, sd)
    specs = {}
    for k, t in sd.items():
        st = dtype if t.is_floating_point() else TORCH_TO_ST[t.dtype]
        specs[k] = (st, tuple(t.shape))
    return specs


def hf_header_only(out_dir, model_type_or_config, dtype: str = "BF16", *,
                   config_json: dict | None = None,
                   max_shard_bytes: int | None = None) -> Path:
    """Build a transformers model on the meta device and write config.json +
    a header-only model.safetensors with the on-disk names and shapes.

    ``model_type_or_config``: a model_type string, or a config dict holding
    ``model_type``.  ``config_json`` (optional) is written verbatim as
    config.json instead of ``model.config.to_json_file``.  ``max_shard_bytes``
    splits the checkpoint into hub-style shards + index (a single sparse file
    of hundreds of GB cannot be mmap-ed by ``safe_open`` on a small machine).
    """
    import transformers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(model_type_or_config, str):
        model_type, kw = model_type_or_config, {}
    else:
        kw = copy.deepcopy(dict(model_type_or_config))
        model_type = kw.pop("model_type")
        kw.pop("architectures", None)
    cfg = hf_config(model_type, kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    specs = hf_disk_specs(model, dtype)
    if config_json is not None:
        _write_config(out_dir, config_json)
    else:
        model.config.to_json_file(str(out_dir / "config.json"))
    _write_checkpoint(out_dir, specs, header_only=True, max_shard_bytes=max_shard_bytes)
    return out_dir


# ---------------------------------------------------------------------------
# Witnesses at real geometry
# ---------------------------------------------------------------------------

# name -> (dialect, dtype, index_base for oute)
WITNESSES = {
    "mamba2-780m": ("native", "F32", None),
    "mamba2attn-2.7b": ("native", "F32", None),
    "mamba2attn-250m.oute-dialect": ("oute", "BF16", 0),
}


# transformers-family witnesses are written in hub-style shards of at most this
# many bytes, each header-only.
HF_WITNESS_SHARD_BYTES = 5 * 10**9


def witness_config(name: str) -> dict:
    name = name.removesuffix(".config.json")
    return json.loads((WITNESS_DIR / f"{name}.config.json").read_text())


def witness_header_only(name: str, out_dir) -> Path:
    """Copy a witness config verbatim and write a header-only checkpoint.

    The three mamba witnesses use the builders here (native F32; OuteAI BF16
    with its true index base 0), one file each.  Any other witness (it has a
    transformers ``model_type``) goes through ``hf_header_only`` (BF16, shards
    of at most ``HF_WITNESS_SHARD_BYTES`` + model.safetensors.index.json), with
    the config copied verbatim.  Note transformers' on-disk spelling applies
    (e.g. fused gpt_oss experts, bf16 not MXFP4).
    """
    name = name.removesuffix(".config.json")
    src = WITNESS_DIR / f"{name}.config.json"
    if not src.exists():
        raise FileNotFoundError(f"no witness config {src}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(src.read_text())
    if name in WITNESSES:
        dialect, dtype, base = WITNESSES[name]
        specs = (native_mamba_specs(cfg, dtype) if dialect == "native"
                 else oute_specs(cfg, base, dtype))
        shutil.copyfile(src, out_dir / "config.json")
        write_header_only(out_dir / "model.safetensors", specs)
        return out_dir
    hf_header_only(out_dir, cfg, "BF16", max_shard_bytes=HF_WITNESS_SHARD_BYTES)
    shutil.copyfile(src, out_dir / "config.json")
    return out_dir


def state_dump(mdir: Path) -> str:
    """The IR of a model directory after verify, bind, closure and state (the witnesses' golden IR)."""
    from vxc.frontends import lower
    from vxc.ir import print_module
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    m = lower(mdir, relative_to=Path(mdir).parent)
    ctx = PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(m, model_dir=mdir))
    return print_module(ctx.module)


_TRITON_VS_TWINS = r"""
import json, os, sys, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(1)
from pathlib import Path
from tests.runtime import parity_table as P
from vxc.codegen import kernels
from vxc.runtime.session import Session
ir, ids, k = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
dev = "cuda" if torch.cuda.is_available() else "cpu"
def run():
    s = Session(P.engine_for(Path(ir), max_context=32, device=dev))
    return torch.cat([s.prefill(ids[:k])] + [s.step(t)[None] for t in ids[k:]]).cpu()
def run_batched():
    # two sequence slots: ids[:k] and ids[:k - 3] prefilled, then batched steps over both (each at its own position)
    e = P.engine_for(Path(ir), max_context=32, device=dev, sequences=2)
    for slot, n in ((0, k), (1, k - 3)):
        e.bind_slot(slot)
        e.prefill_graph(torch.tensor(ids[:n], device=dev), 0)
    rows, pos = [], [k, k - 3]
    for t in ids[k:]:
        rows.append(e.decode_batch([t, ids[pos[1]]], pos, [0, 1]))
        pos = [pos[0] + 1, pos[1] + 1]
    return torch.cat(rows).cpu()
batched = len(sys.argv) > 4 and sys.argv[4] == "batched"
a = run()
a2 = run_batched() if batched else None
kernels.reset_fallbacks()
with kernels.backend("triton"):
    b = run()
    b2 = run_batched() if batched else None
out = {"err": float((a - b).abs().max()), "max": float(a.abs().max()), "fallbacks": kernels.fallbacks()}
if batched:
    out.update(batch_err=float((a2 - b2).abs().max()), batch_max=float(a2.abs().max()),
               batch_vs_single=float((a2[0::2] - a[k:]).abs().max()))
print(json.dumps(out))
"""


def triton_against_twins(ir: Path, ids: list[int], prefill: int, batched: bool = False) -> dict:
    """Logits of a prefill of ``ids[:prefill]`` then one step per remaining id, on vxc's Triton kernels against
    the torch twins, in a fresh process (on CPU Triton's interpreter, chosen at triton's first import; on a GPU
    the device): ``{"err": max-abs, "max": max |logit|, "fallbacks": the Triton run's fallbacks to a twin}``.
    With ``batched``, also a batched decode step over two sequence slots (ids[:prefill] and ids[:prefill - 3]
    prefilled) on both: ``batch_err``, ``batch_max``, and ``batch_vs_single`` (slot 0's rows against the
    single-sequence steps, on the twins)."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-c", _TRITON_VS_TWINS, str(ir), json.dumps(list(ids)), str(prefill)]
                       + (["batched"] if batched else []),
                       cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
