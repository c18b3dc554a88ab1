"""The gemma-3-270m witness at full geometry (header-only, the hub's config spelling): golden IR and describe
JSON, with the structure asserted from constants computed here. Parity is in tests/families/test_gemma3.py.

Config: google/gemma-3-270m's published config.json (transformers 4.55 save; values as released: 18 layers,
hidden 640, 4 query heads and 1 KV head of 256, FFN 2048, vocab 262144, sliding window 512 on five of every six
layers, rope_theta 1e6 / rope_local_base_freq 1e4, query_pre_attn_scalar 256), cross-checked against the
gemma3.* metadata of the Q4_K_M GGUF of the same model (tests/families/test_gguf_gemma3.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests import builders as B

SLIDING = "sliding_attention"
G270_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "_sliding_window_pattern": 6, "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
    "initializer_range": 0.02, "intermediate_size": 2048,
    "layer_types": ([SLIDING] * 5 + ["full_attention"]) * 3,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 512,
    "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0", "use_bidirectional_attention": False,
    "use_cache": True, "vocab_size": 262144,
}
LAYERS, KV, HD, WINDOW, VOCAB, D = 18, 1, 256, 512, 262144, 640
FULL = [5, 11, 17]
KV_PER_TOKEN = 2 * KV * HD


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("witness") / "gemma-3-270m"
    return B.hf_header_only(out, G270_CONFIG, "BF16", config_json=G270_CONFIG)




def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == LAYERS and d["vocab"] == {"logical": VOCAB, "padded": VOCAB}
    assert d["operators"] == {"softmax": {"count": 18, "layers": list(range(18))},
                              "swiglu": {"count": 18, "layers": list(range(18))}}
    st = d["state"]
    assert st["recurrent_layers"] == 0 and st["growing_layers"] == LAYERS
    assert st["fixed_elements"] == 0 and st["per_token_elements"] == LAYERS * KV_PER_TOKEN
    for r in st["regions"]:
        assert r["kind"] == "kv_rows" and r["shape"] == [2, KV, HD]
        assert r["growth"] == ("per_token" if r["layer"] in FULL else f"per_token window {WINDOW}"), r


def test_witness_describe_at_context(witness, describe_json):
    """At 4096 tokens the 15 sliding layers hold 512 rows, the 3 full layers 4096 (bf16: 2 bytes)."""
    d = describe_json(witness, "4096")
    assert d["state"]["at_context"]["bytes"] == 2 * KV_PER_TOKEN * (15 * WINDOW + 3 * 4096)


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    mixers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mixer softmax")]
    assert len(mixers) == LAYERS
    for i, m in enumerate(mixers):
        if i in FULL:
            assert "window=0 " in m and "rotary_base=1000000.0" in m, m
        else:
            assert f"window={WINDOW} " in m and "rotary_base=10000.0" in m, m
        assert f"scale={1 / math.sqrt(256)!r}" in m and "qk_norm_zero_centred=true" in m
    assert text.count("placement PrePost") == LAYERS and text.count("act=gelu_tanh") == LAYERS
    assert f"scale={math.sqrt(D)!r}" in text and "head head tied=true" in text
    assert 'dialect "gemma3_text"' in text and "rope_theta/rope_local_base_freq/rope_scaling" in text
    assert text == snapshot
