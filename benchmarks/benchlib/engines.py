"""Engine children: each measurement runs in its own process (``bench.py --_child bandwidth|engine``),
with the parent's thread count, and writes its result as JSON for ``run_child`` to read back."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, SCRIPT

ENGINE_NAMES = {"vxc": "vxc", "vxc-compiled": "vxc (compile_decode)", "hf": "transformers"}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def bandwidth_child(args, result: dict) -> None:
    """Read bandwidth (bytes/s): a >= 1 GB fp32 sum (torch's, and readbw.c's with software prefetch), and fp32 / bf16
    GEMV over a >= 1 GB matrix; best of a few."""
    import torch

    dev = args.device
    n_gb = 1.0
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
    lib = _readbw_lib() if dev == "cpu" else None
    if lib is not None:  # the same sum with software prefetch, 4 KB ahead (see readbw.c)
        n = x.numel() // 64 * 64
        out["sum_fp32_prefetch"] = best(lambda: lib.vxcb_sum(x.data_ptr(), n, 4096), n * 4, reps)
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


def _readbw_lib():
    """readbw.c built with the host compiler into a temporary directory (None, with a note, where that fails: the
    bound then comes from torch's reads alone)."""
    import ctypes
    import shutil

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("note: no C compiler; the read-bandwidth probe runs without software prefetch", file=sys.stderr)
        return None
    out = Path(tempfile.mkdtemp(prefix="vxc-readbw-")) / "readbw.so"
    src = Path(__file__).resolve().parent / "readbw.c"
    try:
        r = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(out)],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"note: the prefetching read probe did not build ({r.stderr.strip()[-300:]})", file=sys.stderr)
            return None
        lib = ctypes.CDLL(str(out))  # stays mapped once its file is gone
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    lib.vxcb_sum.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.vxcb_sum.restype = ctypes.c_float
    return lib


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


def _greedy_decode(last, step, n: int, vocab: int, dev: str) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens, the first from ``last`` (the prompt's logits); ``step(tok)`` returns the next
    logits, and each call (with a device sync) is timed: ``n - 1`` step times."""
    out, steps = [], []
    for i in range(n):
        tok = int(last[:vocab].argmax())  # (a device sync)
        out.append(tok)
        if i + 1 < n:
            t = time.perf_counter()
            last = step(tok)
            _sync(dev)
            steps.append(time.perf_counter() - t)
    return out, steps


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
            return _greedy_decode(sess.prefill(prompt)[-1], sess.step, n, vocab_real, dev)
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
            cache = o.cache

            def step(tok):
                nonlocal cache
                o = model(torch.tensor([[tok]], dtype=torch.long, device=dev), cache=cache, use_cache=True)
                cache = o.cache
                return o.logits[0, -1]

            return _greedy_decode(o.logits[0, -1], step, n, vocab_real, dev)

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
        cmd = [sys.executable, str(SCRIPT), "--_child", kind, "--_result", path] + argv
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
