"""The deepseek_v3 miniatures both halves of its tests use (tests/frontends/test_deepseek_v3.py: lowering,
dialects, refusals and the witness; tests/families/test_deepseek_v3.py: parity, decode replay, latent rows)."""

from __future__ import annotations

import pytest

from tests.families import latent_support as S


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


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    return {"dense": S.build(root / "dense", "deepseek_v3", DENSE, seed=21), "moe": S.build(root / "moe", "deepseek_v3", MOE, seed=22),
            "direct": S.build(root / "direct", "deepseek_v3", DIRECT, seed=23)}
