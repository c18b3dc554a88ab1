#!/usr/bin/env python
"""Prefill attention: vxc's native blocked kernel (``vxc_attention_prefill``) against the twin it replaces for fp32
sequences (torch's fused CPU kernel, ``F.scaled_dot_product_attention`` on K / V expanded to the query heads), on
the same queries and cache, side by side in one process.

Not a test. Per shape (T new tokens after ``start`` cached positions; heads Hq over Hkv; head width D): the best of
``--rounds`` interleaved calls of each, their ms and GMAC/s (2 T (start + T/2) Hq D multiply-adds: the causal
scores and the weighted sum), the ratio twin / native, the largest difference between the two outputs, and (glibc)
the heap bytes each leaves allocated after its first call (torch's fused kernel keeps its scratch).

Usage::

    .venv/bin/python benchmarks/attention_prefill.py
    .venv/bin/python benchmarks/attention_prefill.py --shapes 256x0x16x8x128,256x768x16x8x128 --rounds 9
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vxc.codegen.kernels import attention as A  # noqa: E402
from vxc.codegen.kernels import native as N  # noqa: E402

# T x start x Hq x Hkv x D: the 0.6B softmax-decoder (qwen3) heads in 256-token chunks; SmolLM2-135M's
SHAPES = "256x0x16x8x128,256x256x16x8x128,256x768x16x8x128,256x0x9x3x64,256x256x9x3x64,32x480x16x8x128"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int | None:
    """Bytes the C allocator has handed out and not had back (glibc's mallinfo2), else None."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = _MallInfo2
    m = f()
    return int(m.hblkhd + m.uordblks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated TxSTARTxHQxHKVxD")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if N.load() is None:
        raise SystemExit(f"the native library is unavailable: {N.status()}")
    engines = {"torch fused (twin)": A.attention_twin, "vxc native": A.attention_native}
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, best of {a.rounds} interleaved rounds\n")
    print("| T | start | Hq / Hkv | D | twin ms | native ms | twin GMAC/s | native GMAC/s | twin / native | max abs diff "
          "| heap kept after 1st call: twin · native |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for spec in a.shapes.split(","):
        T, start, Hq, Hkv, D = (int(x) for x in spec.split("x"))
        q = torch.randn(T, Hq, D, generator=g)
        k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)
        cache = {name: (torch.randn(start + T, Hkv, D, generator=torch.Generator().manual_seed(1)),
                        torch.randn(start + T, Hkv, D, generator=torch.Generator().manual_seed(2))) for name in engines}
        best, outs, kept = {}, {}, {}
        with torch.no_grad():
            for r in range(a.rounds):
                for name, fn in engines.items():
                    kc, vc = cache[name]
                    h0 = _heap_in_use()
                    t = time.perf_counter()
                    out = fn(q, k, v, kc, vc, start, D ** -0.5)
                    dt = time.perf_counter() - t
                    if r == 0:
                        outs[name] = out
                        h1 = _heap_in_use()
                        kept[name] = None if h0 is None else h1 - h0 - out.numel() * out.element_size()
                    best[name] = min(best.get(name, dt), dt)
        tw, nv = best["torch fused (twin)"], best["vxc native"]
        mac = 2 * T * (start + T / 2) * Hq * D
        diff = float((outs["torch fused (twin)"] - outs["vxc native"]).abs().max())
        mb = " · ".join("—" if kept[n] is None else f"{kept[n] / 2**20:.1f} MB" for n in engines)
        print(f"| {T} | {start} | {Hq} / {Hkv} | {D} | {tw * 1e3:.2f} | {nv * 1e3:.2f} | {mac / tw / 1e9:.0f} | "
              f"{mac / nv / 1e9:.0f} | {tw / nv:.2f}× | {diff:.1e} | {mb} |", flush=True)


if __name__ == "__main__":
    main()
