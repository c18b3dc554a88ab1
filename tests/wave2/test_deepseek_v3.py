"""deepseek_v3: MLA with q-LoRA (or a direct q), YaRN with mscale, the interleaved rotary layout, dense
and grouped-routing MoE FFNs, against transformers 5.24's DeepseekV3ForCausalLM at the numerical floor;
both rotary spellings; the latent rows against the reference's cache; named refusals; the DeepSeek-V3
witness at full geometry (header-only) with its golden IR and describe JSON.

Every expected number is written here from the published geometry, never read from vxc's declarations.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests import builders as B
from tests.wave2 import latent_support as S

# Miniature: hidden 44, dense ffn 60, vocab 89, 3 heads; q-LoRA rank 26; kv_lora 18, nope 10, rope 8, v 14
#   (q_b rows 3·18 = 54, kv_a rows 26, kv_b rows 3·24 = 72, o in 42); latent row 18 + 8 = 26 per token.
#   YaRN factor 4 over an original 32 positions (max 128), beta 32/1, mscale 0.8, mscale_all_dim 0.6, theta 1000.
#   MoE variant: 8 experts of 20 in 4 groups, 2 groups kept, top-2, one shared expert; layer 0 dense.
#   Direct variant: q_proj, rope_interleave false, default rope theta 500, 2 layers.
VOCAB = 89
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.8, "mscale_all_dim": 0.6, "rope_theta": 1000.0}
BASE = dict(vocab_size=VOCAB, hidden_size=44, intermediate_size=60, moe_intermediate_size=20, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=18, q_lora_rank=26, qk_rope_head_dim=8, v_head_dim=14,
            qk_nope_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, rope_parameters=YARN, max_position_embeddings=128, rms_norm_eps=1e-6,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
DENSE = {**BASE, "first_k_dense_replace": 3}
MOE = {**BASE, "first_k_dense_replace": 1}
DIRECT = {**BASE, "num_hidden_layers": 2, "first_k_dense_replace": 2, "q_lora_rank": None, "rope_interleave": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
PROMPT, SPLIT = 80, 47


def mscale(f, m):
    return 0.1 * m * math.log(f) + 1.0


YARN_SCALE = 18 ** -0.5 * mscale(4.0, 0.6) ** 2
YARN_ATTENTION_FACTOR = mscale(4.0, 0.8) / mscale(4.0, 0.6)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    return {"dense": S.build(root / "dense", "deepseek_v3", DENSE, seed=21), "moe": S.build(root / "moe", "deepseek_v3", MOE, seed=22),
            "direct": S.build(root / "direct", "deepseek_v3", DIRECT, seed=23)}


def to_hub(src, dst):
    """The hub spelling of the rotary parameters: ``rope_theta`` + ``rope_scaling`` with ``type``."""
    cfg = S.read_config(src)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp.pop("rope_type", None)
    cfg["rope_scaling"] = {**rp, "type": "yarn"}
    cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
    S.copy_weights(src, dst)
    S.write_config(dst, cfg)
    return dst


def _lowered(d):
    from vxc.frontends import lower
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    return PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(lower(d), model_dir=d)).module


# ---------------------------------------------------------------- lowering


def test_lowered_attributes(mini):
    m = _lowered(mini["moe"])
    assert m.source.dialect == "deepseek_v3/transformers-5"
    assert [layer.mixer.kind for layer in m.layers] == ["mla"] * 3
    assert [layer.ffn.kind for layer in m.layers] == ["swiglu", "moe", "moe"]
    a = m.layers[0].mixer.attrs
    assert (a["q_lora"], a["q_lora_rank"], a["kv_lora_rank"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]) == (True, 26, 18, 10, 8, 14)
    assert (a["rotary_dim"], a["rotary_layout"], a["rotary_output"], a["rope_type"]) == (8, "interleaved", "split", "yarn")
    assert (a["rope_factor"], a["rope_original_max_position"], a["rope_beta_fast"], a["rope_beta_slow"]) == (4.0, 32, 32.0, 1.0)
    assert (a["rope_mscale"], a["rope_mscale_all_dim"], a["rope_truncate"]) == (0.8, 0.6, True)
    assert a["scale"] == pytest.approx(YARN_SCALE, rel=1e-12)
    assert a["rope_attention_factor"] == pytest.approx(YARN_ATTENTION_FACTOR, rel=1e-12)
    assert a["norm_eps"] == 1e-6 and "norm_eps" in m.layers[0].mixer.defaults
    assert [(r.name, r.kind, list(r.shape), r.precision, r.growth) for r in m.layers[0].regions] == [
        ("latent", "latent_rows", [26], "compute", "per_token")]
    moe = m.layers[1].ffn.attrs
    assert (moe["router"], moe["n_group"], moe["topk_group"], moe["top_k"], moe["routed_scaling"]) == ("sigmoid_grouped", 4, 2, 2, 2.5)
    d = _lowered(mini["direct"]).layers[0].mixer.attrs
    assert (d["q_lora"], d["q_lora_rank"], d["rotary_layout"], d["rotary_output"], d["rope_type"]) == (False, 0, "half", "in_place", "default")
    assert d["scale"] == pytest.approx(18 ** -0.5, rel=1e-12)


def test_hub_rotary_spelling_same_program(mini, tmp_path):
    hub = to_hub(mini["moe"], tmp_path / "hub")
    a, b = _lowered(mini["moe"]), _lowered(hub)
    assert b.source.dialect == "deepseek_v3/hub"
    assert {f.name: f.value for f in b.facts}["rope_read_from"] == "rope_theta/rope_scaling"
    for la, lb in zip(a.layers, b.layers):
        assert (la.mixer.attrs, la.ffn.attrs, la.regions) == (lb.mixer.attrs, lb.ffn.attrs, lb.regions)
    from vxc.runtime.session import Session

    ids = S.prompt(VOCAB, 20)
    assert torch.equal(Session(S.engine(mini["moe"])).prefill(ids), Session(S.engine(hub)).prefill(ids))


def test_yarn_tables_match_reference(mini):
    """vxc's YaRN inverse frequencies and attention factor equal transformers' for the declared attributes."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vxc.runtime.rope import inv_freq

    cfg = transformers.AutoConfig.from_pretrained(str(mini["dense"]))
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    a = _lowered(mini["dense"]).layers[0].mixer.attrs
    inv, factor = inv_freq(a)
    assert torch.equal(inv, ref_inv.float()) and factor == pytest.approx(ref_factor, rel=1e-12)


# ---------------------------------------------------------------- refusals and providers


def test_missing_q_a_layernorm_is_a_named_finding(mini, tmp_path):
    from safetensors.torch import load_file, save_file

    from vxc.driver import lower_to_file
    from vxc.passes.findings import Refusal

    d = tmp_path / "stripped"
    S.copy_weights(mini["dense"], d)
    S.write_config(d, S.read_config(mini["dense"]))
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.q_a_layernorm.weight"]
    save_file(t, str(d / "model.safetensors"))
    out = tmp_path / "x.vxir"
    with pytest.raises(Refusal) as e:
        lower_to_file(d, out)
    assert [x.line() for x in e.value.findings] == ["layer 1 mla: required role MlaQANorm is not bound  [missing-operand]"]
    assert not out.exists()


def test_provider_without_latent_rows_refuses_mla(mini):
    from vxc.passes.findings import Refusal
    from vxc.runtime.state import ROWS_ONLY, StateProvider

    for provider in (StateProvider(kinds=("recurrent", "conv_history", "kv_rows"), name="no-latent"), ROWS_ONLY):
        with pytest.raises(Refusal) as e:
            S.engine(mini["dense"], provider=provider)
        assert [(f.layer, f.operator, f.code) for f in e.value.findings] == [(i, "mla", "unsupported-region") for i in range(3)]
        assert "latent (latent_rows)" in e.value.findings[0].message


# ---------------------------------------------------------------- parity at the floor


def _check(p: S.Parity, run, want):
    print(p.row())
    assert p.maxabs <= p.tol, p
    assert p.argmax == 1.0 and p.excluded <= PROMPT // 10, p
    assert p.steps_vs_prefill <= p.tol, p
    assert run.greedy == want and len(set(want)) >= S.MIN_DISTINCT, (run.greedy, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["moe", "direct"])
@pytest.mark.native
def test_decode_replays_natively_bit_identical_to_the_graph(mini, variant, dtype):
    """MLA with q-LoRA + YaRN (interleaved, split) or a direct q (half rotary), the grouped sigmoid router with
    its selection bias and the experts all run natively for one token: the decode step is replayed bit-identically."""
    S.assert_replay_bit_identical(mini[variant], S.prompt(VOCAB, 20, seed=3), S.prompt(VOCAB, 12, seed=4), dtype)


def test_parity_qlora_yarn_interleaved(mini):
    _check(*S.parity("deepseek_v3 (q-LoRA, YaRN, interleaved, dense FFN)", mini["dense"], VOCAB, S.prompt(VOCAB, PROMPT, 1), SPLIT))


def test_parity_direct_q_half_rotary(mini):
    _check(*S.parity("deepseek_v3 (direct q, half rotary, dense FFN)", mini["direct"], VOCAB, S.prompt(VOCAB, PROMPT, 2), SPLIT))


def test_parity_grouped_moe(mini):
    p, run, want = S.parity("deepseek_v3 (grouped MoE)", mini["moe"], VOCAB, S.prompt(VOCAB, PROMPT, 3), SPLIT, moe=True)
    _check(p, run, want)
    assert p.experts_match, "the selected experts differ from the reference's at some token"


def test_latent_rows_match_reference_cache(mini):
    """The declared latent row is [normalised c | rotated k_pe] in the reference's order: the rows vxc
    holds after a prefill equal the compressed cache transformers keeps (its k_pe in evens-then-odds order)."""
    import transformers

    from vxc.runtime.session import Session

    ids = S.prompt(VOCAB, 29, seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(mini["dense"]), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).cache
    eng = S.engine(mini["dense"])
    Session(eng).prefill(ids)
    for i in range(3):
        rows = eng.state.buffers[f"L{i}.mla.state.latent"][: len(ids)]
        ref = torch.cat([cache.layers[i].keys[0, 0], cache.layers[i].values[0, 0]], dim=-1)  # [c | k_pe]
        torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the DeepSeek-V3 witness (header-only, full geometry)

W = "deepseek-v3"
W_LATENT = 512 + 64


@pytest.fixture(scope="module")
def witness(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3_witness")
    return B.witness_header_only(W, root / W)


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == 61 and d["compute"] == "bf16"
    assert d["operators"]["mla"] == {"count": 61, "layers": list(range(61))}
    assert d["operators"]["swiglu"] == {"count": 3, "layers": [0, 1, 2]}
    assert d["operators"]["moe"] == {"count": 58, "layers": list(range(3, 61))}
    assert d["surfaces"] == {"attention": 61, "ffn": 61, "moe": 58}
    s = d["state"]
    assert (s["recurrent_layers"], s["growing_layers"], s["fixed_elements"]) == (0, 61, 0)
    assert s["per_token_elements"] == 61 * W_LATENT and s["per_token_bytes"] == 61 * W_LATENT * 2
    assert all(r["kind"] == "latent_rows" and r["shape"] == [W_LATENT] and r["growth"] == "per_token" for r in s["regions"])
    # versus expanded K/V rows: 128 heads × (192 + 128) per token per layer
    assert 128 * (192 + 128) == 40_960 and W_LATENT == 576


def test_witness_attributes(witness):
    m = _lowered(witness)
    a = m.layers[0].mixer.attrs
    assert (a["q_lora"], a["q_lora_rank"], a["heads"], a["rope_type"], a["rope_factor"]) == (True, 1536, 128, "yarn", 40.0)
    assert (a["rotary_layout"], a["rotary_output"], a["rope_original_max_position"]) == ("interleaved", "split", 4096)
    assert a["scale"] == pytest.approx(192 ** -0.5 * mscale(40.0, 1.0) ** 2, rel=1e-12)
    assert a["rope_attention_factor"] == 1.0
    moe = m.layers[3].ffn.attrs
    assert (moe["experts"], moe["top_k"], moe["n_group"], moe["topk_group"], moe["routed_scaling"]) == (256, 8, 8, 4, 2.5)


def test_witness_golden_ir(witness, snapshot):
    from vxc.frontends import lower
    from vxc.ir import print_module
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    m = lower(witness, relative_to=witness.parent)
    ctx = PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(m, model_dir=witness))
    text = print_module(ctx.module)
    assert f'model_dir "{W}"' in text and 'dialect "deepseek_v3/hub"' in text
    assert len(text.splitlines()) < 5000
    assert text == snapshot


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json
