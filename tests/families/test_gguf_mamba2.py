"""GGUF ``mamba2`` files (issue 12), spelled exactly as llama.cpp's ``convert_hf_to_gguf.py`` (class Mamba2Model)
writes them — tests/gguf_support.write_mamba2_gguf, checked byte for byte against the real converter by
tests/gguf_convert_check.py where a llama.cpp tree is present: ``blk.{i}.ssm_*`` tensors, ``ssm_a = -exp(A_log)``
as ``[H, 1]``, D as ``[H, 1]``, the gated norm as ``[groups, d_inner / groups]``, the conv squeezed, the token
list padded to a multiple of 16 (the table not), f32 / bf16 / q8_0 as ``--outtype`` quantises, and a mixed file of
32-blocks as llama-quantize would leave one.

The lowered model runs at the numerical floor of transformers' ``Mamba2ForCausalLM`` on the checkpoint the file
was made from, with the file's lossy tensors (bf16, q8_0, …) decoded by ``gguf.quants.dequantize`` into it
(transformers reads no mamba2 GGUF); greedy identical; decode == prefill. The tokenizer built from the file is
token-identical to the checkpoint's own tokenizer.json."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests import gguf_support as S
from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.runtime import parity_table as P

FILES = {
    "f32": ("f32", None),
    "bf16": ("bf16", None),
    "q8_0": ("q8_0", None),
    # a file as llama-quantize leaves one: the matrices in several 32-value block formats
    "mixed": ("q8_0", {"ssm_in": "Q4_0", "ssm_out": "Q5_0", "output": "Q4_1"}),
}
V = S.MINI_MAMBA2["vocab_size"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("gguf-mamba2")
    model = S.write_mamba2_hf_dir(root / "hf", seed=21)
    out = {}
    for name, (outtype, override) in FILES.items():
        g = S.write_mamba2_gguf(root / f"{name}.gguf", model, root / "hf", outtype, override=override)
        lower_to_file(g, g.with_suffix(".vxir"))
        out[name] = g
    return {"root": root, "model": model, "files": out}


def test_cli_lowers_a_mamba2_gguf(made, vxc_sub, tmp_path):
    r = vxc_sub("lower", made["files"]["q8_0"], "-o", tmp_path / "m.vxir")
    assert r.exit_code == 0, r.stderr
    body = lambda t: [ln for ln in t.splitlines() if not ln.startswith("  source ")]  # noqa: E731 (model_dir differs)
    assert body((tmp_path / "m.vxir").read_text()) == body(made["files"]["q8_0"].with_suffix(".vxir").read_text())


def test_lowering_declares_the_converters_layout(made):
    text = made["files"]["q8_0"].with_suffix(".vxir").read_text()
    L = S.MINI_MAMBA2["num_hidden_layers"]
    assert text.count("mixer mamba2 ") == L and "softmax" not in text and "ffn " not in text
    assert "kv_rows" not in text and text.count("state ssm recurrent [16,8,12] f32 fixed") == L
    assert "norm_order=gate_then_norm (default)" in text and "dt_max=inf (default)" in text
    # the stored A is read back as A_log; D and the gated norm reshaped; the conv as stored
    for i in range(L):
        assert re.search(rf"^  operand %l{i}\.Mamba2ALog f32\[16\] = \$t\d+ \| reshape \[16\] \| log_neg layer {i} "
                         rf"role Mamba2ALog$", text, re.M)
        assert re.search(rf"^  operand %l{i}\.Mamba2D f32\[16\] = \$t\d+ \| reshape \[16\] layer {i}", text, re.M)
        assert re.search(rf"^  operand %l{i}\.Mamba2GatedNorm f32\[128\] = \$t\d+ \| reshape \[128\] layer {i}",
                         text, re.M)
        assert re.search(rf"^  operand %l{i}\.Mamba2Conv1d f32\[176,4\] = \$t\d+ layer {i}", text, re.M)
        # q8_0 blocks of a 64-wide row: 2 blocks x 34 bytes
        assert re.search(rf'^  tensor \$t\d+ u8\[320,68\] @w0 "blk\.{i}\.ssm_in\.weight"$', text, re.M)
        assert re.search(rf"^  operand %l{i}\.Mamba2InProj f32\[320,64\] = q8_0\(blocks \$t\d+\)", text, re.M)
    assert re.search(r"embedding embedding vocab=301 padded_vocab=301 dim=64", text)
    mixed = made["files"]["mixed"].with_suffix(".vxir").read_text()
    for enc, role in (("q4_0", "Mamba2InProj"), ("q5_0", "Mamba2OutProj"), ("q4_1", "LmHead"), ("q8_0", "Embedding")):
        assert re.search(rf"operand %\S*{role} f32\[\d+,\d+\] = {enc}\(blocks", mixed), (enc, role)


def test_print_parse_round_trip(made):
    from vxc.ir.parser import parse_file
    from vxc.ir.printer import print_module

    for g in made["files"].values():
        ir = g.with_suffix(".vxir")
        assert print_module(parse_file(ir)) == ir.read_text()


@pytest.mark.parametrize("name", list(FILES))
def test_parity_with_transformers_on_the_files_weights(made, name, capsys):
    g = made["files"][name]
    ref32, types = S.reference_on_gguf_weights(made["model"], g, "mamba2")
    want = {"f32": {"F32"}, "bf16": {"F32", "BF16"}, "q8_0": {"F32", "Q8_0"}, "mixed": {"F32", "Q8_0", "Q4_0", "Q5_0", "Q4_1"}}
    assert set(types) == want[name], types
    f = P.Family(f"gguf-mamba2-{name}", build=None, reference="hf", vocab=V, padded_vocab=V)
    ref = P.Reference.__new__(P.Reference)
    ref.f, ref.m32 = f, ref32
    ref.m64 = S.reference_on_gguf_weights(made["model"], g, "mamba2")[0].double()
    p = P.measure(f, g.parent, g.with_suffix(".vxir"), ref)
    with capsys.disabled():
        print(f"\nmamba2 {name}: {p.row()}")
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)
    assert p.deterministic


def test_decoded_a_log_equals_the_checkpoints_within_an_ulp(made):
    """The operand reads ``log(-A)`` of the stored ``A = -exp(A_log)``: the checkpoint's A_log to an ulp or so."""
    import torch

    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.weights import Weights

    ir = made["files"]["f32"].with_suffix(".vxir")
    m = parse_file(ir)
    w = Weights(m, model_dir_of(m, ir))
    sd = made["model"].state_dict()
    for o in m.operands:
        if str(o.role) == "Mamba2ALog":
            got = w.operand(o, torch.float32, "cpu")
            want = sd[f"backbone.layers.{o.layer}.mixer.A_log"].float()
            assert torch.allclose(got, want, rtol=4e-7, atol=1e-7), (got - want).abs().max()


def test_tokenizer_from_the_file_matches_the_checkpoints(made):
    """gpt2-model (byte-level BPE) vocabulary padded with [PAD] entries, pre-tokenizer gpt-2: token-identical to
    the tokenizer.json it was made from (transformers reads no mamba2 GGUF tokenizer)."""
    import transformers

    from vxc.frontends.gguf_tokenizer import tokenizer_from_gguf

    hf = transformers.AutoTokenizer.from_pretrained(str(made["root"] / "hf"))
    tok = tokenizer_from_gguf(made["files"]["q8_0"])
    assert tok.get_vocab_size() == -(V // -16) * 16  # the converter's padded token list
    for text in ("The quick brown fox jumps", "Köln, 東京, naïve café -- 12345 it's", "  two  spaces\n\tand tabs",
                 "x<|endoftext|>y", "def f(x):\n    return x * 2\n", ""):
        ids = hf(text)["input_ids"]
        assert tok.encode(text).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text


def test_every_tensor_is_claimed_or_refused_by_name(made, cli, tmp_path):
    """An extra tensor is an itemised unclassified finding; a missing one an itemised missing operand."""
    g = S.write_mamba2_gguf(tmp_path / "odd.gguf", made["model"], made["root"] / "hf", "f32",
                            drop=("blk.1.ssm_d",), extra={"blk.0.ssm_x.weight": np.zeros((8, 64), np.float32)})
    r = cli("lower", g, "-o", tmp_path / "odd.vxir")
    assert r.exit_code != 0 and not (tmp_path / "odd.vxir").exists()
    out = r.output
    assert re.search(r"refused: 2 findings", out), out
    assert "blk.0.ssm_x.weight" in out and "unclassified" in out, out
    assert "layer 1 mamba2: required role Mamba2D is not bound" in out, out


def test_inconsistent_ssm_metadata_is_refused(tmp_path, cli):
    import gguf

    p = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(p), "mamba2")
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(128)
    w.add_ssm_state_size(12)
    w.add_ssm_time_step_rank(12)  # 128 channels do not split into 12 heads
    w.add_ssm_group_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = cli("lower", p, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "ssm.inner_size=128 is not a multiple of ssm.time_step_rank=12" in r.output, r.output


@pytest.mark.parametrize("name", ["mixed", "bf16"])
def test_batched_decode_equals_single(made, name):
    """Sequence slots on a GGUF Mamba2 (mixed block encodings; bf16 stored): a batched decode step equals each
    sequence's single-sequence decode (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(made["files"][name].with_suffix(".vxir"), V)
