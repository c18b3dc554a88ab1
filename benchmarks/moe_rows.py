"""The routed experts of a batched decode step: one ``vxc_moe_ffn_rows`` call for B rows (each selected expert read
once for every row that chose it) against B one-row ``vxc_moe_ffn_step`` calls (each row reading its own experts,
what a batched step did before), interleaved in one process, on random bf16 / fp32 banks (not in CI).

The default shape is a 128-expert, top-8 MoE FFN of a 30B-A3B-class model cut to 12 of its 128 experts' width
(d 2048, expert width 768), so one step's selections read 9.4 MB per distinct expert in bf16. Routing is drawn
per row: ``--routing uniform`` (each row's top-k a random subset) or ``zipf`` (popular experts chosen more
often, as trained routers do). Prints, per B: ms per step of each form, their ratio, the selections and the
distinct experts they hit (the bytes each form reads), and checks that every row's values are the same bits.

    .venv/bin/python benchmarks/moe_rows.py [--rows 2,4,8,16] [--dtype bf16] [--routing zipf]

Time on a quiet machine (nothing else running)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rows", default="2,4,8,16")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--routing", default="uniform", choices=("uniform", "zipf"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from vxc.codegen.kernels import moe
    from vxc.codegen.kernels import native as N

    torch.set_num_threads(args.threads)
    if not N.available():
        sys.exit(f"the native library is not loaded: {N.status()}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    E, k, d, I = args.experts, args.top_k, args.d, args.width
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, d, generator=g) * 0.02).to(dtype)
    up = (torch.randn(E, I, d, generator=g) * 0.02).to(dtype)
    down = (torch.randn(E, d, I, generator=g) * 0.02).to(dtype)
    pop = torch.arange(1, E + 1, dtype=torch.float64).pow(-1.0) if args.routing == "zipf" else torch.ones(E, dtype=torch.float64)
    es = torch.empty((), dtype=dtype).element_size()
    print(f"# {E} experts, top-{k}, d {d}, width {I}, {args.dtype} ({3 * I * d * es / 1e6:.1f} MB an expert), "
          f"{args.routing} routing, {args.threads} threads")
    print("| rows | selections / distinct experts | one call per row ms | rows call ms | per row / rows | bits equal |")
    print("|---:|---|---:|---:|---:|---|")
    for B in (int(b) for b in args.rows.split(",")):
        t_rows, t_one, sel, dist, equal = [], [], 0, 0, True
        for s in range(args.steps + 1):
            x = torch.randn(B, d, generator=g).to(dtype)
            experts = torch.stack([torch.multinomial(pop, k, replacement=False, generator=g) for _ in range(B)])
            weights = torch.rand(B, k, generator=g)
            a = (weights, experts, gate, up, down, None, None, "separate", "silu", None, None)
            t0 = time.perf_counter()
            ys = [moe.experts_native(x[t:t + 1], weights[t:t + 1], experts[t:t + 1], *a[2:]) for t in range(B)]
            t1 = time.perf_counter()
            y = moe.experts_native(x, *a)
            t2 = time.perf_counter()
            equal &= all(torch.equal(y[t:t + 1], ys[t]) for t in range(B))
            if s:  # the first step warms up
                t_one.append(t1 - t0)
                t_rows.append(t2 - t1)
                sel += B * k
                dist += len(torch.unique(experts))
        one, rows = min(t_one) * 1e3, min(t_rows) * 1e3
        print(f"| {B} | {sel / args.steps:.0f} / {dist / args.steps:.1f} | {one:.2f} | {rows:.2f} | {one / rows:.2f}× | "
              f"{'yes' if equal else 'NO'} |")
        if not equal:
            sys.exit(1)


if __name__ == "__main__":
    main()
