"""Tensor parallelism of the ``mla`` (multi-head latent attention) and ``kda`` (Kimi delta attention) mixers, on
loopback (gloo), 2 and 3 ranks, one spawn per rank count for all the miniatures (transformers, fp32):

- dsv3: deepseek_v3 with q-LoRA (rank 20), YaRN, interleaved rotary, 6 heads (q_b rows 6 × (6 nope + 4 rope) = 60,
  kv_b rows 6 × (6 nope + 8 v) = 84, o columns 6 × 8 = 48), latent rows 16 + 4, two dense layers;
- dsv3_direct: the same without q-LoRA (q_proj rows 60), half-pair rotary, layer 1 an MoE (6 experts in 2 groups,
  a shared expert of 12);
- kimi: kimi_linear, KDA (6 heads × 8: q/k/v/f_b/g_b rows 48, b and A_log 6 rows) on layers 0 and 2, NoPE MLA
  (6 heads as above) on layer 1, MoE on layers 1 and 2 (6 experts, a shared expert).

Rank r of N holds heads [6r/N, 6(r+1)/N): the per-head projections' rows, the output projections' columns; the
latent path (q_a / kv_a and their norms, the first factors of KDA's low-rank gates, KDA's per-head output norm) is
whole on every rank, and so are the latent rows. Against TP=1 in this process at the floor of
``tp_support.tolerance``: logits on every rank, decode == prefill, 32 greedy tokens identical, save on N ranks →
resume identical; the cuts worked out by hand; the state each rank saves — the latent rows equal TP=1's whole on
every rank, the KDA state and conv histories TP=1's rows of the rank's heads; each rank's parts read alone (bytes
read == the parts' bytes) and sized as ``describe --tp`` says; refusals when the heads do not divide.
(kv_b cut other than by whole heads — e.g. k_nope rows of one head with v rows of another — or a latent row cut
by N would change the logits or the state: the TP=1 comparisons fail.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.families import deepseek_v3_support as DS
from tests.families import kimi_linear_support as KS
from tests.families import latent_support as L
from tests.runtime import tp_support as S

RANKS = (2, 3)
HEADS = 6
R_LAT, ROPE, NOPE, V = 16, 4, 6, 8  # latent row R + P = 20; q head 10, kv_b head 14, o head 8
MLA_GEO = dict(num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=R_LAT, qk_rope_head_dim=ROPE,
               qk_nope_head_dim=NOPE, v_head_dim=V, hidden_size=32, intermediate_size=48,
               vocab_size=101)  # (tp_support's prompt ids reach 99)
DSV3 = dict(DS.BASE, **MLA_GEO, num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=20)
DIRECT = dict(DSV3, q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
              first_k_dense_replace=1, n_routed_experts=6, n_group=2, topk_group=1, moe_intermediate_size=12)
KDA_D = 8  # KDA: 6 heads × 8 = 48 channels, conv kernel 3
KIMI = dict(KS.BASE, **MLA_GEO, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], linear_num_heads=HEADS, linear_head_dim=KDA_D,
            num_local_experts=6, moe_intermediate_size=12)
NAMES = ["dsv3", "dsv3_direct", "kimi"]
REDUCES = {name: 2 * layers for name, layers in (("dsv3", 2), ("dsv3_direct", 2), ("kimi", 3))}  # a mixer and an FFN per layer


@pytest.fixture(scope="module")
def minis(tmp_path_factory):
    return S.lower_minis(tmp_path_factory.mktemp("tp-latent"), {
        "dsv3": lambda d: L.build(d, "deepseek_v3", DSV3, seed=21),
        "dsv3_direct": lambda d: L.build(d, "deepseek_v3", DIRECT, seed=23),
        "kimi": lambda d: L.build(d, "kimi_linear", KIMI, seed=11),
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
    assert {(res["reduces"], res["graph_reduces"]) for res in ranks[n][name]} == {(REDUCES[name],) * 2}


def test_cut_by_whole_heads(ranks):
    # worked out by hand. 3 ranks, rank 1: heads 2, 3 → q(_b) rows [20:40], kv_b rows [28:56], o columns [16:32]
    for name, q in (("dsv3", "MlaQBProj"), ("dsv3_direct", "MlaQProj")):
        res = ranks[3][name][1]
        for layer in (0, 1):
            assert res["spans"][f"l{layer}.{q}"] == [[20, 40]], (name, layer)
            assert res["spans"][f"l{layer}.MlaKvBProj"] == [[28, 56]], (name, layer)
            assert res["parts"][f"l{layer}.MlaOutProj"] == (1, 16, 32, [32, 16]), (name, layer)
    # the latent path whole: not cut on any rank
    whole = {"MlaQAProj", "MlaQANorm", "MlaKvAProj", "MlaKvANorm", "KdaFAProj", "KdaGAProj", "KdaONorm"}
    for n in RANKS:
        for name in NAMES:
            for res in ranks[n][name]:
                assert not {sym.split(".", 1)[1] for sym in res["parts"]} & whole, (n, name)
    # 2 ranks, rank 1: heads 3..5 → kv_b rows [42:84], o columns [24:48]
    res = ranks[2]["kimi"][1]
    assert res["spans"]["l1.MlaQProj"] == [[30, 60]] and res["spans"]["l1.MlaKvBProj"] == [[42, 84]]
    # KDA 2 ranks, rank 1: heads 3..5 of 8 channels → rows [24:48] of q/k/v, their convs, f_b, g_b, dt_bias
    for layer in (0, 2):
        for role in ("KdaQProj", "KdaKProj", "KdaVProj", "KdaQConv1d", "KdaKConv1d", "KdaVConv1d", "KdaFBProj",
                     "KdaGBProj", "KdaDtBias"):
            assert res["spans"][f"l{layer}.{role}"] == [[24, 48]], (layer, role)
        assert res["spans"][f"l{layer}.KdaBProj"] == res["spans"][f"l{layer}.KdaALog"] == [[3, 6]]
        assert res["parts"][f"l{layer}.KdaOutProj"] == (1, 24, 48, [32, 24])
    # 3 ranks, rank 2: heads 4, 5 → [32:48]; A_log (stored [1, 1, 6, 1], read through a reshape) [4:6]
    res = ranks[3]["kimi"][2]
    assert res["spans"]["l2.KdaQConv1d"] == [[32, 48]] and res["spans"]["l2.KdaALog"] == [[4, 6]]


def test_printed_after_shard(minis, vxc_inproc):
    r = vxc_inproc("passes", minis["kimi"][1], "--tp", "3", "--rank", "1", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    out = r.stdout
    assert "role MlaKvBProj | shard dim 0 of 3 [28:56]" in out
    assert "role MlaKvAProj | replicated" in out and "role MlaKvANorm | replicated" in out
    assert "role KdaFBProj | shard dim 0 of 3 [16:32]" in out and "role KdaFAProj | replicated" in out
    assert "role KdaONorm | replicated" in out
    assert "mixer kda d_model=32 heads=2 " in out and "mixer mla d_model=32 heads=2 " in out


def _states(minis, name, n):
    from safetensors.torch import load_file

    from vxc.runtime.tp import rank_path

    od = minis[name][2]
    whole = load_file(od / "state-tp1.safetensors")
    return whole, [load_file(rank_path(od / f"state-tp{n}.safetensors", r)) for r in range(n)]


@pytest.mark.parametrize("n", RANKS)
def test_state_follows_heads(minis, ranks, n):
    """The state each rank saved after its prefill: the latent rows whole and equal to TP=1's on every rank; KDA's
    delta state and conv histories TP=1's rows of the rank's heads."""
    for name in NAMES:
        whole, parts = _states(minis, name, n)
        latent = [k for k in whole if whole[k].shape[-1] == R_LAT + ROPE]
        kda = [k for k in whole if k not in latent and k != "position"]
        assert len(latent) == (1 if name == "kimi" else 2) and len(kda) == (8 if name == "kimi" else 0), (name, list(whole))
        for r, part in enumerate(parts):
            assert set(part) == set(whole), (name, r)
            assert torch.equal(part["position"], whole["position"])
            for k in latent:
                assert part[k].shape == whole[k].shape == (S.SPLIT, R_LAT + ROPE), (name, k)
                assert torch.allclose(part[k], whole[k], rtol=0, atol=1e-5 * whole[k].abs().max().item()), (name, k, r)
            for k in kda:
                rows = whole[k].shape[0] // n
                want = whole[k][r * rows:(r + 1) * rows]
                assert part[k].shape == want.shape, (name, k, r)
                assert torch.allclose(part[k], want, rtol=0, atol=1e-5 * whole[k].abs().max().item()), (name, k, r)
    shapes = ranks[3]["kimi"][0]["kv_shapes"].values()
    assert sorted(shapes) == sorted([[2, KDA_D, KDA_D], [16, 3], [16, 3], [16, 3]] * 2 + [[64, R_LAT + ROPE]]), shapes


@pytest.mark.parametrize("n", RANKS)
def test_parts_read_alone_and_described(minis, ranks, n):
    for name, (_, ir, _) in minis.items():
        S.check_described(ir, n, ranks[n][name])


def _findings(vxc_inproc, path, n):
    r = vxc_inproc("passes", path, "--tp", str(n), "--json")
    assert r.exit_code == 2, r.stdout
    return json.loads(r.stdout)["findings"]


def test_refusals(minis, vxc_inproc):
    # 6 heads over 4 ranks: every MLA and KDA layer refused by name (the dense FFN's 48 divides)
    found = [f for f in _findings(vxc_inproc, minis["dsv3"][1], 4) if f["operator"] in ("mla", "kda")]
    assert [(f["layer"], f["operator"], f["code"], f["message"]) for f in found] == [
        (i, "mla", "indivisible", "heads=6 is not divisible by --tp 4") for i in (0, 1)]
    found = [f for f in _findings(vxc_inproc, minis["kimi"][1], 4) if f["operator"] in ("mla", "kda")]
    assert [(f["layer"], f["operator"], f["code"], f["message"]) for f in found] == [
        (0, "kda", "indivisible", "heads=6 is not divisible by --tp 4"), (1, "mla", "indivisible", "heads=6 is not divisible by --tp 4"),
        (2, "kda", "indivisible", "heads=6 is not divisible by --tp 4")]
