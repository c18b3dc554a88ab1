"""lfm2 against transformers 5.24's Lfm2ForCausalLM at the numerical floor (VINDEX3.md).

Miniature (independent constants): hidden 42, 3 query heads × 10 (head_dim given, so q width 30 ≠ hidden) over
1 kv head, vocab 157, 5 layers conv / attention / conv / conv / attention, conv L_cache 3, rotary theta 5000; the
FFN width from Lfm2MLP's rule: intermediate_size 90 → int(2·90/3) = 60 → int(1.3·60) = 78 → up to a multiple of 16
= 80 (every width distinct, so a transposed or mis-split tensor cannot pass); norms perturbed away from their init.
The main miniature is LFM2's real configuration (tied head, no conv biases); a second one turns ``conv_bias`` on
(in_proj, conv and out_proj biases, perturbed away from their zero init), unties the head and maps the attention
layers to 0 and 3.

Checked: logits within the floor (fp32 and fp64), argmax agreement, 32 greedy tokens identical, prefill then
step equal to the full prefill, bit-identical reruns; decode replayed natively (fp32 and bf16); save → resume;
the hub's config spelling (full_attn_idxs, rope_theta, block_ff_dim, tie_embedding) lowering to the same program;
a stripped conv weight and bad configs refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.hf_random import random_hf_model
from tests.runtime import parity_table as P

VOCAB, D, H, KV, HD, K, THETA = 157, 42, 3, 1, 10, 3, 5000.0
FFN = 80  # int(1.3 * int(2 * 90 / 3)) = 78, rounded up to a multiple of 16
TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
CONV_LAYERS, ATTN_LAYERS = [0, 2, 3], [1, 4]
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=90, block_ffn_dim_multiplier=1.3, block_multiple_of=16,
            num_hidden_layers=len(TYPES), num_attention_heads=H, num_key_value_heads=KV, head_dim=HD, conv_L_cache=K,
            layer_types=TYPES, rope_parameters={"rope_type": "default", "rope_theta": THETA},
            max_position_embeddings=256, norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            initializer_range=B.HF_INITIALIZER_RANGE)
BIASED = dict(conv_bias=True, tie_word_embeddings=False, layer_types=None, full_attn_idxs=[0, 3])


def build(d: Path, overrides: dict | None = None, seed: int = 7) -> Path:
    cfg = B.hf_config("lfm2", {**MINI, **(overrides or {})})
    model = random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add")
    assert model.model.layers[0].feed_forward.w1.out_features == FFN  # the reference applies the same rule
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # biases start at zero: move them, so a dropped bias cannot pass
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(d), safe_serialization=True)
    return d


TIED = P.Family("lfm2", build, "hf", VOCAB, VOCAB)
BIAS = P.Family("lfm2-bias", lambda d: build(d, BIASED, seed=9), "hf", VOCAB, VOCAB)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2")
    return {"tied": P.build(TIED, root), "bias": P.build(BIAS, root)}


@pytest.fixture(scope="module")
def parity(built):
    return {"tied": P.measure(TIED, *built["tied"]), "bias": P.measure(BIAS, *built["bias"], n_new=8)}


def _layers(text: str) -> list[str]:
    return text.split("  layer ")[1:]


def test_lowered_program(built):
    text = built["tied"][1].read_text()
    layers = _layers(text)
    assert len(layers) == len(TYPES)
    for i, body in enumerate(layers):
        states = [ln.strip() for ln in body.splitlines() if ln.strip().startswith("state ")]
        if i in CONV_LAYERS:
            assert f"mixer short_conv d_model={D} conv_kernel={K} conv_bias=false proj_bias=false" in body, body
            # the conv layer's only continuation state: a fixed history of K gated inputs, no rows, no matrix
            assert states == [f"state conv conv_history [{D},{K}] compute fixed"], states
        else:
            assert f"mixer softmax d_model={D} heads={H} kv_heads={KV} head_dim={HD} " in body
            assert "qk_norm=true qk_norm_eps=1e-05 qk_norm_zero_centred=false" in body
            assert f"rotary_dim={HD} " in body and f"rotary_base={THETA!r}" in body
            assert states == [f"state kv kv_rows [2,{KV},{HD}] compute per_token"], states
        assert f"ffn swiglu d_model={D} intermediate={FFN} act=silu" in body
    assert "placement PreOnly" in layers[0] and "head head tied=true" in text
    assert f"fact ffn_intermediate {FFN} " in text
    biased = built["bias"][1].read_text()
    assert biased.count("conv_bias=true proj_bias=true") == 3 and "head head tied=false" in biased
    assert [i for i, body in enumerate(_layers(biased)) if "mixer softmax" in body] == [0, 3]


@pytest.mark.parametrize("which", ["tied", "bias"])
def test_logits_at_floor(parity, which):
    P.assert_at_floor(parity[which])


def test_greedy_identical(parity):
    p = parity["tied"]
    assert len(p.greedy_vxc) == P.GREEDY_NEW and p.greedy_vxc == p.greedy_ref, (p.greedy_vxc, p.greedy_ref)
    assert p.distinct >= P.MIN_DISTINCT


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replay(built, dtype):
    """The short conv's gates (gated_act, no activation), its conv step and the attention layers run natively
    for one token: the decode step is replayed bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built["bias"][0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 12, seed=4), dtype)


def test_conv_history_is_the_references_conv_state(built):
    """The short conv's one state region holds what the reference's cache holds for that layer — the last
    L_cache gated inputs B·x, oldest first — after a prefill and after three decode steps, at the state's own
    floor (max(2 × the reference's fp32-vs-fp64 error, 1e-5 × max|state|))."""
    import transformers

    from vxc.runtime.session import Session

    mdir, ir = built["bias"]
    ids = P.prompt_ids(BIAS)[:23]
    m32 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    m64 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).double().eval()
    eng = P.engine_for(ir, max_context=64)
    s = Session(eng)
    regions = [rid for rid, kind in eng.state.layout.items() if kind == "conv_history"]
    conv_layers = [i for i, t in enumerate(B.hf_config("lfm2", {**MINI, **BIASED}).layer_types) if t == "conv"]
    assert len(regions) == len(conv_layers) == 3 and all(eng.state.buffers[r].shape == (D, K) for r in regions)

    def ref_states(m, n):  # the reference's conv state per conv layer after a prefill of ids[:n - 3] and 3 steps
        with torch.no_grad():
            o = m(torch.tensor([ids[:n - 3]]), use_cache=True)
            for t in ids[n - 3:n]:
                o = m(torch.tensor([[t]]), cache=o.cache, use_cache=True)
        return [o.cache.get_conv_state(i, state_idx=0)[0].double() for i in conv_layers]

    s.prefill(ids[:20])
    for t in ids[20:]:
        s.step(t)
    for r, a, b in zip(regions, ref_states(m32, 23), ref_states(m64, 23)):
        tol = max(2 * float((a - b).abs().max()), 1e-5 * float(b.abs().max()))
        got = eng.state.buffers[r].double()
        assert float(b.abs().max()) > 1.0 and float((got - b).abs().max()) <= tol, (r, float((got - b).abs().max()), tol)


def test_save_resume(built, tmp_path):
    """Saved after 6 greedy steps, loaded by a fresh engine: the continuation is bit-identical."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ir = built["tied"][1]
    ids = P.prompt_ids(TIED)[:20]

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


def _program(text: str) -> list[str]:
    return [ln.replace(" (default)", "") for ln in text.splitlines()
            if ln.startswith(("    mixer", "    ffn", "    norm", "  embedding", "  head", "  final_norm"))]


def test_hub_dialect_same_program(built, tmp_path):
    """The hub's spelling — full_attn_idxs instead of layer_types, rope_theta, block_ff_dim, tie_embedding —
    lowers to the same operators with the same attribute values."""
    from vxc.frontends import lower
    from vxc.ir.printer import print_module

    src = built["tied"][0]
    dst = tmp_path / "hub"
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    for k in ("rope_parameters", "layer_types", "intermediate_size", "tie_word_embeddings", "full_attn_idxs"):
        cfg.pop(k, None)
    cfg.update(full_attn_idxs=ATTN_LAYERS, rope_theta=THETA, block_ff_dim=90, tie_embedding=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    text = print_module(lower(dst))
    assert _program(text) == _program(built["tied"][1].read_text())
    assert 'fact layer_map_read_from "full_attn_idxs' in text and "block_ff_dim 90" in text


@pytest.mark.parametrize("edit, message", [
    ({"layer_types": ["conv", "sliding_attention", "conv", "conv", "full_attention"]},
     "layer_types[1]='sliding_attention' is not supported"),
    ({"layer_types": ["conv"] * 3}, "layer_types must be a list of 5 entries"),
    ({"layer_types": None, "full_attn_idxs": [1, 5]}, "full_attn_idxs names layer 5"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
])
def test_config_refusals(built, tmp_path, edit, message):
    from vxc.frontends import FrontendError, lower

    dst = tmp_path / "m"
    shutil.copytree(built["tied"][0], dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **edit}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FrontendError, match=message.replace("(", r"\(").replace("[", r"\[")):
        lower(dst)


def test_stripped_operand_is_a_named_refusal(built, tmp_path, vxc_sub):
    """A checkpoint without layer 2's conv weight: lowering refuses, naming the layer, the operator and the
    role, and writes no IR."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(built["tied"][0], dst)
    sd = load_file(dst / "model.safetensors")
    del sd["model.layers.2.conv.conv.weight"]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    r = vxc_sub("lower", dst, "-o", tmp_path / "m.vxir")
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and not (tmp_path / "m.vxir").exists()
    assert "layer 2 short_conv: required role ShortConvConv1d is not bound" in out, out


def test_triton_backend_matches_torch_twins(built):
    """Prefill of 8 tokens and 3 steps on vxc's Triton kernels — the short conv's gates (gated_act, no
    activation), its conv prefill and step, in_proj / out_proj biases — against the torch twins (CPU: Triton's
    interpreter, fresh process)."""
    ir = built["bias"][1]
    ids = P.prompt_ids(BIAS)[:11]
    out = B.triton_against_twins(str(ir), ids, 8)
    print(out)
    assert out["max"] > 2.0 and out["err"] <= 1e-4, out
    assert not {"gated_act", "conv1d_prefill", "conv1d_step"} & set(out["fallbacks"]), out["fallbacks"]


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built["tied"][1], VOCAB)
