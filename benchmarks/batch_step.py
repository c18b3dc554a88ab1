#!/usr/bin/env python
"""The batched decode step (issue #14 §1) at B rows: the fx graph against its native replay, side by side in one
run, and each against B single-sequence steps. Not a test: a measurement.

For each model (``benchlib.models``' shapes with random weights: ``qwen3-0.6b``, ``mamba2-780m``; ``--small`` for
tiny ones; or ``--model X.vxir``) two engines with ``--sequences`` slots are built in this process, one replaying
batched steps (the default) and one running the batched graph (``replay=False``). Every slot is prefilled with a
different number of tokens; then for each B in ``--rows`` the two engines take turns (interleaved, ``--steps``
steps each, best and median after the first ``--warm`` steps, which include the replay's two captures) on B slots
that change at every step (a rotating window over the slots), each row at its own position. Printed per B: ms per
step of the graph and of the replay, replay / graph, the replay's ms per row, and the single-sequence replayed
step's ms × B (what B sequences cost one at a time). The replay's calls run from C (``vxc_run_program``); a
second pass times the same replay with one ctypes call per kernel (the ``VXC_REPLAY_LOOP=python`` loop),
interleaved step by step with the C loop, and prints both and their ratio. The two engines' logits are compared
step by step (``torch.equal``), and the two loops' too: exit status 1 if any differ.

Time only on a quiet machine (no test run or other benchmark beside it).

Usage::

    .venv/bin/python benchmarks/batch_step.py --small                        # smoke run, about a minute
    .venv/bin/python benchmarks/batch_step.py --models qwen3-0.6b --dtype bf16
    .venv/bin/python benchmarks/batch_step.py --model m.vxir --dtype fp32 --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _engines(ir: Path, dtype, sequences: int, context: int):
    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    m = parse_file(ir)
    mdir = model_dir_of(m, ir, None)
    return [Engine(m, mdir, dtype=dtype, max_context=context, sequences=sequences, replay=r) for r in (True, False)]


def _measure(ir: Path, args) -> tuple[list[dict], bool]:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    S = args.sequences
    replay, graph = _engines(ir, dtype, S, args.context)
    g = torch.Generator().manual_seed(0)
    pos = {}
    with torch.no_grad():
        for s in range(S):
            n = 5 + 3 * s
            ids = torch.randint(3, min(replay.vocab, 1000), (n,), generator=g)
            for e in (replay, graph):
                e.bind_slot(s)
                e.prefill_graph(ids, 0)
            pos[s] = n
    rows, equal = [], True
    for B in args.rows:
        times = {"replay": [], "graph": []}
        with torch.no_grad():
            for i in range(args.warm + args.steps):
                slots = [(i + j) % S for j in range(B)]  # a window over the slots that moves at every step
                toks = [int(t) for t in torch.randint(3, min(replay.vocab, 1000), (B,), generator=g)]
                positions = [pos[s] for s in slots]
                t0 = time.perf_counter()
                a = replay.decode_batch(toks, positions, slots)
                t1 = time.perf_counter()
                b = graph.batch_graph(torch.tensor(toks), positions, torch.tensor(positions), slots, torch.tensor(slots))
                t2 = time.perf_counter()
                equal &= torch.equal(a, b)
                if i >= args.warm:
                    times["replay"].append(t1 - t0)
                    times["graph"].append(t2 - t1)
                for s in slots:
                    pos[s] += 1
        r = replay.batch_replays.get(B)
        state = "single-sequence step" if B == 1 and slots == [0] else (
            "replaying" if r is not None and r.ready else f"refused: {r.refused}" if r is not None else "-")
        rows.append(dict(B=B, graph=min(times["graph"]), graph_med=statistics.median(times["graph"]),
                         replay=min(times["replay"]), replay_med=statistics.median(times["replay"]), state=state))
    # the replays' C loop against their Python loop (after the comparison with the graph: this pass runs each step
    # twice from the same state, restoring the replay engine's state in between)
    for row in rows:
        loops, same = _loops(replay, replay.batch_replays.get(row["B"]), row["B"], S, pos, g, args)
        equal &= same
        row.update(loops)
    # one sequence's replayed single-sequence step (slot 0): what B sequences cost one at a time
    single = []
    with torch.no_grad():
        for i in range(args.warm + args.steps):
            t0 = time.perf_counter()
            replay.decode(5, pos[0])
            single.append(time.perf_counter() - t0)
            pos[0] += 1
    one = min(single[args.warm:])
    for r in rows:
        r["single_x_B"] = one * r["B"]
    return rows, equal


def _loops(engine, r, B: int, S: int, pos: dict, g, args) -> tuple[dict, bool]:
    """The replay of B rows timed with its calls run from C and with one ctypes call per kernel: each step runs once
    per loop from the same state (the engine's state regions copied before the first and restored before the
    second; the order alternates step by step), and both loops must leave the same logits and the same state."""
    import torch

    replays = [x for x in (r, engine.replay) if x is not None and x.ready and x.segments is not None]
    if not replays:
        return {}, True
    times = {"c": [], "python": []}
    same = True
    saved = [x.segments for x in replays]
    regions = list(engine.state.slots.values())  # every slot's regions
    with torch.no_grad():
        for i in range(args.steps):
            slots = [(i + j) % S for j in range(B)]
            toks = [int(t) for t in torch.randint(3, min(engine.vocab, 1000), (B,), generator=g)]
            positions = [pos[s] for s in slots]
            before = [t.clone() for t in regions]
            outs, after = {}, {}
            for k, loop in enumerate(("c", "python") if i % 2 else ("python", "c")):
                if k:
                    for t, b in zip(regions, before):
                        t.copy_(b)
                for x, seg in zip(replays, saved):
                    x.segments = seg if loop == "c" else None
                t0 = time.perf_counter()
                outs[loop] = engine.decode_batch(toks, positions, slots)
                times[loop].append(time.perf_counter() - t0)
                after[loop] = [t.clone() for t in regions]
            same &= torch.equal(outs["c"], outs["python"])
            same &= all(torch.equal(a, b) for a, b in zip(after["c"], after["python"]))
            for s in slots:
                pos[s] += 1
    for x, seg in zip(replays, saved):
        x.segments = seg
    return {"c_loop": min(times["c"]), "py_loop": min(times["python"])}, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,mamba2-780m")
    ap.add_argument("--model", default=None, help="a lowered .vxir instead of the built shapes")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--workdir", default=os.environ.get("VXC_BENCH_DIR", str(Path(tempfile.gettempdir()) / "vxc-bench")))
    args = ap.parse_args()
    args.rows = [int(x) for x in args.rows.split(",") if x]
    if max(args.rows) > args.sequences:
        ap.error(f"--rows up to {max(args.rows)} needs --sequences >= {max(args.rows)}")

    targets = []
    if args.model:
        targets.append((Path(args.model).stem, Path(args.model)))
    else:
        from benchlib.models import ensure_built
        from vxc.driver import lower_to_file

        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        for model in args.models.split(","):
            built = ensure_built(model, args.small, args.dtype, work, dict(os.environ))
            ir = built / "model.vxir"
            if not ir.exists():
                lower_to_file(built / "vxc", ir)
            targets.append((model, ir))
    ok = True
    print(f"dtype {args.dtype}; ms per batched step (best / median of {args.steps}); the B slots change at every step")
    print(f"{'model':<28} {'B':>2} {'graph ms':>15} {'replay ms':>15} {'replay/graph':>12} {'ms/row':>7} "
          f"{'1-seq step x B':>14} {'C loop / py loop ms':>20} {'C/py':>5}  replay")
    for name, ir in targets:
        rows, equal = _measure(ir, args)
        ok &= equal
        for r in rows:
            print(f"{name:<28} {r['B']:>2} {r['graph'] * 1e3:>7.1f} / {r['graph_med'] * 1e3:>5.1f} "
                  f"{r['replay'] * 1e3:>7.1f} / {r['replay_med'] * 1e3:>5.1f} {r['replay'] / r['graph']:>11.2f}x "
                  f"{r['replay'] * 1e3 / r['B']:>7.1f} {r['single_x_B'] * 1e3:>14.1f} "
                  + (f"{r['c_loop'] * 1e3:>9.2f} / {r['py_loop'] * 1e3:>8.2f} {r['c_loop'] / r['py_loop']:>5.2f}"
                     if "c_loop" in r else f"{'-':>20} {'-':>5}") + f"  {r['state']}")
        print(f"{name:<28} replayed logits equal to the graph's, and the C loop's to the Python loop's, at every "
              f"step: {equal}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
