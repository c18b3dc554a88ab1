"""Expert parallelism of the ``moe`` FFN under tensor parallelism, on loopback (gloo), 2 and 3 ranks — one spawn per
rank count for both miniatures: a qwen3_moe (transformers, fp32) whose experts (12), heads (12), kv heads (6),
expert width (24) and dense FFN width (72) both 2 and 3 divide (layers: MoE, dense, MoE); and a qwen3moe GGUF file
whose expert banks are ggml-encoded (q4_k / q8_0 / q4_0, 6 experts), run on their resident blocks
(``qmoe_experts``); a gpt_oss with MXFP4-packed banks (sinks, sliding window, YaRN; fused interleaved gate/up
banks, expert and router biases given values, clamped GLU, top-k softmax router); a granitemoehybrid (Mamba2
+ attention + an MoE whose shared expert, a slice of one fused ``input_linear``, is split like a SwiGLU). Rank r
holds experts [r·E/N, (r+1)·E/N) of every bank and of the expert biases; the router is whole on every rank.

Against TP=1 in this process: logits within 1e-5·max|logit| on every rank (and the same bits on all ranks), decode
== prefill, 32 greedy tokens identical, save on N ranks → resume identical; the experts each rank's router
selects at every token of the prompt and its greedy continuation identical to TP=1's (and, for the transformers
miniature, to transformers' own router's, hooked in the reference model); each rank's banks read alone (whole
experts) and sized as ``describe --tp`` says; a refusal when the experts do not divide. (If every rank added every selected expert,
the reduced sum would hold the routed experts N times: the logits checks fail.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.families.moe_support import reference_selection, vxc_selection
from tests.families import test_granitemoehybrid as granite
from tests.families.qwen3_moe_support import MINI as QWEN3_MOE
from tests.gguf_support import MINI_LLAMA, write_llama_gguf
from tests.runtime import tp_support as S

RANKS = (2, 3)
E, TOP_K, I_MOE, D, LAYERS = 12, 4, 24, 48, 3
CFG = dict(QWEN3_MOE, hidden_size=D, num_attention_heads=12, num_key_value_heads=6, head_dim=8, intermediate_size=72,
           moe_intermediate_size=I_MOE, num_experts=E, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS,
           mlp_only_layers=[1])
MOE_LAYERS = (0, 2)
# the GGUF file: every layer MoE, 6 experts of width 96, top-2; heads 6 × 32, kv heads 6; the banks encoded
GG = dict(MINI_LLAMA, heads=6, kv_heads=6, head_dim=32, experts=6, top_k=2, moe_ffn=96)
GG_ENC = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0"}  # everything else f32
# two layers each (sliding + full attention; Mamba2 + attention)
GPT_OSS = dict(num_attention_heads=6, num_key_value_heads=6, num_local_experts=6, num_hidden_layers=2,
               layer_types=["sliding_attention", "full_attention"])  # head_dim 20, experts of width 64, top-2
GRANITE = dict(num_attention_heads=6, num_key_value_heads=6, num_local_experts=6, shared_intermediate_size=24,
               mamba_n_heads=12, mamba_n_groups=6, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"])  # experts of width 20, top-2; d_inner 120
NAMES = ("qwen3_moe", "gguf", "gpt_oss", "granitemoehybrid")


def selection_ids(greedy: list[int]) -> list[int]:
    return S.prompt() + greedy


def rank_moe(rank: int, n: int, jobs: list[tuple[str, str, str, list[int]]]) -> None:
    """For each miniature ``(ir, model dir, out dir, TP=1's greedy tokens)``: ``tp_support.rank_main``, then the
    experts this rank's router selects over the prompt and that greedy continuation (one prefill, observed at the
    ``moe_router`` op) and the kernels of its decode step."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    for ir, mdir, out, greedy in jobs:
        S.rank_main(rank, n, ir, mdir, out)
        engine = Engine(parse_file(Path(ir)), Path(mdir), max_context=64, tp=n, rank=rank)
        extra = {"selected": vxc_selection(engine, selection_ids(greedy)),
                 "kernels": sorted({c.kernel for c in engine.lowered["decode"].groups()})}
        torch.save(extra, Path(out) / f"tp{n}-rank{rank}-moe.pt")


@pytest.fixture(scope="module")
def minis(tmp_path_factory):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("tp-moe")
    mdir = B.build_hf(root / "q3moe", "qwen3_moe", CFG, seed=5)
    lower_to_file(mdir, root / "q3moe.vxir")
    gdir = root / "gguf"
    write_llama_gguf(gdir / "m.gguf", GG, encodings=GG_ENC, arch="qwen3moe", seed=5)
    lower_to_file(gdir / "m.gguf", root / "gguf.vxir")
    out = {"qwen3_moe": (mdir, root / "q3moe.vxir"), "gguf": (gdir, root / "gguf.vxir")}
    out["gpt_oss"] = (_gpt_oss(root / "gpt_oss"), root / "gpt_oss.vxir")
    out["granitemoehybrid"] = (granite.build(root / "granitemoehybrid", GRANITE), root / "granitemoehybrid.vxir")
    for name in ("gpt_oss", "granitemoehybrid"):
        lower_to_file(*out[name])
    for name, (md, ir) in out.items():
        (root / f"out-{name}").mkdir()
        out[name] = (md, ir, root / f"out-{name}")
    return out


def _gpt_oss(d: Path) -> Path:
    """The gpt_oss miniature (fp32) with every bias (attention, sinks, router, experts) given values — transformers
    starts them at zero, and an expert bias added by every rank (or by none) would then pass — its banks then
    packed as MXFP4 (the hub's form)."""
    from safetensors.torch import load_file, save_file

    from tests.families import gpt_oss_support as G

    mdir = B.build_hf(d.with_name(d.name + "-src"), "gpt_oss", dict(G.MINI, **GPT_OSS), seed=G.SEED, dtype=torch.float32)
    w = load_file(mdir / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    biases = [k for k in w if k.endswith(("bias", "sinks"))]
    assert any("experts" in k for k in biases) and any("router" in k for k in biases)
    for k in biases:
        w[k] = torch.randn(w[k].shape, generator=g) * 0.5
    save_file(w, mdir / "model.safetensors", metadata={"format": "pt"})
    return G.to_mxfp4(mdir, d)


@pytest.fixture(scope="module")
def tp1(minis):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    out = S.run_tp1(minis)
    for name, (mdir, ir, od) in minis.items():
        e = Engine(parse_file(ir), mdir, max_context=64)
        out[name].update(selected=vxc_selection(e, selection_ids(out[name]["greedy"])),
                         kernels=sorted({c.kernel for c in e.lowered["decode"].groups()}))
    return out


@pytest.fixture(scope="module")
def ranks(minis, tp1):
    from vxc.runtime import tp as TP

    jobs = [(str(ir), str(mdir), str(od), tp1[name]["greedy"]) for name, (mdir, ir, od) in minis.items()]
    out = {}
    for n in RANKS:
        TP.spawn(rank_moe, n, n, jobs)
        out[n] = {name: [dict(torch.load(od / f"tp{n}-rank{r}.pt"), **torch.load(od / f"tp{n}-rank{r}-moe.pt"))
                         for r in range(n)] for name, (_, _, od) in minis.items()}
    return out


def _tol(ref: torch.Tensor) -> float:
    return 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", RANKS)
def test_logits_match_tp1(tp1, ranks, n, name):
    tp1, ranks = tp1[name], {n: ranks[n][name]}
    assert len(set(tp1["greedy"])) >= 4  # not a degenerate repeat that any model would match
    for res in ranks[n]:
        for k in ("full", "stepped"):
            err = (res[k] - tp1[k]).abs().max().item()
            assert err <= _tol(tp1[k]), (n, res["rank"], k, err)
        err = (res["stepped"] - res["full"]).abs().max().item()  # decode == prefill on the ranks
        assert err <= _tol(res["full"]), (n, res["rank"], err)
        assert res["greedy"] == tp1["greedy"], (n, res["rank"])
    for res in ranks[n][1:]:  # the ranks' logits are the same bits (the head is replicated after the last all-reduce)
        assert torch.equal(res["full"], ranks[n][0]["full"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", RANKS)
def test_save_resume_on_n_ranks(tp1, ranks, n, name):
    tp1, ranks = tp1[name], {n: ranks[n][name]}
    for res in ranks[n]:
        assert torch.equal(res["first_resumed"], res["first"]), (n, res["rank"])
        assert res["cont_resumed"] == res["cont"] == tp1["cont"], (n, res["rank"])
        assert (res["first"] - tp1["first"]).abs().max().item() <= _tol(tp1["first"])


@pytest.fixture(scope="module")
def reference_selected(minis, tp1):
    """transformers' own router (Qwen3MoeTopKRouter, hooked): its selected experts over the same tokens, and how far
    every selection is from a tie."""
    import transformers

    mdir = minis["qwen3_moe"][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    return reference_selection(model, selection_ids(tp1["qwen3_moe"]["greedy"]),
                               lambda layer: layer.mlp.gate if hasattr(layer.mlp, "experts") else None)


def _as_sets(selected: list[torch.Tensor]) -> list[list[set[int]]]:
    return [[set(row.tolist()) for row in layer] for layer in selected]


@pytest.mark.parametrize("n", RANKS)
def test_expert_selection_identical(tp1, ranks, reference_selected, n):
    tp1, ranks = tp1["qwen3_moe"], {n: ranks[n]["qwen3_moe"]}
    want, gap = reference_selected
    tokens = len(selection_ids(tp1["greedy"]))
    assert len(want) == len(MOE_LAYERS) and all(t.shape == (tokens, TOP_K) for t in want)
    assert gap > 1e-4  # no selection is a near-tie
    assert _as_sets(tp1["selected"]) == _as_sets(want)
    for res in ranks[n]:  # every rank routes over all 12 experts, as TP=1 and the reference do
        assert _as_sets(res["selected"]) == _as_sets(want), (n, res["rank"])
    # the selections spread over every rank's experts: no rank is idle (the sums are not one rank's)
    hit = torch.cat([t.flatten() for t in want])
    assert all(((hit >= r * E // n) & (hit < (r + 1) * E // n)).sum() > 0 for r in range(n))


@pytest.mark.parametrize("n", RANKS)
def test_banks_read_alone_and_described(minis, ranks, n):
    from vxc.driver import load
    from vxc.passes.surfaces import tp_ranks

    mdir, ir, _ = minis["qwen3_moe"]
    ranks = {n: ranks[n]["qwen3_moe"]}
    d = tp_ranks(lambda: load(ir), n, context=64)
    held = E // n
    for res in ranks[n]:
        r = res["rank"]
        part_bytes = sum(4 * torch.Size(shape).numel() for _, _, _, shape in res["parts"].values())
        assert res["sliced_bytes"] == part_bytes > 0  # every cut operand read alone: whole experts, nothing more
        for layer in MOE_LAYERS:
            want = {f"l{layer}.PerExpertGate": [held, I_MOE, D], f"l{layer}.PerExpertUp": [held, I_MOE, D],
                    f"l{layer}.PerExpertDown": [held, D, I_MOE]}
            for sym, shape in want.items():
                assert res["parts"][sym] == (0, r * held, (r + 1) * held, shape), (n, r, sym)
            assert f"l{layer}.MoeRouterWeight" not in res["parts"]  # the router is whole on every rank
        mine = d["per_rank"][r]
        assert mine["weight_bytes"] == res["weight_bytes"], (n, r)
        assert mine["state"]["at_context_bytes"] == res["state_bytes"], (n, r)
        assert res["reduces"] == res["graph_reduces"] == 2 * LAYERS  # one all-reduce per mixer and per FFN
    assert len({p["weight_bytes"] for p in d["per_rank"]}) == 1  # nothing is held by one rank only


def test_sharded_ir_declares_the_expert_range(minis, vxc_inproc):
    mdir, ir, _ = minis["qwen3_moe"]
    r = vxc_inproc("passes", ir, "--tp", "3", "--rank", "2", "--print-after", "shard")
    assert r.exit_code == 0, r.stdout + r.stderr
    out = r.stdout
    assert "experts=12 " in out and out.count("expert_ranks=3 expert_rank=2") == len(MOE_LAYERS)
    assert f"operand %l0.PerExpertGate f32[4,{I_MOE},{D}] = $b0 layer 0 role PerExpertGate | shard dim 0 of 3 [8:12]" in out
    assert "role MoeRouterWeight | replicated" in out
    r = vxc_inproc("passes", ir, "--print-after", "state")  # one rank: nothing declared
    assert r.exit_code == 0 and "expert_rank" not in r.stdout


def test_refuses_experts_that_do_not_divide(tmp_path, vxc_inproc):
    mdir = B.hf_header_only(tmp_path / "q3moe", dict(CFG, model_type="qwen3_moe", num_experts=10), "F32")
    r = vxc_inproc("passes", mdir, "--tp", "3", "--json")
    assert r.exit_code == 2, r.stdout
    found = json.loads(r.stdout)["findings"]
    # heads 12, kv heads 6, widths 24 and 72 divide by 3; 10 experts do not: one finding per MoE layer, naming it
    assert [(f["layer"], f["operator"], f["code"]) for f in found] == [(i, "moe", "indivisible") for i in MOE_LAYERS]
    assert all(f["message"] == "experts=10 is not divisible by --tp 3" for f in found)
    r = vxc_inproc("passes", mdir, "--tp", "2", "--json")
    assert r.exit_code == 0, r.stdout


@pytest.mark.parametrize("n", RANKS)
def test_encoded_banks_cut_by_whole_experts(minis, tp1, ranks, n):
    """The GGUF banks stay resident as the file's blocks on every rank, each rank's experts read alone; the
    routing is TP=1's at every token; the ranks' bytes are what ``describe --tp`` says."""
    from vxc.driver import load
    from vxc.passes.surfaces import tp_ranks

    mdir, ir, _ = minis["gguf"]
    d = tp_ranks(lambda: load(ir), n, context=64)
    held, layers = GG["experts"] // n, GG["layers"]
    assert "qmoe_experts" in tp1["gguf"]["kernels"]
    for res in ranks[n]["gguf"]:
        r = res["rank"]
        assert "qmoe_experts" in res["kernels"] and "moe_experts" not in res["kernels"]
        assert _as_sets(res["selected"]) == _as_sets(tp1["gguf"]["selected"]), (n, r)
        banks = {k: v for k, v in res["parts"].items() if "Expert" in k}
        assert len(banks) == 3 * layers
        assert all(v[:3] == (0, r * held, (r + 1) * held) and v[3][0] == held for v in banks.values()), banks
        assert d["per_rank"][r]["weight_bytes"] == res["weight_bytes"], (n, r)
        assert d["per_rank"][r]["state"]["at_context_bytes"] == res["state_bytes"], (n, r)
    # the banks' blocks read: the ranks' parts (gate q4_k 144 B per 256, up q8_0 34 B per 32, down q4_0 18 B per
    # 32), and the plain parts at 4 B each
    enc = held * layers * (GG["moe_ffn"] * GG["d"] // 256 * 144 + GG["moe_ffn"] * GG["d"] // 32 * 34
                           + GG["d"] * GG["moe_ffn"] // 32 * 18)
    for res in ranks[n]["gguf"]:
        plain = sum(4 * torch.Size(s).numel() for k, (_, _, _, s) in res["parts"].items() if "Expert" not in k)
        assert res["sliced_bytes"] == enc + plain > enc


@pytest.mark.parametrize("name", ["gpt_oss", "granitemoehybrid"])
@pytest.mark.parametrize("n", RANKS)
def test_expert_biases_and_shared_expert_parts(minis, tp1, ranks, n, name):
    """gpt_oss: the MXFP4 banks' blocks and scales, and the expert biases, are cut with their experts (each rank
    decodes only its experts and adds only their biases), every part read alone; the router bias is whole.
    granitemoehybrid: the shared expert's gate/up rows and down columns are the rank's part of shared_intermediate
    (24), cut through the slices of the fused input_linear. Both: the routing is TP=1's at every token, and the
    ranks' bytes are what ``describe --tp`` says (MXFP4 banks counted as stored, held decoded)."""
    from vxc.driver import load
    from vxc.passes.surfaces import tp_ranks

    mdir, ir, _ = minis[name]
    d = tp_ranks(lambda: load(ir), n, context=64)
    held, layers = 6 // n, 2
    for res in ranks[n][name]:
        r = res["rank"]
        assert _as_sets(res["selected"]) == _as_sets(tp1[name]["selected"]), (n, r)
        assert len(res["selected"]) == layers
        if name == "gpt_oss":
            cut = {k: v for k, v in res["parts"].items() if k.split(".")[1] in (
                "ExpertGateUp", "ExpertDown", "ExpertGateUpBias", "ExpertDownBias")}
            assert len(cut) == 4 * layers and all(v[:3] == (0, r * held, (r + 1) * held) for v in cut.values()), cut
            assert [v[3] for k, v in cut.items() if k.endswith("ExpertGateUpBias")] == [[held, 128]] * layers
            assert not any("MoeRouter" in k for k in res["parts"])
            # bytes read: the banks' MXFP4 parts (16 B of blocks + 1 B of scale per 32 values), the rest fp32
            mx = {"ExpertGateUp": held * 128 * (96 // 32) * 17, "ExpertDown": held * 96 * (64 // 32) * 17}
            read = sum(mx.get(k.split(".")[1], 4 * torch.Size(v[3]).numel()) for k, v in res["parts"].items())
            assert res["sliced_bytes"] == read, (n, r)
            # describe counts the banks as stored (MXFP4), the rank holds them decoded (fp32), as at TP=1
            decoded = layers * held * (128 * 96 + 96 * 64) * 4
            assert d["per_rank"][r]["weight_bytes"] == res["weight_bytes"] - decoded + layers * sum(mx.values())
        else:
            s = 24 // n
            for layer in range(layers):
                assert res["parts"][f"l{layer}.SharedExpertGate"] == (0, r * s, (r + 1) * s, [s, 60])
                assert res["parts"][f"l{layer}.SharedExpertUp"] == (0, r * s, (r + 1) * s, [s, 60])
                assert res["parts"][f"l{layer}.SharedExpertDown"] == (1, r * s, (r + 1) * s, [60, s])
                assert res["parts"][f"l{layer}.PerExpertGate"][:3] == (0, r * held, (r + 1) * held)
            assert d["per_rank"][r]["weight_bytes"] == res["weight_bytes"], (n, r)
        assert d["per_rank"][r]["state"]["at_context_bytes"] == res["state_bytes"], (n, r)
