"""granitemoehybrid against transformers 5.24's GraniteMoeHybridForCausalLM at the numerical floor (VINDEX3.md).

Miniatures (independent constants). MAIN: hidden 60, layers Mamba2 / attention / Mamba2 (transformers 5's
``layer_types`` spelling), attention 5 query heads × 12 over 1 kv head with rotary (theta 5000), Mamba2 inner
120 = 10 heads × 12 in 2 B/C groups (2 groups of 60 in the gated RMSNorm), state 6, conv 3, chunk 8 (a 48-token
prompt is six chunks); MoE of 5 experts × 20, top-2, plus the shared MLP of 28; vocab 163. Every µP multiplier
differs from 1 and from the others: embedding 1.7, residual 0.6, attention 0.11 (≠ 12^-½ ≈ 0.289), logits
scaling 0.8 (the logits divided by it). DENSE: the same widths with ``num_local_experts`` 0 (the shared MLP alone),
no position embedding (``nope``), the hub's layer spelling (``attention`` / ``mamba``: attention, Mamba2,
attention), attention biases, Mamba2 projection biases, a tied head. Norms perturbed away from 1, dt_bias spread,
A_log log-uniform (``hf_random``), biases moved away from 0, the router's weights scaled up so that no token's
top-2 is a near-tie.

Checked: the lowered program (operators, multipliers, state); logits within the floor (fp32 and fp64), argmax
agreement, 32 greedy tokens identical, prefill then step equal to the full prefill, bit-identical reruns, the
experts selected identical to the reference's at every token of every MoE layer; each multiplier shown to matter;
bf16 no further from the fp32 reference than transformers' own bf16; decode replayed natively (fp32 and bf16);
save → resume; the in-memory expert spelling lowering to the same program; a stripped operand of each kind a named,
itemised refusal; bad configs refused by name.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.families.moe_support import assert_at_floor, measure_moe, print_row
from tests.hf_random import random_hf_model
from tests.runtime import parity_table as P

VOCAB, D, H, KV, HD, LAYERS = 163, 60, 5, 1, 12, 3
D_INNER, MH, MP, G, N, K, CHUNK = 120, 10, 12, 2, 6, 3, 8
E, TOPK, INTER, SHARED = 5, 2, 20, 28
CONV_DIM = D_INNER + 2 * G * N  # 144
EMB, RES, ATT, LOGITS = 1.7, 0.6, 0.11, 0.8
MINI = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=H, num_key_value_heads=KV,
            layer_types=["linear_attention", "full_attention", "linear_attention"], num_local_experts=E,
            num_experts_per_tok=TOPK, intermediate_size=INTER, shared_intermediate_size=SHARED, mamba_n_heads=MH,
            mamba_n_groups=G, mamba_d_state=N, mamba_d_conv=K, mamba_expand=2, mamba_chunk_size=CHUNK,
            position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            embedding_multiplier=EMB, residual_multiplier=RES, attention_multiplier=ATT, logits_scaling=LOGITS,
            max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            initializer_range=B.HF_INITIALIZER_RANGE)
DENSE_TYPES = ["attention", "mamba", "attention"]  # the hub's spelling, written into config.json after the save
DENSE = dict(num_local_experts=0, position_embedding_type="nope", attention_bias=True, mamba_proj_bias=True,
             tie_word_embeddings=True, layer_types=["full_attention", "linear_attention", "full_attention"])


def build(d: Path, overrides: dict | None = None, seed: int = 7) -> Path:
    cfg = B.hf_config("granitemoehybrid", {**MINI, **(overrides or {})})
    model = random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add")
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # biases start at zero: move them, so a dropped bias cannot pass
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.weight"):  # clear top-2 margins: no selection is a near-tie
                p.mul_(4.0)
    model.save_pretrained(str(d), safe_serialization=True)
    if overrides and overrides.get("num_local_experts") == 0:
        cfg = json.loads((d / "config.json").read_text())
        cfg["layer_types"] = DENSE_TYPES
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


MAIN = P.Family("granitemoehybrid", build, "hf", VOCAB, VOCAB)
DENSE_FAMILY = P.Family("granitemoehybrid-dense", lambda d: build(d, DENSE, seed=11), "hf", VOCAB, VOCAB)


def router_of(layer):
    return None if layer.block_sparse_moe is None else layer.block_sparse_moe.router


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("granitemoehybrid")
    return {"main": P.build(MAIN, root), "dense": P.build(DENSE_FAMILY, root)}


@pytest.fixture(scope="module")
def moe_parity(built):
    return measure_moe(MAIN, *built["main"], router_of)


@pytest.fixture(scope="module")
def dense_parity(built):
    return P.measure(DENSE_FAMILY, *built["dense"], n_new=12)


def _layers(text: str) -> list[list[str]]:
    return [[ln.strip() for ln in body.splitlines()] for body in text.split("  layer ")[1:]]


def test_lowered_program(built):
    layers = _layers(built["main"][1].read_text())
    assert len(layers) == LAYERS
    for i, lines in enumerate(layers):
        assert "placement PreOnly" in lines
        assert [ln.split()[1] for ln in lines if ln.startswith("norm ")] == ["PreAttentionNorm", "PreFfnNorm"]
        (mixer,) = [ln for ln in lines if ln.startswith("mixer ")]
        (ffn,) = [ln for ln in lines if ln.startswith("ffn ")]
        states = [ln for ln in lines if ln.startswith("state ")]
        if i == 1:
            assert mixer.startswith(f"mixer softmax d_model={D} heads={H} kv_heads={KV} head_dim={HD} "), mixer
            assert f"scale={ATT} " in mixer and "rotary_dim=12 " in mixer and "rotary_base=5000.0" in mixer
            assert states == [f"state kv kv_rows [2,{KV},{HD}] compute per_token"], states
        else:
            assert mixer.startswith(f"mixer mamba2 d_model={D} d_inner={D_INNER} heads={MH} head_dim={MP} "
                                    f"state_size={N} groups={G} conv_kernel={K} conv_bias=true proj_bias=false "
                                    f"chunk_size={CHUNK} dt_min=0.0 dt_max=inf "), mixer
            assert "norm_order=gate_then_norm" in mixer and f"norm_group={D_INNER // G} " in mixer
            assert states == [f"state ssm recurrent [{MH},{MP},{N}] f32 fixed",
                              f"state conv conv_history [{CONV_DIM},{K}] compute fixed"], states
        assert mixer.endswith(f"output_scale={RES}"), mixer
        assert ffn.startswith(f"ffn moe d_model={D} experts={E} top_k={TOPK} intermediate={INTER} router=topk_softmax "), ffn
        assert f"shared_experts=true (default) shared_intermediate={SHARED} shared_gate=false" in ffn
        assert ffn.endswith(f"output_scale={RES}"), ffn
    text = built["main"][1].read_text()
    assert f"embedding embedding vocab={VOCAB} padded_vocab={VOCAB} dim={D} output_scale={EMB}" in text
    assert f"head head tied=false padded_vocab={VOCAB} dim={D} scale={1 / LOGITS!r}" in text
    dense = built["dense"][1].read_text()
    assert dense.count(f"ffn swiglu d_model={D} intermediate={SHARED} act=silu (default) output_scale={RES}") == LAYERS
    assert dense.count("rotary_dim=0 (default) rotary_base=10000.0 (default) rotary_layout=none") == 2
    assert dense.count("q_bias=true k_bias=true v_bias=true o_bias=true") == 2 and "proj_bias=true" in dense
    assert "head head tied=true" in dense and "fact layer_map_read_from layer_types" in dense


def test_moe_at_floor_with_identical_expert_selection(moe_parity, capsys):
    with capsys.disabled():
        print("\n" + print_row(moe_parity))
    assert_at_floor(moe_parity)
    assert moe_parity.layers == LAYERS and moe_parity.tokens == 48 + P.GREEDY_NEW


def test_dense_at_floor(dense_parity):
    P.assert_at_floor(dense_parity)


# each multiplier, as the IR spells it; "ignored" is what a plain Llama-shaped reading would do: 1, or for the
# attention scale head_dim^-½
IGNORED = {
    "embedding": ("embedding embedding", f"output_scale={EMB}", "output_scale=1.0"),
    "logits": ("head head", f"scale={1 / LOGITS!r}", "scale=1.0"),
    "attention": ("mixer softmax", f"scale={ATT}", f"scale={HD ** -0.5!r}"),
    "residual (mamba2)": ("mixer mamba2", f"output_scale={RES}", "output_scale=1.0"),
    "residual (attention)": ("mixer softmax", f"output_scale={RES}", "output_scale=1.0"),
    "residual (moe)": ("ffn moe", f"output_scale={RES}", "output_scale=1.0"),
}


def test_each_multiplier_matters(built, moe_parity, tmp_path):
    """Each multiplier ignored (on one op, in an edited IR) moves the logits far from transformers' (which the
    unedited program matches within the tolerance)."""
    import transformers

    from tests import references as R
    from vxc.runtime.session import Session

    mdir, ir = built["main"]
    ids = P.prompt_ids(MAIN)[:24]
    want = R.hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval(), ids)
    tol = moe_parity.parity.tol
    assert P.maxabs(Session(P.engine_for(ir, max_context=32)).prefill(ids), want) <= tol
    text = ir.read_text()
    moved = {}
    for name, (start, attr, ignored) in IGNORED.items():
        lines = text.splitlines(keepends=True)
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(start) and f" {attr}" in ln)
        lines[i] = lines[i].replace(f" {attr}", f" {ignored}", 1)
        edited = tmp_path / f"{re.sub(r'[^a-z0-9]+', '_', name)}.vxir"
        edited.write_text("".join(lines))
        got = Session(P.engine_for(edited, max_context=32, model_dir=mdir)).prefill(ids)
        moved[name] = P.maxabs(got, want)
    print({k: f"{v:.2e}" for k, v in moved.items()})
    assert all(v > 100 * tol for v in moved.values()), (moved, tol)


def test_bf16_no_further_than_reference_bf16(built, moe_parity):
    import transformers

    from tests import references as R
    from vxc.runtime.session import Session

    mdir, ir = built["main"]
    ids = P.prompt_ids(MAIN)[:32]
    def ref(dtype):  # the experts' eager loop (the grouped_mm default refuses these odd bf16 strides on CPU)
        m = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=dtype)
        m.set_experts_implementation("eager")
        return R.hf_logits(m.eval(), ids)

    r32, rb = ref(torch.float32), ref(torch.bfloat16)
    vb = Session(P.engine_for(ir, max_context=64, dtype=torch.bfloat16)).prefill(ids)
    ours, theirs = P.maxabs(vb.float(), r32.float()), P.maxabs(rb.float(), r32.float())
    print(f"bf16 vs fp32 reference: vxc {ours:.3f}, transformers {theirs:.3f}")
    assert 0.0 < ours <= max(theirs, 4 * moe_parity.parity.tol), (ours, theirs)


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replay(built, dtype):
    """Mamba2, attention, the top-k-softmax router, the experts, the shared expert and every multiplier
    (scale_segments) run natively for one token: the decode step is replayed bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built["main"][0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 10, seed=4), dtype)
    if dtype == torch.float32:
        assert_replay_bit_identical(built["dense"][0], prompt(VOCAB, 19, seed=5), prompt(VOCAB, 6, seed=6), dtype)


def test_save_resume(built, tmp_path):
    """Saved after 6 greedy steps (KV rows, SSM states, conv histories), loaded by a fresh engine: the
    continuation is bit-identical."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ir = built["main"][1]
    ids = P.prompt_ids(MAIN)[:20]

    def greedy(s, logits, n):  # n tokens; the last one is chosen, not fed
        return P.greedy_fed(s, logits, n, VOCAB)

    s = Session(P.engine_for(ir, max_context=64))
    assert sorted(set(s.engine.state.layout.values())) == ["conv_history", "kv_rows", "recurrent"]
    want = greedy(s, s.prefill(ids)[-1], 14)
    s.reset()
    first = greedy(s, s.prefill(ids)[-1], 6)
    s.save_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    s2 = Session(P.engine_for(ir, max_context=64))
    s2.load_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    assert first + greedy(s2, s2.prefill([first[-1]])[-1], 8) == want


def test_state_is_the_references_cache(built):
    """After a prefill of 20 tokens and 3 steps, each layer's regions hold what transformers' cache holds for it —
    the Mamba2 SSM state and conv history, the attention's rotated K rows and V rows — each at the state's own
    floor, max(2 x the reference's fp32-vs-fp64 difference, 1e-5 x max|state|)."""
    from tests.families.moe_support import load_reference
    from vxc.passes.plan import region_id
    from vxc.runtime.session import Session

    ref = load_reference(built["main"][0], MAIN)
    ids = P.prompt_ids(MAIN)[:23]

    def ref_cache(m):
        with torch.no_grad():
            o = m(torch.tensor([ids[:20]]), use_cache=True)
            for t in ids[20:]:
                o = m(torch.tensor([[t]]), cache=o.cache, use_cache=True)
        c = o.cache
        return [{"k": c.layers[i].keys[0].transpose(0, 1), "v": c.layers[i].values[0].transpose(0, 1)} if i == 1 else
                {"ssm": c.get_recurrent_state(i, state_idx=0)[0], "conv": c.get_conv_state(i, state_idx=0)[0]}
                for i in range(LAYERS)]

    eng = P.engine_for(built["main"][1], max_context=32)
    s = Session(eng)
    s.prefill(ids[:20])
    for t in ids[20:]:
        s.step(t)
    a32, a64 = ref_cache(ref.m32), ref_cache(ref.m64)
    for i in range(LAYERS):
        if i == 1:
            kv = eng.state.buffers[region_id(f"L{i}.softmax", "kv")]
            got = {"k": kv[0, :23], "v": kv[1, :23]}
        else:
            got = {name: eng.state.buffers[region_id(f"L{i}.mamba2", name)] for name in ("ssm", "conv")}
        for name, want in a64[i].items():
            w, g = want.double(), got[name].double()
            assert g.shape == w.shape, (i, name, g.shape, w.shape)
            tol = max(2 * float((a32[i][name].double() - w).abs().max()), 1e-5 * float(w.abs().max()))
            err = float((g - w).abs().max())
            assert float(w.abs().max()) > 0.5 and err <= tol, (i, name, err, tol)


def _program(text: str) -> list[str]:
    return [ln for ln in text.splitlines()
            if ln.startswith(("    mixer", "    ffn", "    norm", "    placement", "  embedding", "  head"))]


def test_in_memory_expert_spelling_same_program(built, tmp_path):
    """transformers 5.24's in-memory names (experts.gate_up_proj / experts.down_proj / router.weight) bind to the
    same operands' shapes and lower to the same program as the hub's input_linear / output_linear / router.layer."""
    from safetensors.torch import load_file, save_file

    from tests.families.moe_support import lowered_text

    src = built["main"][0]
    dst = tmp_path / "mem"
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    for k in [k for k in sd if ".block_sparse_moe." in k]:
        new = (k.replace("input_linear.weight", "experts.gate_up_proj").replace("output_linear.weight", "experts.down_proj")
               .replace("router.layer.weight", "router.weight"))
        sd[new] = sd.pop(k)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    mem, hub = lowered_text(dst), lowered_text(src)
    assert _program(mem) == _program(hub)
    assert "experts.gate_up_proj [E, 2I, d]" in mem and "input_linear [E, 2I, d]" in hub


@pytest.mark.parametrize("edit, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"layer_types": ["mamba", "sliding_attention", "mamba"]}, "layer_types[1]='sliding_attention' is not a Granite"),
    ({"layer_types": ["mamba", "attention"]}, "layer_types has 2 entries, num_hidden_layers=3"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi' is not supported"),
    ({"mamba_d_head": 7}, "mamba_n_heads=10 x mamba_d_head=7 != mamba_expand x hidden_size=120"),
    ({"logits_scaling": 0}, "logits_scaling=0"),
])
def test_config_refusals(built, tmp_path, edit, message):
    from vxc.frontends import FrontendError, lower

    dst = tmp_path / "m"
    shutil.copytree(built["main"][0], dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **edit}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FrontendError, match=re.escape(message)):
        lower(dst)


def test_stripped_operands_are_a_named_refusal(built, tmp_path, cli):
    """A checkpoint without layer 0's Mamba2 D, layer 1's v projection, layer 2's router and layer 1's shared
    output_linear: lowering refuses with each finding itemised — layer, operator, role — and writes no IR."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(built["main"][0], dst)
    sd = load_file(dst / "model.safetensors")
    for k in ("model.layers.0.mamba.D", "model.layers.1.self_attn.v_proj.weight",
              "model.layers.2.block_sparse_moe.router.layer.weight", "model.layers.1.shared_mlp.output_linear.weight"):
        del sd[k]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    r = cli("lower", dst, "-o", tmp_path / "m.vxir")
    assert r.exit_code != 0 and not (tmp_path / "m.vxir").exists()
    assert "4 findings" in r.output, r.output
    for finding in ("layer 0 mamba2: required role Mamba2D is not bound",
                    "layer 1 softmax: required role AttnV is not bound",
                    "layer 2 moe: required role MoeRouterWeight is not bound",
                    "layer 1 moe: required role SharedExpertDown is not bound"):
        assert finding in r.output, r.output


def test_triton_backend_matches_torch_twins(built):
    """Prefill of 10 tokens (past one chunk) and 3 steps on vxc's Triton kernels — the multipliers, the grouped
    gated norm, the SSD scan, rotary attention, the router, the experts and the shared expert — against the torch
    twins (CPU: Triton's interpreter, fresh process)."""
    ids = P.prompt_ids(MAIN)[:13]
    out = B.triton_against_twins(str(built["main"][1]), ids, 10)
    print(out)
    assert out["max"] > 4.0 and out["err"] <= 1e-4, out
    assert not out["fallbacks"], out["fallbacks"]


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built["main"][1], VOCAB)
