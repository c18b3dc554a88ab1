#!/usr/bin/env python
"""The batched decode GEMV (issue #14 §1) on a model's projection shapes: vxc's B-row kernel against the same B rows
as B one-row calls and against torch's GEMM (``F.linear``) on the same weights, side by side in one process. Not a
test: a measurement.

The weights are every projection of every layer of the shape (random values, the session dtype), so one sweep
streams the model's projection bytes from memory as a decode step does: ``qwen3-0.6b`` — q 2048×1024, k and v
1024×1024, o 1024×2048, gate and up 3072×1024, down 1024×3072, 28 layers (0.84 GB in bf16); ``mamba2-780m`` —
in 6448×1536 and out 1536×3072, 48 layers (1.40 GB in bf16), the geometries of ``benchlib.models``. For each B in
``--rows`` the three ways take turns (interleaved, ``--rounds`` sweeps each, best kept), and the script prints ms per
sweep, GFLOP/s, the weights' read rate, and the ratios rows / one-at-a-time and rows / torch. Every row of the
B-row result is checked bit for bit against its one-row call (the kernel's contract: a batched step gives each
sequence its single-sequence values); exit status 1 if any differs.

Time only on a quiet machine (no test run or other benchmark beside it).

Usage::

    .venv/bin/python benchmarks/gemv_rows.py                                  # mamba2-780m, bf16, B = 1, 4, 8, 16
    .venv/bin/python benchmarks/gemv_rows.py --shape qwen3-0.6b --dtype fp32 --rows 2,3,7,8
    .venv/bin/python benchmarks/gemv_rows.py --layers 4 --rounds 2            # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    # (out, in) of each projection of one layer, and the number of layers
    "qwen3-0.6b": ([(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024),
                    (1024, 3072)], 28),
    "mamba2-780m": ([(6448, 1536), (1536, 3072)], 48),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mamba2-780m")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts B (1..16)")
    ap.add_argument("--layers", type=int, default=None, help="layers of weights (default: the shape's)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before any OpenMP runtime starts

    import torch

    from vxc.codegen.kernels import dense
    from vxc.codegen.kernels import native as N

    torch.set_num_threads(args.threads)
    if not N.available():
        print("the native library is not available on this machine", file=sys.stderr)
        return 2
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    per_layer, layers = SHAPES[args.shape]
    layers = args.layers or layers
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(o, i, generator=gen) * i ** -0.5).to(dt) for _ in range(layers) for o, i in per_layer]
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    params = sum(w.numel() for w in mats)
    rows = [int(r) for r in args.rows.split(",") if r]
    if any(not 1 <= b <= dense.GEMV_MAX_ROWS for b in rows):
        ap.error(f"--rows: each B in 1..{dense.GEMV_MAX_ROWS}")
    print(f"{args.shape} projections, {layers} layers, {args.dtype}: {nbytes / 1e9:.2f} GB; {args.threads} threads; "
          f"best of {args.rounds} interleaved sweeps")
    print(f"{'B':>3} {'rows ms':>9} {'one-at-a-time ms':>17} {'torch ms':>9} {'rows GFLOP/s':>13} {'rows GB/s':>10} "
          f"{'rows / 1-at-a-time':>19} {'rows / torch':>13}  bit-identical")
    bad = False
    for B in rows:
        xs = {i: torch.randn(B, i, generator=gen).to(dt) for i in {i for _, i in per_layer}}

        def rows_sweep():
            return [dense.linear_native(xs[w.shape[1]], w, None) for w in mats]

        def one_sweep():
            return [[dense.linear_native(xs[w.shape[1]][t:t + 1], w, None) for t in range(B)] for w in mats]

        def torch_sweep():
            return [torch.nn.functional.linear(xs[w.shape[1]], w) for w in mats]

        got, ref = rows_sweep(), one_sweep()
        same = all(torch.equal(y[t:t + 1], rs[t]) for y, rs in zip(got, ref) for t in range(B))
        bad |= not same
        del got, ref
        best = {"rows": float("inf"), "one": float("inf"), "torch": float("inf")}
        with torch.no_grad():
            for _ in range(args.rounds):
                for name, fn in (("rows", rows_sweep), ("one", one_sweep), ("torch", torch_sweep)):
                    t0 = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t0)
        r, o, t = best["rows"], best["one"], best["torch"]
        print(f"{B:>3} {r * 1e3:>9.1f} {o * 1e3:>17.1f} {t * 1e3:>9.1f} {2 * B * params / r / 1e9:>13.0f} "
              f"{nbytes / r / 1e9:>10.1f} {o / r:>18.2f}× {t / r:>12.2f}×  {same}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
