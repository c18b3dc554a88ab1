"""The two engines of ``benchmarks/llamacpp.py`` on one GGUF file, each in its own process.

- llama.cpp: ``llama-bench -m F -t T -p 128,512 -n 64 -r R -o json`` (prefill of N random tokens into an empty KV
  cache, logits of the last position; ``tg``: N single-token decode steps from an empty cache), its best repetition
  per test; ``llama-perplexity`` and ``llama-completion`` for the agreement mode.
- vxc: ``vxc lower F.gguf -o m.vxir`` (a refusal is recorded with its message), ``vxc describe --json`` (the bytes
  a decode step reads), then a child process (``llamacpp.py --_child vxc``) that builds the ``Engine`` from the IR
  and times it as ``benchlib/engines.py`` does: one warm-up prefill, then per length the best of ``--repeats``
  prefills of N random tokens from a fresh state; decode: a warm-up run (it captures the native replay), then the
  best of ``--repeats`` runs of N single-token steps from a fresh state (as llama-bench's ``tg``).

Every child's peak RSS comes from ``os.wait4`` (the child's own rusage).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import REPO

SCRIPT = Path(__file__).resolve().parent.parent / "llamacpp.py"  # the entry point its children re-run


# ---------------------------------------------------------------------------------------------------- processes


# Linux keeps a process's peak RSS across exec (the pre-exec image's high-water mark goes into the rusage), so a
# command forked straight from this parent (hundreds of MB after building models) would report at least the
# parent's size. A small launcher forks the command from a fresh interpreter and reports its grandchild's own
# peak (the launcher's few MB are the only inheritance left).
_LAUNCHER = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[2:])\n"
             "_, st, ru = os.wait4(p.pid, 0)\n"
             "open(sys.argv[1], 'w').write(str(ru.ru_maxrss))\n"
             "sys.exit(os.waitstatus_to_exitcode(st))\n")


def run_measured(cmd: list[str], env: dict | None, timeout: float, stdout_path: Path | None = None) -> dict:
    """Run ``cmd``; returns rc, stdout, stderr (tails), wall seconds and the command's own peak RSS (bytes)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("w+", suffix=".rss") as rss_file:
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, rss_file.name, *cmd], env=env, stdout=out,
                             stderr=err, start_new_session=True)
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        res = {"rc": p.returncode, "stdout": out.read(), "stderr": err.read(), "wall_s": time.time() - t0,
               "peak_rss": (int(open(rss_file.name).read() or 0) or ru.ru_maxrss) * (1 if sys.platform == "darwin" else 1024),
               "involuntary_ctx_switches": ru.ru_nivcsw}
        if timed_out.is_set():
            res["error"] = f"timed out after {timeout:.0f} s"
        elif p.returncode != 0:
            res["error"] = f"exit status {p.returncode}"
            if p.returncode in (-signal.SIGILL, 128 + signal.SIGILL, 256 - signal.SIGILL):
                res["error"] += (" (an illegal instruction: a CPU that advertises AMX whose tile instructions fault "
                                 "kills a GGML_NATIVE llama.cpp in ggml_backend_amx_mul_mat; rebuild with --build "
                                 "--build-cflags '-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')")
        return res


def tail(text: str, n: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def run_child(kind: str, argv: list[str], env: dict, timeout: float) -> dict:
    """``llamacpp.py --_child KIND ARGV``; its JSON result, plus peak RSS and wall time."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = Path(f.name)
    try:
        r = run_measured([sys.executable, str(SCRIPT), "--_child", kind, "--_result", str(path)] + argv, env, timeout)
        sys.stderr.write(r["stderr"])
        text = path.read_text()
        res = json.loads(text) if text.strip() else {}
        res["child_wall_s"] = r["wall_s"]
        res["peak_rss"] = r["peak_rss"]
        res["involuntary_ctx_switches"] = r["involuntary_ctx_switches"]
        if r.get("error") and not res.get("error"):
            res["error"] = f"{r['error']}: {tail(r['stderr'], 3)}"
        return res
    finally:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- llama.cpp


def llama_bench(exe: Path, gguf: Path, threads: int, prefill: list[int], decode: int, reps: int, env: dict,
                timeout: float, depth: int = 0) -> dict:
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-p", ",".join(map(str, prefill)), "-n", str(decode),
           "-r", str(reps), "-o", "json"] + (["-d", str(depth)] if depth else [])
    r = run_measured(cmd, env, timeout)
    res = {"cmd": " ".join(cmd), "peak_rss": r["peak_rss"], "wall_s": r["wall_s"]}
    if r.get("error"):
        res["error"] = f"llama-bench {r['error']}: {tail(r['stderr'], 4)}"
        return res
    try:
        records = json.loads(r["stdout"])
    except json.JSONDecodeError as e:
        res["error"] = f"llama-bench printed no JSON ({e}): {tail(r['stdout'] or r['stderr'], 4)}"
        return res
    pf, tg = {}, None
    for rec in records:
        best = max(rec.get("samples_ts") or [rec.get("avg_ts", 0.0)])
        if rec.get("n_prompt", 0) > 0 and rec.get("n_gen", 0) == 0:
            pf[str(rec["n_prompt"])] = best
        elif rec.get("n_gen", 0) > 0 and rec.get("n_prompt", 0) == 0:
            tg = best
    first = records[0] if records else {}
    res.update(prefill_tps=pf, decode_tps=tg, records=records,
               build_commit=first.get("build_commit"), build_number=first.get("build_number"),
               cpu_info=first.get("cpu_info"), n_threads=first.get("n_threads"), model_type=first.get("model_type"),
               model_size=first.get("model_size"))
    return res


def llama_version(exe: Path) -> str | None:
    try:
        p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version: (.+)", p.stdout + p.stderr)
    return m.group(1).strip() if m else None


def llama_perplexity(exe: Path, gguf: Path, text_file: Path, ctx: int, threads: int, kld_out: Path, env: dict,
                     timeout: float) -> dict:
    """``llama-perplexity -c CTX -b CTX`` over the text, its logits saved (``--kl-divergence-base``); retried with a
    halved context while the text is too short for two chunks."""
    while True:
        cmd = [str(exe), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
               "--kl-divergence-base", str(kld_out)]
        r = run_measured(cmd, env, timeout)
        out = r["stdout"] + r["stderr"]
        if "you need at least" in out and ctx > 32:
            ctx //= 2
            continue
        m = re.search(r"Final estimate: PPL = ([0-9.eE+-]+) \+/- ([0-9.eE+-]+)", out)
        res = {"cmd": " ".join(cmd), "ctx": ctx, "ppl": float(m.group(1)) if m else None,
               "ppl_err": float(m.group(2)) if m else None, "kld_file": str(kld_out)}
        if m is None:
            res["error"] = f"llama-perplexity gave no PPL ({r.get('error') or 'rc 0'}): {tail(out, 4)}"
        return res


def read_logits_file(path: Path):
    """A ``--kl-divergence-base`` file: (n_ctx, n_vocab, n_chunk, tokens int32[n_chunk*n_ctx], rows) where ``rows`` is
    uint16 [n_chunk, n_ctx - 1 - n_ctx//2, nv]: per scored position (first = n_ctx//2 .. n_ctx-2 of each chunk,
    predicting the next token) two floats (scale, min_log_prob) in the first four words, then the log-probabilities
    quantised as ``min_log_prob + scale*q`` (q = 0: at or below max-16)."""
    import numpy as np

    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(raw, np.int32, 3, 8))
    off = 20
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, off)
    off += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    per = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(raw, np.uint16, n_chunk * per * nv, off).reshape(n_chunk, per, nv)
    return n_ctx, n_vocab, n_chunk, tokens, rows


def llama_completion(exe: Path, gguf: Path, prompt: str, n: int, threads: int, env: dict, timeout: float) -> dict:
    """Greedy ``n`` tokens (``--temp 0``) from ``prompt``; the continuation is stdout (``--no-display-prompt``)."""
    cmd = [str(exe), "-m", str(gguf), "-p", prompt, "-n", str(n), "--temp", "0", "-t", str(threads), "-c", "1024",
           "--seed", "0", "--no-display-prompt", "-no-cnv", "--verbose-prompt"]
    r = run_measured(cmd, env, timeout)
    res = {"cmd": " ".join(cmd[:4]) + " -p '...' " + " ".join(cmd[6:])}
    if r.get("error"):
        res["error"] = f"{exe.name} {r['error']}: {tail(r['stderr'], 4)}"
        return res
    res["text"] = r["stdout"]
    # --verbose-prompt lists the prompt's tokens as '  id -> 'piece''
    # (each log line may carry a timestamp / level prefix: "0.00.224.214 I    504 -> 'The'")
    res["prompt_tokens"] = [int(t) for t in re.findall(r"^(?:[\d.]+ [A-Z] )?\s*(\d+) -> '", r["stderr"], re.M)]
    return res


# ---------------------------------------------------------------------------------------------------- vxc (parent side)


def vxc_exe() -> list[str]:
    exe = Path(sys.executable).parent / "vxc"
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from vxc.cli import main; main()"]


def vxc_lower(gguf: Path, vxir: Path, env: dict, timeout: float, activations: str | None = None) -> dict:
    """``vxc lower F.gguf -o m.vxir [--activations A]`` (always re-lowered: the IR follows the current vxc); a
    refusal's message."""
    vxir.parent.mkdir(parents=True, exist_ok=True)
    act = ["--activations", activations] if activations else []
    r = run_measured(vxc_exe() + ["lower", str(gguf), "-o", str(vxir)] + act, env, timeout)
    if r.get("error"):
        msg = (r["stdout"] + "\n" + r["stderr"]).strip()
        lines = [ln for ln in msg.splitlines() if ln.strip() and not ln.startswith("Traceback")]
        return {"ok": False, "refusal": " / ".join(lines[-4:])[:600] or r["error"]}
    d = run_measured(vxc_exe() + ["describe", str(vxir), "--json"], env, timeout)
    try:
        desc = json.loads(d["stdout"])
    except json.JSONDecodeError:
        return {"ok": True, "describe_error": tail(d["stdout"] + d["stderr"], 3)}
    w = desc.get("weights", {})
    return {"ok": True, "decode_step_bytes": w.get("decode_step_bytes"), "weight_total_bytes": w.get("total_bytes"),
            "by_encoding": w.get("by_encoding"), "layers": desc.get("layers")}


def start_background_load(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes (a Python spin loop each); stop them with :func:`stop_background_load`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_background_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


# ---------------------------------------------------------------------------------------------------- vxc (children)


def _peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (VmHWM: getrusage's maxrss would include the parent's image)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _engine(args, result: dict):
    import torch

    sys.path.insert(0, str(REPO))
    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime import engine as engine_mod
    from vxc.runtime.engine import DTYPES, Engine
    from vxc.runtime.session import Session

    torch.set_num_threads(args.threads)
    enc = getattr(engine_mod, "encoded_resident", None)
    result.update(threads=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype,
                  encoded_resident_env=os.environ.get("VXC_ENCODED"),
                  encoded_resident=enc() if callable(enc) else None, loadavg_start=os.getloadavg()[0])
    m = parse_file(Path(args._ir))
    mdir = model_dir_of(m, Path(args._ir))
    result["rss_before_load"] = _peak_rss_bytes()
    t0 = time.perf_counter()
    kv = getattr(args, "kv_dtype", None)
    eng = Engine(m, mdir, dtype=DTYPES[args.dtype], device="cpu", max_context=args._max_context,
                 **({"kv_dtype": DTYPES[kv]} if kv else {}))
    result["kv_dtype"] = kv or args.dtype
    from vxc.ir.gguf_container import forget

    forget()  # as vxc exec does once the model is loaded
    result["load_s"] = time.perf_counter() - t0
    result["weight_bytes_resident"] = eng.weight_bytes()
    result["encoded_weights"] = getattr(eng, "encoded_weights", None)
    result["rss_after_load"] = _peak_rss_bytes()
    result["state_bytes"] = eng.state.nbytes()  # the KV rows / recurrent state allocated for max_context
    return eng, Session(eng), m, mdir


def vxc_time_child(args, result: dict) -> None:
    import torch

    eng, sess, _, _ = _engine(args, result)
    prefill_lens = [int(x) for x in args.prefill.split(",") if x]
    gen = torch.Generator().manual_seed(1234)
    prompts = {n: torch.randint(0, eng.vocab, (n,), generator=gen).tolist() for n in prefill_lens}
    last_only = args.prefill_logits == "last"

    depth = torch.randint(0, eng.vocab, (args.depth,), generator=gen).tolist() if args.depth else []
    result["depth"] = args.depth

    def at_depth() -> None:
        """A fresh state holding ``--depth`` tokens (llama-bench -d), not timed."""
        sess.reset()
        if depth:
            sess.prefill(depth, last_only=True)

    pf = {}
    if prefill_lens:
        t = time.perf_counter()
        sess.reset()
        sess.prefill(prompts[prefill_lens[0]], last_only=last_only)  # warm-up
        result["warmup_s"] = time.perf_counter() - t
    for n in prefill_lens:
        best = None
        for _ in range(args.repeats):
            at_depth()
            t = time.perf_counter()
            sess.prefill(prompts[n], last_only=last_only)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        pf[str(n)] = n / best
        print(f"  [vxc {args.dtype}] prefill {n}: {n / best:.1f} tok/s", file=sys.stderr, flush=True)
    result["prefill_tps"] = pf

    def decode_run(n: int) -> list[float]:
        """``n`` single-token steps from a fresh state (holding ``--depth`` tokens), each on the previous step's
        argmax (step times)."""
        at_depth()
        tok, steps = int(prompts[prefill_lens[0]][0]) if prefill_lens else 0, []
        for _ in range(n):
            t = time.perf_counter()
            logits = sess.step(tok)
            steps.append(time.perf_counter() - t)
            tok = int(logits[: eng.vocab].argmax())
        return steps

    t = time.perf_counter()
    decode_run(min(8, args.decode))  # warm-up: the native replay is captured here
    result["decode_warmup_s"] = time.perf_counter() - t
    best = None
    for _ in range(max(1, args.repeats)):
        steps = decode_run(args.decode)
        if best is None or sum(steps) < sum(best):
            best = steps
    result["decode_step_s"] = best
    result["decode_tps"] = len(best) / sum(best)
    result["decode_tps_median_step"] = 1 / sorted(best)[len(best) // 2]
    result["replay"] = eng.replay_status()
    result["loadavg_end"] = os.getloadavg()[0]
    result["peak_rss_self"] = _peak_rss_bytes()
    result["rss_at_decode"] = _rss_bytes()  # resident now, after the prefills and decode steps: the steady state
    print(f"  [vxc {args.dtype}] decode: {result['decode_tps']:.2f} tok/s (median step "
          f"{result['decode_tps_median_step']:.2f}; {result['replay']})", file=sys.stderr, flush=True)


_EOG_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>", "<|end|>")


def vxc_agree_child(args, result: dict) -> None:
    """Perplexity and top-1 agreement on llama-perplexity's own tokens and scored positions (read from its logits
    file), and a greedy continuation of the prompt."""
    import numpy as np
    import torch

    eng, sess, m, mdir = _engine(args, result)
    from vxc.runtime.tokenizer import load_tokenizer

    if args._kld:
        n_ctx, n_vocab, n_chunk, tokens, rows = read_logits_file(Path(args._kld))
        bos = _bos_if_added(m, mdir)
        first = n_ctx // 2
        nll, agree, kl, n = 0.0, 0, 0.0, 0
        kl_max = 0.0
        for c in range(n_chunk):
            ids = tokens[c * n_ctx:(c + 1) * n_ctx].tolist()
            if bos is not None:
                ids[0] = bos  # as llama-perplexity: the chunk's first token replaced by BOS when the vocab adds one
            sess.reset()
            logits = sess.prefill(ids).double()[:, :n_vocab]
            logp = torch.log_softmax(logits, dim=-1)
            for j, pos in enumerate(range(first, n_ctx - 1)):
                nxt = ids[pos + 1]
                nll -= float(logp[pos, nxt])
                row = rows[c, j]
                scale, minlp = np.frombuffer(row[:4].tobytes(), np.float32)
                q = row[4:4 + n_vocab].astype(np.float64)
                base = torch.from_numpy(minlp + scale * q)  # llama.cpp's log-probs (quantised; floor at max-16)
                agree += int(int(q.argmax()) == int(logp[pos].argmax()))
                # KL(llama.cpp || vxc) over llama.cpp's renormalised quantised distribution
                pb = torch.softmax(base, dim=-1)
                d = float((pb * (torch.log(pb.clamp_min(1e-300)) - logp[pos])).sum())
                kl += d
                kl_max = max(kl_max, d)
                n += 1
        result.update(ppl=float(np.exp(nll / n)), scored=n, top1_agree=agree / n, kl_mean=kl / n, kl_max=kl_max,
                      ctx=n_ctx, chunks=n_chunk, bos_replaced=bos)

    if args._prompt_file:
        tok = load_tokenizer(mdir, m)
        prompt = Path(args._prompt_file).read_text()
        ids = tok.encode(prompt).ids
        eog = {i for name in _EOG_NAMES if (i := tok.token_to_id(name)) is not None}
        eog |= _eos_ids(m, mdir)
        sess.reset()
        last = sess.prefill(ids, last_only=True)[-1]
        out = []
        for i in range(args.decode):
            t = int(last[: eng.vocab].argmax())
            if t in eog:
                break
            out.append(t)
            if i + 1 < args.decode:
                last = sess.step(t)
        result.update(prompt_tokens=ids, generated=out, text=tok.decode(out), stopped_at_eog=len(out) < args.decode)

        # llama.cpp's continuation in vxc's tokens (the parent passes its text), to count leading tokens equal
        if args._other_text:
            other = tok.encode(Path(args._other_text).read_text(), add_special_tokens=False).ids
            k = 0
            while k < min(len(other), len(out)) and other[k] == out[k]:
                k += 1
            result.update(other_tokens=other, leading_equal=k)
            if k < min(len(other), len(out)):
                # how close the call was where the two continuations part: vxc's log-probabilities of its own
                # token and of llama.cpp's at that position
                sess.reset()
                row = sess.prefill(ids + out[:k], last_only=True)[-1].double()[: eng.vocab]
                lp = torch.log_softmax(row, dim=-1)
                result.update(diverge_logp_vxc=float(lp[out[k]]), diverge_logp_llama=float(lp[other[k]]))


def _gguf_of(m, mdir: Path) -> Path | None:
    files = [f for f in m.files if getattr(f, "format", None) == "gguf"]
    return Path(mdir) / files[0].path if files else None


def _bos_if_added(m, mdir) -> int | None:
    path = _gguf_of(m, mdir)
    if path is None:
        return None
    from vxc.frontends.gguf_tokenizer import special_ids

    import gguf

    r = gguf.GGUFReader(str(path))
    f = r.fields.get("tokenizer.ggml.add_bos_token")
    model = r.fields.get("tokenizer.ggml.model")
    model = bytes(model.parts[model.data[0]]).decode() if model is not None else None
    add = bool(f.parts[f.data[0]][0]) if f is not None else model == "llama"  # llama.cpp's default per vocab type
    return special_ids(path).get("bos") if add else None


def _eos_ids(m, mdir) -> set[int]:
    path = _gguf_of(m, mdir)
    if path is None:
        return set()
    from vxc.frontends.gguf_tokenizer import special_ids

    return {v for k, v in special_ids(path).items() if k == "eos"}


# ---------------------------------------------------------------------------------------------------- llama.cpp build


def configure_flags(cflags: str = "") -> list[str]:
    """cmake's configure options for the llama.cpp build; ``cflags``: extra C / C++ compiler flags (both)."""
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if cflags:
        flags += [f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}"]
    return flags


def build_commands(dest: Path, version: str | None, jobs: int, cflags: str = "") -> tuple[list[list[str]], Path]:
    """The steps that build llama.cpp from the llama-cpp-python source package's vendored tree (never run in CI):
    pip download of the sdist, unpack, cmake configure (-DGGML_NATIVE=ON -DLLAMA_CURL=OFF, plus ``cflags``), build
    of the targets this script uses. The tree's path depends on the version unpacked; ``<unpacked>`` stands for it."""
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    tree = dest / "<unpacked>" / "vendor" / "llama.cpp"
    return [
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(dest)],
        ["tar", "xzf", str(dest / "llama_cpp_python-*.tar.gz"), "-C", str(dest)],
        ["cmake", "-S", str(tree), "-B", str(tree / "build"), *configure_flags(cflags)],
        ["cmake", "--build", str(tree / "build"), "-j", str(jobs), "--target", "llama-bench", "llama-quantize",
         "llama-perplexity", "llama-completion", "llama-imatrix", "llama-server"],  # the last for serve_load.py
    ], tree


def build_llama_cpp(dest: Path, version: str | None, jobs: int, dry_run: bool, cflags: str = "") -> Path:
    cmds, _ = build_commands(dest, version, jobs, cflags)
    for c in cmds:
        print("$ " + " ".join(c), file=sys.stderr, flush=True)
    if dry_run:
        return dest
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmds[0], check=True)
    sdists = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise SystemExit(f"pip download left no llama_cpp_python-*.tar.gz in {dest}")
    with tarfile.open(sdists[-1]) as t:
        t.extractall(dest, filter="data")
    tree = dest / sdists[-1].name[: -len(".tar.gz")] / "vendor" / "llama.cpp"
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not installed (apt-get install cmake build-essential)")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *configure_flags(cflags)], check=True)
    subprocess.run(cmds[3][:2] + [str(tree / "build")] + cmds[3][3:], check=True)
    return tree
