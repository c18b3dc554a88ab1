#!/usr/bin/env python
"""Seeded mutation fuzzing of VINDEX3 text at scale (issue 11: bad input never crashes).

Runs ``--cases`` cases (case ``i`` of ``--seed S`` is seed ``S * 1_000_000 + i`` of
``tests/fuzzing.py``: a golden IR, shrunk, with one to three mutations), classifies each
(accepted / located syntax error / itemised refusal / other) and prints the counts and
every "other" with its seed, mutations and error. Exit status 1 if any case is "other".

Usage::

    .venv/bin/python benchmarks/fuzz_ir.py --cases 10000 --seed 0          # a few minutes on 2 cores
    .venv/bin/python benchmarks/fuzz_ir.py --show 123                       # one case: its mutations and outcome
    .venv/bin/python benchmarks/fuzz_ir.py --show 123 --write /tmp/c.vxir   # ... and its bytes, for `vxc passes`
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests import fuzzing  # noqa: E402

LABELS = {fuzzing.ACCEPTED: "accepted", fuzzing.SYNTAX: "located syntax error",
          fuzzing.REFUSAL: "itemised refusal", fuzzing.CRASH: "other"}
CASES_PER_SEED = 1_000_000


def _init(cap: int) -> None:
    fuzzing.corpus()  # parsed once per worker, before the cap
    if cap:
        fuzzing.memory_cap(cap).__enter__()  # for the worker's life


def _one(seed: int):
    case, out = fuzzing.run_case(seed)
    return seed, case.title(), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--memory-cap-gib", type=float, default=4.0, help="address space each worker may add (0: none)")
    ap.add_argument("--show", type=int, default=None, metavar="SEED", help="run one case seed and print it")
    ap.add_argument("--write", type=Path, default=None, help="with --show: write the case's bytes here")
    args = ap.parse_args(argv)
    cap = int(args.memory_cap_gib * (1 << 30))

    if args.show is not None:
        case = fuzzing.make_case(args.show)
        if args.write:
            args.write.write_bytes(case.data)
        with fuzzing.memory_cap(cap) if cap else _null():
            out = fuzzing.classify(case.data)
        print(case.title())
        print(f"{LABELS[out.kind]} in {out.seconds:.3f} s {out.where} {out.detail}")
        return 1 if out.kind == fuzzing.CRASH else 0

    if not 0 < args.cases <= CASES_PER_SEED:
        ap.error(f"--cases must be 1..{CASES_PER_SEED}")
    seeds = [args.seed * CASES_PER_SEED + i for i in range(args.cases)]
    t0 = time.perf_counter()
    counts: Counter = Counter()
    others: list[tuple[int, str, fuzzing.Outcome]] = []
    slowest = (0.0, None)
    if args.jobs > 1:
        with mp.get_context("fork").Pool(args.jobs, initializer=_init, initargs=(cap,)) as pool:
            results = list(pool.imap_unordered(_one, seeds, chunksize=50))
    else:
        _init(0)
        with fuzzing.memory_cap(cap) if cap else _null():
            results = [_one(s) for s in seeds]
    for seed, title, out in sorted(results, key=lambda r: r[0]):
        counts[out.kind] += 1
        if out.seconds > slowest[0]:
            slowest = (out.seconds, seed)
        if out.kind == fuzzing.CRASH:
            others.append((seed, title, out))
    dt = time.perf_counter() - t0
    print(f"{args.cases} cases, seed {args.seed} (case seeds {seeds[0]}..{seeds[-1]}), {dt:.1f} s, "
          f"slowest case {slowest[0]:.2f} s (seed {slowest[1]})")
    for kind in fuzzing.OUTCOMES:
        print(f"  {LABELS[kind]:<22} {counts[kind]:6d}")
    if others:
        by_where = defaultdict(list)
        for seed, title, out in others:
            parts = out.detail.split(": ")  # "step: ExceptionType: message"
            by_where[(out.where, parts[1] if len(parts) > 2 else parts[0])].append(seed)
        print(f"\n{len(others)} other outcome(s), {len(by_where)} distinct place(s):")
        for (where, kind), ss in sorted(by_where.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(ss):5d} × {where} {kind}  (seeds {', '.join(map(str, ss[:5]))}{', …' if len(ss) > 5 else ''})")
        print()
        for seed, title, out in others:
            print(f"other: {title}\n       → {out.where}: {out.detail}")
    return 1 if others else 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main())
