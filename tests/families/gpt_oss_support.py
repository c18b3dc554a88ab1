"""The gpt_oss miniatures both halves of its tests use (tests/frontends/test_gpt_oss.py: the lowered
program, dialects and the witness; tests/families/test_gpt_oss.py: parity, window, Triton): the fused bf16
experts transformers writes and the MXFP4 packing of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.families.moe_support import copy_model, quantise_mxfp4
from tests.runtime import parity_table as P


# Miniature: hidden 96, 4 heads × 20 (q 80, k/v 40), 3 layers (sliding 8, full, sliding 8), 6 experts of
# width 64, top-2; vocab 139. Widths the MXFP4 blocks pack are multiples of 32: gate_up in 96, down in 64.
# YaRN: factor 8 over an original 32 positions, beta 16/1, not truncated, theta 500.
VOCAB, D, H, KV, HD, E, TOP_K, I, WINDOW = 139, 96, 4, 2, 20, 6, 2, 64, 8
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 500.0}
MINI = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=I, num_hidden_layers=3, num_attention_heads=H,
            num_key_value_heads=KV, head_dim=HD, num_local_experts=E, num_experts_per_tok=TOP_K, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=YARN,
            max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEED = 41
YARN_ATTENTION_FACTOR = 0.1 * math.log(8.0) + 1.0


def build_fused(d: Path) -> Path:
    return B.build_hf(d, "gpt_oss", MINI, seed=SEED, dtype=torch.bfloat16)


def to_mxfp4(src: Path, dst: Path) -> Path:
    """The hub's packing of the experts: ``*_blocks [E, out, in/32, 16]`` + ``*_scales [E, out, in/32]``,
    quantised from the fused input-major tensors; everything else as stored."""

    def pack(sd):
        out = {}
        for k, v in sd.items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantise_mxfp4(v.float().transpose(1, 2))  # [E, in, out] → [E, out, in]
                out[k + "_blocks"], out[k + "_scales"] = blocks.contiguous(), scales.contiguous()
            else:
                out[k] = v
        return out

    def config(cfg):
        return {**cfg, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}

    return copy_model(src, dst, cfg_edit=config, tensors_edit=pack)


FUSED = P.Family("gpt_oss", build_fused, "hf", VOCAB, VOCAB)
MXFP4 = P.Family("gpt_oss-mxfp4", lambda d: to_mxfp4(build_fused(d.with_name(d.name + "-src")), d), "hf", VOCAB, VOCAB)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return {"fused": P.build(FUSED, root), "mxfp4": P.build(MXFP4, root)}
