"""Tensor parallelism of the Mamba2 mixer, the non-gated MLP, the short conv and Parallel layers (two mixers side
by side), and of a sliding-window GeGLU family, on loopback (gloo), 2 and 3 ranks, one spawn per rank count for all
the miniatures:

- mamba2: ONE B/C group (every rank holds it: ``shares``) and one RMS group over all of d_inner (the gated norm's
  sum of squares is all-reduced across the ranks: ``norm_ranks``): 12 heads of 8;
- nemotron_h: mamba2 + relu² MLP + softmax attention, 6 groups that 2 and 3 divide, RMS groups within a rank;
- lfm2: short conv (its b | c | v blocks cut channel by channel) + attention + SwiGLU;
- falcon_h1: attention beside mamba2 in every layer (one all-reduce of their sum) with µP multipliers, normed
  with 6 groups; and its plain variant (no gated norm, one group, biases on every projection, tied head);
- gemma3: sliding and full attention, q/k norms, GeGLU.

Against TP=1 in this process at the floor of ``tp_support.tolerance``: logits on every rank, decode == prefill,
32 greedy tokens identical, save on N ranks → resume identical; the segmented cuts of fused projections checked
against ranges worked out by hand; each rank's parts read alone and sized as ``describe --tp`` says; the number
of all-reduces; refusals by attribute (groups, an RMS group spanning part of the ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.hf_random import random_hf_model
from tests.runtime import tp_support as S
from tests.triton_support import triton_case
from vxc.codegen.kernels.triton_common import INTERPRETED

RANKS = (2, 3)
# hidden 48, expand 2: d_inner 96 = 12 heads × 8; one group of state 12; in_proj rows z 96 | x 96 | B 12 | C 12 | dt 12
M2 = dict(B.MINI_HF["mamba2"], num_heads=12, head_dim=8, hidden_size=48, n_groups=1, state_size=12)
NH = dict(num_attention_heads=6, num_key_value_heads=6, intermediate_size=72, mamba_num_heads=6, n_groups=6)
ATTN = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6, head_dim=8)
# lfm2: FFN int(1.3 · int(2 · 90 / 3)) = 78 rounded up to a multiple of 24 = 96
LFM2 = dict(ATTN, block_multiple_of=24)
FALCON = dict(ATTN, intermediate_size=72, mamba_n_groups=6, mamba_d_state=6)
FALCON_PLAIN = dict(FALCON, mamba_n_groups=1, mamba_rms_norm=False, attention_bias=True, mamba_proj_bias=True,
                    projectors_bias=True, tie_word_embeddings=True)
GEMMA3 = dict(num_attention_heads=6, num_key_value_heads=6, head_dim=8, intermediate_size=72)
NAMES = ["mamba2", "nemotron_h", "lfm2", "falcon_h1", "falcon_h1_plain", "gemma3"]
# all-reduces per decode step: one per split mixer / FFN (one per Parallel pair), plus the mamba2 one-group norm's
REDUCES = {"mamba2": 2 * 2, "nemotron_h": 6, "lfm2": 2 * 5, "falcon_h1": 2 * 3, "falcon_h1_plain": 2 * 3, "gemma3": 2 * 4}


def _hf(model_type: str, mini: dict, overrides: dict, seed: int = 7):
    def build(d: Path) -> Path:
        model = random_hf_model(B.hf_config(model_type, {**mini, **overrides}), seed, norm_std=0.15, dt_bias="add")
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():  # biases start at zero: move them, so a bias added on every rank cannot pass
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        model.save_pretrained(str(d), safe_serialization=True)
        return d
    return build


@pytest.fixture(scope="module")
def minis(tmp_path_factory):
    from tests.families import test_falcon_h1, test_gemma3, test_lfm2
    from tests.families import test_nemotron_h as nemotron

    return S.lower_minis(tmp_path_factory.mktemp("tp-families"), {
        "mamba2": lambda d: B.build_hf(d, "mamba2", M2),
        "nemotron_h": lambda d: nemotron.build(d, NH),
        "lfm2": _hf("lfm2", test_lfm2.MINI, LFM2),
        "falcon_h1": _hf("falcon_h1", test_falcon_h1.MINI, FALCON),
        "falcon_h1_plain": _hf("falcon_h1", test_falcon_h1.MINI, FALCON_PLAIN, seed=9),
        "gemma3": _hf("gemma3_text", test_gemma3.MINI, GEMMA3),
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


def test_fused_in_proj_cut_segment_by_segment(ranks):
    # worked out by hand: z [96·r/2 ...], x at 96 + 48·r, B and C (one group) whole at 192..216, dt at 216 + 6·r;
    # adjacent ranges merge
    spans = {r: ranks[2]["mamba2"][r]["spans"]["l0.Mamba2InProj"] for r in range(2)}
    assert spans == {0: [[0, 48], [96, 144], [192, 222]], 1: [[48, 96], [144, 216], [222, 228]]}
    for r in range(2):
        assert ranks[2]["mamba2"][r]["parts"]["l0.Mamba2InProj"][3] == [96 + 24 + 6, 48]
    # three ranks: 4 heads each: z 32 rows, x 32, B 12, C 12, dt 4 = 92 rows
    for res in ranks[3]["mamba2"]:
        assert res["parts"]["l0.Mamba2InProj"][3] == [92, 48]
        assert res["parts"]["l0.Mamba2Conv1d"][3] == [32 + 24, 4]  # x part + both groups


def test_segment_ranges_printed(minis, vxc_inproc):
    mdir, ir, _ = minis["mamba2"]
    expect = {0: "[0:48,96:144,192:222]", 1: "[48:96,144:216,222:228]"}
    for rank, spans in expect.items():
        r = vxc_inproc("passes", ir, "--tp", "2", "--rank", str(rank), "--print-after", "shard")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert f"role Mamba2InProj | shard dim 0 of 2 {spans}" in r.stdout
        assert "norm_ranks=2" in r.stdout
        assert r.stdout.count(" all_reduce ") == 2  # the mixers' (the norm's all-reduce is inside the mixer)
    mdir, ir, _ = minis["nemotron_h"]
    r = vxc_inproc("passes", ir, "--tp", "3", "--rank", "2", "--print-after", "shard")
    assert r.exit_code == 0 and "norm_ranks" not in r.stdout
    # 6 heads of 10, 6 groups of state 8: rank 2 holds heads 4..5 and groups 4..5
    # z [40:60], x [60+40:60+60], B [120+32:120+48], C [168+32:168+48], dt [216+4:216+6]
    assert "role Mamba2InProj | shard dim 0 of 3 [40:60,100:120,152:168,200:216,220:222]" in r.stdout


def test_short_conv_and_parallel_printed(minis, vxc_inproc):
    # lfm2, 48 channels over 2 ranks: rank 1 holds channels 24..47 of each of b | c | v
    r = vxc_inproc("passes", minis["lfm2"][1], "--tp", "2", "--rank", "1", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "role ShortConvInProj | shard dim 0 of 2 [24:48,72:96,120:144]" in r.stdout
    assert "channels=24" in r.stdout and "state conv conv_history [24,3] compute fixed" in r.stdout
    # falcon_h1: the reduce comes after the second mixer of the pair (never between the two: the second reads the
    # pair's shared input)
    r = vxc_inproc("passes", minis["falcon_h1"][1], "--tp", "3", "--rank", "0", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    kinds = [ln.split()[3] for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit() and " layer 0 " in ln]
    assert kinds == ["add_rmsnorm", "mamba2", "softmax", "all_reduce", "add_rmsnorm", "swiglu", "all_reduce"], kinds


@pytest.mark.parametrize("n", RANKS)
def test_parts_read_alone_and_described(minis, ranks, n):
    for name, (mdir, ir, _) in minis.items():
        S.check_described(ir, n, ranks[n][name])


def test_state_follows_heads(ranks):
    # mamba2 at 3 ranks: ssm [4 heads, 8, 12] fp32 and conv [32 + 2·12, 4] per layer on each rank
    for res in ranks[3]["mamba2"]:
        shapes = sorted(res["kv_shapes"].values())
        assert shapes == sorted([[4, 8, 12], [56, 4]] * 2), shapes


def _findings(vxc_inproc, mdir, n):
    r = vxc_inproc("passes", mdir, "--tp", str(n), "--json")
    assert r.exit_code == 2, r.stdout
    return json.loads(r.stdout)["findings"]


def test_refusals(tmp_path, vxc_inproc):
    # 2 groups over 3 ranks: neither divides the other
    mdir = B.hf_header_only(tmp_path / "g2", dict(M2, model_type="mamba2", n_groups=2), "F32")
    found = _findings(vxc_inproc, mdir, 3)
    assert [(f["layer"], f["operator"], f["code"], f["message"]) for f in found] == [
        (i, "mamba2", "indivisible", "groups=2 neither divides by --tp 3 nor divides it") for i in range(2)]
    # 2 groups (RMS groups of 48 channels) over 4 ranks of 24 channels: a group spans two of the four ranks
    found = _findings(vxc_inproc, mdir, 4)
    assert len(found) == 2 and all(f["code"] == "indivisible" and f["message"].startswith("norm_group=48: an RMS group spans")
                                   for f in found)
    # 12 heads over 5
    found = _findings(vxc_inproc, mdir, 5)
    assert {f["message"] for f in found} == {"heads=12 is not divisible by --tp 5", "d_inner=96 is not divisible by --tp 5",
                                             "groups=2 neither divides by --tp 5 nor divides it"}


def _split_norm_check(before: bool, backends: tuple[str, ...]) -> None:
    """The two halves of a gated norm whose group spans ranks, summed over 3 column blocks by hand, equal one
    RMS group over the whole width (a formula written here)."""
    from vxc.codegen.kernels import norms  # noqa: F401  (registers the ops)
    from vxc.codegen.kernels.registry import backend

    g = torch.Generator().manual_seed(0)
    x, z, w = torch.randn(5, 36, generator=g), torch.randn(5, 36, generator=g), torch.randn(36, generator=g)
    gate = z * torch.sigmoid(z)
    h = x if before else x * gate
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    want = want * gate if before else want
    cols = [slice(0, 12), slice(12, 24), slice(24, 36)]
    for name in backends:
        with backend(name):
            ss = sum(torch.ops.vxc.gated_rms_sumsq(x[:, c], z[:, c], before, "silu") for c in cols)
            got = torch.cat([torch.ops.vxc.gated_rmsnorm_total(x[:, c], z[:, c], w[c], ss, 36, 1e-5, before, "silu")
                             for c in cols], -1)
        assert (got - want).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("before", [False, True])
def test_split_norm_kernels(before):
    _split_norm_check(before, ("torch", "native"))


@triton_case(INTERPRETED)
def test_split_norm_kernels_triton():
    for before in (False, True):
        _split_norm_check(before, ("triton",))
