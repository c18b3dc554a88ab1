"""Model building: the benchmarked geometries and the checkpoint directories written for them.

``build_child`` runs in its own process (``bench.py --_build``), so the parent stays small;
``ensure_built`` starts it unless the work dir already holds the model (``.done`` marker).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import REPO, SCRIPT

WITNESS_DIR = Path(os.environ.get("VXC_WITNESS_DIR", REPO.parent / "shared" / "witnesses"))
if not WITNESS_DIR.is_dir():
    WITNESS_DIR = Path("/work/shared/witnesses")

MODELS = ("mamba2-780m", "qwen3-0.6b")  # the default set
KNOWN_MODELS = MODELS + ("qwen3-next-shaped", "kimi-linear-shaped")

# ---------------------------------------------------------------------------
# geometries
# ---------------------------------------------------------------------------

QWEN3_0_6B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
}

QWEN3_SMALL = dict(QWEN3_0_6B, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                   bos_token_id=1, eos_token_id=2)


# Qwen3-Next-80B-A3B's hidden size and head geometry (shared/witnesses/qwen3-next-80b-a3b.config.json), cut to
# 4 layers keeping the real pattern (full_attention_interval 4: gated delta on 0-2, gated softmax on 3) and
# 32 of the 512 experts (top-10 as real, moe/shared intermediate 512 as real, MoE on every layer).
QWEN3_NEXT_SHAPED = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 32,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pad_token_id": 151643,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
}
QWEN3_NEXT_SMALL = dict(QWEN3_NEXT_SHAPED, vocab_size=4096, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=2048,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Kimi-Linear-48B-A3B's hidden size and head geometry (shared/witnesses/kimi-linear-48b-a3b.config.json), cut to
# 4 layers: KDA on 0-2, NoPE MLA on 3 (the real stack's first MLA layer is 1-based 4), layer 0 a dense FFN
# (first_k_dense_replace 1), MoE on 1-3 with 32 of the 256 experts (top-8 as real, one shared expert).
KIMI_LINEAR_SHAPED = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "mlp_layer_types": ["dense"] + ["sparse"] * 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 32,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pad_token_id": 163839,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "initializer_range": 0.02,
}
KIMI_LINEAR_SMALL = dict(KIMI_LINEAR_SHAPED, vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32, linear_head_dim=32, linear_num_heads=4,
                         num_local_experts=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def describe_geometry(model: str, small: bool) -> str:
    """One line: the (reduced) geometry a model is benchmarked at."""
    c = geometry(model, small)["config"]
    if model == "qwen3-next-shaped":
        mix = ", ".join("gated_delta" if t == "linear_attention" else "gated_softmax" for t in c["layer_types"])
        rp = c["rope_parameters"]
        return (f"hidden {c['hidden_size']}, vocab {c['vocab_size']} (untied head), {c['num_hidden_layers']} layers [{mix}] "
                f"(real: 48); gated delta {c['linear_num_key_heads']} k-heads × {c['linear_key_head_dim']}, "
                f"{c['linear_num_value_heads']} v-heads × {c['linear_value_head_dim']}, conv {c['linear_conv_kernel_dim']}; "
                f"softmax {c['num_attention_heads']} q × {c['head_dim']}, {c['num_key_value_heads']} kv, output gate, rotary "
                f"{rp['partial_rotary_factor']} × {c['head_dim']} θ {rp['rope_theta']:g}; MoE on every layer: "
                f"{c['num_experts']} experts (real: 512) top-{c['num_experts_per_tok']} × {c['moe_intermediate_size']} + shared "
                f"expert × {c['shared_expert_intermediate_size']} (gated)")
    if model == "kimi-linear-shaped":
        mix = ", ".join("kda" if t == "linear_attention" else "mla" for t in c["layer_types"])
        return (f"hidden {c['hidden_size']}, vocab {c['vocab_size']} (untied head), {c['num_hidden_layers']} layers [{mix}] "
                f"(real: 27); KDA {c['linear_num_heads']} heads × {c['linear_head_dim']}, conv {c['linear_conv_kernel_dim']}; "
                f"MLA (NoPE) {c['num_attention_heads']} heads, kv_lora {c['kv_lora_rank']}, nope {c['qk_nope_head_dim']} + rope "
                f"{c['qk_rope_head_dim']}, v {c['v_head_dim']}; FFN: layer 0 dense × {c['intermediate_size']}, layers 1-"
                f"{c['num_hidden_layers'] - 1} MoE {c['num_local_experts']} experts (real: 256) top-{c['num_experts_per_tok']} × "
                f"{c['moe_intermediate_size']} + {c['n_shared_experts']} shared, sigmoid router, scaling {c['routed_scaling_factor']}")
    if model == "qwen3-0.6b":
        return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} q / "
                f"{c['num_key_value_heads']} kv heads × {c['head_dim']}, ffn {c['intermediate_size']}, vocab {c['vocab_size']} (tied)")
    c = geometry(model, small)["config"]
    return f"d_model {c.get('d_model')}, {c.get('n_layer')} layers, vocab {c.get('vocab_size')} (witness config)"


def mamba2_config(small: bool) -> dict:
    cfg = json.loads((WITNESS_DIR / "mamba2-780m.config.json").read_text())
    if small:
        cfg = dict(cfg, d_model=256, n_layer=4, vocab_size=1000)
    return cfg


def geometry(model: str, small: bool) -> dict:
    if model == "mamba2-780m":
        return {"family": "mamba2-native", "config": mamba2_config(small)}
    if model == "qwen3-0.6b":
        return {"family": "qwen3", "config": QWEN3_SMALL if small else QWEN3_0_6B}
    if model == "qwen3-next-shaped":
        return {"family": "qwen3_next", "config": QWEN3_NEXT_SMALL if small else QWEN3_NEXT_SHAPED}
    if model == "kimi-linear-shaped":
        return {"family": "kimi_linear", "config": KIMI_LINEAR_SMALL if small else KIMI_LINEAR_SHAPED}
    raise SystemExit(f"unknown model {model!r}; known: {', '.join(KNOWN_MODELS)}")


def geometry_key(geo: dict) -> str:
    return hashlib.sha256(json.dumps(geo, sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------
# building model directories (in a child process, so the parent stays small)
# ---------------------------------------------------------------------------


def _convert_dir(src: Path, dst: Path, dtype_name: str) -> None:
    """Copy a checkpoint dir, casting every floating tensor to ``dtype_name``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sizes = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            out = {}
            with safe_open(str(f), framework="pt") as h:
                meta = h.metadata() or {"format": "pt"}
                for k in h.keys():
                    t = h.get_tensor(k)
                    out[k] = t.to(dt) if t.is_floating_point() else t
            save_file(out, str(tmp / f.name), metadata=meta)
            sizes.update({k: v.numel() * v.element_size() for k, v in out.items()})
            del out
        elif f.is_file():
            shutil.copyfile(f, tmp / f.name)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = {"bf16": "bfloat16", "fp32": "float32"}[dtype_name]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    index = tmp / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        index.write_text(json.dumps(idx, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def build_child(model: str, small: bool, out: Path, ckpt: str) -> None:
    """Write ``out/vxc`` and ``out/hf`` (the same dir for qwen3) at ``ckpt`` dtype."""
    import torch

    sys.path.insert(0, str(REPO))
    geo = geometry(model, small)
    out.mkdir(parents=True, exist_ok=True)
    if ckpt != "fp32":
        base = out.parent / f"{out.name.rsplit('-', 1)[0]}-fp32"
        if not (base / ".done").exists():
            build_child(model, small, base, "fp32")
        for sub in ("vxc", "hf"):
            if (base / sub).is_symlink():
                (out / sub).unlink(missing_ok=True)
                (out / sub).symlink_to(os.readlink(base / sub))
            else:
                _convert_dir(base / sub, out / sub, ckpt)
        (out / ".done").write_text(json.dumps(geo))
        return
    if geo["family"] == "mamba2-native":
        from tests.builders import build_native_mamba
        from tests.references import native_to_hf_mamba2

        t0 = time.time()
        build_native_mamba(out / "vxc", geo["config"], seed=0, dtype=torch.float32, scale=1.0)
        print(f"[build] {model}: native dir written in {time.time() - t0:.0f} s", file=sys.stderr)
        hf = native_to_hf_mamba2(out / "vxc", torch.float32)
        hf.save_pretrained(str(out / "hf"), safe_serialization=True)
        del hf
    else:
        import transformers

        from tests.hf_random import random_hf_model

        if geo["family"] == "qwen3":
            torch.manual_seed(0)
            cfg = transformers.Qwen3Config(**geo["config"])
            with torch.no_grad():
                m = transformers.Qwen3ForCausalLM(cfg).float().eval()
        else:
            # qwen3_next / kimi_linear: random init (seed 0), then, as tests/families builds its miniatures, the decay
            # rates exp(A_log) log-uniform in [0.05, 2] (the reference init, up to 16, decays the state to nothing
            # within a token or two), dt_bias spread, norms moved off their initial values, and a nonzero
            # router selection bias (kimi: e_score_correction_bias starts at 0)
            cfg = transformers.AutoConfig.for_model(geo["family"], **geo["config"])
            t0 = time.time()
            m = random_hf_model(cfg, 0, norm_std=0.15, dt_bias="add").float()
            print(f"[build] {model}: {sum(p.numel() for p in m.parameters()) / 1e9:.2f} B parameters initialised in "
                  f"{time.time() - t0:.0f} s", file=sys.stderr)
        m.save_pretrained(str(out / "hf"), safe_serialization=True)
        del m
        (out / "vxc").unlink(missing_ok=True)
        (out / "vxc").symlink_to("hf")
    (out / ".done").write_text(json.dumps(geo))


def ensure_built(model: str, small: bool, ckpt: str, workdir: Path, env: dict) -> Path:
    geo = geometry(model, small)
    out = workdir / f"{model}{'-small' if small else ''}-{geometry_key(geo)}-{ckpt}"
    if (out / ".done").exists():
        return out
    t0 = time.time()
    print(f"[build] {model} ({ckpt} checkpoint) -> {out}", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(SCRIPT), "--_build", model, "--_out", str(out), "--_ckpt", ckpt] + (["--small"] if small else [])
    subprocess.run(cmd, check=True, env=env)
    print(f"[build] {model} ({ckpt}) done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out
