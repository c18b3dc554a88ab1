"""falcon_h1 against transformers 5.24's FalconH1ForCausalLM at the numerical floor (VINDEX3.md).

Miniature (independent constants): hidden 44, 3 query heads × 10 (head_dim given, so q width 30 ≠ hidden) over
1 kv head, Mamba2 d_ssm 48 = 6 heads × 8 in 2 B/C groups, state 6, conv 3, chunk 8 (a 48-token prompt is six
chunks), FFN 76, vocab 151, 3 layers, rotary theta 5000 — every width distinct, so a transposed or mis-split
tensor cannot pass; norms perturbed away from their init. Every µP multiplier differs from 1 and from every
other: embedding 1.7, lm_head 0.6, attention in 0.8 / out 1.3, key 0.7, ssm in 1.2 / out 0.9, ssm segments
z 0.9 · x 1.1 · B 0.8 · C 1.25 · dt 1.3, mlp gate 1.4 / down 0.75. The main miniature has the gated RMSNorm in 2
groups, gate then normalise (mamba_norm_before_gate false); a second one is Falcon-H1-0.5B's shape of options:
no gated norm (y·silu(z)), attention biases, projection biases (in_proj and out_proj), a tied head.

Checked: each layer declares both mixers and both mixers' state (KV rows, SSM state, conv history); logits within
the floor (fp32 and fp64), argmax agreement, 32 greedy tokens identical, prefill then step equal to the full
prefill, bit-identical reruns; each multiplier matters (set to 1 in the IR, the logits leave the tolerance by
far); decode replayed natively (fp32 and bf16); save → resume; a stripped operand of each mixer and bad configs
refused by name; the new kernels (add, scale_segments) on every backend against fp64.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.hf_random import random_hf_model
from tests.runtime import parity_table as P

VOCAB, D, H, KV, HD, FFN, LAYERS = 151, 44, 3, 1, 10, 76, 3
D_SSM, MH, MP, G, N, K, CHUNK = 48, 6, 8, 2, 6, 3, 8
CONV_DIM = D_SSM + 2 * G * N  # 72
MULT = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, attention_in_multiplier=0.8,
            attention_out_multiplier=1.3, key_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
            ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 1.3], mlp_multipliers=[1.4, 0.75])
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=H,
            num_key_value_heads=KV, head_dim=HD, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            mamba_d_ssm=D_SSM, mamba_n_heads=MH, mamba_d_head=MP, mamba_n_groups=G, mamba_d_state=N, mamba_d_conv=K,
            mamba_chunk_size=CHUNK, mamba_rms_norm=True, mamba_norm_before_gate=False, max_position_embeddings=256,
            rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            initializer_range=B.HF_INITIALIZER_RANGE, **MULT)
PLAIN = dict(mamba_rms_norm=False, attention_bias=True, mamba_proj_bias=True, projectors_bias=True,
             tie_word_embeddings=True)


def build(d: Path, overrides: dict | None = None, seed: int = 7) -> Path:
    cfg = B.hf_config("falcon_h1", {**MINI, **(overrides or {})})
    model = random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add")
    # the reference computes the same µP vector: z | x | B | C | dt segments of in_proj's output
    mup = model.model.layers[0].mamba.mup_vector.flatten()
    assert mup.shape == (2 * D_SSM + 2 * G * N + MH,) and mup[0] == 0.9 and mup[D_SSM] == 1.1 and mup[-1] == 1.3
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # biases start at zero: move them, so a dropped bias cannot pass
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(d), safe_serialization=True)
    return d


NORMED = P.Family("falcon_h1", build, "hf", VOCAB, VOCAB)
GATE_ONLY = P.Family("falcon_h1-gate", lambda d: build(d, PLAIN, seed=9), "hf", VOCAB, VOCAB, prompt_len=32, split=21)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("falcon_h1")
    return {"normed": P.build(NORMED, root), "gate": P.build(GATE_ONLY, root)}


@pytest.fixture(scope="module")
def refs(built):
    return {"normed": P.Reference(NORMED, built["normed"][0]), "gate": P.Reference(GATE_ONLY, built["gate"][0])}


@pytest.fixture(scope="module")
def parity(built, refs):
    return {"normed": P.measure(NORMED, *built["normed"], ref=refs["normed"]),
            "gate": P.measure(GATE_ONLY, *built["gate"], ref=refs["gate"], n_new=8)}


def _layers(text: str) -> list[str]:
    return text.split("  layer ")[1:]


def test_lowered_program(built):
    """Every layer: placement Parallel, one pre-mixer norm, the mamba2 and the softmax mixer side by side with
    their multipliers, the FFN with its own, and the state of both mixers on the one layer."""
    text = built["normed"][1].read_text()
    layers = _layers(text)
    assert len(layers) == LAYERS
    for body in layers:
        lines = [ln.strip() for ln in body.splitlines()]
        assert "placement Parallel" in lines
        assert [ln.split()[1] for ln in lines if ln.startswith("norm ")] == ["PreAttentionNorm", "PreFfnNorm"]
        mixers = [ln for ln in lines if ln.startswith("mixer ")]
        assert [m.split()[1] for m in mixers] == ["mamba2", "softmax"], mixers
        assert (f"mixer mamba2 d_model={D} d_inner={D_SSM} heads={MH} head_dim={MP} state_size={N} groups={G} "
                f"conv_kernel={K} conv_bias=true proj_bias=false chunk_size={CHUNK} ") in mixers[0]
        assert "norm_order=gate_then_norm" in mixers[0] and f"norm_group={D_SSM // G}" in mixers[0]
        assert ("z_scale=0.9 x_scale=1.1 b_scale=0.8 c_scale=1.25 dt_scale=1.3 input_scale=1.2 output_scale=0.9"
                in mixers[0])
        assert f"mixer softmax d_model={D} heads={H} kv_heads={KV} head_dim={HD} " in mixers[1]
        assert "key_scale=0.7 input_scale=0.8 output_scale=1.3" in mixers[1] and "rotary_base=5000.0" in mixers[1]
        assert f"ffn swiglu d_model={D} intermediate={FFN} act=silu (default) gate_scale=1.4 output_scale=0.75" in lines
        states = [ln for ln in lines if ln.startswith("state ")]
        assert states == [f"state ssm recurrent [{MH},{MP},{N}] f32 fixed",
                          f"state conv conv_history [{CONV_DIM},{K}] compute fixed",
                          f"state kv kv_rows [2,{KV},{HD}] compute per_token"], states
    assert "embedding embedding vocab=151 padded_vocab=151 dim=44 scale=1.7" in text
    assert "head head tied=false padded_vocab=151 dim=44 scale=0.6" in text
    gate = built["gate"][1].read_text()
    assert gate.count("gated_norm=false norm_act=silu") == LAYERS and "norm_eps" not in gate
    assert gate.count("q_bias=true k_bias=true v_bias=true o_bias=true") == LAYERS and "head head tied=true" in gate


def test_describe_shows_both_mixers_state_on_each_layer(built, describe_json):
    d = describe_json(built["normed"][1])
    assert d["operators"] == {"mamba2": {"count": LAYERS, "layers": [0, 1, 2]},
                              "softmax": {"count": LAYERS, "layers": [0, 1, 2]},
                              "swiglu": {"count": LAYERS, "layers": [0, 1, 2]}}
    assert d["surfaces"] == {"attention": LAYERS, "ffn": LAYERS, "moe": 0}
    st = d["state"]
    assert st["recurrent_layers"] == 0 and st["growing_layers"] == LAYERS  # every layer holds a growing region
    assert st["fixed_elements"] == LAYERS * (MH * MP * N + CONV_DIM * K)
    assert st["per_token_elements"] == LAYERS * 2 * KV * HD
    for layer in range(LAYERS):
        regions = [(r["operator"], r["name"], r["kind"]) for r in st["regions"] if r["layer"] == layer]
        assert regions == [("mamba2", "ssm", "recurrent"), ("mamba2", "conv", "conv_history"),
                           ("softmax", "kv", "kv_rows")], regions


@pytest.mark.parametrize("which", ["normed", "gate"])
def test_logits_at_floor(parity, which):
    P.assert_at_floor(parity[which], min_logit=2.0)


def test_greedy_identical(parity):
    p = parity["normed"]
    assert len(p.greedy_vxc) == P.GREEDY_NEW and p.greedy_vxc == p.greedy_ref, (p.greedy_vxc, p.greedy_ref)
    assert p.distinct >= P.MIN_DISTINCT


# each declared multiplier, as the IR spells it on layer 1's ops (or the model's): set to 1 (ignored), the
# logits must leave the tolerance by a wide margin
IGNORED = {
    "embedding": ("embedding embedding", "scale=1.7"), "head": ("head head", "scale=0.6"),
    "attention in": ("mixer softmax", "input_scale=0.8"), "attention out": ("mixer softmax", "output_scale=1.3"),
    "key": ("mixer softmax", "key_scale=0.7"), "ssm in": ("mixer mamba2", "input_scale=1.2"),
    "ssm out": ("mixer mamba2", "output_scale=0.9"), "ssm z": ("mixer mamba2", "z_scale=0.9"),
    "ssm x": ("mixer mamba2", "x_scale=1.1"), "ssm B": ("mixer mamba2", "b_scale=0.8"),
    "ssm C": ("mixer mamba2", "c_scale=1.25"), "ssm dt": ("mixer mamba2", "dt_scale=1.3"),
    "mlp gate": ("ffn swiglu", "gate_scale=1.4"), "mlp down": ("ffn swiglu", "output_scale=0.75"),
}


def test_each_multiplier_matters(built, refs, parity, tmp_path):
    from vxc.runtime.session import Session

    mdir, ir = built["normed"]
    ids = P.prompt_ids(NORMED)[:24]
    want = refs["normed"].full(ids)
    tol = parity["normed"].tol
    text = ir.read_text()
    moved = {}
    for name, (line_start, attr) in IGNORED.items():
        lines = text.splitlines(keepends=True)
        hits = [i for i, ln in enumerate(lines) if ln.strip().startswith(line_start) and f" {attr}" in ln]
        layer1 = [i for i in hits if i > text[:text.index("  layer 1 {")].count("\n")]
        i = (layer1 or hits)[0]  # layer 1's op (the model-level ones have one line)
        lines[i] = lines[i].replace(f" {attr}", " " + attr.split("=")[0] + "=1.0")
        edited = tmp_path / f"{name.replace(' ', '_')}.vxir"
        edited.write_text("".join(lines))
        got = Session(P.engine_for(edited, max_context=32, model_dir=mdir)).prefill(ids)
        moved[name] = P.maxabs(got, want)
    print({k: f"{v:.2e}" for k, v in moved.items()})
    assert all(v > 100 * tol for v in moved.values()), (moved, tol)


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replay(built, dtype):
    """Both mixers, their multipliers (scale_segments), the sum of their outputs (add) and the gate-only Mamba2
    output (gated_act) run natively for one token: the decode step is replayed bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built["gate"][0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 12, seed=4), dtype)
    if dtype == torch.float32:
        assert_replay_bit_identical(built["normed"][0], prompt(VOCAB, 19, seed=5), prompt(VOCAB, 6, seed=6), dtype)


def test_save_resume(built, tmp_path):
    """Saved after 6 greedy steps (KV rows, SSM states and conv histories of every layer), loaded by a fresh
    engine: the continuation is bit-identical."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ir = built["normed"][1]
    ids = P.prompt_ids(NORMED)[:20]

    def greedy(s, logits, n):  # n tokens; the last one is chosen, not fed
        return P.greedy_fed(s, logits, n, VOCAB)

    s = Session(P.engine_for(ir, max_context=64))
    kinds = sorted(set(s.engine.state.layout.values()))
    assert kinds == ["conv_history", "kv_rows", "recurrent"], kinds
    want = greedy(s, s.prefill(ids)[-1], 14)
    s.reset()
    first = greedy(s, s.prefill(ids)[-1], 6)
    s.save_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    s2 = Session(P.engine_for(ir, max_context=64))
    s2.load_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    cont = greedy(s2, s2.prefill([first[-1]])[-1], 8)
    assert first + cont == want


def test_both_mixers_state_is_the_references_cache(built, refs):
    """After a prefill of 20 tokens and 3 steps, every layer's three regions hold what the reference's cache
    holds for that layer — the Mamba2 SSM state and conv history, and the K rows (k_proj · key multiplier,
    rotated) and V rows of the attention beside it — each at the state's own floor, max(2 × the reference's
    fp32-vs-fp64 difference, 1e-5 × max|state|)."""
    from vxc.passes.plan import region_id
    from vxc.runtime.session import Session

    ids = P.prompt_ids(NORMED)[:23]

    def ref_cache(m):
        with torch.no_grad():
            o = m(torch.tensor([ids[:20]]), use_cache=True)
            for t in ids[20:]:
                o = m(torch.tensor([[t]]), cache=o.cache, use_cache=True)
        c = o.cache
        return [{"ssm": c.get_recurrent_state(i, state_idx=0)[0], "conv": c.get_conv_state(i, state_idx=0)[0],
                 "k": c.layers[i].keys[0].transpose(0, 1), "v": c.layers[i].values[0].transpose(0, 1)}
                for i in range(LAYERS)]

    eng = P.engine_for(built["normed"][1], max_context=32)
    s = Session(eng)
    s.prefill(ids[:20])
    for t in ids[20:]:
        s.step(t)
    a32, a64 = ref_cache(refs["normed"].m32), ref_cache(refs["normed"].m64)
    for i in range(LAYERS):
        kv = eng.state.buffers[region_id(f"L{i}.softmax", "kv")]
        got = {"ssm": eng.state.buffers[region_id(f"L{i}.mamba2", "ssm")],
               "conv": eng.state.buffers[region_id(f"L{i}.mamba2", "conv")], "k": kv[0, :23], "v": kv[1, :23]}
        for name, want in a64[i].items():
            w, g = want.double(), got[name].double()
            assert g.shape == w.shape, (i, name, g.shape, w.shape)
            tol = max(2 * float((a32[i][name].double() - w).abs().max()), 1e-5 * float(w.abs().max()))
            assert float(w.abs().max()) > 0.5 and float((g - w).abs().max()) <= tol, (i, name, float((g - w).abs().max()), tol)


@pytest.mark.parametrize("edit, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"projectors_bias": True}, "mamba_proj_bias=False and projectors_bias=True differ"),
    ({"ssm_multipliers": [1.0, 1.0, 1.0, 1.0]}, "ssm_multipliers must hold 5 multipliers, not 4"),
    ({"mamba_d_head": 7}, "mamba_n_heads=6 x mamba_d_head=7 != mamba_d_ssm=48"),
])
def test_config_refusals(built, tmp_path, edit, message):
    from vxc.frontends import FrontendError, lower

    dst = tmp_path / "m"
    shutil.copytree(built["normed"][0], dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **edit}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FrontendError, match=re.escape(message)):
        lower(dst)


def test_stripped_operands_are_a_named_refusal(built, tmp_path, vxc_sub):
    """A checkpoint without layer 1's Mamba2 D and layer 2's k projection: lowering refuses with both findings
    itemised — each naming the layer, the mixer it belongs to and the role — and writes no IR."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(built["normed"][0], dst)
    sd = load_file(dst / "model.safetensors")
    del sd["model.layers.1.mamba.D"], sd["model.layers.2.self_attn.k_proj.weight"]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    r = vxc_sub("lower", dst, "-o", tmp_path / "m.vxir")
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and not (tmp_path / "m.vxir").exists()
    assert "2 findings" in out, out
    assert "layer 1 mamba2: required role Mamba2D is not bound" in out, out
    assert "layer 2 softmax: required role AttnK is not bound" in out, out


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_combine_kernels_at_floor(backend):
    """add and scale_segments (bf16 and fp32, a decode row and a prefill block) against fp64 arithmetic: fp32
    results exact to one rounding of the fp64 value, bf16 ones to bf16's; every backend the same."""
    from vxc.codegen import kernels

    if backend == "native" and not kernels.native.available():
        pytest.skip(kernels.native.status())
    if backend == "triton" and not _interpreted():
        return _rerun_interpreted()
    g = torch.Generator().manual_seed(5)
    sizes, scales = [5, 5, 3, 3, 2], [0.9, 1.1, 0.8, 1.25, 1.3]
    # the scales as fp32 holds them: x · s is exact in fp64, then rounded to fp32 (and from there to bf16)
    per_col = torch.tensor(sum(([s] * n for n, s in zip(sizes, scales)), []), dtype=torch.float32).double()
    with kernels.backend(backend):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 7):
                x = torch.randn(rows, sum(sizes), generator=g).to(dtype)
                y = torch.randn(rows, sum(sizes), generator=g).to(dtype)
                kernels.reset_fallbacks()
                s = torch.ops.vxc.scale_segments(x, sizes, scales)
                a = torch.ops.vxc.add(x, y)
                whole = torch.ops.vxc.scale_segments(x, [], [0.7])
                if backend != "torch" and rows == 1:
                    assert not kernels.fallbacks(), kernels.fallbacks()
                assert s.dtype == a.dtype == dtype
                f32 = torch.float32
                for got, exact in ((s, x.double() * per_col), (a, x.double() + y.double()),
                                   (whole, x.double() * torch.tensor(0.7, dtype=f32).double())):
                    if backend == "triton" and dtype == torch.bfloat16:
                        # Triton's CPU interpreter converts fp32 to bf16 by truncation: within one bf16 step
                        assert float(((got.double() - exact) / exact.abs().clamp_min(1e-30)).abs().max()) <= 2.0 ** -7
                    else:
                        assert torch.equal(got, exact.to(f32).to(dtype))  # one rounding of the fp32 product


def _interpreted() -> bool:
    """Whether this process's triton runs the interpreter: fixed when triton was first imported (an environment
    variable set later by another test does not make it so)."""
    from vxc.codegen.kernels.triton_common import INTERPRETED

    return INTERPRETED


def _rerun_interpreted():
    """Triton on CPU needs its interpreter, chosen when triton is first imported: run this case in a fresh
    process with TRITON_INTERPRET=1 (never a skip)."""
    from tests.triton_support import triton_case

    triton_case(False)(lambda: None)()


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built["normed"][1], VOCAB)
