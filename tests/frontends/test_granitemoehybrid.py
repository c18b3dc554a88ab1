"""The Granite-4.0-H-Tiny witness at full geometry (header-only, the hub's config spelling): golden IR and describe
JSON, with the structure asserted from constants computed here. Parity is in tests/families/test_granitemoehybrid.py.

Config: ibm-granite/granite-4.0-h-tiny's published config.json (the release's transformers 4.56 save, hub spelling:
``layer_types`` of ``mamba`` / ``attention``, ``rope_theta``, keys transformers 5.24 does not read — init_method,
normalization_function — kept as released). The file itself could not be fetched in this environment; the
values are the published ones as quoted by independent tools' fixtures of the same config.json: 40 layers with
attention at 5, 15, 25, 35 (``mamba`` x5, ``attention``, then (``mamba`` x9, ``attention``) x3, ``mamba`` x4),
hidden 1536, 12 query heads and 4 KV heads (head_dim 128), 64 experts of 512, top-6, shared MLP 1024, Mamba2
48 heads x 64 (expand 2) in 1 group, state 128, conv 4, chunk 256, vocab 100352, tied head, max positions 131072,
embedding_multiplier 12, logits_scaling 6, rms_norm_eps 1e-5 (quoted in a serving manifest of this checkpoint
and in an HF-config ingestion fixture); position_embedding_type nope, residual_multiplier 0.22 and
attention_multiplier 0.0078125 (= 1/head_dim) as in the Granite 4.0 family's published configs. transformers 5.24
builds the model from this dict (the header's shapes are its own, in the hub's expert spelling).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import builders as B

TYPES = ["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4
TINY_CONFIG = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125, "bos_token_id": 100257, "embedding_multiplier": 12, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 1536, "init_method": "mup", "initializer_range": 0.1,
    "intermediate_size": 512, "layer_types": TYPES, "logits_scaling": 6, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2,
    "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_proj_bias": False, "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid", "normalization_function": "rmsnorm", "num_attention_heads": 12,
    "num_experts_per_tok": 6, "num_hidden_layers": 40, "num_key_value_heads": 4, "num_local_experts": 64,
    "output_router_logits": False, "pad_token_id": 100256, "position_embedding_type": "nope",
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000,
    "router_aux_loss_coef": 0.0, "shared_intermediate_size": 1024, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.56.0", "use_cache": True, "vocab_size": 100352,
}
LAYERS, D, HEADS, KV, HD, VOCAB = 40, 1536, 12, 4, 128, 100352
E, TOPK, INTER, SHARED = 64, 6, 512, 1024
MH, MP, N, K = 48, 64, 128, 4
ATTN = [5, 15, 25, 35]
MAMBA = [i for i in range(LAYERS) if i not in ATTN]
D_INNER = MH * MP  # 3072 = 2 x 1536
CONV_DIM = D_INNER + 2 * N  # 3328
SSM_ELEMENTS, CONV_ELEMENTS, KV_PER_TOKEN = MH * MP * N, CONV_DIM * K, 2 * KV * HD


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("witness") / "granite-4.0-h-tiny"
    return B.hf_header_only(out, TINY_CONFIG, "BF16", config_json=TINY_CONFIG, max_shard_bytes=B.HF_WITNESS_SHARD_BYTES)


def test_layer_map_constants():
    assert len(TYPES) == LAYERS and [i for i, t in enumerate(TYPES) if t == "attention"] == ATTN
    assert D_INNER == 2 * D and D // HEADS == HD and 1 / HD == 0.0078125


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    every = list(range(LAYERS))
    assert d["layers"] == LAYERS and d["vocab"] == {"logical": VOCAB, "padded": VOCAB}
    assert d["operators"] == {"mamba2": {"count": 36, "layers": MAMBA}, "moe": {"count": LAYERS, "layers": every},
                              "softmax": {"count": 4, "layers": ATTN}}
    assert d["surfaces"]["attention"] == 4 and d["surfaces"]["moe"] == LAYERS
    st = d["state"]
    assert st["recurrent_layers"] == 36 and st["growing_layers"] == 4
    assert st["fixed_elements"] == 36 * (SSM_ELEMENTS + CONV_ELEMENTS) == 14_635_008
    assert st["fixed_bytes"] == 36 * (4 * SSM_ELEMENTS + 2 * CONV_ELEMENTS)  # SSM state fp32, conv history bf16
    assert st["per_token_elements"] == 4 * KV_PER_TOKEN == 4096
    for r in st["regions"]:
        if r["layer"] in ATTN:
            assert (r["operator"], r["kind"], r["shape"], r["growth"]) == ("softmax", "kv_rows", [2, KV, HD], "per_token"), r
        elif r["kind"] == "recurrent":
            assert (r["operator"], r["shape"], r["dtype"]) == ("mamba2", [MH, MP, N], "f32"), r
        else:
            assert (r["operator"], r["kind"], r["shape"], r["dtype"]) == ("mamba2", "conv_history", [CONV_DIM, K], "bf16"), r


def test_witness_describe_at_context(witness, describe_json):
    """At 4096 tokens: 36 fixed Mamba2 states + 4 layers of 4096 bf16 KV rows."""
    d = describe_json(witness, "4096")
    assert d["state"]["at_context"]["bytes"] == (36 * (4 * SSM_ELEMENTS + 2 * CONV_ELEMENTS)
                                                 + 4 * 2 * 4096 * KV_PER_TOKEN)


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    mixers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mixer ")]
    assert len(mixers) == LAYERS
    for i, m in enumerate(mixers):
        if i in ATTN:
            assert m.startswith(f"mixer softmax d_model={D} heads={HEADS} kv_heads={KV} head_dim={HD} (default) "
                                f"q_bias=false "), m
            assert "scale=0.0078125 " in m and "rotary_dim=0 (default)" in m and "rotary_layout=none" in m, m
        else:
            assert m.startswith(f"mixer mamba2 d_model={D} d_inner={D_INNER} heads={MH} head_dim={MP} state_size={N} "
                                f"groups=1 conv_kernel={K} conv_bias=true proj_bias=false chunk_size=256 "), m
            assert f"norm_eps=1e-05 norm_order=gate_then_norm (default) norm_act=silu (default) norm_group={D_INNER}" in m
        assert m.endswith("output_scale=0.22"), m
    ffn = (f"ffn moe d_model={D} experts={E} top_k={TOPK} intermediate={INTER} router=topk_softmax "
           f"norm_topk_prob=false (default)")
    assert text.count(ffn) == LAYERS and text.count(f"shared_intermediate={SHARED} shared_gate=false (default) "
                                                    f"output_scale=0.22") == LAYERS
    assert f"embedding embedding vocab={VOCAB} padded_vocab={VOCAB} dim={D} output_scale=12.0" in text
    assert f"head head tied=true padded_vocab={VOCAB} dim={D} scale={1 / 6!r}" in text
    assert 'dialect "granitemoehybrid"' in text and "compute bf16" in text
    assert text == snapshot
