"""The kimi_linear miniatures both halves of its tests use (tests/frontends/test_kimi_linear.py: lowering,
dialects, refusals and the witness; tests/families/test_kimi_linear.py: parity, providers, decode replay,
KDA state)."""

from __future__ import annotations

import pytest

from tests.families import latent_support as S


# Miniature: hidden 40, dense ffn 56, vocab 97; 5 layers, MLA (NoPE) on 0-based 1 and 4, KDA elsewhere.
#   KDA: 2 heads × 12 (q/k/v 24 rows), short conv 3; MLA: 3 heads, kv_lora 20, nope 10, rope 6, v 14
#   (q rows 3·16 = 48, kv_a rows 26, kv_b rows 3·24 = 72, o in 42); latent row 26 per token.
#   MoE variant: 6 experts of 24, top-2, one shared expert; layer 0 dense.
VOCAB = 97
N_LAYERS = 5
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
MLA_LAYERS, KDA_LAYERS = [1, 4], [0, 2, 3]
BASE = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, num_hidden_layers=N_LAYERS,
            num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=20, q_lora_rank=None, qk_rope_head_dim=6,
            v_head_dim=14, qk_nope_head_dim=10, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=1,
            linear_head_dim=12, linear_num_heads=2, linear_conv_kernel_dim=3, rms_norm_eps=1e-5,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, layer_types=TYPES)
DENSE = {**BASE, "mlp_layer_types": ["dense"] * N_LAYERS}
MOE = {**BASE, "mlp_layer_types": ["dense"] + ["sparse"] * (N_LAYERS - 1)}
PROMPT, SPLIT = 80, 50  # one KDA chunk of 64 and a partial one; prefill 0..49 then step


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    return {"dense": S.build(root / "dense", "kimi_linear", DENSE, seed=11), "moe": S.build(root / "moe", "kimi_linear", MOE, seed=12)}
