"""Helpers of the Qwen3-Next tests: miniature builders (both config dialects), the transformers reference
and vxc runs, with the measurements of VINDEX3.md "Numerical floor". Nothing here reads vxc's operator
declarations; the miniature geometry is written out as independent constants."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests import references as R
from tests.hf_random import random_hf_model

# Miniature geometry: every width distinct, Hv ≠ Hk, both mixer kinds interleaved.
#   hidden 44, ffn 58, vocab 103; softmax: 3 q heads × 24, 1 kv head, rotary 0.25 → 6 of 24 dims, theta 5000
#   gated delta: 2 key heads × 12, 6 value heads × 10 (3 per key head), conv 4
#     qkvz rows 2·(2·12 + 2·3·10) = 168, conv channels 2·2·12 + 6·10 = 108, ba rows 12
#   layers: 0 linear, 1 full, 2 linear, 3 linear, 4 full   (hub spelling: none — explicit list only)
VOCAB = 103
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
BASE = {
    "vocab_size": VOCAB, "hidden_size": 44, "intermediate_size": 58, "num_hidden_layers": 5,
    "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 24,
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 12, "linear_value_head_dim": 10,
    "linear_conv_kernel_dim": 4, "layer_types": LAYER_TYPES,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts": 7, "num_experts_per_tok": 3, "moe_intermediate_size": 18, "shared_expert_intermediate_size": 22,
    "norm_topk_prob": True, "decoder_sparse_step": 1,
}
DENSE = {**BASE, "mlp_only_layers": list(range(5))}  # every FFN a dense SwiGLU
MOE = {**BASE, "mlp_only_layers": [2]}  # MoE everywhere but layer 2 (a dense one between)

# hub dialect of a 4-layer stack: softmax on layers 1, 3 by full_attention_interval 2
HUB4 = {**DENSE, "num_hidden_layers": 4, "mlp_only_layers": list(range(4)),
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}

PROMPT_LEN = 150  # three delta chunks of 64 (64 + 64 + 22)
SPLIT = 120  # prefill 0..119 (a chunk and a partial one), then step 120..149
GREEDY_NEW = 32
MIN_DISTINCT = 8


def build(out_dir: Path, overrides: dict, seed: int) -> Path:
    """A random Qwen3NextForCausalLM saved by transformers' save_pretrained, with the norms perturbed away
    from their initial values (zero-centred norms start at w = 0, the gated norm at w = 1, dt_bias at 1),
    so a norm applied as ``w`` instead of ``1 + w`` (or the reverse) cannot pass; decay rates exp(A_log)
    log-uniform in [0.05, 2] (the reference's own init, up to 16, drives the chunk's cumulative log-decay to
    thousands, where fp32 rounding of the cumsum alone puts the fp32-vs-fp64 floor near 1e-3 — true of both
    sides, but a blunt test). The random init is tests/hf_random.py's (norm_std 0.15, dt_bias spread added)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = B.hf_config("qwen3_next", {"initializer_range": B.HF_INITIALIZER_RANGE, **overrides})
    model = random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def to_hub_dialect(src: Path, dst: Path, interval: int) -> Path:
    """The same weights with the hub checkpoint's config spelling: ``full_attention_interval`` instead of
    ``layer_types``, ``rope_theta`` + top-level ``partial_rotary_factor`` instead of ``rope_parameters``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).glob("*.safetensors*"):
        shutil.copyfile(f, dst / f.name)
    cfg = json.loads((Path(src) / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg["full_attention_interval"] = interval
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# ------------------------------------------------------------------ the miniatures both halves of the tests use


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen3_next")


@pytest.fixture(scope="module")
def moe_dir(root) -> Path:
    return build(root / "moe", MOE, seed=4)


@pytest.fixture(scope="module")
def dialects(root):
    new = build(root / "hub4_new", HUB4, seed=9)
    hub = to_hub_dialect(new, root / "hub4_hub", interval=2)
    return new, hub


def prompt(seed: int = 0, n: int = PROMPT_LEN) -> list[int]:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ------------------------------------------------------------------ reference (transformers 5.24)


class Reference:
    """transformers 5.24's Qwen3NextForCausalLM at fp32 and fp64 on the same weights."""

    def __init__(self, model_dir: Path, moe: bool):
        import transformers

        m32 = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if moe:
            # the eager expert loop: the grouped matmul refuses float64, and on CPU also these awkward widths
            # ("strides should be multiple of 16 bytes")
            m32.set_experts_implementation("eager")
        self.m32 = m32.eval()
        self.m64 = copy.deepcopy(m32).double().eval()

    @staticmethod
    def _routers(model):
        return [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]

    @torch.no_grad()
    def full(self, ids) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """fp32 logits [T, V] and, per MoE layer, the experts its router selects for each token [T, top_k]."""
        got: dict[int, torch.Tensor] = {}
        hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: got.__setitem__(i, out[2].clone()))
                 for i, r in self._routers(self.m32)]
        try:
            return R.hf_logits(self.m32, ids), got
        finally:
            for h in hooks:
                h.remove()

    @torch.no_grad()
    def full64(self, ids) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """fp64 logits and, per MoE layer and token, the router probability gap between the k-th and the
        (k+1)-th expert (how near the selection is to a tie)."""
        got: dict[int, torch.Tensor] = {}

        def hook(mod, out, i):
            p = torch.softmax(out[0].double(), -1).sort(-1, descending=True).values
            got[i] = p[:, mod.top_k - 1] - p[:, mod.top_k]

        hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: hook(mod, out, i)) for i, r in self._routers(self.m64)]
        try:
            return R.hf_logits(self.m64, ids), got
        finally:
            for h in hooks:
                h.remove()

    def prefill_then_step(self, ids, k: int) -> torch.Tensor:
        return R.hf_prefill_then_step(self.m32, ids, k)

    @torch.no_grad()
    def greedy(self, ids, n: int) -> list[int]:
        x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        o = self.m32(x, use_cache=True)
        out: list[int] = []
        for i in range(n):
            out.append(int(o.logits[0, -1, :VOCAB].argmax()))
            if i + 1 < n:
                o = self.m32(torch.tensor([[out[-1]]]), cache=o.cache, use_cache=True)
        return out


# ------------------------------------------------------------------ vxc


def engine(model_dir: Path, max_context: int = 256):
    from vxc.frontends import lower
    from vxc.runtime.engine import Engine

    return Engine(lower(model_dir), Path(model_dir), max_context=max_context)


class RouterTap:
    """Records what every ``vxc::moe_router`` call of an engine's prefill graph selects, by rewriting the
    graph's call targets to a recording wrapper (test instrumentation; the op itself is unchanged)."""

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
        self.calls.append(out[1].clone())
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
    greedy = s.generate(ids, n_new, Sampler(vocab=eng.vocab), logits=full[-1])  # continues after the prefill
    s.reset()
    rows = [s.prefill(ids[:k])]
    for t in ids[k:]:
        rows.append(s.step(t)[None])
    stepped = torch.cat(rows, 0)
    return Run(full, stepped, greedy, sel)


def maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ------------------------------------------------------------------ Triton end to end (child process)

E2E_PROMPT, E2E_SPLIT, E2E_GREEDY = 70, 66, 4  # two delta chunks (64 + 6), four steps, four greedy tokens


def triton_child(model_dir: str) -> dict:
    """Run in a fresh process with TRITON_INTERPRET=1: the miniature through every Triton launcher
    (``set_backend("triton")``), against transformers (fp32, fp64).
    Counts the calls reaching the gated-delta launchers and twins."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    from vxc.codegen import kernels as K
    names = ("gated_delta_prefill", "gated_delta_step", "sigmoid_gate_mul")
    counts = {"triton": dict.fromkeys(names, 0), "torch": dict.fromkeys(names, 0)}

    def counting(which, name, fn):
        def wrapped(*a, **kw):
            counts[which][name] += 1
            return fn(*a, **kw)
        return wrapped

    for n in names:
        impls = K.KERNELS[n].impls
        impls["triton"] = counting("triton", n, impls["triton"])
        impls["torch"] = counting("torch", n, impls["torch"])
    ids = prompt(5, n=E2E_PROMPT)
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    ref = Reference(model_dir, moe=len(cfg["mlp_only_layers"]) < cfg["num_hidden_layers"])
    r32, _ = ref.full(ids)
    r64, _ = ref.full64(ids)
    with K.backend("triton"):
        run = vxc_run(engine(model_dir, 128), ids, E2E_SPLIT, E2E_GREEDY)
    return {"counts": counts, "vs_ref": maxabs(run.full, r32), "step_vs_ref": maxabs(run.stepped, r32),
            "step_vs_full": maxabs(run.stepped, run.full), "fp32_vs_fp64": maxabs(r32, r64),
            "max_logit": float(r64.abs().max()), "greedy": run.greedy, "greedy_ref": ref.greedy(ids, E2E_GREEDY)}
