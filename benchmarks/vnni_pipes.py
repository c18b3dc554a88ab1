"""Which vector instructions compete with ``vpdpbusd`` for its execution pipes on this CPU (not in CI).

The packed int8 products (``vxc_qgemv_a8p``: the batched decode step and quantised prefill) are bound by arithmetic
from a few rows of x on, and each weight group's integer sums are rescaled in floats. On an AMD Zen 4 the FP
multiply and FMA of that rescale run on the pipes ``vpdpbusd`` runs on. This script measures it: for each
instruction X it times 8 independent ``vpdpbusd`` chains alone, 8 independent X chains alone, and both together
in one loop (all 512-bit, register-only, 50 M iterations), and prints the ratio together / max(alone). About 1.0
means X runs beside the dots for free; about 2.0 means it takes their pipes. It also prints the ``vpdpbusd``
peak (int8 multiply-adds per second) on one thread and on all of ``--threads``.

    .venv/bin/python benchmarks/vnni_pipes.py [--threads 2]

Needs a C compiler and a CPU with AVX-512 VNNI (it says so and stops otherwise)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define N 50000000L
#define BAR(x) __asm__ volatile("" : "+v"(x))
int main(void) {
    __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512i b0 = _mm512_set1_epi32(2), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0, b6 = b0, b7 = b0;
    __m512 f0 = _mm512_set1_ps(1.f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0;
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
    __m512 g = _mm512_set1_ps(1.0001f);
    static int mem[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    BAR(u); BAR(s); BAR(g);
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        double t = now();
        for (long k = 0; k < N; k++) {
#if NDP
#define D(a) a = _mm512_dpbusd_epi32(a, u, s); BAR(a);
            D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7)
#endif
#if NX
#if MODE == 0
#define X(b, f) f = _mm512_mul_ps(f, g); BAR(f);
#elif MODE == 1
#define X(b, f) f = _mm512_fmadd_ps(f, g, g); BAR(f);
#elif MODE == 2
#define X(b, f) b = _mm512_mullo_epi32(b, u); BAR(b);
#elif MODE == 3
#define X(b, f) b = _mm512_ternarylogic_epi32(b, u, s, 0xf8); BAR(b);
#elif MODE == 4
#define X(b, f) f = _mm512_cvtepi32_ps(b); BAR(f); b = _mm512_castps_si512(f);
#elif MODE == 5
#define X(b, f) f = _mm512_add_ps(f, g); BAR(f);
#elif MODE == 6
#define X(b, f) b = _mm512_add_epi32(b, u); BAR(b);
#elif MODE == 7
#define X(b, f) b = _mm512_and_si512(b, u); BAR(b);
#elif MODE == 8
#define X(b, f) b = _mm512_srli_epi16(b, 2); BAR(b);
#elif MODE == 9
#define X(b, f) b = _mm512_add_epi32(b, _mm512_set1_epi32(mem[k & 15])); BAR(b);
#endif
            X(b0, f0) X(b1, f1) X(b2, f2) X(b3, f3) X(b4, f4) X(b5, f5) X(b6, f6) X(b7, f7)
#endif
        }
        double dt = now() - t;
        if (dt < best) best = dt;
    }
    printf("%.6e\n", best / N);
    return 0;
}
"""

PEAK = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
    long iters = 20000000;
    double best = 1e9;
    long sink = 0;
    int th = 1;
    for (int r = 0; r < 3; r++) {
        double t = now();
#pragma omp parallel reduction(+ : sink)
        {
            __m512i a[12];
            for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
            __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
            for (long k = 0; k < iters; k++) {
#pragma GCC unroll 12
                for (int i = 0; i < 12; i++) { a[i] = _mm512_dpbusd_epi32(a[i], u, s); __asm__ volatile("" ::"v"(a[i])); }
            }
            for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(a[i]);
#pragma omp single
            th = omp_get_num_threads();
        }
        double dt = now() - t;
        if (dt < best) best = dt;
    }
    printf("%d %.6e %ld\n", th, (double)iters * 12 * 64 * th / best, sink & 1);
    return 0;
}
"""

MODES = ["vmulps", "vfmadd", "vpmulld", "vpternlogd", "vcvtdq2ps", "vaddps", "vpaddd", "vpandd", "vpsrlw",
         "vpbroadcastd (load) + vpaddd"]


def build(cc: str, src: str, out: Path, defs: list[str], openmp: bool = False) -> None:
    c = out.with_suffix(".c")
    c.write_text(src)
    cmd = [cc, "-O3", "-march=native", *(["-fopenmp"] if openmp else []), *defs, str(c), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def vnni_available() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler (set CC)", file=sys.stderr)
        return 2
    if not vnni_available():
        print("this CPU has no AVX-512 VNNI (avx512_vnni in /proc/cpuinfo): nothing to measure", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vxc-pipes-") as d:
        tmp = Path(d)
        build(cc, PEAK, tmp / "peak", [], openmp=True)
        for n in sorted({1, args.threads}):
            out = subprocess.run([str(tmp / "peak")], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(n)}).stdout.split()
            print(f"vpdpbusd peak, {out[0]} thread(s): {float(out[1]) / 1e9:.0f} GMAC/s")

        def secs(mode: int, ndp: int, nx: int) -> float:
            exe = tmp / f"m{mode}_{ndp}_{nx}"
            build(cc, SRC, exe, [f"-DMODE={mode}", f"-DNDP={ndp}", f"-DNX={nx}"])
            return float(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)

        dots = secs(0, 1, 0)
        print(f"8 vpdpbusd chains alone: {dots * 1e9:.2f} ns an iteration")
        print(f"{'X (8 chains)':32s} {'X alone ns':>10s} {'with dots ns':>12s} {'together / max(alone)':>22s}")
        for m, name in enumerate(MODES):
            alone, both = secs(m, 0, 1), secs(m, 1, 1)
            print(f"{name:32s} {alone * 1e9:10.2f} {both * 1e9:12.2f} {both / max(alone, dots):22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
