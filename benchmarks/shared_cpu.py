"""Decode on a shared CPU: vxc's decode tok/s with the machine quiet and with deliberate background load, the
thread governor on (the default) and off (``VXC_THREADS=fixed``: every parallel region on all threads, the
behaviour before the governor), side by side in one run.

    .venv/bin/python benchmarks/shared_cpu.py MODEL [MODEL ...] [--threads 2] [--decode 128] [--load 1]

MODEL is a ``.gguf`` file, a model directory or a ``.vxir`` (lowered to a temporary directory first). Each
measurement is a fresh child process (fp32 compute; prefill of 8 tokens, then ``--decode`` single-token steps;
tok/s over the steps after the first 8, best of ``--repeats``). The background load is ``--load`` processes each
spinning on the CPU for the whole child (plain Python busy loops), started before the engine loads. Printed: tok/s
per (model, load, governor), the ratio governor / fixed at each load, and how far each falls from quiet.
Never part of the test suite; run it with the machine otherwise quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "import time\nend = time.time() + {secs}\nwhile time.time() < end:\n    pass\n"


def child(args) -> None:
    import torch

    sys.path.insert(0, str(REPO))
    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    torch.set_num_threads(args.threads)
    m = parse_file(Path(args.ir))
    eng = Engine(m, model_dir_of(m, Path(args.ir), None), max_context=args.decode + 16)
    s = Session(eng)
    logits = s.prefill(list(range(1, 9)))
    times = []
    tok = int(logits[-1].argmax())
    for _ in range(args.decode):
        t0 = time.perf_counter()
        tok = int(s.step(tok).argmax())
        times.append(time.perf_counter() - t0)
    steady = times[8:]
    print(json.dumps({"tok_s": len(steady) / sum(steady), "replay": eng.replay_status(),
                      "threads": getattr(eng, "thread_report", lambda: None)()}))


def lower(model: Path, work: Path) -> Path:
    if model.suffix == ".vxir":
        return model
    out = work / (model.stem + ".vxir")
    subprocess.run([sys.executable, "-m", "vxc.cli", "lower", str(model), "-o", str(out)], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return out


def measure(ir: Path, args, load: int, governor: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VXC_THREADS="auto" if governor == "on" else "fixed")
    best = 0.0
    for _ in range(args.repeats):
        busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(secs=600)]) for _ in range(load)]
        try:
            time.sleep(0.5 if load else 0)
            r = subprocess.run([sys.executable, __file__, "--_child", "--_ir", str(ir), "--threads", str(args.threads),
                                "--decode", str(args.decode)], env=env, capture_output=True, text=True, timeout=1800)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        if r.returncode:
            raise SystemExit(f"child failed: {r.stderr[-2000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        best = max(best, out["tok_s"])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--load", type=int, default=1, help="busy background processes in the loaded runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_ir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        args.ir = args._ir
        return child(args)
    if not args.models:
        ap.error("name at least one model (.gguf, model directory or .vxir)")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}, "
          f"{args.threads} threads, {args.decode} decode steps, background load {args.load} busy process(es)")
    print("| model | background | fixed tok/s | governor tok/s | governor / fixed |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            ir = lower(model, Path(work))
            quiet = {}
            for load in (0, args.load):
                # interleaved: fixed, governor, at each load
                r = {g: measure(ir, args, load, g) for g in ("off", "on")}
                quiet.setdefault("off", r["off"])
                quiet.setdefault("on", r["on"])
                label = "quiet" if load == 0 else f"{load} busy"
                print(f"| {model.name} | {label} | {r['off']:.2f} ({r['off'] / quiet['off']:.2f}x quiet) | "
                      f"{r['on']:.2f} ({r['on'] / quiet['on']:.2f}x quiet) | **{r['on'] / r['off']:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
