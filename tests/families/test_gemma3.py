"""gemma3_text against transformers 5.24's Gemma3ForCausalLM at the numerical floor (VINDEX3.md).

Miniature (independent constants): hidden 48, 3 query heads × 20, 1 kv head, query_pre_attn_scalar 24 (not the
head dim), FFN 72, vocab 151, 4 layers sliding / sliding / full / sliding with a window of 7 and rotary thetas
900 (sliding) and 50000 (full); norms perturbed away from their zero init (so ``w`` read as ``1 + w`` cannot
pass). The head is untied in the main miniature — with Gemma's tied head a random model's greedy loop repeats its
own input token (the scaled embedding dominates the residual) — and tied in a second one, checked on its logits.

Checked: logits within the floor (fp32 and fp64), argmax agreement, 32 greedy tokens identical, prefill then
step equal to the full prefill, bit-identical reruns; the embedding scale, the zero-centred norms, the GELU,
the window and the two thetas each shown to matter; decode replayed natively (fp32 and bf16); save → resume;
the whole model on the Triton kernels; the hub's config spelling (rope_theta / rope_local_base_freq /
sliding_window_pattern) lowering to the same program; named refusals.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.hf_random import random_hf_model
from tests.runtime import parity_table as P

VOCAB, D, H, KV, HD, FFN, WINDOW, QPAS = 151, 48, 3, 1, 20, 72, 7, 24
THETA_LOCAL, THETA_GLOBAL = 900.0, 50000.0
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=4, num_attention_heads=H,
            num_key_value_heads=KV, head_dim=HD, query_pre_attn_scalar=QPAS, sliding_window=WINDOW, layer_types=TYPES,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": THETA_GLOBAL},
                             "sliding_attention": {"rope_type": "default", "rope_theta": THETA_LOCAL}},
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=B.HF_INITIALIZER_RANGE)


def build(d: Path, overrides: dict | None = None, seed: int = 7) -> Path:
    cfg = B.hf_config("gemma3_text", {**MINI, **(overrides or {})})
    random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add").save_pretrained(str(d), safe_serialization=True)
    return d


UNTIED = P.Family("gemma3", build, "hf", VOCAB, VOCAB)
TIED = P.Family("gemma3-tied", lambda d: build(d, {"tie_word_embeddings": True}, seed=9), "hf", VOCAB, VOCAB)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    return {"untied": P.build(UNTIED, root), "tied": P.build(TIED, root)}


@pytest.fixture(scope="module")
def parity(built):
    return {k: P.measure(f, *built[k]) for k, f in (("untied", UNTIED), ("tied", TIED))}


def test_lowered_program(built):
    text = built["untied"][1].read_text()
    assert text.count("placement PrePost") == 4
    assert f"embedding embedding vocab={VOCAB} padded_vocab={VOCAB} dim={D} scale={math.sqrt(D)!r}" in text
    assert text.count("act=gelu_tanh") == 4 and text.count(" zero_centred=true") == 4 * 4 + 1
    assert text.count("qk_norm_zero_centred=true") == 4
    assert text.count(f"window={WINDOW} ") == 3 and text.count("window=0 ") == 1
    assert text.count(f"rotary_base={THETA_LOCAL!r}") == 3 and text.count(f"rotary_base={THETA_GLOBAL!r}") == 1
    assert text.count(f"scale={1 / math.sqrt(QPAS)!r}") == 4  # query_pre_attn_scalar, not head_dim
    assert "head head tied=false" in built["untied"][1].read_text()
    assert "head head tied=true" in built["tied"][1].read_text()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_logits_at_floor(parity, which):
    P.assert_at_floor(parity[which], greedy=False)


def test_greedy_identical(parity):
    p = parity["untied"]
    assert len(p.greedy_vxc) == P.GREEDY_NEW and p.greedy_vxc == p.greedy_ref, (p.greedy_vxc, p.greedy_ref)
    assert p.distinct >= P.MIN_DISTINCT


def test_each_gemma_convention_matters(built, parity):
    """Editing one declared attribute of the IR moves the logits far past the tolerance: the checks above
    cannot pass with the embedding scale, the 1 + w norms, the GELU, the window or the local theta ignored."""
    from vxc.ir.parser import parse
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    mdir, ir = built["untied"]
    text = ir.read_text()
    ids = P.prompt_ids(UNTIED)

    def run(t):
        return Session(Engine(parse(t), mdir, max_context=64)).prefill(ids)

    base = run(text)
    edits = {
        "embedding scale": text.replace(f" scale={math.sqrt(D)!r}", ""),
        "1 + w norms": text.replace("zero_centred=true", "zero_centred=false"),
        "gelu": text.replace("act=gelu_tanh", "act=silu"),
        "window": text.replace(f"window={WINDOW} ", "window=0 ").replace(f" window {WINDOW}", ""),
        "local theta": text.replace(f"rotary_base={THETA_LOCAL!r}", f"rotary_base={THETA_GLOBAL!r}"),
    }
    for what, t in edits.items():
        assert t != text, what
        assert float((run(t) - base).abs().max()) > 100 * parity["untied"].tol, what


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replay(built, dtype):
    """The post-norms, GELU gating, embedding scale, q/k norms and the window's ring run natively for one
    token: the decode step is replayed bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built["untied"][0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 12, seed=4), dtype)


def test_save_resume(built, tmp_path):
    """Saved after 6 greedy steps, loaded by a fresh engine: the continuation is bit-identical."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ir = built["untied"][1]
    ids = P.prompt_ids(UNTIED)[:20]

    def greedy(s, logits, n):  # n tokens; the last one is chosen, not fed
        return P.greedy_fed(s, logits, n, VOCAB)

    s = Session(P.engine_for(ir, max_context=64))
    want = greedy(s, s.prefill(ids)[-1], 14)
    s.reset()
    first = greedy(s, s.prefill(ids)[-1], 6)
    s.save_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    s2 = Session(P.engine_for(ir, max_context=64))
    s2.load_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    # continue from the saved position: feed the last generated token, as `vxc exec --resume-state` does
    cont = greedy(s2, s2.prefill([first[-1]])[-1], 8)
    assert first + cont == want


def test_triton_backend_matches_torch_twins(built):
    """Prefill of 10 tokens (past the window) and 4 steps on vxc's Triton kernels — gated_act, scale, attention
    with the window, zero-centred norms — against the torch twins (CPU: Triton's interpreter, fresh process)."""
    ir = built["untied"][1]
    ids = P.prompt_ids(UNTIED)[:14]
    out = B.triton_against_twins(str(ir), ids, 10)
    assert out["max"] > 4.0 and out["err"] <= 1e-4, out
    assert "gated_act" not in out["fallbacks"] and "scale" not in out["fallbacks"], out["fallbacks"]


def _program(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(("    mixer", "    ffn", "    norm", "  embedding", "  head"))]


def test_hub_dialect_same_program(built, tmp_path):
    """The hub's spelling — rope_theta + rope_local_base_freq, sliding_window_pattern instead of layer_types —
    lowers to the same operators with the same attribute values."""
    from vxc.frontends import lower
    from vxc.ir.printer import print_module

    src = built["untied"][0]
    dst = tmp_path / "hub"
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    for k in ("rope_parameters", "layer_types"):
        cfg.pop(k)
    cfg.update(rope_theta=THETA_GLOBAL, rope_local_base_freq=THETA_LOCAL, sliding_window_pattern=3)
    cfg["num_hidden_layers"] = 4  # pattern 3: layers 0, 1 slide, 2 is full, 3 slides — the miniature's map
    (dst / "config.json").write_text(json.dumps(cfg))
    want = [ln.replace(" (default)", "") for ln in _program(built["untied"][1].read_text())]
    got = [ln.replace(" (default)", "") for ln in _program(print_module(lower(dst)))]
    assert got == want


@pytest.mark.parametrize("edit, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must be a list of 4 entries"),
])
def test_config_refusals(built, tmp_path, edit, message):
    from vxc.frontends import FrontendError, lower

    dst = tmp_path / "m"
    shutil.copytree(built["untied"][0], dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **edit}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FrontendError, match=message.replace("(", r"\(").replace("[", r"\[")):
        lower(dst)


def test_stripped_operand_is_a_named_refusal(built, tmp_path, vxc_sub):
    """A checkpoint without layer 2's post-FFN norm: lowering refuses, naming the layer and the role."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(built["untied"][0], dst)
    sd = load_file(dst / "model.safetensors")
    del sd["model.layers.2.post_feedforward_layernorm.weight"]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    r = vxc_sub("lower", dst, "-o", tmp_path / "m.vxir")
    assert r.exit_code != 0 and not (tmp_path / "m.vxir").exists()
    assert "layer 2" in r.stdout + r.stderr and "PostFfnNorm" in r.stdout + r.stderr, r.stdout + r.stderr


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built["untied"][1], VOCAB)
