"""The Falcon-H1-0.5B witness at full geometry (header-only): golden IR and describe JSON, with the structure
asserted from constants computed here. Parity is in tests/families/test_falcon_h1.py.

Config: tiiuae/Falcon-H1-0.5B-Base's published config.json values. The file itself could not be fetched in this
environment; the values are those quoted by NVIDIA-NeMo/Megatron-Bridge's test fixture of that config
(tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py, FALCON_H1_500M_CONFIG), which omits one key the
hub file spells: ``mamba_d_ssm`` 1536 — the fixture's own round-trip test writes it as mamba_n_heads ·
mamba_d_head (24 · 64), and FalconH1Config refuses any other value for these heads (its default, 1024, is not a
multiple of 24). Values: 36 layers, hidden 1024, 8 query heads and 2 KV heads of head_dim 64 (not hidden / heads:
q width 512), vocab 32784, FFN 2048, Mamba2 24 heads x 64 in 1 group, state 128, conv 4, chunk 128, no gated
RMSNorm (mamba_rms_norm false), no biases, rope_theta 1e11, untied head, bf16, and the µP multipliers below.
transformers 5.24 builds the model from this dict (the header's shapes are its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import builders as B

FALCON_H1_05B_CONFIG = {
    "architectures": ["FalconH1ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "attn_layer_indices": None,
    "embedding_multiplier": 5.656854249492381, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 2048, "key_multiplier": 0.39062499999999994,
    "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128, "mamba_conv_bias": True, "mamba_d_conv": 4,
    "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1,
    "mamba_n_heads": 24, "mamba_norm_before_gate": False, "mamba_proj_bias": False, "mamba_rms_norm": False,
    "mamba_use_mlp": True, "max_position_embeddings": 16384, "mlp_bias": False,
    "mlp_multipliers": [0.8838834764831844, 0.5859375], "model_type": "falcon_h1", "num_attention_heads": 8,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "projectors_bias": False, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32784,
}
LAYERS, D, KV, HD, VOCAB, FFN = 36, 1024, 2, 64, 32784, 2048
MH, MP, N, K = 24, 64, 128, 4
CONV_DIM = MH * MP + 2 * 1 * N  # 1792
SSM_ELEMENTS, CONV_ELEMENTS, KV_PER_TOKEN = MH * MP * N, CONV_DIM * K, 2 * KV * HD


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("witness") / "Falcon-H1-0.5B-Base"
    return B.hf_header_only(out, FALCON_H1_05B_CONFIG, "BF16", config_json=FALCON_H1_05B_CONFIG)


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    every = list(range(LAYERS))
    assert d["layers"] == LAYERS and d["vocab"] == {"logical": VOCAB, "padded": VOCAB}
    assert d["operators"] == {"mamba2": {"count": LAYERS, "layers": every}, "softmax": {"count": LAYERS, "layers": every},
                              "swiglu": {"count": LAYERS, "layers": every}}
    assert d["surfaces"] == {"attention": LAYERS, "ffn": LAYERS, "moe": 0}
    st = d["state"]
    # every layer holds both mixers' state: the Mamba2 SSM state and conv history (fixed) and the KV rows (growing)
    assert st["recurrent_layers"] == 0 and st["growing_layers"] == LAYERS
    assert st["fixed_elements"] == LAYERS * (SSM_ELEMENTS + CONV_ELEMENTS) == 7_335_936
    assert st["fixed_bytes"] == LAYERS * (4 * SSM_ELEMENTS + 2 * CONV_ELEMENTS)  # SSM state fp32, history bf16
    assert st["per_token_elements"] == LAYERS * KV_PER_TOKEN == 9216
    for layer in every:
        regions = [(r["operator"], r["name"], r["kind"], r["shape"], r["dtype"], r["growth"])
                   for r in st["regions"] if r["layer"] == layer]
        assert regions == [("mamba2", "ssm", "recurrent", [MH, MP, N], "f32", "fixed"),
                           ("mamba2", "conv", "conv_history", [CONV_DIM, K], "bf16", "fixed"),
                           ("softmax", "kv", "kv_rows", [2, KV, HD], "bf16", "per_token")], (layer, regions)


def test_witness_describe_at_context(witness, describe_json):
    """At 4096 tokens: 36 x (fp32 SSM state + bf16 conv history + 4096 bf16 KV rows)."""
    d = describe_json(witness, "4096")
    assert d["state"]["at_context"]["bytes"] == LAYERS * (4 * SSM_ELEMENTS + 2 * CONV_ELEMENTS + 2 * 4096 * KV_PER_TOKEN)


def test_witness_human_describe_lists_both_regions(witness, cli):
    r = cli("describe", witness)
    assert r.exit_code == 0, r.output
    assert "0 recurrent layers" in r.output and "36 growing layers" in r.output
    for row in ("mamba2    ssm", "mamba2    conv", "softmax   kv"):
        assert any(row.split()[0] in ln and row.split()[1] in ln and "0–35" in ln for ln in r.output.splitlines()), row


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    mixers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mixer ")]
    assert len(mixers) == 2 * LAYERS
    mamba = (f"mixer mamba2 d_model={D} d_inner={MH * MP} heads={MH} head_dim={MP} state_size={N} groups=1 "
             f"conv_kernel={K} conv_bias=true proj_bias=false chunk_size=128 dt_min=0.0 (default) dt_max=inf (default) "
             f"gated_norm=false norm_act=silu (default) z_scale=0.3535533905932738 x_scale=0.25 "
             f"b_scale=0.3535533905932738 c_scale=0.5 dt_scale=0.3535533905932738 input_scale=1.25 "
             f"output_scale=0.23570226039551587")
    assert mixers[0::2] == [mamba] * LAYERS, mixers[0]
    for m in mixers[1::2]:
        assert m.startswith(f"mixer softmax d_model={D} heads=8 kv_heads={KV} head_dim={HD} q_bias=false "), m
        assert "rotary_base=100000000000.0" in m and f"rotary_dim={HD} " in m
        assert m.endswith("key_scale=0.39062499999999994 input_scale=1.0 output_scale=0.9375"), m
    assert text.count(f"ffn swiglu d_model={D} intermediate={FFN} act=silu (default) gate_scale=0.8838834764831844 "
                      f"output_scale=0.5859375") == LAYERS
    assert text.count("placement Parallel") == LAYERS
    assert f"embedding embedding vocab={VOCAB} padded_vocab={VOCAB} dim={D} scale=5.656854249492381" in text
    assert f"head head tied=false padded_vocab={VOCAB} dim={D} scale=0.0390625" in text
    assert 'dialect "falcon_h1"' in text and "compute bf16" in text
    assert text == snapshot


def test_two_mixers_only_on_a_parallel_layer(witness):
    """The IR's rules for a second mixer line: only placement Parallel spells one (a located syntax error
    otherwise), and verify refuses two mixers of one kind or a Parallel layer with one mixer."""
    from dataclasses import replace

    from vxc.ir import parse
    from vxc.ir.diagnostics import IRSyntaxError
    from vxc.passes.verify import verify_structure

    text = B.state_dump(witness)
    first = text.index("placement Parallel")
    with pytest.raises(IRSyntaxError, match=r"layer 0: mixer given twice \(only placement Parallel declares two mixers\)"):
        parse(text[:first] + "placement PreOnly" + text[first + len("placement Parallel"):])
    m = parse(text)
    assert verify_structure(m) == []
    m.layers[3].parallel = replace(m.layers[3].mixer)
    m.layers[5].parallel = None
    found = [(f.layer, f.code, f.message) for f in verify_structure(m)]
    assert found == [(3, "bad-placement", "placement Parallel: the two mixers are both mamba2 (two mixers of one kind "
                                          "would share their state regions' names)"),
                     (5, "bad-placement", "placement Parallel declares two mixers side by side, declared 1")], found
