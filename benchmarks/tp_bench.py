#!/usr/bin/env python
"""Tensor parallelism on one machine (issue #15): decode and prefill tok/s, per-rank peak RSS and what the
collectives cost per step, at TP=1 and TP=N, side by side in one run. Not a test: a measurement.

For each model (``benchlib.models``' shapes with random weights: ``qwen3-0.6b``, ``mamba2-780m``; ``--small`` for
tiny ones) the checkpoint is built once in ``--workdir`` and lowered to a ``.vxir``. Then every configuration runs
in fresh processes of its own (``vxc.runtime.tp.spawn``: a gloo group on loopback, one process per rank, each with
``--threads-per-rank`` compute threads):

- ``tp1 ×T``: one process, T threads (T from ``--tp1-threads``, default 1 and the total of the TP run's threads);
- ``tpN``: N processes, one thread each (``--threads-per-rank``).

Each rank loads the model (only its parts), prefills ``--prompt`` random tokens (best of ``--repeats``), then
decodes ``--decode`` greedy steps; it records its peak RSS (``ru_maxrss``), its weight and state bytes, and the
wall time spent inside ``vxc::all_reduce`` calls (the kernel's implementation wrapped with a timer in that process;
a call's time includes waiting for the slower rank). Printed per configuration: decode tok/s and its ratio to
``tp1 ×1``, prefill tok/s, all-reduces per decode step and their ms per step (mean over ranks), and per rank the
peak RSS and weight MiB, and how many leading greedy tokens equal ``tp1 ×1``'s (under fp32 all must: exit status
1 if not; under bf16 each rank's partial sums are rounded to bf16 before the all-reduce, so a random-weight model's
near-tied logits can part after a few tokens).

Time only on a quiet machine (no test run or other benchmark beside it: on 2 cores a busy neighbour halves
everything).

Usage::

    .venv/bin/python benchmarks/tp_bench.py --small                    # smoke run, about a minute
    .venv/bin/python benchmarks/tp_bench.py --models qwen3-0.6b,mamba2-780m --tp 2 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _rank(rank: int, n: int, ir: str, mdir: str, threads: int, dtype: str, prompt: int, decode: int, repeats: int,
          out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from vxc.codegen.kernels import native
    from vxc.codegen.kernels.registry import KERNELS
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    lib = native.load()
    if lib is not None:
        lib.vxc_set_threads(threads)
    from vxc.codegen.kernels import collective

    spent = {"calls": 0, "s": 0.0, "depth": 0}

    def timer(fn):
        def timed(*args):
            spent["depth"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent["depth"] -= 1
                if not spent["depth"]:  # (the graph's call records the replayable one inside it: counted once)
                    spent["calls"] += 1
                    spent["s"] += time.perf_counter() - t0
        return timed

    # the graph's calls go through the kernel's table; a replayed step calls the recorded host function
    k = KERNELS["all_reduce"]
    for name, fn in list(k.impls.items()):
        k.impls[name] = timer(fn)
    collective._reduce_into = timer(collective._reduce_into)
    t0 = time.perf_counter()
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    engine = Engine(parse_file(Path(ir)), Path(mdir), max_context=prompt + decode + 8, dtype=dt, tp=n, rank=rank)
    load_s = time.perf_counter() - t0
    ids = torch.randint(3, min(engine.vocab, 1000), (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    s = Session(engine)
    best = float("inf")
    for _ in range(repeats):
        s.reset()
        t0 = time.perf_counter()
        logits = s.prefill(ids)
        best = min(best, time.perf_counter() - t0)
    tok = int(logits[-1].argmax())
    s.step(tok)  # warm (a first step may build what later steps reuse)
    spent.update(calls=0, s=0.0)
    toks = []
    t0 = time.perf_counter()
    for _ in range(decode):
        logits = s.step(tok)
        tok = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        toks.append(tok)
    dec_s = time.perf_counter() - t0
    res = dict(rank=rank, load_s=load_s, prefill_tok_s=prompt / best, decode_tok_s=decode / dec_s,
               reduce_calls_per_step=spent["calls"] / decode, reduce_ms_per_step=1e3 * spent["s"] / decode,
               step_ms=1e3 * dec_s / decode, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               weight_bytes=engine.weight_bytes(), state_bytes=engine.state.nbytes(), tokens=toks)
    Path(out.format(rank)).write_text(json.dumps(res))


def _run(ir: Path, mdir: Path, n: int, threads: int, args, work: Path) -> list[dict]:
    from vxc.runtime import tp as TP

    tag = f"tp{n}x{threads}"
    outs = [work / f"{tag}-rank{r}.json" for r in range(n)]
    for o in outs:
        o.unlink(missing_ok=True)
    TP.spawn(_rank, n, n, str(ir), str(mdir), threads, args.dtype, args.prompt, args.decode, args.repeats,
             str(work / f"{tag}-rank{{}}.json"))
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,mamba2-780m")
    ap.add_argument("--tp", default="2", help="rank counts besides 1 (comma-separated)")
    ap.add_argument("--tp1-threads", default=None, help="thread counts of the TP=1 runs (default: 1 and N)")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--workdir", default=os.environ.get("VXC_BENCH_DIR", str(Path(tempfile.gettempdir()) / "vxc-bench")))
    args = ap.parse_args()

    from benchlib.models import ensure_built
    from vxc.driver import lower_to_file

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tps = [int(x) for x in args.tp.split(",") if x]
    failed = False
    rows = []
    for model in args.models.split(","):
        built = ensure_built(model, args.small, args.dtype, work, dict(os.environ))
        mdir = built / "vxc"
        ir = built / "model.vxir"
        if not ir.exists():
            lower_to_file(mdir, ir)
        tp1_threads = ([int(x) for x in args.tp1_threads.split(",")] if args.tp1_threads else
                       sorted({1, *(n * args.threads_per_rank for n in tps)}))
        runs = [(1, t) for t in tp1_threads] + [(n, args.threads_per_rank) for n in tps]
        results = {}
        for n, t in runs:
            results[(n, t)] = _run(ir, mdir, n, t, args, built)
            print(f"[{model}] tp{n} x{t} thread(s)/rank done", file=sys.stderr, flush=True)
        base = results[(1, tp1_threads[0])][0]
        for (n, t), rs in results.items():
            same = min(next((i for i, (a, b) in enumerate(zip(r["tokens"], base["tokens"])) if a != b), len(r["tokens"]))
                       for r in rs)  # leading tokens equal to tp1 x1's
            failed |= same < len(base["tokens"]) and args.dtype == "fp32"  # (bf16 partial sums round differently)
            dec = min(r["decode_tok_s"] for r in rs)
            rows.append(dict(model=model, config=f"tp{n} x{t}", decode=dec, ratio=dec / base["decode_tok_s"],
                             prefill=min(r["prefill_tok_s"] for r in rs),
                             reduces=rs[0]["reduce_calls_per_step"],
                             reduce_ms=sum(r["reduce_ms_per_step"] for r in rs) / len(rs),
                             step_ms=max(r["step_ms"] for r in rs),
                             rss=[r["peak_rss"] / 2**20 for r in rs], weights=[r["weight_bytes"] / 2**20 for r in rs],
                             same=same))
    print(f"\ndtype {args.dtype}, prompt {args.prompt}, {args.decode} decode steps; ratio: decode tok/s / tp1 x1's")
    print(f"{'model':<14} {'config':<8} {'decode tok/s':>12} {'ratio':>6} {'prefill tok/s':>13} {'reduces/step':>12} "
          f"{'reduce ms/step':>14} {'step ms':>8}  per-rank peak RSS MiB / weights MiB  tokens = tp1 x1's")
    for r in rows:
        per = ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(r["rss"], r["weights"]))
        print(f"{r['model']:<14} {r['config']:<8} {r['decode']:>12.2f} {r['ratio']:>5.2f}x {r['prefill']:>13.1f} "
              f"{r['reduces']:>12.0f} {r['reduce_ms']:>14.2f} {r['step_ms']:>8.1f}  {per}  {r['same']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
