"""Tensor parallelism of ggml block-encoded weights (``vxc quantize``; GGUF files lower to the same operands): a
rank reads and keeps only its blocks — whole rows of a column-parallel projection, whole 32- / 256-value blocks of
each row of a row-parallel one — and multiplies them with the encoded kernels as a single process does.

One qwen3 miniature whose every projection row is whole blocks at 2 and 3 ranks (d_model 64; q 12 heads × 16 =
192, kv 6 × 16 = 96, FFN 192: a rank's 96 or 64 columns are whole 32-value blocks), quantised three ways:
``q8_0``; ``q4_k_m`` (its mix falls back to 32-value formats where a row is not whole 256-value super-blocks);
``q4_0`` with ``int8_block32`` activations. And a Mamba2 GGUF file as llama-quantize leaves one (q8_0 with in_proj
Q4_0, out_proj Q5_0, head Q4_1; 16 heads, 2 groups: 2 ranks only), whose fused in_proj is cut segment by segment
in whole rows of blocks; a Kimi-Linear GGUF file (q8_0, attn_q Q4_0, the down banks Q4_1, the dense and shared
FFNs F32; 2 ranks), whose MLA up-projection is a ``concat`` of the converter's attn_k_b / attn_v_b cut by heads.
Against TP=1 on the same file, one spawn per rank count for all:

- fp32 activations: logits within ``tp_support.tolerance`` (the fp32 floor), decode == prefill, 32 greedy identical;
- int8 activations: not at the fp32 floor by construction — each projection's input is rounded per block to int8,
  so the last-bit differences of a sum taken in another order (the all-reduce) can move a value across a rounding
  step. Stated tolerance: logits within 1 % of max|logit| (TP=1 vs the fp32 path of the same weights differs by
  ~4 % here), greedy 32 identical;
- each rank's bytes read are exactly its blocks' bytes (rows × the row bytes of its columns, by ggml's block sizes
  written here), and ``describe --tp`` says what it holds; a cut off the block boundaries is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests.runtime import tp_support as S
from tests.runtime.test_tp import CFG as QWEN3

RANKS = (2, 3)
CFG = dict(QWEN3, hidden_size=64, head_dim=16, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192)
SCHEMES = {"q8": ("q8_0", None), "q4km": ("q4_k_m", None), "q4a8": ("q4_0", "int8_block32")}
# ggml block geometry, (values, bytes) per block, from ggml's block layouts
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24), "q4_1": (32, 20), "q4_k": (256, 144),
         "q6_k": (256, 210)}


@pytest.fixture(scope="module")
def minis(tmp_path_factory, vxc_inproc):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("tp-encoded")
    mdir = B.build_hf(root / "m", "qwen3", CFG)
    base = root / "m.vxir"
    lower_to_file(mdir, base)
    out = {}
    for name, (scheme, act) in SCHEMES.items():
        ir = root / f"{name}.vxir"
        r = vxc_inproc("quantize", base, "-o", ir, "--scheme", scheme, *(["--activations", act] if act else []))
        assert r.exit_code == 0, r.stdout + r.stderr
        (root / f"out-{name}").mkdir()
        out[name] = (root, ir, root / f"out-{name}")  # a quantised model's weights sit beside its IR
    from tests import gguf_support as G

    model = G.write_mamba2_hf_dir(root / "mamba2-hf", seed=21)
    g = G.write_mamba2_gguf(root / "mamba2.gguf", model, root / "mamba2-hf", "q8_0",
                            override={"ssm_in": "Q4_0", "ssm_out": "Q5_0", "output": "Q4_1"})
    lower_to_file(g, g.with_suffix(".vxir"))
    (root / "out-gguf-mamba2").mkdir()
    out["gguf-mamba2"] = (root, g.with_suffix(".vxir"), root / "out-gguf-mamba2")
    from tests import gguf_kimi as K

    hf = K.write_kimi_hf_dir(root / "kimi-hf", seed=21)
    # (the dense and shared down projections' rows of 96 / 32 values halve off the 32-value blocks: those FFNs F32,
    # all three matrices — an operator with encoded and plain weights runs decoded, which describe does not count)
    plain = {k: "F32" for k in ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")}
    g = K.write_kimi_gguf(root / "kimi.gguf", hf, "q8_0", override={"attn_q": "Q4_0", "ffn_down_exps": "Q4_1", **plain})
    lower_to_file(g, g.with_suffix(".vxir"))
    (root / "out-gguf-kimi").mkdir()
    out["gguf-kimi"] = (root, g.with_suffix(".vxir"), root / "out-gguf-kimi")
    return out


def _at(n: int) -> list[str]:
    """The miniatures run at ``n`` ranks (the Mamba2 file's 2 groups and 16 heads, the Kimi-Linear file's 2 heads, do
    not split in 3)."""
    return [*SCHEMES, *(["gguf-mamba2", "gguf-kimi"] if n == 2 else [])]


@pytest.fixture(scope="module")
def tp1(minis):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    return {name: S.measure(Engine(parse_file(ir), mdir, max_context=64), lambda s: s)
            for name, (mdir, ir, _) in minis.items()}


@pytest.fixture(scope="module")
def ranks(minis):
    from vxc.runtime import tp as TP

    out = {}
    for n in RANKS:
        TP.spawn(S.rank_many, n, n, [tuple(map(str, (minis[k][1], minis[k][0], minis[k][2]))) for k in _at(n)])
        out[n] = {k: [torch.load(minis[k][2] / f"tp{n}-rank{r}.pt") for r in range(n)] for k in _at(n)}
    return out


@pytest.mark.parametrize("name", [*SCHEMES, "gguf-mamba2", "gguf-kimi"])
@pytest.mark.parametrize("n", RANKS)
def test_matches_tp1(tp1, ranks, n, name):
    if name not in ranks[n]:
        return  # (the GGUF files at 2 ranks only; the Mamba2 file's refusal at 3 is checked below)
    ref = tp1[name]
    tol = 0.01 * ref["full"].abs().max().item() if SCHEMES.get(name, (0, None))[1] else S.tolerance(ref)
    assert len(set(ref["greedy"])) >= 4
    for res in ranks[n][name]:
        r = res["rank"]
        assert (res["full"] - ref["full"]).abs().max().item() <= tol, (n, r)
        assert (res["stepped"] - ref["stepped"]).abs().max().item() <= tol, (n, r)
        assert (res["stepped"] - res["full"]).abs().max().item() <= tol, (n, r)
        assert res["greedy"] == ref["greedy"], (n, r)
        assert res["cont_resumed"] == res["cont"], (n, r)


def _encodings(ir: Path) -> dict[str, str]:
    from vxc.ir.parser import parse_file

    return {o.sym: o.encoding for o in parse_file(ir).operands}


@pytest.mark.parametrize("n", RANKS)
def test_blocks_read_alone_and_described(minis, ranks, n):
    from vxc.driver import load
    from vxc.ir.parser import parse_file
    from vxc.passes.surfaces import tp_ranks

    for name in _at(n):
        mdir, ir, _ = minis[name]
        enc = _encodings(ir)
        assert sum(e is not None for e in enc.values()) >= 5, enc
        d = tp_ranks(lambda: load(ir), n, context=64)
        # read whole, then cut (never sliced): a concat operand (the Kimi-Linear file's MLA up-projection, its two
        # parts decoded whole) and a vector behind an elementwise view (its A_log, 2 values per layer)
        whole = {o.sym for o in parse_file(ir).operands
                 if o.parts or any(t.kind == "log_neg" for t in o.transforms)} if name == "gguf-kimi" else set()
        for res in ranks[n][name]:
            want = 0
            for sym, (dim, start, stop, shape) in res["parts"].items():
                if sym in whole:
                    continue
                rows = torch.Size(shape[:-1]).numel()
                if enc[sym] is None:
                    want += 4 * rows * shape[-1]
                else:
                    values, nbytes = BLOCK[enc[sym]]
                    assert shape[-1] % values == 0, (sym, shape)
                    want += rows * shape[-1] // values * nbytes
            assert res["sliced_bytes"] == want > 0, (name, n)
            assert d["per_rank"][res["rank"]]["weight_bytes"] == res["weight_bytes"], (name, n)
        if name == "gguf-kimi":
            assert len(whole) == 5, whole  # 2 MLA up-projections, 3 KDA A_log
            continue
        if name == "gguf-mamba2":
            # in_proj rows z 128 | x 128 | B 24 | C 24 | dt 16 over 2 ranks (one group each): rank 1's blocks
            assert ranks[n][name][1]["spans"]["l0.Mamba2InProj"] == [[64, 128], [192, 256], [268, 280], [292, 304],
                                                                       [312, 320]]
            continue
        # the row-parallel projections: rank r holds columns [r·192/n, (r+1)·192/n) of each row
        for res in ranks[n][name]:
            r = res["rank"]
            assert res["spans"]["l0.FfnDown"] == [[r * 192 // n, (r + 1) * 192 // n]]
            assert tuple(res["parts"]["l0.FfnDown"][:2]) == (1, r * 192 // n)


def test_off_block_cut_refused(minis, vxc_inproc):
    # 4 ranks: the FFN's 192 columns give 48 a rank, not whole 32-value blocks (kv heads 6 do not divide either)
    _, ir, _ = minis["q8"]
    r = vxc_inproc("passes", ir, "--tp", "4", "--json")
    assert r.exit_code == 2
    msgs = {(f["layer"], f["message"]) for f in json.loads(r.stdout)["findings"]}
    assert (0, "operand %l0.FfnDown is q8_0: this rank's columns 0:48 are not whole 32-value blocks") in msgs
    assert (1, "operand %l1.FfnDown is q8_0: this rank's columns 0:48 are not whole 32-value blocks") in msgs
    r = vxc_inproc("passes", minis["gguf-mamba2"][1], "--tp", "3", "--json")
    assert r.exit_code == 2
    assert {f["message"] for f in json.loads(r.stdout)["findings"]} == {
        "heads=16 is not divisible by --tp 3", "d_inner=128 is not divisible by --tp 3",
        "groups=2 neither divides by --tp 3 nor divides it"}


def test_decoded_at_load_part(minis):
    """Under bf16 compute the blocks are decoded at load: a rank decodes only its blocks, to the values of the
    whole operand decoded and cut (gguf's reference dequantisation of every block, cut here)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    mdir, ir, _ = minis["q8"]
    e = Engine(parse_file(ir), mdir, max_context=16, dtype=torch.bfloat16, tp=3, rank=2)
    ops = {o.sym: o for o in e.module.operands}
    for sym, dim in (("l0.FfnDown", 1), ("l0.AttnQ", 0)):
        o = ops[sym]
        got = e.weights.operand(o, torch.bfloat16, "cpu")
        from safetensors import safe_open

        t = parse_file(ir).tensor_table()[o.sources[0]]
        with safe_open(str(mdir / next(f.path for f in parse_file(ir).files if f.sym == t.file)), "pt") as f:
            blocks = f.get_tensor(t.key).numpy()
        whole = torch.from_numpy(np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0), dtype=np.float32))
        size = whole.shape[dim] // 3
        assert torch.equal(got, whole.narrow(dim, 2 * size, size).to(torch.bfloat16)), sym
