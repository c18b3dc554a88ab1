"""gpt_oss lowering: softmax attention with q/k/v/o biases and per-head sinks, alternating sliding-window
(8) / full layers, YaRN rotary; a biased top-k → softmax router over clamped-GLU experts with biases, as
program lines — for the fused bf16 experts transformers writes (input-major ``[E, in, out]``, bound through a
transpose view) and for MXFP4-packed experts (blocks + scales). The hub dialect lowers to the same program.
The gpt-oss-20b witness at full geometry (header-only): golden IR and describe JSON, with its structure
asserted from independent constants. Parity against transformers 5.24 is in tests/families/test_gpt_oss.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tests import builders as B
from tests.families.gpt_oss_support import D, E, HD, I, KV, TOP_K, WINDOW, YARN_ATTENTION_FACTOR
from tests.families.gpt_oss_support import built  # noqa: F401  (fixture)
from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.families.moe_support import copy_model, lowered_text, program_lines


def test_program(built):
    _, ir = built["fused"]
    text = ir.read_text()
    prog = program_lines(text)
    mixers = [line for line in prog if line.startswith("mixer ")]
    assert [("window=%d" % WINDOW) in m for m in mixers] == [True, False, True]
    assert all("window=0" in m for m in mixers[1:2])
    for m in mixers:
        for want in ("q_bias=true", "k_bias=true", "v_bias=true", "o_bias=true", "sinks=true", f"head_dim={HD}",
                     "rope_type=yarn", "rope_factor=8.0", "rope_beta_fast=16.0", "rope_beta_slow=1.0",
                     "rope_original_max_position=32", "rope_truncate=false", f"rotary_dim={HD}", "rotary_base=500.0"):
            assert want in m, want
        assert f"rope_attention_factor={YARN_ATTENTION_FACTOR!r}" in m
    moe = [line for line in prog if line.startswith("ffn moe")]
    assert len(moe) == 3
    for want in (f"experts={E}", f"top_k={TOP_K}", f"intermediate={I}", "router=topk_softmax", "router_bias=true",
                 "expert_layout=fused_interleaved", "expert_bias=true", "act=clamped_glu", "glu_alpha=1.702",
                 "glu_limit=7.0"):
        assert want in moe[0], want
    states = [line for line in prog if line.startswith("state ")]
    assert states == [f"state kv kv_rows [2,{KV},{HD}] compute per_token window {WINDOW}",
                      f"state kv kv_rows [2,{KV},{HD}] compute per_token",
                      f"state kv kv_rows [2,{KV},{HD}] compute per_token window {WINDOW}"]
    # input-major banks [E, in, out] seen as [E, out, in]
    assert f"%l0.ExpertGateUp bf16[{E},{2 * I},{D}] = $" in text and "| transpose 1 2" in text
    assert f"%l0.ExpertDown bf16[{E},{D},{I}] = $" in text
    assert 'fact experts_read_from "fused input-major' in text


def test_mxfp4_program(built):
    _, ir = built["mxfp4"]
    text = ir.read_text()
    assert 'fact experts_read_from "mxfp4' in text and "fact quantization_config mxfp4" in text
    lines = [line.strip() for line in text.splitlines() if "%l0.ExpertGateUp " in line or "%l0.ExpertDown " in line]
    assert len(lines) == 2 and all("mxfp4" in line and "transpose" not in line for line in lines), lines
    assert f"[{E},{2 * I},{D}]" in lines[0] and f"[{E},{D},{I}]" in lines[1]
    blocks = [line for line in text.splitlines() if "gate_up_proj_blocks" in line and line.strip().startswith("tensor")]
    assert blocks and f"u8[{E},{2 * I},{D // 32},16]" in blocks[0]
    _, fused_ir = built["fused"]
    assert program_lines(text) == program_lines(fused_ir.read_text())


def test_hub_dialect_lowers_to_the_same_program(built, tmp_path):
    mdir, _ = built["fused"]

    def hub(cfg):
        cfg = dict(cfg)
        rp = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rp.pop("rope_theta")
        cfg["rope_scaling"] = rp
        cfg["experts_per_token"] = cfg["num_experts_per_tok"]
        return cfg

    base, hub_text = lowered_text(mdir), lowered_text(copy_model(mdir, tmp_path / "hub", cfg_edit=hub))
    assert program_lines(hub_text) == program_lines(base)
    assert 'dialect "gpt_oss (hub)"' in hub_text and 'dialect "gpt_oss (transformers 5.24 save_pretrained)"' in base
    assert 'fact rope_read_from "rope_theta/rope_scaling"' in hub_text and "fact rope_read_from rope_parameters" in base


# ------------------------------------------------------------------------------ the gpt-oss-20b witness

# gpt-oss-20b (hub config): 24 layers, sliding window 128 on even layers, full on odd; 64 query heads, 8 KV
# heads × 64; 32 experts, top-4, width 2880; d 2880; vocab 201088; YaRN factor 32 over 4096, θ 150000.
W_LAYERS, W_KV, W_HD, W_WINDOW, W_E, W_TOPK, W_VOCAB = 24, 8, 64, 128, 32, 4, 201088
W_SLIDING = list(range(0, 24, 2))
W_KV_PER_TOKEN = 2 * 8 * 64  # K and V rows per position per layer


@pytest.fixture(scope="module")
def witness(tmp_path_factory):
    root = tmp_path_factory.mktemp("witness")
    return B.witness_header_only("gpt-oss-20b", root / "gpt-oss-20b")




def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == W_LAYERS and d["vocab"] == {"logical": W_VOCAB, "padded": W_VOCAB}
    assert d["operators"] == {"softmax": {"count": 24, "layers": list(range(24))}, "moe": {"count": 24, "layers": list(range(24))}}
    assert d["surfaces"] == {"attention": 24, "ffn": 24, "moe": 24}
    st = d["state"]
    assert st["recurrent_layers"] == 0 and st["growing_layers"] == 24
    assert st["fixed_elements"] == 0 and st["per_token_elements"] == W_LAYERS * W_KV_PER_TOKEN
    assert len(st["regions"]) == 24
    for r in st["regions"]:
        assert r["kind"] == "kv_rows" and r["shape"] == [2, W_KV, W_HD] and math.prod(r["shape"]) == W_KV_PER_TOKEN
        want = f"per_token window {W_WINDOW}" if r["layer"] in W_SLIDING else "per_token"
        assert r["growth"] == want, r


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_witness_describe_at_context(witness, describe_json):
    """At 4096 tokens the sliding layers hold 128 rows, the full layers 4096 (bf16: 2 bytes)."""
    d = describe_json(witness, "4096")
    assert d["state"]["at_context"]["bytes"] == 2 * W_KV_PER_TOKEN * (12 * W_WINDOW + 12 * 4096)


def test_witness_golden_ir(witness, snapshot):
    text = B.state_dump(witness)
    prog = program_lines(text)
    mixers = [line for line in prog if line.startswith("mixer ")]
    assert len(mixers) == 24
    for i, m in enumerate(mixers):
        assert ("window=128" if i in W_SLIDING else "window=0") in m
        assert "sinks=true" in m and "q_bias=true" in m and "o_bias=true" in m and "rope_type=yarn" in m
        assert f"rope_attention_factor={0.1 * math.log(32.0) + 1.0!r}" in m and "rotary_base=150000.0" in m
    moe = [line for line in prog if line.startswith("ffn moe")]
    assert len(moe) == 24 and all(f"experts={W_E} top_k={W_TOPK} intermediate=2880" in line for line in moe)
    assert 'dialect "gpt_oss (hub)"' in text and 'model_dir "gpt-oss-20b"' in text
    assert text.count("AttnSinks") >= 24
    assert text == snapshot
