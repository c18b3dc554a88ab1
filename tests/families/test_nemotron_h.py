"""nemotron_h against transformers 5.24's NemotronHForCausalLM at the numerical floor (VINDEX3.md).

Miniature (independent constants): hidden 44, layer map ``M-*M-M`` (Mamba2, MLP-only, attention, Mamba2, MLP-only,
Mamba2), attention 3 query heads × 12 and 1 kv head with no rotary, Mamba2 6 heads × 10 in 3 B/C groups (so 3
groups of 20 in the gated RMSNorm), state 8, conv 4, chunk 16 (a 48-token prompt is three chunks), relu² MLP of
76, vocab 139; norms perturbed away from 1 and dt_bias spread (``hf_random``).

Checked: logits within the floor (fp32 and fp64), argmax agreement, 32 greedy tokens identical, prefill then
step equal to the full prefill, bit-identical reruns; the no-rotary attention, the grouped gated norm and the dt
floor (time_step_min, applied by the reference's prefill) each shown to matter; a config asking for a tied head
runs untied as the reference does (NemotronHForCausalLM ties nothing); decode replayed natively (fp32, bf16);
save → resume; the whole model on the Triton kernels; the hub spelling (hybrid_override_pattern, the mamba_*
aliases, attention_head_dim) lowering to the same program; named refusals (MoE layers among them).
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

VOCAB, D, H, KV, HD, FFN = 139, 44, 3, 1, 12, 76
MH, MP, G, N, CONV, CHUNK = 6, 10, 3, 8, 4, 16
TYPES = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp", "linear_attention"]
PATTERN = "M-*M-M"
MINI = dict(vocab_size=VOCAB, hidden_size=D, layers_block_type=TYPES, num_attention_heads=H, num_key_value_heads=KV,
            head_dim=HD, intermediate_size=FFN, mamba_num_heads=MH, mamba_head_dim=MP, n_groups=G, ssm_state_size=N,
            conv_kernel=CONV, chunk_size=CHUNK, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=B.HF_INITIALIZER_RANGE)


def build(d: Path, overrides: dict | None = None, seed: int = 5, dt_bias: str = "set") -> Path:
    cfg = B.hf_config("nemotron_h", {**MINI, **(overrides or {})})
    random_hf_model(cfg, seed, norm_std=0.15, dt_bias=dt_bias).save_pretrained(str(d), safe_serialization=True)
    return d


MAIN = P.Family("nemotron_h", build, "hf", VOCAB, VOCAB)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return P.build(MAIN, tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def parity(built):
    return P.measure(MAIN, *built)


def _prefill(text: str, mdir: Path, ids: list[int]) -> torch.Tensor:
    from vxc.ir.parser import parse
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    return Session(Engine(parse(text), mdir, max_context=64, replay=False)).prefill(ids)


def test_lowered_program(built):
    text = built[1].read_text()
    mixers = [ln.split()[1] if ln.strip().startswith("mixer") else "-" for ln in text.splitlines()
              if ln.strip().startswith(("mixer", "ffn"))]
    assert mixers == ["mamba2", "-", "softmax", "mamba2", "-", "mamba2"]
    assert text.count("placement PreFfn") == 2 and text.count("placement PreMixer") == 4
    assert text.count(f"ffn mlp d_model={D} intermediate={FFN} act=relu2") == 2
    assert "ffn swiglu" not in text and "ffn moe" not in text
    assert text.count(f"d_inner={MH * MP} heads={MH} head_dim={MP} state_size={N} groups={G} ") == 3
    assert text.count(f"norm_group={MH * MP // G} ") == 3 and text.count("dt_min=0.001 dt_max=inf") == 3
    assert "rotary_dim=0 (default) rotary_base=10000.0 (default) rotary_layout=none" in text
    assert f"scale={HD ** -0.5!r}" in text and "head head tied=false (default)" in text
    assert text.count("\n    residual compute\n") == len(TYPES)


def test_logits_at_floor(parity):
    P.assert_at_floor(parity, max_floor=1e-4, max_tol=2e-4, max_excluded=4, greedy=False)


def test_greedy_identical(parity):
    assert len(parity.greedy_vxc) == P.GREEDY_NEW and parity.greedy_vxc == parity.greedy_ref, (parity.greedy_vxc, parity.greedy_ref)
    assert parity.distinct >= P.MIN_DISTINCT


def test_each_convention_matters(built, parity):
    """Editing one declared attribute of the IR moves the logits far past the tolerance: the checks above cannot
    pass with rotary applied to the attention or with the gated norm over all of d_inner."""
    mdir, ir = built
    text = ir.read_text()
    ids = P.prompt_ids(MAIN)
    base = _prefill(text, mdir, ids)
    edits = {
        "rotary": text.replace("rotary_dim=0 (default) rotary_base=10000.0 (default) rotary_layout=none (default)",
                               f"rotary_dim={HD} rotary_base=10000.0 rotary_layout=half"),
        "one norm group": text.replace(f"norm_group={MH * MP // G} (default)", f"norm_group={MH * MP}"),
    }
    for what, t in edits.items():
        assert t != text, what
        assert float((_prefill(t, mdir, ids) - base).abs().max()) > 100 * parity.tol, what


def test_dt_floor(tmp_path):
    """A miniature whose dt falls below time_step_min (dt_bias at the reference's small-dt init): vxc's prefill
    is at transformers' prefill (which clamps dt at 0.001) within its fp32-vs-fp64 floor, and declaring no floor
    (dt_min=0) moves it far past that."""
    from vxc.driver import lower_to_file

    mdir = build(tmp_path / "low_dt", seed=8, dt_bias="add")
    ir = tmp_path / "low_dt.vxir"
    lower_to_file(mdir, ir)
    ids = P.prompt_ids(MAIN)
    ref = P.Reference(MAIN, mdir)
    r32, r64 = ref.full(ids), ref.full(ids, fp64=True)
    tol = max(2 * P.maxabs(r32, r64), 1e-5 * float(r32.abs().max()))
    text = ir.read_text()
    got = _prefill(text, mdir, ids)
    assert P.maxabs(got, r32) <= tol, (P.maxabs(got, r32), tol)
    unclamped = _prefill(text.replace("dt_min=0.001 ", "dt_min=0.0 "), mdir, ids)
    assert P.maxabs(unclamped, r32) > 100 * tol, (P.maxabs(unclamped, r32), tol)


def test_tied_config_runs_untied(tmp_path):
    """tie_word_embeddings=true: NemotronHForCausalLM declares no tied weights, so transformers keeps (and saves)
    a separate lm_head; vxc declares the head untied, records why, and matches the reference's logits."""
    from vxc.driver import lower_to_file

    mdir = build(tmp_path / "tied", {"tie_word_embeddings": True, "layers_block_type": TYPES[:3]}, seed=9)
    ir = tmp_path / "tied.vxir"
    lower_to_file(mdir, ir)
    text = ir.read_text()
    assert "head head tied=false" in text and "fact tie_word_embeddings_not_applied" in text
    ids = P.prompt_ids(MAIN)[:20]
    ref = P.Reference(MAIN, mdir)
    assert not torch.equal(ref.m32.lm_head.weight, ref.m32.model.embeddings.weight)
    r32 = ref.full(ids)
    tol = max(2 * P.maxabs(r32, ref.full(ids, fp64=True)), 1e-5 * float(r32.abs().max()))
    assert P.maxabs(_prefill(text, mdir, ids), r32) <= tol



def test_bf16_no_further_than_reference_bf16(built, parity):
    """vxc at bf16 is no further from the fp32 reference than transformers' own bf16 run is (NemotronHRMSNorm
    multiplies its weight in fp32 before one cast, vxc's plain RMSNorm casts first: the bf16 paths round
    differently, so this is the bf16 check rather than a floor)."""
    import transformers

    from tests import references as R
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    mdir, ir = built
    ids = P.prompt_ids(MAIN)
    def ref(dtype):
        return R.hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=dtype).eval(), ids).float()

    r32, rb = ref(torch.float32), ref(torch.bfloat16)
    vb = Session(Engine(parse_file(ir), mdir, dtype=torch.bfloat16, max_context=64)).prefill(ids).float()
    ours, theirs = P.maxabs(vb, r32), P.maxabs(rb, r32)
    print(f"bf16 vs fp32 reference: vxc {ours:.3f}, transformers {theirs:.3f}")
    assert 0.0 < ours <= max(theirs, 4 * parity.tol), (ours, theirs)

@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_replay(built, dtype):
    """The relu² MLP layers, the no-rotary attention and the grouped Mamba2 steps run natively for one token: the
    decode step is replayed bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built[0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 10, seed=4), dtype)


def test_save_resume(built, tmp_path):
    """Saved after 6 greedy steps, loaded by a fresh engine: the continuation is bit-identical."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ir = built[1]
    ids = P.prompt_ids(MAIN)[:20]

    def greedy(s, logits, n):  # n tokens; the last one is chosen, not fed
        return P.greedy_fed(s, logits, n, VOCAB)

    s = Session(P.engine_for(ir, max_context=64))
    want = greedy(s, s.prefill(ids)[-1], 14)
    s.reset()
    first = greedy(s, s.prefill(ids)[-1], 6)
    s.save_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    s2 = Session(P.engine_for(ir, max_context=64))
    s2.load_state(tmp_path / "s.safetensors", Sampler(vocab=VOCAB))
    cont = greedy(s2, s2.prefill([first[-1]])[-1], 8)
    assert first + cont == want


def test_triton_backend_matches_torch_twins(built):
    """Prefill of 18 tokens (past one chunk) and 3 steps on vxc's Triton kernels — activation (relu²), the
    grouped gated norm, the SSD scan, attention without rotary — against the torch twins (CPU: Triton's
    interpreter, fresh process). The batched decode step over two sequence slots too: on Triton against the
    twins, and its slot-0 rows against the single-sequence steps."""
    ids = P.prompt_ids(MAIN)[:21]
    out = B.triton_against_twins(str(built[1]), ids, 18, batched=True)
    assert out["max"] > 4.0 and out["err"] <= 1e-4, out
    assert out["batch_max"] > 4.0 and out["batch_err"] <= 1e-4, out
    assert out["batch_vs_single"] <= 1e-5 * out["max"], out
    assert not out["fallbacks"], out["fallbacks"]


def _program(text: str) -> list[str]:
    return [ln.replace(" (default)", "") for ln in text.splitlines()
            if ln.startswith(("    mixer", "    ffn", "    norm", "    placement", "  embedding", "  head"))]


def test_hub_dialect_same_program(built, tmp_path):
    """The hub's spelling — hybrid_override_pattern and num_hidden_layers instead of layers_block_type, the
    mamba_* aliases, attention_head_dim — lowers to the same operators with the same attribute values."""
    from vxc.frontends import lower
    from vxc.ir.printer import print_module

    src = built[0]
    dst = tmp_path / "hub"
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    for k in ("layers_block_type", "n_groups", "conv_kernel", "chunk_size", "head_dim", "time_step_min"):
        cfg.pop(k)
    cfg.update(hybrid_override_pattern=PATTERN, num_hidden_layers=len(PATTERN), mamba_n_groups=G, mamba_d_conv=CONV,
               mamba_chunk_size=CHUNK, attention_head_dim=HD, mamba_dt_min=0.001, rms_norm_eps=1e-5)
    (dst / "config.json").write_text(json.dumps(cfg))
    assert _program(print_module(lower(dst))) == _program(built[1].read_text())


@pytest.mark.parametrize("edit, message", [
    ({"layers_block_type": None, "hybrid_override_pattern": "M-E*"}, "layers 2 are MoE layers"),
    ({"layers_block_type": TYPES[:2] + ["moe"]}, "layers 2 are MoE layers"),
    ({"layers_block_type": None, "hybrid_override_pattern": "M-X"}, "hybrid_override_pattern has characters 'X'"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' is not supported"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"sliding_window": 16}, "sliding_window=16 is not supported"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    ({"head_dim": 12, "attention_head_dim": 16}, "head_dim=12 and attention_head_dim=16 disagree"),
])
def test_config_refusals(built, tmp_path, edit, message):
    from vxc.frontends import FrontendError, lower

    dst = tmp_path / "m"
    shutil.copytree(built[0], dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **edit}
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(FrontendError, match=message.replace("(", r"\(").replace("[", r"\[")):
        lower(dst)


def test_stripped_operand_is_a_named_refusal(built, tmp_path, cli):
    """A checkpoint without layer 4's MLP up projection and layer 3's D: lowering refuses, naming each layer and
    role, and writes no IR."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(built[0], dst)
    sd = load_file(dst / "model.safetensors")
    del sd["backbone.layers.4.mixer.up_proj.weight"], sd["backbone.layers.3.mixer.D"]
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    r = cli("lower", dst, "-o", tmp_path / "m.vxir")
    assert r.exit_code != 0 and not (tmp_path / "m.vxir").exists()
    assert "2 findings" in r.output, r.output
    assert "layer 4 mlp: required role FfnUp is not bound" in r.output, r.output
    assert "layer 3 mamba2: required role Mamba2D is not bound" in r.output, r.output



def test_cli_lower_counts_the_mixers(built, tmp_path, cli):
    """``vxc lower --json`` on the miniature: 6 layers, mixers counted on the 4 layers that have one (the MLP-only
    layers have none)."""
    r = cli("lower", built[0], "-o", tmp_path / "m.vxir", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["layers"] == len(TYPES) and out["mixers"] == {"mamba2": 3, "softmax": 1}, out


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built[1], VOCAB)
