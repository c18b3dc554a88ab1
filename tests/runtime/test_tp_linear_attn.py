"""Tensor parallelism of the ``gated_delta`` (Qwen3-Next linear attention) and ``conv_qkv`` (mamba_ssm's MHA with a
conv over the fused qkv) mixers, on loopback (gloo), 2 and 3 ranks, one spawn per rank count for all the miniatures:

- qwen3_next: gated delta with 6 key heads × 8 and 12 value heads × 6 (two per key head: rank r holds key heads
  [6r/N, 6(r+1)/N) and the value heads reading them), an output-gated softmax layer (6 heads, 6 kv heads) between
  two gated-delta layers, MoE FFNs (6 experts, a shared expert) on layers 0 and 2, a dense one on layer 1. The
  checkpoint's in_proj_qkvz / in_proj_ba are grouped per key head and bound through gather views (so is q_proj's
  query | gate): each rank reads its rows of them through the view, alone;
- qwen3_next_shared: ONE key head (every rank holds it: ``shares``) for 6 value heads, two gated-delta layers;
- mamba2attn (mamba_ssm native): mamba2, conv_qkv (12 heads, 6 kv heads × 8, both biases), mamba2.

Against TP=1 in this process at the floor of ``tp_support.tolerance``: logits on every rank, decode == prefill,
32 greedy tokens identical, save on N ranks → resume identical; the fused projections' segment ranges worked out
by hand; each rank's parts read alone (bytes read == the parts' bytes), equal to the whole operand's rows, and
sized as ``describe --tp`` says; the regions following the heads; refusals by attribute."""

from __future__ import annotations

import json

import pytest
import torch

from tests import builders as B
from tests.families import qwen3_next_support as Q
from tests.runtime import tp_support as S

RANKS = (2, 3)
# gated delta: 6 key heads × 8, 12 value heads × 6: q|k|v rows 48 | 48 | 72 = 168; z 72 rows; b, a 12 rows each
NEXT = dict(Q.BASE, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=6, num_key_value_heads=6, head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
            linear_num_key_heads=6, linear_num_value_heads=12, linear_key_head_dim=8, linear_value_head_dim=6,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=18,
            mlp_only_layers=[1])
# one key head × 8 for 6 value heads × 8: q|k|v rows 8 | 8 | 48 = 64; dense FFNs
SHARED = dict(NEXT, num_hidden_layers=2, layer_types=["linear_attention"] * 2, mlp_only_layers=[0, 1],
              linear_num_key_heads=1, linear_num_value_heads=6, linear_value_head_dim=8)
# mamba2 12 heads × 8, 6 groups of state 8; conv_qkv 12 heads, 6 kv heads × 8: q|k|v rows 96 | 48 | 48 = 192
M2ATTN = dict(B.MINI_NATIVE_MAMBA2ATTN, d_model=48, vocab_size=101,
              ssm_cfg=dict(B.MINI_NATIVE_MAMBA2ATTN["ssm_cfg"], d_state=8, ngroups=6),
              attn_cfg=dict(B.MINI_NATIVE_MAMBA2ATTN["attn_cfg"], num_heads=12, num_heads_kv=6, head_dim=8,
                            rotary_emb_dim=4))
NAMES = ["qwen3_next", "qwen3_next_shared", "mamba2attn"]
# all-reduces per decode step: one per split mixer and FFN (mamba2attn has no FFN)
REDUCES = {"qwen3_next": 2 * 3, "qwen3_next_shared": 2 * 2, "mamba2attn": 3}


@pytest.fixture(scope="module")
def minis(tmp_path_factory):
    return S.lower_minis(tmp_path_factory.mktemp("tp-linear-attn"), {
        "qwen3_next": lambda d: Q.build(d, NEXT, seed=4),
        "qwen3_next_shared": lambda d: Q.build(d, SHARED, seed=6),
        "mamba2attn": lambda d: B.build_native_mamba(d, M2ATTN, seed=3),
    })


@pytest.fixture(scope="module")
def tp1(minis):
    return S.run_tp1(minis)


@pytest.fixture(scope="module")
def ranks(minis):
    return S.run_ranks(minis, RANKS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", RANKS)
def test_matches_tp1(tp1, ranks, n, name):
    S.check_matches(tp1[name], ranks[n][name])


@pytest.mark.parametrize("n", RANKS)
def test_reduces(ranks, n):
    for name, count in REDUCES.items():
        for res in ranks[n][name]:
            assert res["reduces"] == res["graph_reduces"] == count, (name, n)


def test_fused_projections_cut_segment_by_segment(ranks):
    # worked out by hand. qwen3_next, 2 ranks, rank 1: key heads 3..5 → q [24:48], k [48+24:96]; value heads 6..11
    # of 6 → v [96+36:168]
    assert ranks[2]["qwen3_next"][1]["spans"]["l0.LinearAttnInProjQkv"] == [[24, 48], [72, 96], [132, 168]]
    assert ranks[2]["qwen3_next"][1]["spans"]["l0.LinearAttnConv1d"] == [[24, 48], [72, 96], [132, 168]]
    # 3 ranks, rank 2: key heads 4..5 → q [32:48], k [80:96]; value heads 8..11 → v [96+48:168]; z: 4 heads of 6
    res = ranks[3]["qwen3_next"][2]
    assert res["spans"]["l2.LinearAttnInProjQkv"] == [[32, 48], [80, 96], [144, 168]]
    assert res["spans"]["l2.LinearAttnInProjZ"] == [[48, 72]]
    assert res["spans"]["l2.LinearAttnInProjB"] == res["spans"]["l2.LinearAttnALog"] == [[8, 12]]
    assert res["parts"]["l2.LinearAttnOutProj"] == (1, 48, 72, [48, 24])  # value columns 48..71
    # one key head: every rank holds q [0:8] | k [8:16] (merged) and its 2 value heads of 8 (3 ranks, rank 1)
    assert ranks[3]["qwen3_next_shared"][1]["spans"]["l1.LinearAttnInProjQkv"] == [[0, 16], [32, 48]]
    assert ranks[2]["qwen3_next_shared"][0]["spans"]["l1.LinearAttnInProjQkv"] == [[0, 40]]
    # conv_qkv, 2 ranks, rank 1: heads 6..11 → q [48:96]; kv heads 3..5 → k [96+24:144], v [144+24:192]
    res = ranks[2]["mamba2attn"][1]
    for role in ("ConvQkvInProj", "ConvQkvInProjBias", "ConvQkvConv1d", "ConvQkvConv1dBias"):
        assert res["spans"][f"l1.{role}"] == [[48, 96], [120, 144], [168, 192]], role
    assert res["parts"]["l1.ConvQkvOutProj"] == (1, 48, 96, [48, 48])


def test_segment_ranges_printed(minis, vxc_inproc):
    r = vxc_inproc("passes", minis["qwen3_next"][1], "--tp", "3", "--rank", "1", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "role LinearAttnInProjQkv | shard dim 0 of 3 [16:32,64:80,120:144]" in r.stdout
    assert "role LinearAttnNorm | replicated" in r.stdout
    r = vxc_inproc("passes", minis["mamba2attn"][1], "--tp", "3", "--rank", "2", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    # 4 heads of 8 and 2 kv heads of 8 per rank: q [64:96], k [96+32:144], v [144+32:192]
    assert "role ConvQkvInProj | shard dim 0 of 3 [64:96,128:144,176:192]" in r.stdout
    assert "role ConvQkvOutProjBias | whole, added once (rank 0)" in r.stdout
    assert "heads=4" in r.stdout and "kv_heads=2" in r.stdout


@pytest.mark.parametrize("n", RANKS)
def test_parts_read_alone_and_described(minis, ranks, n):
    for name, (_, ir, _) in minis.items():
        S.check_described(ir, n, ranks[n][name])


def test_parts_through_gather_views(minis):
    """A rank's part of an operand bound through a gather view (qwen3_next's per-key-head grouped in_proj_qkvz,
    in_proj_ba, q_proj's query | gate) is the whole operand's rows at its ranges, read without the rest of the
    tensor: the bytes read are the part's."""
    from vxc.driver import load
    from vxc.passes.manager import TP_PIPELINE, PassManager, parse_pipeline
    from vxc.runtime.weights import Weights

    mdir, ir, _ = minis["qwen3_next"]
    ctx = load(ir)
    whole = Weights(ctx.module, mdir)
    viewed = [o for o in ctx.module.operands if any(t.kind == "gather" for t in o.transforms)]
    assert {str(o.role) for o in viewed} >= {"LinearAttnInProjQkv", "LinearAttnInProjZ", "LinearAttnInProjB",
                                             "LinearAttnInProjA", "AttnQ", "AttnOutputGate"}
    full = {o.sym: whole.operand(o, None, "cpu") for o in viewed}
    for n, rank in ((2, 1), (3, 2)):
        ctx = load(ir)
        ctx.tp, ctx.rank = n, rank
        PassManager(parse_pipeline(TP_PIPELINE), emit=lambda s: None).run(ctx)
        w = Weights(ctx.module, mdir)
        for o in ctx.module.operands:
            if o.sym not in full:
                continue
            before = w.sliced_bytes()
            x = w.operand(o, None, "cpu")
            assert w.sliced_bytes() - before == x.numel() * 4, o.sym
            want = torch.cat([full[o.sym][a:b] for a, b in o.shard.spans()])
            assert torch.equal(x, want), (n, rank, o.sym)


def test_state_follows_heads(ranks):
    # qwen3_next at 3 ranks: delta [4 value heads, 8, 6] fp32, conv [16 + 16 + 24, 4] per gated-delta layer; the
    # softmax layer's kv rows hold 2 kv heads (at context 64)
    shapes = sorted(ranks[3]["qwen3_next"][0]["kv_shapes"].values())
    assert [4, 8, 6] in shapes and [56, 4] in shapes, shapes
    # one shared key head at 2 ranks: delta [3, 8, 8], conv [8 + 8 + 24, 4]
    shapes = sorted(ranks[2]["qwen3_next_shared"][1]["kv_shapes"].values())
    assert shapes == sorted([[3, 8, 8], [40, 4]] * 2), shapes
    # conv_qkv at 3 ranks: conv history [32 + 16 + 16, 3]
    assert [64, 3] in ranks[3]["mamba2attn"][2]["kv_shapes"].values()


def _findings(vxc_inproc, mdir, n):
    r = vxc_inproc("passes", mdir, "--tp", str(n), "--json")
    assert r.exit_code == 2, r.stdout
    return json.loads(r.stdout)["findings"]


def test_refusals(minis, tmp_path, vxc_inproc):
    # 2 key heads, 6 value heads (3 per key head) over 3 ranks: rank 1's value heads 2, 3 would read key heads 0
    # and 1 — neither divides the other, refused by k_heads
    mdir = B.hf_header_only(tmp_path / "k2", dict(Q.DENSE, model_type="qwen3_next", num_attention_heads=6,
                                                   num_key_value_heads=3, head_dim=8), "F32")
    found = [f for f in _findings(vxc_inproc, mdir, 3) if f["operator"] == "gated_delta"]
    assert [(f["layer"], f["code"], f["message"]) for f in found] == [
        (i, "indivisible", "k_heads=2 neither divides by --tp 3 nor divides it") for i in (0, 2, 3)]
    # 12 value heads over 5 ranks
    found = [f for f in _findings(vxc_inproc, minis["qwen3_next"][1], 5) if f["operator"] == "gated_delta"]
    assert {f["message"] for f in found} == {"v_heads=12 is not divisible by --tp 5",
                                             "k_heads=6 neither divides by --tp 5 nor divides it"}
    # conv_qkv: 6 kv heads over 4 ranks
    found = [f for f in _findings(vxc_inproc, minis["mamba2attn"][1], 4) if f["operator"] == "conv_qkv"]
    assert [(f["layer"], f["message"]) for f in found] == [(1, "kv_heads=6 is not divisible by --tp 4")]
