#!/usr/bin/env python
"""vxc vs transformers (eager) on real-geometry models with random weights.

One run of this script:

1. builds (or reuses, keyed by geometry and checkpoint dtype) model
   directories in a work dir outside the repository:
   - ``mamba2-780m``: the witness config (mamba_ssm native dialect) with random
     weights; vxc lowers that native dir.  transformers gets an equivalent
     ``Mamba2ForCausalLM`` directory with the same weights renamed
     (``tests/references.py::native_to_hf_mamba2``) written by save_pretrained.
   - ``qwen3-0.6b``: a Qwen3-0.6B-shaped transformers ``Qwen3Config`` model
     (random init) written by save_pretrained; vxc lowers the same dir.
   - ``qwen3-next-shaped`` / ``kimi-linear-shaped``: the witness configs' hidden sizes and head geometry
     with 4 layers (the real layer pattern) and 32 experts, random init (decay rates as tests/wave2's
     miniatures), written by save_pretrained; vxc lowers the same dir.
   Checkpoints are written at the run dtype (an fp32 copy for the fp32 runs, a
   bf16 copy for the bf16 runs) unless ``--ckpt-dtype fp32`` is given.
2. measures memory read bandwidth (tensor sum and GEMV over >= 1 GB, best of a
   few) in a child process with the same thread count;
3. runs each engine in its own child process (peak RSS is per engine), same
   thread count, same weights: prefill tokens/s at each ``--prefill`` length
   (fresh state each, one warm-up run first), decode tokens/s (batch 1,
   ``--decode`` greedy tokens after a short prompt, each engine's own cache),
   peak RSS (``ru_maxrss``);
4. prints a markdown table with the ratios vxc/transformers and the fraction
   of the memory-bandwidth bound for decode
   (bound tok/s = bandwidth / weight bytes read per token).

Usage::

    .venv/bin/python benchmarks/bench.py --small                 # < 1 minute
    .venv/bin/python benchmarks/bench.py --models mamba2-780m,qwen3-0.6b --dtypes fp32,bf16
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WITNESS_DIR = Path(os.environ.get("VXC_WITNESS_DIR", REPO.parent / "shared" / "witnesses"))
if not WITNESS_DIR.is_dir():
    WITNESS_DIR = Path("/work/shared/witnesses")

MODELS = ("mamba2-780m", "qwen3-0.6b")  # the default set
KNOWN_MODELS = MODELS + ("qwen3-next-shaped", "kimi-linear-shaped")
ENGINE_NAMES = {"vxc": "vxc", "vxc-compiled": "vxc (compile_decode)", "hf": "transformers"}

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
        import math

        import transformers

        torch.manual_seed(0)
        if geo["family"] == "qwen3":
            cfg = transformers.Qwen3Config(**geo["config"])
            with torch.no_grad():
                m = transformers.Qwen3ForCausalLM(cfg).float().eval()
        else:
            # qwen3_next / kimi_linear: random init, then (as tests/wave2 builds its miniatures) the decay rates
            # exp(A_log) log-uniform in [0.05, 2] (the reference init, up to 16, decays the state to nothing
            # within a token or two), dt_bias spread, norms moved off their initial values, and a nonzero
            # router selection bias (kimi: e_score_correction_bias starts at 0)
            cfg = transformers.AutoConfig.for_model(geo["family"], **geo["config"])
            t0 = time.time()
            with torch.no_grad():
                m = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
                g = torch.Generator().manual_seed(1)
                for name, p in m.named_parameters():
                    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                        p.add_(0.15 * torch.randn(p.shape, generator=g))
                    elif name.endswith("dt_bias"):
                        p.add_(0.5 * torch.randn(p.shape, generator=g))
                    elif name.endswith("A_log"):
                        p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(2.0), generator=g))
                for name, b in m.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        b.copy_(0.1 * torch.randn(b.shape, generator=g))
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
    cmd = [sys.executable, __file__, "--_build", model, "--_out", str(out), "--_ckpt", ckpt] + (["--small"] if small else [])
    subprocess.run(cmd, check=True, env=env)
    print(f"[build] {model} ({ckpt}) done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------
# children: bandwidth and engines
# ---------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def bandwidth_child(args, result: dict) -> None:
    """Read bandwidth (bytes/s): a >= 1 GB fp32 sum, and fp32 / bf16 GEMV over a >= 1 GB matrix; best of a few."""
    import torch

    dev = args.device
    n_gb = 1.0 if not args.small else 1.0
    numel = int(n_gb * 2**30 / 4) + 2**20
    x = torch.empty(numel, dtype=torch.float32, device=dev).normal_()
    out = {}

    def best(fn, nbytes, reps):
        fn()
        _sync(dev)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            ts.append(time.perf_counter() - t0)
        return nbytes / min(ts)

    reps = 5
    out["sum_fp32"] = best(lambda: x.sum(), x.numel() * 4, reps)
    rows = 16384
    cols = numel // rows
    a = x[: rows * cols].view(rows, cols)
    v = torch.randn(cols, dtype=torch.float32, device=dev)
    out["gemv_fp32"] = best(lambda: torch.mv(a, v), a.numel() * 4, reps)
    del a, v
    xb = x[: numel].to(torch.bfloat16)  # 0.5 GB bf16 ...
    del x
    xb2 = torch.cat([xb, xb])  # ... -> >= 1 GB
    del xb
    cols_b = xb2.numel() // rows
    ab = xb2[: rows * cols_b].view(rows, cols_b)
    vb = torch.randn(cols_b, dtype=torch.bfloat16, device=dev)
    out["gemv_bf16"] = best(lambda: torch.mv(ab, vb), ab.numel() * 2, reps)
    out["sum_bf16"] = best(lambda: xb2.sum(), xb2.numel() * 2, reps)
    result["bandwidth"] = out


def _unique_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n


def _active_bytes(model) -> int:
    """Weight bytes one decode step reads: every tensor once, except an untied input embedding (one row is
    gathered) and the routed-expert banks, of which top_k / experts is read (shared experts count whole)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    cfg = model.config
    k, e = getattr(cfg, "num_experts_per_tok", None), getattr(cfg, "num_experts", None)
    seen, n = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        b = t.numel() * t.element_size()
        if t.data_ptr() == emb.data_ptr() and not tied:
            b = emb.shape[-1] * emb.element_size()
        elif ".experts." in name and k and e:
            b = b * k / e
        n += b
    return int(n)


def engine_child(args, result: dict) -> None:
    import torch

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dev = args.device
    prefill_lens = [int(x) for x in args.prefill.split(",") if x]
    gen = torch.Generator().manual_seed(1234)
    model_dir = Path(args._dir)
    result.update(threads=torch.get_num_threads(), torch=torch.__version__, loadavg_start=os.getloadavg()[0])

    vocab_real = args._vocab  # the model's real (unpadded) vocabulary, the same for both engines
    prompts = {n: torch.randint(0, int(vocab_real), (n,), generator=gen).tolist() for n in prefill_lens}
    decode_prompt = torch.randint(0, int(vocab_real), (args.prompt,), generator=gen).tolist()
    max_ctx = max(prefill_lens + [args.prompt + args.decode]) + 8

    if args._engine.startswith("vxc"):
        sys.path.insert(0, str(REPO))
        from vxc.frontends import lower
        from vxc.runtime.engine import Engine
        from vxc.runtime.session import Session
    else:
        import transformers
    # the process before any weight is touched: interpreter, torch and the engine's own modules
    result["rss_before_load"] = _peak_rss_bytes()

    t0 = time.perf_counter()
    if args._engine.startswith("vxc"):
        eng = Engine(lower(model_dir), model_dir, dtype=dtype, device=dev, max_context=max_ctx,
                     compile_decode=args._engine == "vxc-compiled")
        sess = Session(eng)
        result["weight_bytes"] = eng.weight_bytes()
        result["state_bytes"] = eng.state.nbytes()
        emb_names = [n for n, b in eng.root.named_buffers() if n.startswith("w_")]
        result["weight_buffers"] = len(emb_names)

        def prefill(ids):
            sess.reset()
            return sess.prefill(ids, last_only=args.prefill_logits == "last")

        def decode(prompt, n):
            sess.reset()
            last = sess.prefill(prompt)[-1]
            out, steps = [], []
            for i in range(n):
                tok = int(last[:vocab_real].argmax())  # (a device sync)
                out.append(tok)
                if i + 1 < n:
                    t = time.perf_counter()
                    last = sess.step(tok)
                    _sync(dev)
                    steps.append(time.perf_counter() - t)
            return out, steps
    else:
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        kw = {"dtype": dtype}
        if args.hf_attn:
            kw["attn_implementation"] = args.hf_attn
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).to(dev).eval()
        result["hf_class"] = type(model).__name__
        result["hf_attn"] = getattr(model.config, "_attn_implementation", None)
        result["weight_bytes"] = _unique_bytes(list(model.parameters()) + list(model.buffers()))
        result["hf_experts"] = getattr(model.config, "_experts_implementation", None)
        result["active_bytes"] = _active_bytes(model)

        @torch.no_grad()
        def prefill(ids):
            x = torch.tensor([ids], dtype=torch.long, device=dev)
            keep = {"logits_to_keep": 1} if args.prefill_logits == "last" else {}
            return model(x, use_cache=True, **keep).logits[0]

        @torch.no_grad()
        def decode(prompt, n):
            x = torch.tensor([prompt], dtype=torch.long, device=dev)
            o = model(x, use_cache=True)
            cache, last = o.cache, o.logits[0, -1]
            out, steps = [], []
            for i in range(n):
                tok = int(last[:vocab_real].argmax())  # (a device sync)
                out.append(tok)
                if i + 1 < n:
                    t = time.perf_counter()
                    o = model(torch.tensor([[tok]], dtype=torch.long, device=dev), cache=cache, use_cache=True)
                    cache, last = o.cache, o.logits[0, -1]
                    _sync(dev)
                    steps.append(time.perf_counter() - t)
            return out, steps

    _sync(dev)
    result["load_s"] = time.perf_counter() - t0
    result["rss_after_load"] = _peak_rss_bytes()

    pf = {}
    if not args._decode_only:
        t = time.perf_counter()
        prefill(prompts[prefill_lens[0]])  # warm-up
        _sync(dev)
        result["warmup_s"] = time.perf_counter() - t
        for n in prefill_lens:
            best = None
            for _ in range(args.repeats):
                _sync(dev)
                t = time.perf_counter()
                prefill(prompts[n])
                _sync(dev)
                dt = time.perf_counter() - t
                best = dt if best is None else min(best, dt)
            pf[str(n)] = n / best
            print(f"  [{args._engine} {args.dtype}] prefill {n}: {n / best:.1f} tok/s", file=sys.stderr, flush=True)
    result["prefill_tps"] = pf

    t = time.perf_counter()
    decode(decode_prompt, min(4, args.decode))  # warm-up (and compile, for compile_decode)
    result["decode_warmup_s"] = time.perf_counter() - t
    f0 = resource.getrusage(resource.RUSAGE_SELF)
    # one run: the first new token comes from the prompt's logits, so n - 1 steps are timed
    ids, steps = decode(decode_prompt, args.decode)
    f1 = resource.getrusage(resource.RUSAGE_SELF)
    result["decode_step_s"] = steps
    result["decode_tps"] = len(steps) / sum(steps) if steps else None
    result["decode_tps_median_step"] = 1 / sorted(steps)[len(steps) // 2] if steps else None
    result["decode_faults"] = {"minor": f1.ru_minflt - f0.ru_minflt, "major": f1.ru_majflt - f0.ru_majflt,
                               "involuntary_ctx_switches": f1.ru_nivcsw - f0.ru_nivcsw}
    result["generated"] = ids
    result["loadavg_end"] = os.getloadavg()[0]
    print(f"  [{args._engine} {args.dtype}] decode: {result['decode_tps']:.2f} tok/s "
          f"(median step {result['decode_tps_median_step']:.2f})", file=sys.stderr, flush=True)
    if dev.startswith("cuda"):
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    result["peak_rss"] = _peak_rss_bytes()


def run_child(kind: str, argv: list[str], env: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [sys.executable, __file__, "--_child", kind, "--_result", path] + argv
        t0 = time.time()
        p = subprocess.run(cmd, env=env, timeout=timeout)
        text = Path(path).read_text()
        res = json.loads(text) if text.strip() else {}
        res["child_wall_s"] = time.time() - t0
        if p.returncode != 0:
            res["error"] = f"exit status {p.returncode}"
        return res
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        Path(path).unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
        return ",".join(have) or "-"
    except (OSError, IndexError):
        return "?"


def fmt(x, nd=1):
    if x is None:
        return "—"
    return f"{x:.{nd}f}"


def weight_bytes_per_token(res: dict, tied: bool, emb_bytes: int) -> int:
    """Bytes of weights one decode step reads: everything, except an untied input
    embedding (one row is gathered); a tied table is read whole as the head."""
    return res["weight_bytes"] - (0 if tied else emb_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prefill", default="128,512", help="prefill lengths (comma-separated)")
    ap.add_argument("--decode", type=int, default=64, help="new tokens per decode run")
    ap.add_argument("--prompt", type=int, default=8, help="prompt length before decoding")
    ap.add_argument("--repeats", type=int, default=2, help="timed prefill runs per length (the best is reported)")
    ap.add_argument("--prefill-logits", default="all", choices=("all", "last"),
                    help="prefill returns logits at every position (all: teacher forcing, the default) or at the last "
                         "only (last: what generation needs; vxc's prefill(last_only=True), transformers' "
                         "logits_to_keep=1)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine child this many times, interleaved (vxc, hf, vxc, hf, ...), and report "
                         "each engine's best throughput over the rounds (a shared machine's slow spells then hit "
                         "both engines alike)")
    ap.add_argument("--workdir", default=os.environ.get("VXC_BENCH_DIR", str(Path(tempfile.gettempdir()) / "vxc-bench")))
    ap.add_argument("--ckpt-dtype", default="match", choices=("match", "fp32"),
                    help="checkpoint dtype: 'match' writes a copy at each run dtype; 'fp32' converts at load")
    ap.add_argument("--engines", default="vxc,hf", help="vxc, vxc-compiled (compile_decode=True; decode only), hf")
    ap.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: its own default, sdpa)")
    ap.add_argument("--small", action="store_true", help="tiny geometries (smoke run, < 1 minute)")
    ap.add_argument("--timeout", type=float, default=3600, help="per-child timeout, seconds")
    ap.add_argument("--json-out", default=None, help="also write every raw result here")
    # internal (child processes)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_engine", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_decode_only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_vocab", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_build", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._build:
        build_child(args._build, args.small, Path(args._out), args._ckpt)
        return
    if args._child:
        import torch

        torch.set_num_threads(args.threads)
        result: dict = {}
        try:
            (bandwidth_child if args._child == "bandwidth" else engine_child)(args, result)
        finally:
            Path(args._result).write_text(json.dumps(result))
        return

    t_start = time.time()
    args._load0 = os.getloadavg()[0]
    workdir = Path(args.workdir).resolve()
    if workdir == REPO or REPO in workdir.parents:
        raise SystemExit(f"--workdir {workdir} is inside the repository; pick a directory outside it")
    workdir.mkdir(parents=True, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    engines = [e for e in args.engines.split(",") if e]
    for m in models:
        geometry(m, args.small)  # unknown names fail here, before anything is built
    for e in engines:
        if e not in ENGINE_NAMES:
            raise SystemExit(f"unknown engine {e!r}; known: {', '.join(ENGINE_NAMES)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    prefill_lens = [int(x) for x in args.prefill.split(",") if x]

    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(args.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")

    common = ["--threads", str(args.threads), "--device", args.device, "--prefill", args.prefill,
              "--prefill-logits", args.prefill_logits,
              "--decode", str(args.decode), "--prompt", str(args.prompt), "--repeats", str(args.repeats)]
    if args.hf_attn:
        common += ["--hf-attn", args.hf_attn]

    # -- build
    dirs = {}
    for m in models:
        for d in dtypes:
            ck = d if args.ckpt_dtype == "match" else "fp32"
            dirs[(m, d)] = (ensure_built(m, args.small, ck, workdir, env), ck)

    # -- bandwidth
    print("[bench] measuring read bandwidth", file=sys.stderr, flush=True)
    bw = run_child("bandwidth", common, env, args.timeout).get("bandwidth", {})

    # -- engines
    rows = []
    for m in models:
        for d in dtypes:
            base, ck = dirs[(m, d)]
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            for rnd in range(args.rounds):
                for e in engines:
                    sub = base / ("hf" if e == "hf" else "vxc")
                    vocab = int(geometry(m, args.small)["config"]["vocab_size"])
                    argv = common + ["--_engine", e, "--_dir", str(sub), "--dtype", d, "--_vocab", str(vocab)]
                    if e == "vxc-compiled":
                        argv.append("--_decode_only")
                    print(f"[bench] {m} {d} {ENGINE_NAMES[e]}" + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""),
                          file=sys.stderr, flush=True)
                    res = run_child("engine", argv, env, args.timeout)
                    if res.get("error"):
                        print(f"[bench] {m} {d} {e}: {res['error']}", file=sys.stderr, flush=True)
                    runs[e].append(res)
            for e in engines:
                rows.append({"model": m, "dtype": d, "ckpt": ck, "engine": e, **best_of_rounds(runs[e])})

    # -- bandwidth again (the machine is shared: keep the better of the two measurements per kind)
    print("[bench] measuring read bandwidth again", file=sys.stderr, flush=True)
    bw2 = run_child("bandwidth", common, env, args.timeout).get("bandwidth", {})
    bw = {k: max(bw.get(k, 0), bw2.get(k, 0)) for k in set(bw) | set(bw2)}
    bandwidth = max(bw.values()) if bw else None

    wall = time.time() - t_start
    report(args, rows, bw, bandwidth, prefill_lens, wall)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "bandwidth": bw, "wall_s": wall}, indent=2))


def best_of_rounds(results: list[dict]) -> dict:
    """One engine's rounds merged: the best prefill tok/s per length and the best decode run (its steps,
    tokens and figures kept together); memory figures are the largest seen. The first failed round's error
    is kept when every round failed."""
    ok = [r for r in results if not r.get("error")]
    if not ok:
        return results[0]
    best = dict(max(ok, key=lambda r: r.get("decode_tps") or 0.0))
    best["prefill_tps"] = {n: max(r.get("prefill_tps", {}).get(n, 0.0) for r in ok)
                           for n in dict.fromkeys(n for r in ok for n in r.get("prefill_tps", {}))}
    best["decode_tps_median_step"] = max(r.get("decode_tps_median_step") or 0.0 for r in ok) or None
    for k in ("peak_rss", "rss_after_load", "rss_before_load"):
        if any(r.get(k) for r in ok):
            best[k] = max(r.get(k) or 0 for r in ok)
    best["rounds"] = len(results)
    return best


def active_fraction(r: dict, hf: dict | None) -> float:
    """The fraction of a row's weight bytes one decode step reads, from the transformers row of the same
    model and dtype (the same weights): 1 for the tied dense models, less with an untied embedding or MoE."""
    if r.get("active_bytes") and r.get("weight_bytes"):
        return r["active_bytes"] / r["weight_bytes"]
    if hf and hf.get("active_bytes") and hf.get("weight_bytes"):
        return hf["active_bytes"] / hf["weight_bytes"]
    return 1.0


def table_row(r: dict, head: list[str], prefill_lens: list[int], bandwidth, hf: dict | None = None) -> str:
    wb = r.get("weight_bytes")
    if r.get("error") and not wb:
        cells = [r["model"], r["dtype"], r["ckpt"], ENGINE_NAMES[r["engine"]], f"failed: {r['error']}"]
        return "| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |"
    pf = r.get("prefill_tps", {})
    dec = r.get("decode_tps")
    read = wb * active_fraction(r, hf) if wb else None
    frac = dec * read / bandwidth if (dec and read and bandwidth) else None
    rss = r.get("peak_rss")
    cells = [r["model"], r["dtype"], r["ckpt"], ENGINE_NAMES[r["engine"]]]
    cells += [fmt(pf.get(str(n))) for n in prefill_lens]
    cells += [fmt(dec, 2), fmt(r.get("decode_tps_median_step"), 2), fmt(rss / 1e9 if rss else None, 2), fmt(wb / 1e9, 3 if wb < 1e8 else 2),
              fmt(read / 1e9 if read else None, 3 if (read or 0) < 1e8 else 2),
              fmt(rss / wb if rss else None, 2),
              fmt((rss - r["rss_before_load"]) / wb if rss and r.get("rss_before_load") else None, 2),
              f"{frac * 100:.0f}%" if frac is not None else "—",
              fmt(r["rss_after_load"] / 1e9 if r.get("rss_after_load") else None, 2), fmt(r.get("load_s"), 1)]
    if r.get("error"):
        cells[-1] += f" ({r['error']})"
    return "| " + " | ".join(cells) + " |"


def report(args, rows, bw, bandwidth, prefill_lens, wall) -> None:
    import torch

    import transformers

    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print()
    print(f"**{date}** · {cpu_model()} ({os.cpu_count()} CPUs, {cpu_flags()}) · device {args.device} · "
          f"threads {args.threads} · torch {torch.__version__} · transformers {transformers.__version__} · "
          f"{'small geometries' if args.small else 'real geometries, random weights'} · wall {wall / 60:.1f} min · "
          f"load average {args._load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    if bw:
        print(f"read bandwidth (best of 5 at the start and 5 at the end, >= 1 GB): sum fp32 {bw['sum_fp32'] / 1e9:.1f} GB/s, sum bf16 "
              f"{bw['sum_bf16'] / 1e9:.1f}, GEMV fp32 {bw['gemv_fp32'] / 1e9:.1f}, GEMV bf16 {bw['gemv_bf16'] / 1e9:.1f}; "
              f"bound uses the best, {bandwidth / 1e9:.1f} GB/s")
    print()
    pcols = [f"prefill{n} tok/s" for n in prefill_lens]
    head = ["model", "dtype", "ckpt", "engine"] + pcols + ["decode tok/s", "decode tok/s (median step)", "peak RSS GB", "weight GB",
                                                          "read GB/token", "RSS/weights", "(RSS − base)/weights",
                                                          "decode / bw bound", "RSS after load GB", "load s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    by = {(r["model"], r["dtype"], r["engine"]): r for r in rows}
    ratio = lambda a, b: f"**{a / b:.2f}×**" if a and b else "—"  # noqa: E731
    groups = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    for g in groups:
        group = [r for r in rows if (r["model"], r["dtype"]) == g]
        hf = by.get((*g, "hf"))
        for r in group:
            print(table_row(r, head, prefill_lens, bandwidth, hf))
        for r in group:
            if not r["engine"].startswith("vxc") or not hf or hf.get("error") or r.get("error"):
                continue
            pf, hpf = r.get("prefill_tps", {}), hf.get("prefill_tps", {})
            gen_v, gen_h = r.get("generated") or [], hf.get("generated") or []
            same = next((i for i, (a, b) in enumerate(zip(gen_v, gen_h)) if a != b), min(len(gen_v), len(gen_h)))
            cells = ["", "", "", f"*{ENGINE_NAMES[r['engine']]} / transformers*"]
            cells += [ratio(pf.get(str(n)), hpf.get(str(n))) for n in prefill_lens]
            cells += [ratio(r.get("decode_tps"), hf.get("decode_tps")),
                      ratio(r.get("decode_tps_median_step"), hf.get("decode_tps_median_step")),
                      ratio(r.get("peak_rss"), hf.get("peak_rss")),
                      "", "", "", "", f"greedy: first {same}/{len(gen_v)} tokens equal", "", ""]
            print("| " + " | ".join(cells) + " |")
    print()
    print("Geometry (random weights):")
    for m in dict.fromkeys(r["model"] for r in rows):
        print(f"- **{m}**: {describe_geometry(m, args.small)}")
    impl = {f"{r['model']} {r['dtype']}": r.get("hf_experts") for r in rows if r["engine"] == "hf" and r.get("hf_experts")}
    if impl:
        print("- transformers experts implementation: " + ", ".join(f"{k}: {v}" for k, v in impl.items()))
    print()
    print("Notes: checkpoint dtype `ckpt` is the dtype of the safetensors files loaded (`match`: written at the run "
          "dtype; `fp32`: converted at load). Prefill: one warm-up run, then a fresh state per length "
          f"(best of {args.repeats}); " + ("full-width logits at every position on both engines" if args.prefill_logits == "all"
                                          else "logits of the last position only on both engines (vxc "
                                               "prefill(last_only=True), transformers logits_to_keep=1)") + ". Decode: batch 1, "
          f"{args.decode} greedy tokens after a {args.prompt}-token prompt (after a 4-token warm-up), each engine's "
          f"own cache; tok/s = {args.decode - 1} timed steps / their total time, and 1 / the median step time (robust "
          "to other processes on a shared machine). vxc uses `Engine(..., compile_decode=False)` (the Engine default) unless the "
          "row says compile_decode. transformers: `from_pretrained(dtype=...)`, eager (no torch.compile), its default "
          "attention implementation (and experts implementation, listed above for the MoE models). Bound = read "
          "bandwidth / weight bytes read per token (`read GB/token`: every weight once, except an untied input embedding, "
          "of which one row is read, and the routed experts, of which top_k / experts is read; the tied dense models "
          "read every byte; recurrent/KV state traffic is not counted). "
          "Peak RSS = ru_maxrss of the engine's own process (prefill activations included); RSS after load = "
          "ru_maxrss right after loading (vxc maps weights lazily, so pages become resident on first use); base = "
          "ru_maxrss before loading (interpreter, torch and the engine's modules imported), so (RSS − base)/weights "
          "is what running the model adds per weight byte. "
          + (f"Each engine ran {args.rounds} times, interleaved with the other; the best throughput of its rounds "
             "is shown, and the largest RSS. " if args.rounds > 1 else "") +
          "Ratio rows: vxc / transformers for each throughput and for peak RSS; greedy = how many leading generated "
          "tokens agree (bf16 rounding differs between engines, so bf16 runs diverge early).")


if __name__ == "__main__":
    main()
