#!/usr/bin/env python
"""Native qgemv (GEMV straight from ggml blocks) against the native dense GEMV (vxc_gemv, bf16 / fp32) on the
same logical shape: µs per call, effective GB/s of weight bytes, and the dense/quantised time ratio.

Not a test. Each weight is allocated in enough copies to exceed ``--stream-mb`` (default 512 MB, well past
the L3) and the timed calls cycle through them, so every call streams its weight from memory as a decode step
does (a single copy of a 4096x4096 q4_0 weight, 9.4 MB, would sit in L3 and report cache bandwidth; ``--hot``
adds that column too). The C functions are called directly through ctypes with preallocated outputs (no
dispatcher, no allocation), qgemv and vxc_gemv alike (vxc_gemv takes one row of x: B calls for B rows). Each
kernel is timed ``--rounds`` times, the rounds interleaved across kernels, and its best is reported: on a shared
machine a busy spell then costs every kernel a round rather than one kernel its only timing. Threads: OpenMP's default (OMP_NUM_THREADS, else every core).

Usage::

    .venv/bin/python benchmarks/qgemv.py                       # 4096x4096 and 2048x8192 (rows x cols), B = 1
    .venv/bin/python benchmarks/qgemv.py --batch 1,3 --hot
    .venv/bin/python benchmarks/qgemv.py --shapes 4096x4096 --encodings q4_0,q8_0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vxc.codegen.kernels import quant  # noqa: E402
from vxc.codegen.kernels import native as N  # noqa: E402
from vxc.ir.ggml import ENCODINGS, row_bytes  # noqa: E402
from vxc.runtime.ggml_blocks import QUANTIZE, quantize  # noqa: E402

ENCS = list(quant.NATIVE_ENCODINGS)


def random_blocks(name: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Realistic blocks: the 32-value formats encoded from N(0, 0.02²) weights; the k-quants random bytes with
    their f16 scales set to small positive values (their values do not change the kernel's work)."""
    if name in QUANTIZE:
        return quantize(name, torch.randn(rows, cols, generator=gen) * 0.02)
    e = ENCODINGS[name]
    b = torch.randint(0, 256, (rows, row_bytes(name, cols)), dtype=torch.uint8, generator=gen)
    blocks = b.view(-1, e.type_size)
    at = 0
    for field, w in e.fields:
        if field.endswith(":f16"):
            d = (torch.rand(blocks.shape[0], 1, generator=gen) * 1e-3 + 1e-4).to(torch.float16)
            blocks[:, at:at + 2] = d.view(torch.uint8)
        at += w
    return b


def copies(w: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """``w`` and clones of it (distinct memory, same bytes) totalling at least ``budget`` bytes."""
    n = max(2, -(-budget // max(w.numel() * w.element_size(), 1)))
    return [w] + [w.clone() for _ in range(n - 1)]


def timed(fn, ws: list, iters: int) -> float:
    """µs per call over ``iters`` calls cycling through the weights ``ws``."""
    t0 = time.perf_counter()
    for i in range(iters):
        fn(ws[i % len(ws)])
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x4096,2048x8192", help="rows x cols, comma separated")
    ap.add_argument("--encodings", default=",".join(ENCS))
    ap.add_argument("--batch", default="1", help="rows of x, comma separated")
    ap.add_argument("--iters", type=int, default=100, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=7, help="timings per kernel, interleaved across kernels; best kept")
    ap.add_argument("--stream-mb", type=int, default=512)
    ap.add_argument("--hot", action="store_true", help="also time one (L3-resident) copy")
    a = ap.parse_args()
    lib = N.load()
    if lib is None:
        sys.exit(f"native library unavailable: {N.status()}")
    gen = torch.Generator().manual_seed(0)
    budget = a.stream_mb << 20
    print(f"native: {N.status()} · OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} · "
          f"cpus {os.cpu_count()} · load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"streaming: weights cycled over copies totalling >= {a.stream_mb} MB; best of {a.rounds} interleaved "
          f"rounds of {a.iters} calls")
    hdr = f"{'shape':>10} {'B':>2} {'weight':>6} {'MB':>7} {'µs/call':>9} {'GB/s':>7}"
    hdr += f" {'hot µs':>8} {'hot GB/s':>8}" if a.hot else ""
    hdr += f" {'bf16/this':>9} {'fp32/this':>9}"
    print(hdr)
    for shape in a.shapes.split(","):
        rows, cols = map(int, shape.lower().split("x"))
        for B in map(int, a.batch.split(",")):
            kernels = {}  # name -> (weight bytes, run, weights)
            # dense references: vxc_gemv is one row of x (B calls for B rows)
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                w = (torch.randn(rows, cols, generator=gen) * 0.02).to(dt)
                x = torch.randn(B, cols, generator=gen).to(dt)
                y = torch.empty(B, rows, dtype=dt)

                def run(w, x=x, y=y, bf=N.BF[dt]):
                    for b in range(B):
                        lib.vxc_gemv(w.data_ptr(), x[b].data_ptr(), None, y[b].data_ptr(), rows, cols, bf)

                kernels[name] = (w.numel() * w.element_size(), run, copies(w, budget))
            for enc in a.encodings.split(","):
                w = random_blocks(enc, rows, cols, gen)
                x = torch.randn(B, cols, generator=gen)
                y = torch.empty(B, rows, dtype=torch.float32)

                def run(w, x=x, y=y, code=quant.NATIVE_ENCODINGS[enc]):
                    lib.vxc_qgemv(code, w.data_ptr(), x.data_ptr(), y.data_ptr(), rows, cols, B, 0)

                ref = quant.qgemv_twin(enc, w, x)  # a guard against timing a broken kernel
                run(w)
                assert torch.allclose(y, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max())), enc
                kernels[enc] = (w.numel(), run, copies(w, budget))
            best = {k: float("inf") for k in kernels}
            hot = {k: float("inf") for k in kernels}
            for name, (_, run, ws) in kernels.items():
                for w in ws:
                    run(w)  # pages touched, pool started
            for _ in range(a.rounds):
                for name, (_, run, ws) in kernels.items():
                    best[name] = min(best[name], timed(run, ws, a.iters))
                    if a.hot:
                        hot[name] = min(hot[name], timed(run, ws[:1], a.iters))
            for name, (nbytes, _, _) in kernels.items():
                us = best[name]
                line = f"{shape:>10} {B:>2} {name:>6} {nbytes / 1e6:>7.2f} {us:>9.1f} {nbytes / us / 1e3:>7.1f}"
                if a.hot:
                    line += f" {hot[name]:>8.1f} {nbytes / hot[name] / 1e3:>8.1f}"
                line += f" {best['bf16'] / us:>9.2f} {best['fp32'] / us:>9.2f}"
                print(line, flush=True)
            del kernels


if __name__ == "__main__":
    main()
