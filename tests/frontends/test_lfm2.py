"""The LFM2-350M witness at full geometry (header-only, the hub's config spelling): golden IR and describe JSON,
with the structure asserted from constants computed here. Parity is in tests/families/test_lfm2.py.

Config: LiquidAI/LFM2-350M's published config.json (the release's transformers 4.54 dev save, hub spelling:
``full_attn_idxs``, ``block_ff_dim``, ``tie_embedding``, ``rope_theta``; the ``block_*`` / ``conv_*`` keys
transformers ignores kept as released). Values as published: 16 layers, hidden 1024, 16 query heads and 8 KV heads
(head_dim 64), vocab 65536, conv L_cache 3 without biases, attention on layers 2, 5, 8, 10, 12, 14, block_ff_dim 6656
with auto-adjust (→ 4608), norm_eps 1e-5, rope_theta 1e6, eos 7. The file itself could not be fetched in this
environment; the values are the published ones as quoted by independent ports' test fixtures (mlx-lm's and
llama.cpp-side trimmed copies of the same config.json agree on every value used here), and transformers 5.24
builds the model from this dict (the header's shapes are its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import builders as B

ATTN = [2, 5, 8, 10, 12, 14]
LFM2_350M_CONFIG = {
    "architectures": ["Lfm2ForCausalLM"], "block_auto_adjust_ff_dim": True, "block_dim": 1024, "block_ff_dim": 6656,
    "block_ffn_dim_multiplier": 1.0, "block_mlp_init_scale": 1.0, "block_multiple_of": 256, "block_norm_eps": 1e-05,
    "block_out_init_scale": 1.0, "block_use_swiglu": True, "block_use_xavier_init": True, "bos_token_id": 1,
    "conv_L_cache": 3, "conv_bias": False, "conv_dim": 1024, "conv_dim_out": 1024, "conv_use_xavier_init": True,
    "eos_token_id": 7, "full_attn_idxs": ATTN, "hidden_size": 1024, "initializer_range": 0.02,
    "max_position_embeddings": 128000, "model_type": "lfm2", "norm_eps": 1e-05, "num_attention_heads": 16,
    "num_heads": 16, "num_hidden_layers": 16, "num_key_value_heads": 8, "pad_token_id": 0, "rope_theta": 1000000.0,
    "theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0",
    "use_cache": True, "use_pos_enc": True, "vocab_size": 65536,
}
LAYERS, D, KV, HD, VOCAB, L_CACHE = 16, 1024, 8, 64, 65536, 3
CONV = [i for i in range(LAYERS) if i not in ATTN]
FFN = 4608  # int(2 * 6656 / 3) = 4437 -> int(1.0 * 4437) = 4437 -> next multiple of 256
KV_PER_TOKEN = 2 * KV * HD
CONV_ELEMENTS = D * L_CACHE


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("witness") / "LFM2-350M"
    return B.hf_header_only(out, LFM2_350M_CONFIG, "BF16", config_json=LFM2_350M_CONFIG)


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == LAYERS and d["vocab"] == {"logical": VOCAB, "padded": VOCAB}
    assert d["operators"] == {"short_conv": {"count": 10, "layers": CONV}, "softmax": {"count": 6, "layers": ATTN},
                              "swiglu": {"count": 16, "layers": list(range(LAYERS))}}
    assert d["surfaces"] == {"attention": 6, "ffn": 16, "moe": 0}
    st = d["state"]
    # the conv layers hold only their fixed conv history; the attention layers only growing KV rows
    assert st["recurrent_layers"] == 10 and st["growing_layers"] == 6
    assert st["fixed_elements"] == 10 * CONV_ELEMENTS and st["per_token_elements"] == 6 * KV_PER_TOKEN
    for r in st["regions"]:
        if r["layer"] in CONV:
            assert (r["operator"], r["kind"], r["shape"], r["growth"]) == ("short_conv", "conv_history", [D, L_CACHE], "fixed"), r
        else:
            assert (r["operator"], r["kind"], r["shape"], r["growth"]) == ("softmax", "kv_rows", [2, KV, HD], "per_token"), r
    assert sorted(r["layer"] for r in st["regions"]) == list(range(LAYERS))  # one region per layer


def test_witness_describe_at_context(witness, describe_json):
    """At 4096 tokens (bf16: 2 bytes): 10 conv histories of 1024 x 3, and 6 layers of 4096 KV rows."""
    d = describe_json(witness, "4096")
    assert d["state"]["at_context"]["bytes"] == 2 * (10 * CONV_ELEMENTS + 6 * 4096 * KV_PER_TOKEN)


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    mixers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mixer ")]
    assert len(mixers) == LAYERS
    for i, m in enumerate(mixers):
        if i in ATTN:
            assert m.startswith(f"mixer softmax d_model={D} heads=16 kv_heads={KV} head_dim={HD} "), m
            assert "qk_norm=true qk_norm_eps=1e-05" in m and "rotary_base=1000000.0" in m and f"rotary_dim={HD} " in m
        else:
            assert m == f"mixer short_conv d_model={D} conv_kernel={L_CACHE} conv_bias=false proj_bias=false", m
    assert text.count(f"ffn swiglu d_model={D} intermediate={FFN} ") == LAYERS
    assert text.count("placement PreOnly") == LAYERS and "head head tied=true" in text
    assert 'dialect "lfm2"' in text and 'fact layer_map_read_from "full_attn_idxs' in text
    assert text == snapshot
