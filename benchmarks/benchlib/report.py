"""Report: each engine's rounds merged, and the markdown table with the ratios vxc / transformers and the
fraction of the memory-bandwidth bound for decode."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

from benchlib.engines import ENGINE_NAMES
from benchlib.models import describe_geometry


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
        have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
        return ",".join(have) or "-"
    except (OSError, IndexError):
        return "?"


def fmt(x, nd=1):
    if x is None:
        return "—"
    return f"{x:.{nd}f}"


def best_of_rounds(results: list[dict]) -> dict:
    """One engine's rounds merged: the best prefill tok/s per length and the best decode run (its steps,
    tokens and figures kept together); memory figures are the largest seen. The first failed round's error
    is kept when every round failed."""
    ok = [r for r in results if not r.get("error")]
    if not ok:
        return results[0]
    best = dict(max(ok, key=lambda r: r.get("decode_tps") or 0.0))
    best["prefill_tps"] = {n: max(r.get("prefill_tps", {}).get(n, 0.0) for r in ok)
                           for n in dict.fromkeys(n for r in ok for n in r.get("prefill_tps", {}))}
    best["decode_tps_median_step"] = max(r.get("decode_tps_median_step") or 0.0 for r in ok) or None
    for k in ("peak_rss", "rss_after_load", "rss_before_load"):
        if any(r.get(k) for r in ok):
            best[k] = max(r.get(k) or 0 for r in ok)
    best["rounds"] = len(results)
    return best


def active_fraction(r: dict, hf: dict | None) -> float:
    """The fraction of a row's weight bytes one decode step reads, from the transformers row of the same
    model and dtype (the same weights): 1 for the tied dense models, less with an untied embedding or MoE."""
    if r.get("active_bytes") and r.get("weight_bytes"):
        return r["active_bytes"] / r["weight_bytes"]
    if hf and hf.get("active_bytes") and hf.get("weight_bytes"):
        return hf["active_bytes"] / hf["weight_bytes"]
    return 1.0


def table_row(r: dict, head: list[str], prefill_lens: list[int], bandwidth, hf: dict | None = None) -> str:
    wb = r.get("weight_bytes")
    if r.get("error") and not wb:
        cells = [r["model"], r["dtype"], r["ckpt"], ENGINE_NAMES[r["engine"]], f"failed: {r['error']}"]
        return "| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |"
    pf = r.get("prefill_tps", {})
    dec = r.get("decode_tps")
    read = wb * active_fraction(r, hf) if wb else None
    frac = dec * read / bandwidth if (dec and read and bandwidth) else None
    rss = r.get("peak_rss")
    cells = [r["model"], r["dtype"], r["ckpt"], ENGINE_NAMES[r["engine"]]]
    cells += [fmt(pf.get(str(n))) for n in prefill_lens]
    cells += [fmt(dec, 2), fmt(r.get("decode_tps_median_step"), 2), fmt(rss / 1e9 if rss else None, 2), fmt(wb / 1e9, 3 if wb < 1e8 else 2),
              fmt(read / 1e9 if read else None, 3 if (read or 0) < 1e8 else 2),
              fmt(rss / wb if rss else None, 2),
              fmt((rss - r["rss_before_load"]) / wb if rss and r.get("rss_before_load") else None, 2),
              f"{frac * 100:.0f}%" if frac is not None else "—",
              fmt(r["rss_after_load"] / 1e9 if r.get("rss_after_load") else None, 2), fmt(r.get("load_s"), 1)]
    if r.get("error"):
        cells[-1] += f" ({r['error']})"
    return "| " + " | ".join(cells) + " |"


def report(args, rows, bw, bandwidth, prefill_lens, wall) -> None:
    import torch

    import transformers

    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print()
    print(f"**{date}** · {cpu_model()} ({os.cpu_count()} CPUs, {cpu_flags()}) · device {args.device} · "
          f"threads {args.threads} · torch {torch.__version__} · transformers {transformers.__version__} · "
          f"{'small geometries' if args.small else 'real geometries, random weights'} · wall {wall / 60:.1f} min · "
          f"load average {args._load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    if bw:
        print(f"read bandwidth (best of 5 at the start and 5 at the end, >= 1 GB): sum fp32 {bw['sum_fp32'] / 1e9:.1f} GB/s, sum bf16 "
              f"{bw['sum_bf16'] / 1e9:.1f}, GEMV fp32 {bw['gemv_fp32'] / 1e9:.1f}, GEMV bf16 {bw['gemv_bf16'] / 1e9:.1f}"
              + (f", sum fp32 with software prefetch {bw['sum_fp32_prefetch'] / 1e9:.1f}" if bw.get("sum_fp32_prefetch") else "")
              + "; "
              f"bound uses the best, {bandwidth / 1e9:.1f} GB/s")
    print()
    pcols = [f"prefill{n} tok/s" for n in prefill_lens]
    head = ["model", "dtype", "ckpt", "engine"] + pcols + ["decode tok/s", "decode tok/s (median step)", "peak RSS GB", "weight GB",
                                                          "read GB/token", "RSS/weights", "(RSS − base)/weights",
                                                          "decode / bw bound", "RSS after load GB", "load s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    by = {(r["model"], r["dtype"], r["engine"]): r for r in rows}
    ratio = lambda a, b: f"**{a / b:.2f}×**" if a and b else "—"  # noqa: E731
    groups = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    for g in groups:
        group = [r for r in rows if (r["model"], r["dtype"]) == g]
        hf = by.get((*g, "hf"))
        for r in group:
            print(table_row(r, head, prefill_lens, bandwidth, hf))
        for r in group:
            if not r["engine"].startswith("vxc") or not hf or hf.get("error") or r.get("error"):
                continue
            pf, hpf = r.get("prefill_tps", {}), hf.get("prefill_tps", {})
            gen_v, gen_h = r.get("generated") or [], hf.get("generated") or []
            same = next((i for i, (a, b) in enumerate(zip(gen_v, gen_h)) if a != b), min(len(gen_v), len(gen_h)))
            cells = ["", "", "", f"*{ENGINE_NAMES[r['engine']]} / transformers*"]
            cells += [ratio(pf.get(str(n)), hpf.get(str(n))) for n in prefill_lens]
            cells += [ratio(r.get("decode_tps"), hf.get("decode_tps")),
                      ratio(r.get("decode_tps_median_step"), hf.get("decode_tps_median_step")),
                      ratio(r.get("peak_rss"), hf.get("peak_rss")),
                      "", "", "", "", f"greedy: first {same}/{len(gen_v)} tokens equal", "", ""]
            print("| " + " | ".join(cells) + " |")
    print()
    print("Geometry (random weights):")
    for m in dict.fromkeys(r["model"] for r in rows):
        print(f"- **{m}**: {describe_geometry(m, args.small)}")
    impl = {f"{r['model']} {r['dtype']}": r.get("hf_experts") for r in rows if r["engine"] == "hf" and r.get("hf_experts")}
    if impl:
        print("- transformers experts implementation: " + ", ".join(f"{k}: {v}" for k, v in impl.items()))
    print()
    print("Notes: checkpoint dtype `ckpt` is the dtype of the safetensors files loaded (`match`: written at the run "
          "dtype; `fp32`: converted at load). Prefill: one warm-up run, then a fresh state per length "
          f"(best of {args.repeats}); " + ("full-width logits at every position on both engines" if args.prefill_logits == "all"
                                          else "logits of the last position only on both engines (vxc "
                                               "prefill(last_only=True), transformers logits_to_keep=1)") + ". Decode: batch 1, "
          f"{args.decode} greedy tokens after a {args.prompt}-token prompt (after a 4-token warm-up), each engine's "
          f"own cache; tok/s = {args.decode - 1} timed steps / their total time, and 1 / the median step time (robust "
          "to other processes on a shared machine). vxc uses `Engine(..., compile_decode=False)` (the Engine default) unless the "
          "row says compile_decode. transformers: `from_pretrained(dtype=...)`, eager (no torch.compile), its default "
          "attention implementation (and experts implementation, listed above for the MoE models). Bound = read "
          "bandwidth / weight bytes read per token (`read GB/token`: every weight once, except an untied input embedding, "
          "of which one row is read, and the routed experts, of which top_k / experts is read; the tied dense models "
          "read every byte; recurrent/KV state traffic is not counted). "
          "Peak RSS = ru_maxrss of the engine's own process (prefill activations included); RSS after load = "
          "ru_maxrss right after loading (vxc maps weights lazily, so pages become resident on first use); base = "
          "ru_maxrss before loading (interpreter, torch and the engine's modules imported), so (RSS − base)/weights "
          "is what running the model adds per weight byte. "
          + (f"Each engine ran {args.rounds} times, interleaved with the other; the best throughput of its rounds "
             "is shown, and the largest RSS. " if args.rounds > 1 else "") +
          "Ratio rows: vxc / transformers for each throughput and for peak RSS; greedy = how many leading generated "
          "tokens agree (bf16 rounding differs between engines, so bf16 runs diverge early).")
