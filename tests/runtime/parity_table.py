"""Parity of vxc against each family's reference, at the numerical floor.

Run as a script to print the parity table::

    .venv/bin/python tests/runtime/parity_table.py [--triton] [--families a,b]

Imported by the runtime tests, which assert on the same measurements.

The references are independent of vxc (``tests/references.py``): transformers
for llama / qwen2 / qwen3 / mamba2 (the native pure-Mamba2 checkpoint is
renamed into ``Mamba2ForCausalLM``), and the plain-torch ``Mamba2AttnOracle``
for both mamba2attn dialects. VINDEX3.md "Numerical floor":

- floor = max(reference fp32 vs the same reference in fp64,
              reference full prefill vs its prefill-then-step)
- tol   = max(2 * floor, 1e-5 * max|logit|)

vxc's logits are compared with the reference's over the padded vocabulary
(both sides return it). Argmax agreement and greedy continuations are taken
over the logical vocabulary on both sides: vxc's sampler never chooses a
padding id, so the reference's greedy loop must not either.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from tests import builders as B  # noqa: E402
from tests import references as R  # noqa: E402

GREEDY_NEW = 32
MIN_DISTINCT = 8


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[Path], Path]
    reference: str  # "hf" (AutoModelForCausalLM.from_pretrained), "hf-native" (native → Mamba2ForCausalLM), "oracle"
    vocab: int  # logical vocabulary (independent constant from the miniature geometry)
    padded_vocab: int
    prompt_len: int = 48  # three SSD chunks of 16
    split: int = 37  # prefill 0..split (two chunks and a part), then step split..n
    prompt_seed: int = 0
    index_base: int | None = None


def _hf(model_type: str, seed: int) -> Callable[[Path], Path]:
    return lambda d: B.build_hf(d, model_type, B.MINI_HF[model_type], seed=seed)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("mamba2-native", lambda d: B.build_native_mamba(d, B.MINI_NATIVE_MAMBA2, seed=11), "hf-native", 101, 112),
    Family("mamba2-hf", _hf("mamba2", 12), "hf", 113, 113),
    Family("llama", _hf("llama", 13), "hf", 103, 103),
    Family("qwen2", _hf("qwen2", 14), "hf", 107, 107),
    Family("qwen3", _hf("qwen3", 15), "hf", 109, 109),
    Family("mamba2attn-native", lambda d: B.build_native_mamba(d, B.MINI_NATIVE_MAMBA2ATTN, seed=16), "oracle", 97, 112),
    Family("oute-base0", lambda d: B.build_oute(d, B.MINI_OUTE, index_base=0, seed=17), "oracle", 131, 131, index_base=0),
    Family("oute-base1", lambda d: B.build_oute(d, B.MINI_OUTE, index_base=1, seed=18), "oracle", 131, 131, index_base=1),
)}


def prompt_ids(f: Family) -> list[int]:
    g = torch.Generator().manual_seed(1000 + f.prompt_seed)
    return torch.randint(0, f.vocab, (f.prompt_len,), generator=g).tolist()


# ------------------------------------------------------------------ building


def build(f: Family, root: Path) -> tuple[Path, Path]:
    """(model dir, lowered .vxir) under ``root``."""
    from vxc.driver import lower_to_file

    mdir = f.build(root / f.name)
    ir = root / f"{f.name}.vxir"
    lower_to_file(mdir, ir)
    return mdir, ir


def engine_for(ir: Path, **kw):
    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    m = parse_file(ir)
    return Engine(m, model_dir_of(m, ir, kw.pop("model_dir", None)), **kw)


# ------------------------------------------------------------------ references


class Reference:
    """One family's reference at fp32 and fp64: full logits, prefill-then-step, greedy."""

    def __init__(self, f: Family, mdir: Path):
        self.f = f
        if f.reference == "oracle":
            self.m32 = R.Mamba2AttnOracle(mdir, torch.float32, index_base=f.index_base)
            self.m64 = R.Mamba2AttnOracle(mdir, torch.float64, index_base=f.index_base)
        elif f.reference == "hf-native":
            self.m32 = R.native_to_hf_mamba2(mdir, torch.float32)
            self.m64 = R.native_to_hf_mamba2(mdir, torch.float64)
        else:
            import transformers

            self.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
            self.m64 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).double().eval()

    def full(self, ids, fp64: bool = False) -> torch.Tensor:
        m = self.m64 if fp64 else self.m32
        if self.f.reference == "oracle":
            return m(ids)
        return R.hf_logits(m, ids)

    def prefill_then_step(self, ids, k: int) -> torch.Tensor:
        if self.f.reference == "oracle":
            return self.m32.prefill_then_step(ids, k)
        return R.hf_prefill_then_step(self.m32, ids, k)

    @torch.no_grad()
    def greedy(self, ids, n: int) -> list[int]:
        """The reference's own greedy loop with its own cache; argmax over the logical vocab."""
        V = self.f.vocab
        out: list[int] = []
        if self.f.reference == "oracle":
            logits = self.m32.prefill(ids)[-1]
            for i in range(n):
                out.append(int(logits[:V].argmax()))
                if i + 1 < n:
                    logits = self.m32.step(out[-1])
            return out
        x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        o = self.m32(x, use_cache=True)
        for i in range(n):
            out.append(int(o.logits[0, -1, :V].argmax()))
            if i + 1 < n:
                o = self.m32(torch.tensor([[out[-1]]]), cache=o.cache, use_cache=True)
        return out


# ------------------------------------------------------------------ measurement


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@dataclass
class Parity:
    family: str
    positions: int
    floor: float
    tol: float
    fp32_vs_fp64: float
    full_vs_step: float
    max_abs_logit: float
    err: float  # vxc vs reference fp32
    err64: float  # vxc vs reference fp64
    err_step: float  # vxc prefill-then-step vs vxc full prefill
    err_step_ref: float  # vxc prefill-then-step vs the reference fp32 full
    argmax: float
    excluded: int
    greedy_vxc: list[int]
    greedy_ref: list[int]
    deterministic: bool
    shape: tuple[int, int]
    logits: torch.Tensor = field(repr=False, default=None)
    seconds: float = 0.0

    @property
    def greedy_match(self) -> bool:
        return self.greedy_vxc == self.greedy_ref

    @property
    def distinct(self) -> int:
        return len(set(self.greedy_vxc))

    def row(self) -> dict[str, Any]:
        return {"family": self.family, "max_abs": self.err, "max_abs_vs_fp64": self.err64, "floor": self.floor,
                "tol": self.tol, "max_logit": self.max_abs_logit, "argmax": self.argmax, "excluded": self.excluded,
                "positions": self.positions, "greedy_match": self.greedy_match, "distinct": self.distinct,
                "step_err": self.err_step, "deterministic": self.deterministic, "seconds": self.seconds}


def vxc_runs(engine, ids: list[int], k: int, n_new: int):
    """(full logits, prefill-then-step logits, greedy ids) from one engine."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    s = Session(engine)
    full = s.prefill(ids)
    s.reset()
    rows = [s.prefill(ids[:k])]
    for t in ids[k:]:
        rows.append(s.step(t)[None])
    stepped = torch.cat(rows, 0)
    s.reset()
    greedy = s.generate(ids, n_new, Sampler(vocab=engine.vocab))
    return full, stepped, greedy


def greedy_fed(session, logits, n: int, vocab: int) -> list[int]:
    """``n`` greedy tokens from ``logits`` over the logical vocabulary, each but the last fed back with
    ``session.step`` (the last one is chosen, not fed: where a resumed run continues)."""
    out: list[int] = []
    for i in range(n):
        out.append(int(logits[:vocab].argmax()))
        if i < n - 1:
            logits = session.step(out[-1])
    return out


def assert_at_floor(p, *, min_logit: float = 4.0, max_floor: float = 1e-3, max_tol: float = 1e-3,
                    max_excluded: int = 2, greedy: bool = True) -> None:
    """The parity checks of a family miniature (VINDEX3.md "Numerical floor"): logits that say something, a floor
    and tolerance in range, vxc within the tolerance of the reference in fp32 and fp64, argmax agreement where the
    margin is clear, prefill-then-step within it too, bit-identical reruns, and (``greedy``) the same greedy
    continuation as the reference's own loop."""
    print(p.row())
    assert p.max_abs_logit > min_logit and 0.0 < p.floor < max_floor and p.tol < max_tol, p.row()
    assert p.err <= p.tol and p.err64 <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded <= max_excluded, p.row()
    assert p.err_step <= p.tol and p.err_step_ref <= p.tol, p.row()
    assert p.deterministic, p.row()
    if greedy:
        assert p.greedy_vxc == p.greedy_ref, (p.greedy_vxc, p.greedy_ref)


def measure(f: Family, mdir: Path, ir: Path, ref: Reference | None = None, engine=None,
            n_new: int = GREEDY_NEW, ids: list[int] | None = None, split: int | None = None) -> Parity:
    t0 = time.perf_counter()
    ids = prompt_ids(f) if ids is None else ids
    k = f.split if split is None else split
    ref = ref or Reference(f, mdir)
    r32, r64 = ref.full(ids), ref.full(ids, fp64=True)
    rstep = ref.prefill_then_step(ids, k)
    fl = R.floor_and_tolerance(r32, r64, rstep)
    engine = engine or engine_for(ir, max_context=256)
    full, stepped, greedy = vxc_runs(engine, ids, k, n_new)
    # a second run: a fresh engine over the same IR, bit-identical
    full2, stepped2, greedy2 = vxc_runs(engine_for(ir, max_context=256), ids, k, n_new)
    det = torch.equal(full, full2) and torch.equal(stepped, stepped2) and greedy == greedy2
    V = f.vocab
    agree, excluded = R.argmax_agreement(r32[:, :V], full[:, :V], fl["tol"])
    gref = ref.greedy(ids, n_new)
    return Parity(
        family=f.name, positions=len(ids), floor=fl["floor"], tol=fl["tol"], fp32_vs_fp64=fl["fp32_vs_fp64"],
        full_vs_step=fl["full_vs_step"], max_abs_logit=fl["max_abs_logit"],
        err=maxabs(full, r32), err64=maxabs(full, r64), err_step=maxabs(stepped, full), err_step_ref=maxabs(stepped, r32),
        argmax=agree, excluded=excluded, greedy_vxc=greedy, greedy_ref=gref, deterministic=det,
        shape=tuple(full.shape), logits=full, seconds=time.perf_counter() - t0)


# ------------------------------------------------------------------ the table


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'family':<18} {'max-abs err':>11} {'vs fp64':>9} {'floor':>9} {'tol':>9} {'max|logit|':>10} "
            f"{'argmax %':>8} {'excluded':>8} {'greedy 32':>10} {'distinct':>8} {'step err':>9} {'bit-equal':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['family']:<18} {r['max_abs']:>11.2e} {r['max_abs_vs_fp64']:>9.2e} {r['floor']:>9.2e} {r['tol']:>9.2e} "
            f"{r['max_logit']:>10.2f} {100 * r['argmax']:>8.1f} {str(r['excluded']) + '/' + str(r['positions']):>8} "
            f"{'match' if r['greedy_match'] else 'DIFFER':>10} {r['distinct']:>8} {r['step_err']:>9.2e} "
            f"{'yes' if r['deterministic'] else 'NO':>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--triton", action="store_true", help="run vxc's Triton kernels (needs TRITON_INTERPRET=1 on CPU)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=GREEDY_NEW)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the miniatures are tiny)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.triton:
        from vxc.codegen import kernels

        kernels.set_backend("triton")
    rows = []
    with tempfile.TemporaryDirectory(prefix="vxc-parity-") as tmp:
        for name in a.families.split(","):
            f = FAMILIES[name]
            mdir, ir = build(f, Path(tmp))
            rows.append(measure(f, mdir, ir, n_new=a.new_tokens).row())
    if a.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows))
    ok = all(r["max_abs"] <= r["tol"] and r["argmax"] == 1.0 and r["greedy_match"] and r["deterministic"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.disable(logging.WARNING)
    raise SystemExit(main())
