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
     with 4 layers (the real layer pattern) and 32 experts, random init (decay rates as tests/families'
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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO
from benchlib.engines import ENGINE_NAMES, bandwidth_child, engine_child, run_child
from benchlib.models import MODELS, build_child, ensure_built, geometry
from benchlib.report import best_of_rounds, report


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


if __name__ == "__main__":
    main()
