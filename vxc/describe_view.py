"""Human rendering of ``vxc describe`` (rich): the same facts as the JSON."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _ranges(layers: list[int]) -> str:
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}–{layers[j]}")
        i = j + 1
    return ", ".join(out)


def _bytes(n: int) -> str:
    """``n`` bytes in B..TiB with one decimal, in exact decimal arithmetic: a byte count the IR's shapes make
    larger than a float can hold (past 1.8e308) is still written, not an OverflowError."""
    for i, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if n < 1024 ** (i + 1) or unit == "TiB":
            if unit == "B":
                return f"{n} B"
            with localcontext() as ctx:  # exact: n / 2**(10 i) has at most 10 i decimals
                ctx.prec = len(str(abs(n))) + 10 * i + 2
                v = (Decimal(n) / Decimal(1024**i)).quantize(Decimal("0.1"), rounding=ROUND_HALF_EVEN)
            return f"{v} {unit}"
    raise AssertionError("unreachable")


def render(d: dict[str, Any], console: Console | None = None) -> None:
    c = console or Console(width=120)
    s = d["state"]
    # the module name is the IR's text: a Text object, neither read as rich markup ("[/x]" would raise
    # MarkupError) nor run through the highlighter (quadratic in its length: a 100 kB name took seconds)
    c.print(Text(d["name"], style="bold"), f" schema {d['schema']}  ·  {d['layers']} layers  ·  vocab {d['vocab']['logical']} "
            f"(padded {d['vocab']['padded']})  ·  compute {d['compute']}"
            + (f"  ·  KV / latent rows {d['kv_dtype']}" if d.get("kv_dtype") else ""))
    t = Table(title="operators", show_edge=False)
    t.add_column("operator")
    t.add_column("count", justify="right")
    t.add_column("layers")
    for kind, e in d["operators"].items():
        t.add_row(kind, str(e["count"]), _ranges(e["layers"]))
    c.print(t)
    su = d["surfaces"]
    c.print(f"surfaces: attention {su['attention']} · ffn {su['ffn']} · moe {su['moe']}")
    w = d["weights"]
    parts = " · ".join(f"{enc} {e['bytes']:,} B in {e['operands']}" for enc, e in w["by_encoding"].items())
    c.print(f"weights: {w['total_bytes']:,} bytes ({_bytes(w['total_bytes'])}) as stored: {parts}")
    c.print(f"  a decode step streams {w['decode_step_bytes']:,} bytes ({_bytes(w['decode_step_bytes'])}) of weights as stored")
    for act, n in w.get("activations", {}).items():
        c.print(f"  {n} encoded operands declare activations {act} (their products quantise their input)")
    c.print(f"state: {s['recurrent_layers']} recurrent layers (all regions fixed) · {s['growing_layers']} growing layers "
            f"(a per-token region)")
    c.print(f"  fixed: {s['fixed_elements']:,} elements = {s['fixed_bytes']:,} bytes ({_bytes(s['fixed_bytes'])})")
    c.print(f"  per token: {s['per_token_elements']:,} elements = {s['per_token_bytes']:,} bytes")
    if "at_context" in s:
        a = s["at_context"]
        if a.get("sequences", 1) > 1:
            c.print(f"  at {a['tokens']:,} tokens × {a['sequences']} sequence slots: {a['bytes']:,} bytes ({_bytes(a['bytes'])}; "
                    f"{a['bytes_per_sequence']:,} per slot)")
        else:
            c.print(f"  at {a['tokens']:,} tokens: {a['bytes']:,} bytes ({_bytes(a['bytes'])})")
    rt = Table(title="state regions", show_edge=False)
    for col in ("layers", "operator", "region", "kind", "shape", "dtype", "growth"):
        rt.add_column(col)
    groups: dict[tuple, list[int]] = {}
    for r in s["regions"]:
        key = (r["operator"], r["name"], r["kind"], "×".join(map(str, r["shape"])), r["dtype"], r["growth"])
        groups.setdefault(key, []).append(r["layer"])
    for key, layers in groups.items():
        rt.add_row(_ranges(layers), *key)
    c.print(rt)
    if "tp" in d:  # vxc describe --tp N: what each rank holds
        tp = d["tp"]
        c.print(f"tensor parallel over {tp['ranks']} ranks (per rank):")
        for r in tp["per_rank"]:
            st = r["state"]
            at = f" · at context {st['at_context_bytes']:,} bytes" if "at_context_bytes" in st else ""
            c.print(f"  rank {r['rank']}: weights {r['weight_bytes']:,} bytes ({_bytes(r['weight_bytes'])}) · state fixed "
                    f"{st['fixed_bytes']:,} bytes · per token {st['per_token_bytes']:,} bytes{at}")
