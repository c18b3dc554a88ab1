#!/usr/bin/env python
"""A bounded loopback load test of ``vxc serve`` (issue #14 §2). Not a test: a measurement with checks.

One run:

1. takes ``--model X.vxir``, or lowers ``--gguf FILE``, or builds vxc's demo miniature (``vxc.demo``: Mamba2 +
   conv-QKV attention, a character tokenizer) in a temporary directory;
2. starts ``vxc serve`` on a free loopback port (``--sequences`` slots, default the largest concurrency);
3. for each concurrency C in ``--concurrency`` (default 1,4,8,16) sends the same ``--requests`` streamed greedy
   completions (temperature 0, ``--max-tokens`` each, prompts of mixed lengths cut from one passage) through C
   concurrent clients (httpx async), and records each request's time to first token, text and completion tokens;
4. checks that no request was lost or failed (HTTP 200, a finish_reason, ``[DONE]``) and that every greedy
   output equals the same request's output at concurrency 1 (each request alone on the server);
5. prints, per concurrency, the aggregate decode rate (completion tokens / wall time of the phase) and the p50 /
   p99 time to first token, and the ratio of the rate with 8 streams to the rate with 1;
6. with ``--gguf FILE`` and ``$VXC_LLAMA_CPP`` naming a llama.cpp build directory (``build/bin/llama-server``),
   runs the same request mix against ``llama-server -np 8`` through its ``/v1/completions`` and prints its row
   beside vxc's (its outputs are checked against its own concurrency-1 run).

It stops by itself: servers are terminated at the end, and the whole run is bounded by ``--timeout`` seconds.
Exit status 1 when a check fails.

Usage::

    .venv/bin/python benchmarks/serve_load.py                        # the demo miniature, about a minute
    .venv/bin/python benchmarks/serve_load.py --model m.vxir --max-tokens 64 --requests 32
    VXC_LLAMA_CPP=/path/to/llama.cpp .venv/bin/python benchmarks/serve_load.py --gguf model.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PASSAGE = (
    "The state of a recurrent layer is a fixed amount of memory that summarises everything the model has read so "
    "far, while an attention layer keeps one row of keys and values for every position it has seen. A server that "
    "decodes many sequences at once keeps one copy of every such region per sequence slot, admits requests into "
    "free slots as they arrive, prefills long prompts in chunks so that no prompt stalls the others for long, and "
    "runs one batched decode step for all the sequences that have a token to feed, reading the weights once for "
    "all of them. Throughput grows with the number of streams until the step stops being bound by reading the "
    "weights; the time to the first token grows with the prompt work queued ahead of a request."
)
PROMPT_CHARS = (12, 40, 120, 300)  # the mix of prompt lengths (characters of the passage)


def log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        k = PROMPT_CHARS[i % len(PROMPT_CHARS)]
        start = (i * 37) % (len(PASSAGE) - k)
        out.append(PASSAGE[start:start + k])
    return out


@dataclass
class Result:
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    error: str = ""


@dataclass
class Phase:
    concurrency: int
    wall: float
    results: list[Result] = field(default_factory=list)
    # vxc's scheduler counters over the level (from /health): generated rows, seconds in batched decode steps and in
    # prefill chunks (the engine calls alone), batched steps; None for an engine that does not report them
    sched: dict | None = None

    @property
    def step_rate(self) -> float | None:
        """Generated tokens per second of batched decode steps: the decode rate without the prefills the level's
        wall time also holds."""
        if not self.sched or self.sched["decode_seconds"] <= 0:
            return None
        return self.sched["decoded_rows"] / self.sched["decode_seconds"]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    def ttft(self, q: float) -> float | None:
        xs = sorted(r.ttft for r in self.results if r.ttft is not None)
        if not xs:
            return None
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def one(client, url: str, body: dict) -> Result:
    t0 = time.perf_counter()
    res = Result(ok=False)
    parts, reason, done = [], None, False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    return Result(False, error=str(ev["error"])[:200])
                if ev.get("usage"):
                    res.tokens = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    # the first streamed choice is the first token (llama-server streams one event per token, with
                    # empty text for a token that prints nothing; vxc streams text as it becomes final)
                    if res.ttft is None and not c.get("finish_reason"):
                        res.ttft = time.perf_counter() - t0
                    if c.get("text"):
                        parts.append(c["text"])
                    if c.get("finish_reason"):
                        reason = c["finish_reason"]
    except Exception as e:  # a lost request is reported, not raised
        return Result(False, error=f"{type(e).__name__}: {e}")
    res.text = "".join(parts)
    if not res.tokens:  # a server that sends no usage chunk: one streamed piece per token (llama.cpp's stream)
        res.tokens = len(parts)
    res.ok = done and reason is not None
    if not res.ok:
        res.error = f"stream ended without {'[DONE]' if not done else 'a finish_reason'}"
    return res


async def phase(base: str, reqs: list[str], concurrency: int, max_tokens: int, model: str | None) -> Phase:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(reqs):
        queue.put_nowait((i, p))
    results: list[Result | None] = [None] * len(reqs)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def worker():
            while True:
                try:
                    i, p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if model:
                    body["model"] = model
                results[i] = await one(client, base + "/v1/completions", body)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Phase(concurrency, wall, [r for r in results])


def wait_up(proc: subprocess.Popen, url: str, deadline: float, what: str) -> None:
    import httpx

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before it served")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up at {url}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def run_engine(name: str, base: str, reqs: list[str], levels: list[int], max_tokens: int, model: str | None,
               deadline: float) -> tuple[list[Phase], list[str]]:
    phases, problems = [], []
    # first-call costs are nobody's latency, and every level starts from the same caches: the warm-up sends every
    # prompt once (4 tokens each), so a prefix cache (vxc's, llama-server's slots) holds them before the first
    # level as before the later ones (with a one-request warm-up the one-stream level alone prefilled every prompt
    # cold: 1013 tokens in 2.14 s against 437 in 0.88 s at the next levels, on the qwen3 shape)
    warm = asyncio.run(phase(base, reqs, max(levels), 4, model))
    bad = [r for r in warm.results if r is None or not r.ok]
    if bad:
        problems.append(f"{name}: {len(bad)} warm-up requests failed: {bad[0].error if bad[0] else 'never sent'}")
    for c in levels:
        left = deadline - time.monotonic()
        if left <= 0:
            problems.append(f"{name}: out of time before concurrency {c}")
            break
        before = sched_stats(base)
        try:
            ph = asyncio.run(asyncio.wait_for(phase(base, reqs, c, max_tokens, model), left))
        except asyncio.TimeoutError:
            problems.append(f"{name}: concurrency {c} ran past --timeout")
            break
        after = sched_stats(base)
        if before and after:
            ph.sched = {k: after[k] - before[k] for k in after}
        bad = [i for i, r in enumerate(ph.results) if r is None or not r.ok]
        for i in bad[:5]:
            problems.append(f"{name} c={c}: request {i} lost or failed: {ph.results[i].error if ph.results[i] else 'never sent'}")
        if bad:
            problems.append(f"{name} c={c}: {len(bad)} of {len(reqs)} requests lost or failed")
        if phases:  # each request's greedy output against the same request alone (concurrency 1)
            ref = phases[0]
            diff = [i for i, (a, b) in enumerate(zip(ref.results, ph.results)) if a and b and a.ok and b.ok and a.text != b.text]
            for i in diff[:3]:
                problems.append(f"{name} c={c}: request {i} differs from its run alone: {ph.results[i].text[:60]!r} vs "
                                f"{ref.results[i].text[:60]!r}")
            if diff:
                problems.append(f"{name} c={c}: {len(diff)} of {len(reqs)} outputs differ from their runs alone")
        phases.append(ph)
        log(f"  {name} c={c}: {ph.tokens} tokens in {ph.wall:.2f} s -> {ph.rate:.1f} tok/s, "
            f"TTFT p50 {fmt_ms(ph.ttft(0.5))} p99 {fmt_ms(ph.ttft(0.99))}")
    return phases, problems


def sched_stats(base: str) -> dict | None:
    """vxc serve's scheduler counters (GET /health), or None (another server, or counters it lacks)."""
    import httpx

    try:
        st = httpx.get(base + "/health", timeout=10).json().get("scheduler") or {}
    except Exception:
        return None
    keys = ("decoded_rows", "decode_seconds", "prefill_seconds", "decode_steps", "prefilled_tokens")
    return {k: st[k] for k in keys} if all(k in st for k in keys) else None


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def table(rows: dict[str, list[Phase]]) -> str:
    out = ["| engine | streams | requests | completion tokens | wall s | decode tok/s (aggregate) | TTFT p50 | TTFT p99 "
           "| in decode steps: s / tok/s | in prefill chunks: s (prompt tokens prefilled) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, phases in rows.items():
        for ph in phases:
            steps = (f"{ph.sched['decode_seconds']:.2f} / {ph.step_rate:.1f}" if ph.step_rate else "n/a")
            pre = f"{ph.sched['prefill_seconds']:.2f} ({ph.sched['prefilled_tokens']})" if ph.sched else "n/a"
            out.append(f"| {name} | {ph.concurrency} | {len(ph.results)} | {ph.tokens} | {ph.wall:.2f} | {ph.rate:.1f} | "
                       f"{fmt_ms(ph.ttft(0.5))} | {fmt_ms(ph.ttft(0.99))} | {steps} | {pre} |")
    for name, phases in rows.items():
        by = {p.concurrency: p for p in phases}
        if 1 in by and 8 in by and by[1].rate > 0:
            out.append(f"\n{name}: 8 streams / 1 stream aggregate decode rate = {by[8].rate / by[1].rate:.2f}x")
            if by[1].step_rate and by[8].step_rate:
                out.append(f"{name}: 8 streams / 1 stream in decode steps alone (prefill chunks left out) = "
                           f"{by[8].step_rate / by[1].step_rate:.2f}x")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a .vxir (default: --gguf lowered, else the demo miniature)")
    ap.add_argument("--gguf", type=Path, help="a GGUF file: lowered for vxc unless --model; llama.cpp's side with $VXC_LLAMA_CPP")
    ap.add_argument("--vxc-activations", default="int8_block32",
                    help="vxc lower --activations for a --gguf lowered here (default int8_block32, llama.cpp's own "
                         "scheme: its quantised products take int8 activations; 'fp32' keeps fp32 activations)")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels (1 is always run first: the reference)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sequences", type=int, help="vxc serve --sequences (default: the largest concurrency)")
    ap.add_argument("--max-context", type=int, default=512, help="vxc serve --max-context (per slot); llama.cpp: per slot too")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--kv-dtype", default="", help="vxc serve --kv-dtype; comma-separated to run vxc once per cache "
                                                   "type in this run (e.g. fp32,fp16; llama-server keeps its default f16)")
    ap.add_argument("--prefix-cache-mib", type=float, help="vxc serve --prefix-cache-mib (default: its own, 256)")
    ap.add_argument("--threads", type=int, help="torch / llama.cpp threads (default: theirs)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    deadline = time.monotonic() + a.timeout
    levels = sorted({int(x) for x in a.concurrency.split(",") if x.strip()} | {1})
    if any(c < 1 for c in levels) or a.requests < 1 or a.max_tokens < 1:
        ap.error("--concurrency levels, --requests and --max-tokens must be positive")
    work = Path(tempfile.mkdtemp(prefix="vxc-serve-load-"))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    procs: list[subprocess.Popen] = []
    try:
        model = a.model
        if model is None and a.gguf is not None:
            model = work / "model.vxir"
            acts = [] if a.vxc_activations == "fp32" else ["--activations", a.vxc_activations]
            log(f"lowering {a.gguf} -> {model} (activations: {a.vxc_activations})")
            subprocess.run([sys.executable, "-m", "vxc.cli", "lower", str(a.gguf), "-o", str(model), *acts], check=True, env=env)
        if model is None:
            from vxc.demo import build_demo
            from vxc.driver import lower_to_file

            mdir = build_demo(work / "mini")
            model = work / "mini.vxir"
            lower_to_file(mdir, model)
            log(f"built the demo miniature: {model}")
        reqs = prompts(a.requests)
        seqs = a.sequences or max(levels)
        rows, problems = {}, []
        kvs = [k.strip() for k in a.kv_dtype.split(",") if k.strip()] or [None]
        for kv in kvs:
            port = free_port()
            cmd = [sys.executable, "-m", "vxc.cli", "serve", str(model), "--port", str(port), "--sequences", str(seqs),
                   "--max-context", str(a.max_context), "--chunk", str(a.chunk), "--dtype", a.dtype,
                   "--max-queue", str(max(64, a.requests))] + (["--kv-dtype", kv] if kv else []) + (
                   ["--prefix-cache-mib", str(a.prefix_cache_mib)] if a.prefix_cache_mib is not None else [])
            log("starting: " + " ".join(cmd))
            p = subprocess.Popen(cmd, env=env, cwd=REPO)
            procs.append(p)
            base = f"http://127.0.0.1:{port}"
            wait_up(p, base + "/health", deadline, "vxc serve")
            name = f"vxc (kv {kv})" if kv else "vxc"
            log(f"{name} serve: {a.requests} requests x {a.max_tokens} tokens at concurrency {levels}, {seqs} slots")
            rows[name], pr = run_engine(name, base, reqs, levels, a.max_tokens, None, deadline)
            problems += pr
            stop(p)
        lcpp = os.environ.get("VXC_LLAMA_CPP")
        if lcpp and a.gguf is not None:
            binary = Path(lcpp) / "build" / "bin" / "llama-server"
            if not binary.is_file():
                problems.append(f"$VXC_LLAMA_CPP: no {binary}")
            else:
                port = free_port()
                cmd = [str(binary), "-m", str(a.gguf), "-np", "8", "-c", str(8 * a.max_context), "--port", str(port),
                       "--host", "127.0.0.1"] + (["-t", str(a.threads)] if a.threads else [])
                log("starting: " + " ".join(cmd))
                q = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(q)
                base = f"http://127.0.0.1:{port}"
                wait_up(q, base + "/health", deadline, "llama-server")
                rows["llama.cpp -np 8"], pr = run_engine("llama.cpp", base, reqs, levels, a.max_tokens, None, deadline)
                problems += pr
                stop(q)
        elif a.gguf is not None:
            log("note: set VXC_LLAMA_CPP to a llama.cpp build directory for the llama-server side-by-side")
        print(table(rows))
        if a.json_out:
            a.json_out.write_text(json.dumps({name: [{"concurrency": ph.concurrency, "wall_s": ph.wall,
                                                      "completion_tokens": ph.tokens, "tok_per_s": ph.rate,
                                                      "ttft_s": [r.ttft if r else None for r in ph.results],
                                                      "ok": [bool(r and r.ok) for r in ph.results],
                                                      "scheduler": ph.sched} for ph in phases]
                                              for name, phases in rows.items()}, indent=1))
        if problems:
            print("\nCHECKS FAILED:\n  " + "\n  ".join(problems))
            return 1
        print(f"\nchecks: 0 lost or failed; every greedy output equal to the same request run alone "
              f"({a.requests} requests x {len(levels)} levels per engine)")
        return 0
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
