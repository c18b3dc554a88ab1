"""The qwen3_moe miniature both halves of its tests use (tests/frontends/test_qwen3_moe.py: the lowered
program and dialects; tests/families/test_qwen3_moe.py: parity and expert selection)."""

from __future__ import annotations

import pytest

from tests import builders as B
from tests.runtime import parity_table as P


# Miniature: hidden 56, 4 heads × 18 (q 72, k/v 36), 3 layers, layer 1 dense (SwiGLU 88), layers 0 and 2
# MoE: 10 experts of width 40, top-3, renormalised; vocab 131.
VOCAB, E, TOP_K, I_MOE, I_DENSE, D, H, KV, HD = 131, 10, 3, 40, 88, 56, 4, 2, 18
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=I_DENSE, moe_intermediate_size=I_MOE, num_hidden_layers=3,
            num_attention_heads=H, num_key_value_heads=KV, head_dim=HD, num_experts=E, num_experts_per_tok=TOP_K,
            norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEED = 31
FAMILY = P.Family("qwen3_moe", lambda d: B.build_hf(d, "qwen3_moe", MINI, seed=SEED), "hf", VOCAB, VOCAB)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    return P.build(FAMILY, root)
