"""Helpers of the kimi_linear / deepseek_v3 / hybrid tests: miniature builders (transformers'
save_pretrained plus the hub spellings), the transformers reference with its floor, and vxc runs.
Nothing here reads vxc's operator declarations; geometry is written out as constants by the tests.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests import builders as B
from tests import references as R
from tests.hf_random import random_hf_model

GREEDY_NEW = 32
MIN_DISTINCT = 8


def build(out_dir: Path, model_type: str, overrides: dict, seed: int) -> Path:
    """A random transformers model saved with save_pretrained, perturbed where the reference's init would
    hide a defect: norm weights away from 1 (a skipped norm weight cannot pass), KDA decay rates
    exp(A_log) log-uniform in [0.05, 2] and dt_bias spread (the reference's init decays the state to
    nothing within a token or two, so a wrong recurrence would hide), and a nonzero selection bias
    (``e_score_correction_bias`` starts at 0, so a router ignoring it would pass)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = B.hf_config(model_type, {"initializer_range": B.HF_INITIALIZER_RANGE, **overrides})
    model = random_hf_model(cfg, seed, norm_std=0.2, dt_bias="set")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def copy_weights(src: Path, dst: Path, rename: dict[str, str] | None = None) -> None:
    """Copy the safetensors of ``src`` into ``dst``, renaming keys by substring (a dialect's spelling)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).glob("*.safetensors"):
        tensors = load_file(str(f))
        if rename:
            out = {}
            for k, v in tensors.items():
                for a, b in rename.items():
                    k = k.replace(a, b)
                out[k] = v
            tensors = out
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})


def write_config(dst: Path, cfg: dict) -> None:
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=2))


def read_config(d: Path) -> dict:
    return json.loads((Path(d) / "config.json").read_text())


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(3000 + seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ------------------------------------------------------------------ reference (transformers 5.24)


class Reference:
    def __init__(self, model_dir: Path, vocab: int, moe: bool):
        import transformers

        self.vocab = vocab
        self.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        m64 = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if moe:
            m64.set_experts_implementation("eager")  # the grouped matmul refuses float64
            self.m32.set_experts_implementation("eager")
        self.m64 = m64.double().eval()

    def full(self, ids, fp64: bool = False) -> torch.Tensor:
        return R.hf_logits(self.m64 if fp64 else self.m32, ids)

    def prefill_then_step(self, ids, k: int) -> torch.Tensor:
        return R.hf_prefill_then_step(self.m32, ids, k)

    @staticmethod
    def _routers(model):
        return [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]

    @torch.no_grad()
    def selections(self, ids, fp64: bool = False) -> dict[int, torch.Tensor]:
        """layer → the experts its router selects for each token, sorted [T, top_k] (full prefill)."""
        got: dict[int, torch.Tensor] = {}
        hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: got.__setitem__(i, out[2].sort(-1).values.clone()))
                 for i, r in self._routers(self.m64 if fp64 else self.m32)]
        try:
            self.full(ids, fp64)
        finally:
            for h in hooks:
                h.remove()
        return got

    @torch.no_grad()
    def greedy(self, ids, n: int) -> list[int]:
        x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        o = self.m32(x, use_cache=True)
        out: list[int] = []
        for i in range(n):
            out.append(int(o.logits[0, -1, :self.vocab].argmax()))
            if i + 1 < n:
                o = self.m32(torch.tensor([[out[-1]]]), cache=o.cache, use_cache=True)
        return out


# ------------------------------------------------------------------ vxc


def engine(model_dir: Path, max_context: int = 160, provider=None):
    from vxc.frontends import lower
    from vxc.runtime.engine import Engine

    return Engine(lower(model_dir), Path(model_dir), max_context=max_context, provider=provider)


class RouterTap:
    """Records what every router call of an engine's prefill graph selects, by pointing the graph's
    router calls at a recording wrapper (test instrumentation; the op itself is unchanged)."""

    def __init__(self, eng):
        self.calls: list[torch.Tensor] = []
        target = torch.ops.vxc.moe_router.default
        gm = eng.prefill_graph
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is target:
                node.target = self._record
        gm.recompile()

    def _record(self, *args):
        out = torch.ops.vxc.moe_router.default(*args)
        self.calls.append(out[1].sort(-1).values.clone())
        return out


@dataclass
class Run:
    full: torch.Tensor
    stepped: torch.Tensor
    greedy: list[int]
    selections: list[torch.Tensor] = field(default_factory=list)


def vxc_run(eng, ids: list[int], k: int, n_new: int, tap: RouterTap | None = None) -> Run:
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    s = Session(eng)
    full = s.prefill(ids)
    sel = list(tap.calls) if tap is not None else []
    s.reset()
    rows = [s.prefill(ids[:k])]
    for t in ids[k:]:
        rows.append(s.step(t)[None])
    stepped = torch.cat(rows, 0)
    s.reset()
    greedy = s.generate(ids, n_new, Sampler(vocab=eng.vocab))
    return Run(full, stepped, greedy, sel)


@dataclass
class Parity:
    family: str
    maxabs: float
    floor: float
    tol: float
    argmax: float
    excluded: int
    greedy_match: bool
    distinct: int
    steps_vs_prefill: float
    experts_match: bool | None = None

    def row(self) -> str:
        e = "n/a" if self.experts_match is None else ("yes" if self.experts_match else "NO")
        return (f"| {self.family} | {self.maxabs:.2e} | {self.floor:.2e} | {self.tol:.2e} | {100 * self.argmax:.1f}% | "
                f"{self.excluded} | {'yes' if self.greedy_match else 'NO'} ({self.distinct} distinct) | {e} |")


def parity(family: str, model_dir: Path, vocab: int, ids: list[int], k: int, moe: bool = False) -> tuple[Parity, Run, list[int]]:
    ref = Reference(model_dir, vocab, moe)
    r32, r64 = ref.full(ids), ref.full(ids, fp64=True)
    ft = R.floor_and_tolerance(r32, r64, ref.prefill_then_step(ids, k))
    eng = engine(model_dir)
    tap = RouterTap(eng) if moe else None
    run = vxc_run(eng, ids, k, GREEDY_NEW, tap)
    agree, excluded = R.argmax_agreement(r32[:, :vocab], run.full[:, :vocab], ft["tol"])
    want = ref.greedy(ids, GREEDY_NEW)
    experts = None
    if moe:
        sel = ref.selections(ids)
        experts = len(run.selections) == len(sel) and all(torch.equal(a, b) for a, b in zip(run.selections, sel.values()))
    p = Parity(family, maxabs(run.full, r32), ft["floor"], ft["tol"], agree, excluded, run.greedy == want, len(set(want)),
               maxabs(run.stepped, run.full), experts)
    record(p)
    return p, run, want


def check_parity(p: Parity, run: Run, want: list[int], prompt_len: int) -> None:
    """The floor checks of a miniature's parity run over a prompt of ``prompt_len`` tokens: max-abs within
    tolerance, argmax agreeing (at most a tenth of the positions excluded as near-ties), prefill-then-step equal
    to one prefill, and the greedy tokens the reference's, with at least MIN_DISTINCT distinct ones."""
    print(p.row())
    assert p.maxabs <= p.tol, p
    assert p.argmax == 1.0 and p.excluded <= prompt_len // 10, p
    assert p.steps_vs_prefill <= p.tol, p
    assert run.greedy == want and len(set(want)) >= MIN_DISTINCT, (run.greedy, want)


def record(p: Parity) -> None:
    """Append the row to $VXC_PARITY_ROWS when set (the closing report collects them)."""
    path = os.environ.get("VXC_PARITY_ROWS")
    if path:
        with open(path, "a") as f:
            f.write(p.row() + "\n")


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def assert_replay_bit_identical(model_dir: Path, ids: list[int], tokens: list[int], dtype: torch.dtype) -> None:
    """Decode steps after a prefill of ``ids``: the engine captures and replays them as native calls, and each
    replayed step equals the fx graph's step bit for bit."""
    from vxc.frontends import lower
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    def steps(replay: bool):
        eng = Engine(lower(model_dir), Path(model_dir), dtype=dtype, max_context=len(ids) + len(tokens) + 4,
                     replay=replay)
        s = Session(eng)
        s.prefill(ids)
        return eng, [s.step(t) for t in tokens]

    replayed, got = steps(True)
    _, want = steps(False)
    assert replayed.replay_status().startswith("replaying"), replayed.replay_status()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: max diff {(a.float() - b.float()).abs().max().item():.3e}"
