#!/usr/bin/env python
"""vxc vs llama.cpp, side by side in one run, on the same GGUF files, interleaved, same thread count (issue 12 §4).

One run of this script:

1. finds llama.cpp (``--llama-cpp DIR``, default ``$VXC_LLAMA_CPP`` or the vendored tree of the llama-cpp-python
   sdist unpacked under /tmp/lcpp): ``build/bin/llama-bench``, ``llama-quantize``, ``llama-perplexity`` (and
   ``llama-completion`` for ``--agreement``, ``llama-imatrix`` for the IQ1 / IQ2 / IQ3_XXS files, ``llama-server`` for serve_load.py). ``--build`` downloads the sdist (pip download --no-deps --no-binary
   :all: llama-cpp-python) into the work dir and builds those targets with cmake -DGGML_NATIVE=ON
   -DLLAMA_CURL=OFF first (a fresh machine; never in CI);
2. builds (or reuses, keyed by model, geometry and precision) the GGUF files in a work dir outside the repository:
   the ``qwen3-0.6b`` / ``mamba2-780m`` shapes with random weights (``benchlib/models.py``'s checkpoints, converted
   by llama.cpp's ``convert_hf_to_gguf.py`` to f32 / bf16, then ``llama-quantize`` f32 -> q8_0 / q4_0 / q4_k_m / q5_k_m / q3_k_m / q2_k /
   the i-quants; iq3_xxs / iq2_* / iq1_* with ``--imatrix`` from ``llama-imatrix`` over the benchmark's text),
   SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M (real weights from their registry wheels);
3. lowers each file with ``vxc lower F.gguf -o m.vxir`` (a refusal is reported in vxc's column with its message;
   llama.cpp's numbers are printed all the same) and reads the bytes a decode step reads from ``vxc describe --json``;
4. measures read bandwidth (benchlib/engines.py's child) at the start and the end;
5. per (model, precision), for ``--rounds`` rounds, alternating which engine goes first: ``llama-bench -m F -t T
   -p 128,512 -n 64 -r R -o json`` and a vxc child on the same file (prefill of N random tokens from an empty state,
   best of R; N single-token decode steps from an empty state, best of R; torch threads = T; fp32 compute with the
   ggml blocks resident for quantised files (VXC_ENCODED=1, unless --vxc-encoded off), bf16 for bf16 files);
   best of rounds per engine;
6. prints the markdown table (and ``--json-out`` the raw results), once per ``--background-load`` level.

``--agreement`` instead compares the engines' outputs on the real models: perplexity of both on an embedded real
text (llama-perplexity vs vxc's prefill logits on llama-perplexity's own tokens and scored positions), top-1
agreement and KL divergence against llama.cpp's saved logits (``--kl-divergence-base``), and greedy continuations
of a prompt (``llama-completion --temp 0``).

Usage::

    .venv/bin/python benchmarks/llamacpp.py --small --precisions q8_0            # smoke run, < 3 minutes
    .venv/bin/python benchmarks/llamacpp.py --rounds 2 --json-out /tmp/lcpp.json # the full table (quiet machine!)
    .venv/bin/python benchmarks/llamacpp.py --models qwen3-0.6b --precisions bf16 --background-load 0,1
    .venv/bin/python benchmarks/llamacpp.py --agreement
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import REPO  # noqa: E402
from benchlib.lcpp_engines import (build_llama_cpp, llama_bench, llama_completion, llama_perplexity,  # noqa: E402
                                   llama_version, run_child, start_background_load, stop_background_load,
                                   vxc_agree_child, vxc_lower, vxc_time_child)
from benchlib.lcpp_models import (ALL_MODELS, PRECISIONS, QUANT_TYPES, RANDOM_MODELS, REAL_MODELS, binary,  # noqa: E402
                                  gguf_facts, log, random_gguf, real_gguf, requantized_real_gguf)
from benchlib.lcpp_report import agreement_table, best_of_rounds, geometry_lines, header, timing_table  # noqa: E402
from benchlib.lcpp_text import PROMPT, TEXT  # noqa: E402

QUANTISED = ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q3_k_m", "q2_k", "iq4_xs", "iq4_nl", "iq3_s", "iq3_m", "q4_1",
             "iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")


def llama_cpp_dir(explicit: str | None = None) -> Path:
    """The llama.cpp tree: ``--llama-cpp``, else ``$VXC_LLAMA_CPP``, else tests/gguf_convert's default."""
    sys.path.insert(0, str(REPO))
    from tests.gguf_convert import llama_cpp_tree

    return Path(explicit).resolve() if explicit else llama_cpp_tree().resolve()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None,
                    help="llama.cpp source tree with build/bin (default: $VXC_LLAMA_CPP, else the vendored tree of "
                         "the llama-cpp-python sdist under /tmp/lcpp)")
    ap.add_argument("--build", action="store_true",
                    help="first download the llama-cpp-python sdist into WORKDIR/llama-cpp-src and build llama.cpp's "
                         "llama-bench, llama-quantize, llama-perplexity, llama-completion, llama-imatrix there (cmake "
                         "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF); then use that tree. Not for CI")
    ap.add_argument("--build-dry-run", action="store_true", help="print the --build steps and exit")
    ap.add_argument("--build-cflags", default="",
                    help="extra C / C++ flags for the --build (CMAKE_C_FLAGS / CMAKE_CXX_FLAGS), e.g. '-mno-amx-tile "
                         "-mno-amx-int8 -mno-amx-bf16' on a CPU that advertises AMX but faults on its tile "
                         "instructions (an Intel Xeon VM, 2026-12-05: llama-bench died with SIGILL in "
                         "ggml_backend_amx_mul_mat, --repack 0 ran)")
    ap.add_argument("--llama-cpp-python-version", default="0.3.36", help="the sdist --build fetches")
    ap.add_argument("--models", default=None,
                    help=f"comma-separated, from {', '.join(ALL_MODELS)} (default: all four; --small: the two "
                         f"random shapes; --agreement: the two real models)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help="for the random-weight shapes (the real models run at their file's precision)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="128,512", help="prefill lengths (llama-bench -p)")
    ap.add_argument("--decode", type=int, default=64, help="decode steps (llama-bench -n); --agreement: new tokens")
    ap.add_argument("--depth", type=int, default=0,
                    help="tokens already in the context before each prefill and decode test (llama-bench -d): decode "
                         "at a long context streams the KV cache too")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per model and precision; best of rounds")
    ap.add_argument("--repeats", type=int, default=2, help="llama-bench -r, and vxc's timed runs per test (best)")
    ap.add_argument("--prefill-logits", default="last", choices=("last", "all"),
                    help="vxc prefill computes the head on the last position (as llama-bench does) or on all")
    ap.add_argument("--vxc-encoded", default="auto", choices=("auto", "on", "off"),
                    help="VXC_ENCODED for vxc's fp32 runs: auto = on for quantised files (ggml blocks resident, "
                         "vxc::qgemv), off otherwise")
    ap.add_argument("--background-load", default="0",
                    help="comma-separated counts of busy processes (a Python spin loop each) running during the "
                         "timing; one table per count (e.g. 0,1)")
    ap.add_argument("--vxc-activations", default=None, choices=("int8_block32",),
                    help="lower the quantised files with this activation precision (vxc lower --activations): "
                         "int8 blocks of 32 as llama.cpp's q8_0 / q8_1 / q8_K dot products take them")
    ap.add_argument("--vxc-dtype", default=None, choices=("fp32", "bf16"),
                    help="vxc's session dtype on the files other than bf16 ones (default fp32; bf16: a bf16 session, "
                         "which keeps a quantised file's blocks resident too unless --vxc-encoded off)")
    ap.add_argument("--vxc-kv-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="vxc's KV cache element type (vxc exec --kv-dtype; default: the compute dtype); llama.cpp "
                         "keeps its default f16 cache")
    ap.add_argument("--small", action="store_true", help="tiny geometries (smoke run, < 3 minutes)")
    ap.add_argument("--agreement", action="store_true", help="the agreement mode (perplexity, top-1, greedy)")
    ap.add_argument("--requantize-real", default=None,
                    help="comma-separated: run the real models on their files requantised to these types "
                         "(llama-quantize --allow-requantize; f32, bf16 or one of the quantised mixes, e.g. q3_k_m, "
                         "q2_k: files no registry package ships; a file's own type is the file itself)")
    ap.add_argument("--requantize-pure", action="store_true",
                    help="with --requantize-real: llama-quantize --pure, the mix's base type (q3_k_m: Q3_K) on every "
                         "matrix whose rows allow it")
    ap.add_argument("--ppl-ctx", type=int, default=256, help="--agreement: llama-perplexity -c (halved until it fits)")
    ap.add_argument("--workdir", default=os.environ.get("VXC_BENCH_LLAMACPP_DIR",
                                                        str(Path(tempfile.gettempdir()) / "vxc-bench-llamacpp")))
    ap.add_argument("--timeout", type=float, default=3600, help="per-process timeout, seconds")
    ap.add_argument("--json-out", default=None, help="also write every raw result here")
    # internal (child processes)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_ir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_max_context", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--_kld", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_prompt_file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_other_text", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--kv-dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)  # the bandwidth child reads it
    return ap.parse_args()


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {}
    try:
        if args._child == "bandwidth":
            from benchlib.engines import bandwidth_child

            bandwidth_child(args, result)
        elif args._child == "vxc":
            vxc_time_child(args, result)
        elif args._child == "vxc-agree":
            vxc_agree_child(args, result)
        else:
            raise SystemExit(f"unknown child {args._child}")
    except Exception as e:  # recorded for the parent's table, then re-raised for the traceback
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        raise
    finally:
        Path(args._result).write_text(json.dumps(result))


def child_env(args, quantised: bool | None = None) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(args.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if quantised is not None:
        on = args.vxc_encoded == "on" or (args.vxc_encoded == "auto" and quantised)
        env["VXC_ENCODED"] = "1" if on else "0"
    return env


def machine_facts(args, llama: Path) -> dict:
    facts = {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "llama_cpp": str(llama),
             "llama_version": llama_version(binary(llama, "llama-bench"))}
    try:
        facts["vxc_commit"] = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %cs"],
                                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "vxc"],
                               capture_output=True, text=True).stdout.strip()
        if dirty:
            facts["vxc_commit"] += " + uncommitted changes under vxc/"
    except OSError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
    except ImportError:
        pass
    return facts


def files_for(args, models: list[str], precisions: list[str], workdir: Path, llama: Path) -> list[dict]:
    """The (model, precision, GGUF path) entries of the run, built or reused."""
    env = child_env(args)
    entries = []
    for m in models:
        if m in REAL_MODELS:
            if args.requantize_real:
                types = args.requantize_real.split(",")
                if bad := [p for p in types if p not in QUANT_TYPES and p not in ("f32", "bf16")]:
                    raise SystemExit(f"--requantize-real {','.join(bad)}: not f32, bf16 or one of {', '.join(QUANT_TYPES)}")
                for p in types:
                    own = p == REAL_MODELS[m]["precision"] and not args.requantize_pure
                    entries.append({"model": m, "precision": p,
                                    "gguf": real_gguf(m, workdir) if own else
                                    requantized_real_gguf(m, p, workdir, llama, args.threads, args.requantize_pure)})
            else:
                entries.append({"model": m, "precision": REAL_MODELS[m]["precision"], "gguf": real_gguf(m, workdir)})
            continue
        for p in precisions:
            entries.append({"model": m, "precision": p,
                            "gguf": random_gguf(m, p, args.small, workdir, llama, env, args.threads, TEXT)})
    return entries


def prepare_vxc(args, e: dict, workdir: Path) -> None:
    """Lower the entry's file for vxc (or record the refusal) and the bytes a decode step reads."""
    g: Path = e["gguf"]
    act = args.vxc_activations if e["precision"] in QUANTISED else None  # declared on encoded operands only
    name = f"{g.stem}.{act}.vxir" if act else f"{g.stem}.vxir"
    lw = vxc_lower(g, workdir / "vxir" / name, child_env(args), args.timeout, act)
    e["vxir"] = str(workdir / "vxir" / name)
    e["vxc_activations"] = act or "fp32"
    facts = gguf_facts(g)
    e["gguf_facts"] = facts
    e["file_bytes"] = facts["file_bytes"]
    if not lw["ok"]:
        e["vxc_refusal"] = lw["refusal"]
    e["vxc_describe"] = lw
    if lw.get("decode_step_bytes"):
        e["step_bytes"], e["step_bytes_from"] = lw["decode_step_bytes"], "vxc describe"
    else:
        e["step_bytes"], e["step_bytes_from"] = facts["decode_step_bytes"], "GGUF tensor sizes"
    e["vxc_dtype"] = "bf16" if e["precision"] == "bf16" else (args.vxc_dtype or "fp32")


def timing(args, entries: list[dict], llama: Path, prefill: list[int], load: int) -> list[dict]:
    bench = binary(llama, "llama-bench")
    rows = []
    procs = start_background_load(load) if load else []
    if load:
        log(f"background load: {load} busy process(es) started (pids {', '.join(str(p.pid) for p in procs)})")
    try:
        for e in entries:
            quantised = e["precision"] in QUANTISED
            env = child_env(args, quantised)
            runs = {"llama": [], "vxc": []}
            for rnd in range(args.rounds):
                order = ("llama", "vxc") if rnd % 2 == 0 else ("vxc", "llama")
                for eng in order:
                    tag = f"{e['model']} {e['precision']}" + (f" round {rnd + 1}/{args.rounds}" if args.rounds > 1 else "")
                    if eng == "llama":
                        log(f"{tag}: llama-bench")
                        r = llama_bench(bench, e["gguf"], args.threads, prefill, args.decode, args.repeats, env,
                                        args.timeout, depth=args.depth)
                        if r.get("decode_tps"):
                            log("  [llama.cpp] " + ", ".join(f"pp{n} {v:.1f}" for n, v in r["prefill_tps"].items())
                                + f", tg{args.decode} {r['decode_tps']:.2f} tok/s")
                    elif e.get("vxc_refusal"):
                        continue
                    else:
                        log(f"{tag}: vxc ({e['vxc_dtype']}, VXC_ENCODED={env['VXC_ENCODED']})")
                        argv = ["--threads", str(args.threads), "--prefill", ",".join(map(str, prefill)),
                                "--decode", str(args.decode), "--repeats", str(args.repeats),
                                "--prefill-logits", args.prefill_logits, "--_ir", e["vxir"], "--dtype", e["vxc_dtype"],
                                "--depth", str(args.depth),
                                "--_max_context", str(args.depth + max(prefill + [args.decode]) + 8)]
                        if args.vxc_kv_dtype:
                            argv += ["--kv-dtype", args.vxc_kv_dtype]
                        r = run_child("vxc", argv, env, args.timeout)
                    if r.get("error"):
                        log(f"  {eng}: {r['error']}")
                    runs[eng].append(r)
            rows.append({**{k: (str(v) if isinstance(v, Path) else v) for k, v in e.items()},
                         "llama": best_of_rounds(runs["llama"]), "vxc": best_of_rounds(runs["vxc"]) if runs["vxc"] else {},
                         "llama_runs": runs["llama"], "vxc_runs": runs["vxc"], "background_load": load})
    finally:
        stop_background_load(procs)
    return rows


def bandwidth(args) -> dict:
    log("measuring read bandwidth")
    return run_child("bandwidth", ["--threads", str(args.threads)], child_env(args), args.timeout).get("bandwidth", {})


def agreement(args, entries: list[dict], llama: Path, workdir: Path) -> list[dict]:
    ppl_exe = binary(llama, "llama-perplexity")
    comp = binary(llama, "llama-completion", required=False) or binary(llama, "llama-cli", required=False)
    d = workdir / "agree"
    d.mkdir(parents=True, exist_ok=True)
    text_file, prompt_file = d / "text.txt", d / "prompt.txt"
    text_file.write_text(TEXT)
    prompt_file.write_text(PROMPT)
    rows = []
    for e in entries:
        env = child_env(args, e["precision"] in QUANTISED)
        label = REAL_MODELS.get(e["model"], {}).get("label", e["model"]) + f" {e['precision'].upper()}"
        row = {"model": e["model"], "precision": e["precision"], "label": label, "gguf": str(e["gguf"]),
               "prompt": PROMPT, "vxc_refusal": e.get("vxc_refusal"), "vxc_encoded": env["VXC_ENCODED"]}
        kld = d / f"{e['gguf'].stem}-c{args.ppl_ctx}.kld"
        log(f"{label}: llama-perplexity")
        row["llama_ppl"] = lp = llama_perplexity(ppl_exe, e["gguf"], text_file, args.ppl_ctx, args.threads, kld, env,
                                                 args.timeout)
        if lp.get("ppl"):
            log(f"  [llama.cpp] PPL {lp['ppl']:.4f} +/- {lp['ppl_err']:.4f} (c={lp['ctx']})")
        other = None
        if comp is not None:
            log(f"{label}: {comp.name} greedy {args.decode}")
            row["llama_greedy"] = lg = llama_completion(comp, e["gguf"], PROMPT, args.decode, args.threads, env,
                                                        args.timeout)
            if lg.get("text") is not None:
                other = d / f"{e['gguf'].stem}.llama.txt"
                other.write_text(lg["text"])
        else:
            log("no llama-completion / llama-cli under build/bin: greedy comparison skipped")
        if not e.get("vxc_refusal"):
            log(f"{label}: vxc (fp32, VXC_ENCODED={env['VXC_ENCODED']})")
            argv = ["--threads", str(args.threads), "--_ir", e["vxir"], "--dtype", "fp32", "--decode", str(args.decode),
                    "--_prompt_file", str(prompt_file), "--_max_context", str(max(args.ppl_ctx, 1024) + 8)]
            if args.vxc_kv_dtype:
                argv += ["--kv-dtype", args.vxc_kv_dtype]
            if lp.get("ppl") and Path(lp["kld_file"]).is_file():
                argv += ["--_kld", lp["kld_file"]]
            if other is not None:
                argv += ["--_other_text", str(other)]
            row["vxc"] = v = run_child("vxc-agree", argv, env, args.timeout)
            if v.get("ppl"):
                log(f"  [vxc] PPL {v['ppl']:.4f}, top-1 agreement {v['top1_agree']:.1%}, KL mean {v['kl_mean']:.2e}")
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    if args._child:
        child(args)
        return
    t0 = time.time()
    load_start = os.getloadavg()[0]
    workdir = Path(args.workdir).resolve()
    if workdir == REPO or REPO in workdir.parents:
        raise SystemExit(f"--workdir {workdir} is inside the repository; pick a directory outside it")
    if args.build or args.build_dry_run:
        tree = build_llama_cpp(workdir / "llama-cpp-src", args.llama_cpp_python_version, os.cpu_count() or 2,
                               args.build_dry_run, args.build_cflags)
        if args.build_dry_run:
            return
        args.llama_cpp = str(tree)
    llama = llama_cpp_dir(args.llama_cpp)
    binary(llama, "llama-bench"), binary(llama, "llama-quantize")  # missing binaries fail here, before any work
    workdir.mkdir(parents=True, exist_ok=True)

    if args.models:
        models = [m for m in args.models.split(",") if m]
    elif args.agreement:
        models = list(REAL_MODELS)
    else:
        models = list(RANDOM_MODELS) if args.small else list(ALL_MODELS)
    for m in models:
        if m not in ALL_MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(ALL_MODELS)}")
    precisions = [p for p in args.precisions.split(",") if p]
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"unknown precision {p!r}; known: {', '.join(PRECISIONS)}")
    prefill = [int(x) for x in args.prefill.split(",") if x]
    loads = [int(x) for x in args.background_load.split(",") if x != ""]

    facts = machine_facts(args, llama)
    entries = files_for(args, models, precisions, workdir, llama)
    for e in entries:
        prepare_vxc(args, e, workdir)
        if e.get("vxc_refusal"):
            log(f"{e['model']} {e['precision']}: vxc refuses the file: {e['vxc_refusal']}")

    if args.agreement:
        rows = agreement(args, entries, llama, workdir)
        facts.update(load_start=load_start, load_end=os.getloadavg()[0], bandwidth={})
        print(header(args, facts).split("\n- read bandwidth")[0])
        print(f"- load average (1 min): {load_start:.2f} at start, {facts['load_end']:.2f} at end")
        print(f"- text: Pride and Prejudice, chapter 1 ({len(TEXT.split())} words); vxc runs fp32 "
              f"(VXC_ENCODED={rows[0]['vxc_encoded'] if rows else '?'} for the quantised files; KV cache "
              f"{args.vxc_kv_dtype or 'fp32'}, llama.cpp's f16) on llama-perplexity's "
              f"tokens, scoring its positions (the second half of each chunk)\n")
        print(agreement_table(rows, args.decode))
        out = {"mode": "agreement", "rows": rows, "facts": facts, "wall_s": time.time() - t0}
    else:
        bw = bandwidth(args)
        tables = []
        for load in loads:
            tables.append((load, timing(args, entries, llama, prefill, load)))
        bw2 = bandwidth(args)
        bw = {k: max(bw.get(k, 0), bw2.get(k, 0)) for k in set(bw) | set(bw2)}
        bound = max(bw.values()) if bw else None
        facts.update(load_start=load_start, load_end=os.getloadavg()[0], bandwidth=bw)
        print(header(args, facts))
        geo = geometry_lines(models, args.small)
        if geo:
            print(geo)
        for load, rows in tables:
            print(f"\n## background load: {load} busy process{'es' if load != 1 else ''}\n")
            print(timing_table(rows, prefill, args.decode, bound, args.small))
        print("\nread/token: weight bytes one decode step reads as stored (vxc describe's weights.decode_step_bytes; "
              "GGUF tensor sizes when vxc refuses the file); the bound is that over the best measured read bandwidth. "
              "Recurrent state / KV traffic is not counted.")
        out = {"mode": "timing", "tables": [{"background_load": ld, "rows": rows} for ld, rows in tables],
               "facts": facts, "bandwidth_bound": bound, "wall_s": time.time() - t0}
    print(f"\n(wall time {time.time() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
