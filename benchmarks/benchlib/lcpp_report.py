"""The markdown tables of ``benchmarks/llamacpp.py``: timing (llama.cpp vs vxc per model and precision, ratios,
decode as a fraction of the bandwidth bound) and agreement (perplexity, top-1, KL, greedy continuations)."""

from __future__ import annotations

from benchlib.lcpp_models import REAL_MODELS
from benchlib.models import describe_geometry
from benchlib.report import cpu_flags, cpu_model, fmt


def best_of_rounds(runs: list[dict]) -> dict:
    """One engine's rounds merged: the best prefill tok/s per length and the best decode tok/s; memory the largest
    seen; the first error kept when every round failed."""
    ok = [r for r in runs if not r.get("error")]
    if not ok:
        return dict(runs[0]) if runs else {"error": "not run"}
    best = dict(max(ok, key=lambda r: r.get("decode_tps") or 0.0))
    best["prefill_tps"] = {n: max(r.get("prefill_tps", {}).get(n, 0.0) for r in ok)
                           for n in dict.fromkeys(n for r in ok for n in r.get("prefill_tps", {}))}
    if any(r.get("decode_tps_median_step") for r in ok):
        best["decode_tps_median_step"] = max(r.get("decode_tps_median_step") or 0.0 for r in ok)
    best["peak_rss"] = max(r.get("peak_rss") or 0 for r in ok) or None
    best["rss_at_decode"] = max(r.get("rss_at_decode") or 0 for r in ok) or None
    best["rounds_ok"] = len(ok)
    best["rounds"] = len(runs)
    return best


def _ratio(a, b):
    return f"{a / b:.2f}×" if a and b else "—"


def _short(msg: str, n: int = 90) -> str:
    msg = " ".join(str(msg).split()).replace("|", "\\|")
    return msg if len(msg) <= n else msg[: n - 1] + "…"


def model_label(row: dict, small: bool) -> str:
    if row["model"] in REAL_MODELS:
        return REAL_MODELS[row["model"]]["label"]
    return f"{row['model']} shape" + (" (small)" if small else "")


def timing_table(rows: list[dict], prefill: list[int], decode: int, bandwidth: float | None, small: bool) -> str:
    pp = " / ".join(f"pp{n}" for n in prefill)
    head = ["model", "precision", "read/token MB", f"llama.cpp {pp} / tg{decode} tok/s",
            f"vxc {pp} / tg{decode}", "vxc dtype, weights", "vxc / llama.cpp prefill", "vxc / llama.cpp decode",
            "decode / bw bound llama.cpp · vxc", "peak RSS MB llama.cpp · vxc",
            "vxc (peak RSS − pre-load RSS − state) / file", "vxc (RSS at decode − pre-load RSS − state) / file"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        lc, vx = r["llama"], r["vxc"]
        step = r.get("step_bytes")

        def speeds(e):
            if e.get("error") and not e.get("prefill_tps") and not e.get("decode_tps"):
                return None
            pf = e.get("prefill_tps", {})
            return " / ".join([fmt(pf.get(str(n))) for n in prefill] + [fmt(e.get("decode_tps"), 2)])

        lcs = speeds(lc)
        if lcs is None:
            notes.append(f"{r['model']} {r['precision']} llama.cpp: {lc.get('error')}")
            lcs = f"failed: {_short(lc.get('error', ''), 50)}"
        if r.get("vxc_refusal"):
            vxs = f"refused: {_short(r['vxc_refusal'])}"
            notes.append(f"{r['model']} {r['precision']} vxc lower refused: {r['vxc_refusal']}")
            wts = "—"
        else:
            vxs = speeds(vx)
            if vxs is None:
                notes.append(f"{r['model']} {r['precision']} vxc: {vx.get('error')}")
                vxs = f"failed: {_short(vx.get('error', ''), 50)}"
            res = vx.get("weight_bytes_resident")
            wts = (f"{vx.get('dtype', r.get('vxc_dtype'))}, " + ("ggml blocks resident" if vx.get("encoded_weights")
                   else "decoded at load") + (f" ({res / 1e6:.0f} MB)" if res else "")
                   + (f", {r['vxc_activations']} activations" if r.get("vxc_activations", "fp32") != "fp32" else ""))
        lpf, vpf = lc.get("prefill_tps", {}), vx.get("prefill_tps", {}) if not r.get("vxc_refusal") else {}
        pf_ratio = " / ".join(_ratio(vpf.get(str(n)), lpf.get(str(n))) for n in prefill)
        dec_ratio = _ratio(vx.get("decode_tps"), lc.get("decode_tps")) if not r.get("vxc_refusal") else "—"

        def frac(e):
            return f"{e['decode_tps'] * step / bandwidth:.0%}" if (e.get("decode_tps") and step and bandwidth) else "—"

        bw = f"{frac(lc)} · {frac(vx) if not r.get('vxc_refusal') else '—'}"
        rss = f"{fmt((lc.get('peak_rss') or 0) / 1e6, 0) if lc.get('peak_rss') else '—'} · " \
              f"{fmt(vx['peak_rss'] / 1e6, 0) if vx.get('peak_rss') and not r.get('vxc_refusal') else '—'}"
        mem = "—"
        if vx.get("peak_rss") and vx.get("rss_before_load") and vx.get("state_bytes") is not None and r.get("file_bytes"):
            mem = f"{(vx['peak_rss'] - vx['rss_before_load'] - vx['state_bytes']) / r['file_bytes']:.2f}×"
        steady = "—"
        if vx.get("rss_at_decode") and vx.get("rss_before_load") and vx.get("state_bytes") is not None and r.get("file_bytes"):
            steady = f"{(vx['rss_at_decode'] - vx['rss_before_load'] - vx['state_bytes']) / r['file_bytes']:.2f}×"
        cells = [model_label(r, small), r["precision"], fmt(step / 1e6, 1) if step else "—", lcs, vxs, wts,
                 pf_ratio, f"**{dec_ratio}**" if dec_ratio != "—" else dec_ratio, bw, rss, mem, steady]
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out.append("")
        out += [f"- {n}" for n in notes]
    return "\n".join(out)


def header(args, facts: dict) -> str:
    lines = [
        f"# vxc vs llama.cpp, {facts['date']}",
        "",
        f"- machine: {cpu_model()} ({facts['cores']} cores visible; flags {cpu_flags()}); threads: {args.threads} "
        f"(llama-bench -t, torch.set_num_threads / OMP_NUM_THREADS for vxc)",
        f"- llama.cpp: {facts.get('llama_version') or '?'}; tree {facts['llama_cpp']}",
        f"- vxc: {facts.get('vxc_commit') or '?'}; torch {facts.get('torch') or '?'}"
        + (f"; KV cache {args.vxc_kv_dtype} (--vxc-kv-dtype)" if getattr(args, "vxc_kv_dtype", None) else ""),
        f"- read bandwidth (best of start/end, same thread count): "
        + (", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in sorted(facts.get("bandwidth", {}).items())) or "not measured"),
        f"- load average (1 min): {facts['load_start']:.2f} at start, {facts['load_end']:.2f} at end",
        f"- rounds: {args.rounds} (engines interleaved per model and precision, order alternating; best of rounds), "
        f"repeats: {args.repeats} (llama-bench -r; vxc best of runs), prefill logits: {args.prefill_logits} position(s) "
        f"(llama-bench computes the last only)",
    ]
    if getattr(args, "depth", 0):
        lines.append(f"- depth: {args.depth} tokens already in the context before every prefill and decode test "
                     f"(llama-bench -d; vxc prefills them untimed)")
    if args.small:
        lines.append("- **--small**: tiny geometries, a smoke run; the numbers say nothing about the real shapes")
    return "\n".join(lines)


def geometry_lines(models: list[str], small: bool) -> str:
    out = []
    for m in models:
        if m not in REAL_MODELS:
            out.append(f"- {m}: {describe_geometry(m, small)}; random weights")
    return "\n".join(out)


def agreement_table(rows: list[dict], n_new: int) -> str:
    head = ["model", "tokens scored (ctx, chunks)", "PPL llama.cpp", "PPL vxc (same tokens)", "top-1 agreement",
            "KL(llama.cpp‖vxc) mean / max", f"greedy {n_new}: vxc tokens equal to llama.cpp's"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    texts = []
    for r in rows:
        lp, vx, lg = r.get("llama_ppl", {}), r.get("vxc", {}), r.get("llama_greedy", {})
        if r.get("vxc_refusal"):
            vcell = f"refused: {_short(r['vxc_refusal'], 70)}"
        elif vx.get("error"):
            vcell = f"failed: {_short(vx['error'], 70)}"
        else:
            vcell = None
        scored = f"{vx.get('scored', '—')} (c={lp.get('ctx', '—')}, {vx.get('chunks', '—')})" if lp else "—"
        lppl = (f"{lp['ppl']:.3f} ± {lp['ppl_err']:.3f}" if lp.get("ppl") else f"failed: {_short(lp.get('error', ''), 50)}")
        if vcell:
            cells = [r["label"], scored, lppl, vcell, "—", "—", "—"]
        else:
            greedy = "—"
            if lg.get("error"):
                greedy = f"llama.cpp: {_short(lg['error'], 50)}"
            elif "leading_equal" in vx:
                same = lg.get("text", "").strip() == vx.get("text", "").strip()
                greedy = f"{vx['leading_equal']} of {len(vx.get('generated', []))}" + (" (text identical)" if same else "")
                if vx.get("diverge_logp_vxc") is not None:
                    greedy += (f"; where they part, vxc's log-probs: its token {vx['diverge_logp_vxc']:.3f}, "
                               f"llama.cpp's {vx['diverge_logp_llama']:.3f}")
                if lg.get("prompt_tokens") and vx.get("prompt_tokens") is not None:
                    greedy += "; prompt tokens " + ("identical" if lg["prompt_tokens"] == vx["prompt_tokens"] else "DIFFER")
            elif not lg:
                greedy = "llama-completion not built"
            cells = [r["label"], scored, lppl, fmt(vx.get("ppl"), 3) if vx.get("ppl") else "—",
                     f"{vx['top1_agree']:.1%}" if vx.get("top1_agree") is not None else "—",
                     f"{vx['kl_mean']:.2e} / {vx['kl_max']:.2e}" if vx.get("kl_mean") is not None else "—", greedy]
        out.append("| " + " | ".join(cells) + " |")
        if lg.get("text") is not None or vx.get("text") is not None:
            texts.append(f"**{r['label']}**, prompt {r['prompt']!r}:")
            if lg.get("text") is not None:
                texts.append(f"- llama.cpp: {lg['text']!r}")
            if vx.get("text") is not None:
                texts.append(f"- vxc:       {vx['text']!r}")
    return "\n".join(out + ([""] + texts if texts else []))
