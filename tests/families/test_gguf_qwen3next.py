"""GGUF ``qwen3next`` files (issue 12), spelled exactly as llama.cpp's ``convert_hf_to_gguf.py --no-mtp`` (class
Qwen3NextModel) writes them — tests/gguf_support.write_qwen3next_gguf, checked byte for byte against the real
converter by ``python -m tests.gguf_convert_check`` where a llama.cpp tree is present: the checkpoint's grouped
``in_proj_qkvz`` split into ``attn_qkv`` (q | k | v of all heads) and ``attn_gate`` (z), ``ssm_ba`` kept grouped,
``ssm_a = -exp(A_log)``, every norm weight but the gated norm's stored as ``1 + w``, the expert banks
``[E, rows, cols]``, a shared expert with its sigmoid gate; f32 / bf16 / q8_0 as ``--outtype`` quantises, a mixed
file of 32-blocks as llama-quantize would leave one, and the grouped ``ssm_in`` of a legacy file.

The lowered model runs at the numerical floor of transformers' ``Qwen3NextForCausalLM`` on the checkpoint the
file was made from, with the file's lossy tensors (bf16, q8_0, …) decoded by ``gguf.quants.dequantize`` into it
and the converter's split undone (transformers reads no qwen3next GGUF); greedy identical; decode == prefill."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests import gguf_support as S
from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.runtime import parity_table as P

FILES = {
    "f32": ("f32", None, False),
    "bf16": ("bf16", None, False),
    "q8_0": ("q8_0", None, False),
    # as llama-quantize leaves a file: several 32-value block formats, the expert banks too
    "mixed": ("q8_0", {"attn_qkv": "Q4_0", "attn_gate": "Q4_1", "ssm_out": "Q5_0", "attn_q": "Q4_0",
                       "ffn_gate_exps": "Q4_0", "ffn_down_exps": "Q4_1", "output": "Q4_0"}, False),
    "legacy": ("q8_0", None, True),  # the grouped ssm_in of converters before the attn_qkv / attn_gate split
}
V = S.MINI_Q3N["vocab_size"]
SEED = 29
# three gated-delta chunks of 64 (64 + 64 + 22); prefill 0..119 then step 120..149
FAMILY = dict(build=None, reference="hf", vocab=V, padded_vocab=V, prompt_len=150, split=120)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("gguf-qwen3next")
    model = S.write_qwen3next_hf_dir(root / "hf", seed=SEED)
    out = {}
    for name, (outtype, override, legacy) in FILES.items():
        g = S.write_qwen3next_gguf(root / f"{name}.gguf", model, root / "hf", outtype, override=override, legacy=legacy)
        lower_to_file(g, g.with_suffix(".vxir"))
        out[name] = g
    return {"root": root, "model": model, "files": out}


def test_cli_lowers_a_qwen3next_gguf(made, vxc_sub, tmp_path):
    r = vxc_sub("lower", made["files"]["q8_0"], "-o", tmp_path / "m.vxir")
    assert r.exit_code == 0, r.stderr
    assert "5 layers (3 gated_delta, 2 softmax)" in r.stdout + r.stderr
    body = lambda t: [ln for ln in t.splitlines() if not ln.startswith("  source ")]  # noqa: E731 (model_dir differs)
    assert body((tmp_path / "m.vxir").read_text()) == body(made["files"]["q8_0"].with_suffix(".vxir").read_text())


def test_lowering_declares_the_converters_layout(made):
    text = made["files"]["q8_0"].with_suffix(".vxir").read_text()
    kinds = re.findall(r"^    mixer (\w+) ", text, re.M)
    assert kinds == ["gated_delta", "softmax", "gated_delta", "gated_delta", "softmax"]
    assert text.count("ffn moe ") == 5 and text.count("shared_experts=true shared_intermediate=64 shared_gate=true") == 5
    # the 1 + w norms are plain RMSNorms; the checkpoint's zero-centred convention is nowhere
    assert "zero_centred=true" not in text and "qk_norm_zero_centred=false" in text
    assert "fact norm_weights_stored_as \"1 + w\"" in text and "fact moe_renormalise true" in text
    assert 'fact layer_map_read_from "attention.recurrent_layers"' in text
    # 2 key heads x 32 (q, k) + 4 value heads x 32 (v) = 256 rows, as stored; z 128 rows; b / a gathered by key head
    assert re.search(r"operand %l0\.LinearAttnInProjQkv f32\[256,64\] = q8_0\(blocks \$t\d+\) layer 0", text)
    assert re.search(r"operand %l0\.LinearAttnInProjZ f32\[128,64\] = q8_0\(blocks \$t\d+\) layer 0", text)
    assert re.search(r"operand %l0\.LinearAttnInProjB f32\[4,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 2 \[0:2\]", text)
    assert re.search(r"operand %l0\.LinearAttnInProjA f32\[4,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 2 \[2:4\]", text)
    assert re.search(r"operand %l0\.LinearAttnALog f32\[4\] = \$t\d+ \| log_neg layer 0", text)
    assert re.search(r"operand %l1\.AttnQ f32\[128,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 4 \[0:32\]", text)
    assert re.search(r"operand %l1\.AttnOutputGate f32\[128,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 4 \[32:64\]", text)
    assert "rotary_dim=8 rotary_base=5000.0" in text  # rope.dimension_count: a quarter of the 32-wide head
    legacy = made["files"]["legacy"].with_suffix(".vxir").read_text()
    # the grouped ssm_in: per key head q 32 | k 32 | v 64 | z 64
    assert re.search(r"operand %l0\.LinearAttnInProjQkv f32\[256,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 2 "
                     r"\[0:32, 32:64, 64:128\]", legacy)
    assert re.search(r"operand %l0\.LinearAttnInProjZ f32\[128,64\] = q8_0\(blocks \$t\d+\) \| gather 0 groups 2 \[128:192\]", legacy)


def test_print_parse_round_trip(made):
    from vxc.ir.parser import parse_file
    from vxc.ir.printer import print_module

    for g in made["files"].values():
        ir = g.with_suffix(".vxir")
        assert print_module(parse_file(ir)) == ir.read_text()


def _reference(made, name):
    g = made["files"][name]
    f = P.Family(f"gguf-qwen3next-{name}", **FAMILY)
    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    ref.m32, types = S.qwen3next_reference_on_gguf_weights(made["model"], g)
    ref.m32.set_experts_implementation("eager")  # the grouped matmul refuses fp64
    m64 = S.qwen3next_reference_on_gguf_weights(made["model"], g)[0]
    m64.set_experts_implementation("eager")
    ref.m64 = m64.double()
    return f, ref, types


@pytest.mark.parametrize("name,resident", [*((n, "encoded") for n in FILES), ("q8_0", "decoded"), ("mixed", "decoded")])
def test_parity_with_transformers_on_the_files_weights(made, name, resident, capsys, monkeypatch):
    """``encoded``: every ggml-encoded operand stays resident as the file's blocks (a gathered one as its rows'
    blocks); ``decoded``: decoded to fp32 at load. Both at the floor of the reference on the file's weights."""
    monkeypatch.setenv("VXC_ENCODED", "1" if resident == "encoded" else "0")
    f, ref, types = _reference(made, name)
    want = {"f32": {"F32"}, "bf16": {"F32", "BF16"}, "q8_0": {"F32", "Q8_0"}, "legacy": {"F32", "Q8_0"},
            "mixed": {"F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0"}}
    assert set(types) == want[name], types
    g = made["files"][name]
    p = P.measure(f, g.parent, g.with_suffix(".vxir"), ref)
    with capsys.disabled():
        print(f"\nqwen3next {name} ({resident}): {p.row()}")
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)
    assert p.deterministic


def test_encoded_operands_stay_blocks_gathered_ones_included(made, monkeypatch):
    """With fp32 compute every 2-D projection of the mixed file runs on blocks: the gathered ones (q / gate of
    ``attn_q``, b / a of ``ssm_ba``, q|k|v / z of a legacy ``ssm_in``) as their selected rows' blocks — no decoded
    matrix is resident."""
    monkeypatch.setenv("VXC_ENCODED", "1")
    for name in ("mixed", "legacy"):
        eng = P.engine_for(made["files"][name].with_suffix(".vxir"), max_context=64)
        decoded = [n for n, b in eng.root.named_buffers() if n.startswith("w_") and b.dim() >= 2 and b.is_floating_point()
                   and b.shape[-1] == S.MINI_Q3N["hidden_size"] and b.shape[0] > 8]
        assert not decoded, (name, decoded)
        blocks = {n: b for n, b in eng.root.named_buffers() if n.startswith("wq_")}
        assert all(b.dtype == torch.uint8 for b in blocks.values())
        for i, role, rows in ((0, "LinearAttnInProjQkv", 256), (0, "LinearAttnInProjB", 4), (0, "LinearAttnInProjA", 4),
                              (1, "AttnQ", 128), (1, "AttnOutputGate", 128), (0, "SharedExpertGate", 64)):
            assert blocks[f"wq_l{i}_{role}"].shape[0] == rows, (name, role)
        kernels = {c.kernel for c in eng.lowered["decode"].groups()}
        assert {"qlinear", "qmoe_experts", "qmoe_shared"} <= kernels and not {"linear", "moe_shared"} & kernels


def test_tokenizer_from_the_file_matches_the_checkpoints(made):
    import transformers

    from vxc.frontends.gguf_tokenizer import tokenizer_from_gguf

    hf = transformers.AutoTokenizer.from_pretrained(str(made["root"] / "hf"))
    tok = tokenizer_from_gguf(made["files"]["q8_0"])
    for text in ("The quick brown fox jumps", "Köln, 東京, naïve café -- 12345 it's", "x<|endoftext|>y", ""):
        ids = hf(text)["input_ids"]
        assert tok.encode(text).ids == ids, text


def test_every_tensor_is_claimed_or_refused_by_name(made, cli, tmp_path):
    g = S.write_qwen3next_gguf(tmp_path / "odd.gguf", made["model"], made["root"] / "hf", "f32",
                               drop=("blk.2.attn_gate.weight", "blk.4.attn_k_norm.weight"),
                               extra={"blk.0.ssm_x.weight": np.zeros((8, 64), np.float32)})
    r = cli("lower", g, "-o", tmp_path / "odd.vxir")
    assert r.exit_code != 0 and not (tmp_path / "odd.vxir").exists()
    out = r.output
    assert re.search(r"refused: 3 findings", out), out
    assert "blk.0.ssm_x.weight" in out and "unclassified" in out, out
    assert "layer 2 gated_delta: required role LinearAttnInProjZ is not bound" in out, out
    assert "layer 4 softmax: required role AttnKNorm is not bound" in out, out


@pytest.mark.parametrize("key,value,message", [
    ("qwen3next.ssm.time_step_rank", 3, "ssm.time_step_rank=3 (value heads) is not a multiple of ssm.group_count=2"),
    ("qwen3next.ssm.inner_size", 102, "ssm.inner_size=102 is not a multiple of ssm.time_step_rank=4"),
    ("qwen3next.rope.dimension_count", 7, "rope.dimension_count=7 must be even and at most key_length=32"),
    ("qwen3next.nextn_predict_layers", 1, "nextn_predict_layers=1: the file holds multi-token-prediction layers"),
])
def test_inconsistent_metadata_is_refused(made, tmp_path, cli, key, value, message):
    import gguf

    src = gguf.GGUFReader(str(made["files"]["f32"]))
    p = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(p), "qwen3next")
    w.add_uint32(key, value)
    for k, fld in src.fields.items():
        if k.startswith("GGUF.") or k in (key, "general.architecture") or k.startswith("tokenizer."):
            continue
        v = fld.contents()
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, int(v))
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = cli("lower", p, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and message in r.output, r.output
    assert not (tmp_path / "x.vxir").exists()


@pytest.mark.parametrize("name", ["mixed", "bf16"])
def test_batched_decode_equals_single(made, name):
    """Sequence slots on a GGUF Qwen3-Next: a batched decode step equals each sequence's single-sequence decode."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(made["files"][name].with_suffix(".vxir"), V)
