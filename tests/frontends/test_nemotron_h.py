"""The Nemotron-H-8B witness at full geometry (header-only, the hub's config spelling): golden IR and describe
JSON, with the structure asserted from constants computed here. Parity is in tests/families/test_nemotron_h.py.

Config: nvidia/Nemotron-H-8B-Base-8K's published config.json (the release's transformers 4.48 dev save, hub
spelling: ``hybrid_override_pattern`` with ``num_hidden_layers``, ``attention_head_dim``, ``rms_norm_eps`` beside
``layer_norm_epsilon``, ``mamba_proj_bias``; keys transformers 5.24 does not read kept as released). Values as
published: 52 layers in the pattern ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` (24 Mamba2, 4
attention, 24 MLP), hidden 4096, 32 query heads and 8 KV heads of 128, MLP 21504 (relu2), Mamba2 128 heads × 64
in 8 groups, state 128, conv 4, chunk 128, vocab 131072, max positions 8192, untied head. The file itself could
not be fetched in this environment; the values are the published ones as quoted by independent tools' test
fixtures and write-ups of the same config.json (the pattern, hidden size, layer count, head counts, Mamba2
geometry and vocab agree in each), and they are NemotronHConfig's own defaults (transformers documents its
defaults from this checkpoint family); transformers 5.24 builds the model from this dict (the header's shapes
are its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import builders as B

PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B_CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_head_dim": 128, "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2,
    "expand": 2, "hidden_dropout": 0.0, "hidden_size": 4096, "hybrid_override_pattern": PATTERN,
    "initializer_range": 0.02, "intermediate_size": 21504, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 8192,
    "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h", "n_groups": 8,
    "num_attention_heads": 32, "num_hidden_layers": 52, "num_key_value_heads": 8, "num_logits_to_keep": 1,
    "pad_token_id": 0, "rescale_prenorm_residual": True, "residual_in_fp32": False, "rms_norm_eps": 1e-05,
    "sliding_window": None, "ssm_state_size": 128, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0", "use_bias": False, "use_cache": True, "use_conv_bias": True,
    "use_mamba_kernels": True, "vocab_size": 131072,
}
LAYERS, D, HEADS, KV, HD, FFN, VOCAB = 52, 4096, 32, 8, 128, 21504, 131072
MH, MP, G, N, K = 128, 64, 8, 128, 4
MAMBA = [i for i, c in enumerate(PATTERN) if c == "M"]
ATTN = [i for i, c in enumerate(PATTERN) if c == "*"]
MLP = [i for i, c in enumerate(PATTERN) if c == "-"]
D_INNER = MH * MP  # 8192
CONV_DIM = D_INNER + 2 * G * N  # 10240
SSM_ELEMENTS = MH * MP * N  # 1,048,576 fp32
CONV_ELEMENTS = CONV_DIM * K
KV_PER_TOKEN = 2 * KV * HD


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("witness") / "Nemotron-H-8B-Base-8K"
    return B.hf_header_only(out, NEMOTRON_H_8B_CONFIG, "BF16", config_json=NEMOTRON_H_8B_CONFIG,
                            max_shard_bytes=B.HF_WITNESS_SHARD_BYTES)


def test_pattern_constants():
    assert (len(PATTERN), len(MAMBA), len(ATTN), len(MLP)) == (52, 24, 4, 24) and ATTN == [7, 18, 29, 40]


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == LAYERS and d["vocab"] == {"logical": VOCAB, "padded": VOCAB}
    assert d["operators"] == {"mamba2": {"count": 24, "layers": MAMBA}, "mlp": {"count": 24, "layers": MLP},
                              "softmax": {"count": 4, "layers": ATTN}}
    assert d["surfaces"] == {"attention": 4, "ffn": 24, "moe": 0}
    st = d["state"]
    # the MLP-only layers hold no state at all; Mamba2 layers a fixed SSM state + conv history; attention KV rows
    assert st["recurrent_layers"] == 24 and st["growing_layers"] == 4
    assert st["fixed_elements"] == 24 * (SSM_ELEMENTS + CONV_ELEMENTS) and st["per_token_elements"] == 4 * KV_PER_TOKEN
    layers_with_state = sorted({r["layer"] for r in st["regions"]})
    assert layers_with_state == sorted(MAMBA + ATTN)
    for r in st["regions"]:
        if r["layer"] in ATTN:
            assert (r["operator"], r["kind"], r["shape"], r["growth"]) == ("softmax", "kv_rows", [2, KV, HD], "per_token"), r
        elif r["kind"] == "recurrent":
            assert (r["operator"], r["shape"], r["growth"]) == ("mamba2", [MH, MP, N], "fixed"), r
        else:
            assert (r["operator"], r["kind"], r["shape"], r["growth"]) == ("mamba2", "conv_history", [CONV_DIM, K], "fixed"), r


def test_witness_describe_at_context(witness, describe_json):
    """At 8192 tokens: 24 SSM states in fp32, 24 conv histories and 4 layers of 8192 KV rows in bf16."""
    d = describe_json(witness, "8192")
    assert d["state"]["at_context"]["bytes"] == 24 * (4 * SSM_ELEMENTS + 2 * CONV_ELEMENTS) + 2 * 4 * 8192 * KV_PER_TOKEN


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    blocks = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("mixer ", "ffn "))]
    assert len(blocks) == LAYERS
    for i, m in enumerate(blocks):
        if i in ATTN:
            assert m.startswith(f"mixer softmax d_model={D} heads={HEADS} kv_heads={KV} head_dim={HD} "), m
            assert "rotary_dim=0 (default)" in m and "rotary_layout=none (default)" in m and f"scale={HD ** -0.5!r}" in m
        elif i in MLP:
            assert m == f"ffn mlp d_model={D} intermediate={FFN} act=relu2", m
        else:
            assert m.startswith(f"mixer mamba2 d_model={D} d_inner={D_INNER} heads={MH} head_dim={MP} state_size={N} "
                                f"groups={G} conv_kernel={K} conv_bias=true proj_bias=false chunk_size=128 "
                                f"dt_min=0.001 (default) dt_max=inf (default) "), m
            assert f"norm_group={D_INNER // G} (default)" in m, m
    assert text.count("placement PreFfn") == 24 and text.count("placement PreMixer") == 28
    assert "head head tied=false (default)" in text and 'dialect "nemotron_h"' in text
    assert "fact layer_map_read_from hybrid_override_pattern" in text
    assert text == snapshot
