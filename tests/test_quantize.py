"""``vxc quantize`` (issue 12): the operands of roles declared ``quantise=True`` encoded in a ggml block format,
written with the IR that declares them; data preparation, checked before anything is written.

The reference is built independently of vxc's code: transformers' own model with each projection / embedding /
head parameter replaced by its ggml-decoded value under gguf-py (the format's reference decoder): for q8_0 /
q4_0 / q4_1 ``gguf.quants.dequantize(gguf.quants.quantize(p))``; for the k-quant mixes (gguf-py has no k-quant encoder)
gguf-py's decode of the blocks vxc wrote (their bytes are ggml's: tests/runtime/test_ggml_blocks.py,
tests/ggml_quant_check.py). Compared at the fp32 floor; greedy identical; decode == prefill."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from tests import builders as B
from tests.runtime import parity_table as P

# every width a multiple of 32, so every quantisable matrix is whole blocks: q 64 = 4 heads x 16, kv 32, ffn 96
CFG = dict(B.MINI_HF["llama"], vocab_size=103, hidden_size=64, intermediate_size=96, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16)
LAYERS = CFG["num_hidden_layers"]
# by hand: per layer q, k, v, o, gate, up, down; plus the embedding and the untied head
QUANTISED = 7 * LAYERS + 2
HF_QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")

# q4_k_m: rows of 256 (hidden: q 256 = 4 x 64, kv 128) are whole q4_k / q6_k blocks; the FFN's 288 (9 x 32) are not
K_CFG = dict(CFG, hidden_size=256, intermediate_size=288, head_dim=64)
# by hand, for 2 layers (use_more_bits(i, 2): i < 0, i >= 1, (i - 0) % 3 == 2 -> layer 1 only):
#   q4_k: q, k, o, gate, up of both layers (10), layer 0's v, the embedding       12
#   q6_k: layer 1's v (the value class, 2nd of 2), the head                          2
#   q5_0: layer 0's down (q4_k falls back: rows of 288)                              1
#   q8_0: layer 1's down (the down class on layer 1 wants q6_k, which falls back)    1
K_MIX = {"q4_k": 12, "q6_k": 2, "q5_0": 1, "q8_0": 1}
K_FORMATS = {"l0.AttnV": "q4_k", "l1.AttnV": "q6_k", "l0.FfnDown": "q5_0", "l1.FfnDown": "q8_0", "LmHead": "q6_k",
             "Embedding": "q4_k", "l0.AttnQ": "q4_k", "l1.FfnUp": "q4_k"}
# vxc's operand -> the transformers parameter it is (llama layout; by hand)
HF_OF = {"AttnQ": "self_attn.q_proj", "AttnK": "self_attn.k_proj", "AttnV": "self_attn.v_proj",
         "AttnO": "self_attn.o_proj", "FfnGate": "mlp.gate_proj", "FfnUp": "mlp.up_proj", "FfnDown": "mlp.down_proj"}


def _hf_name(sym: str) -> str:
    if sym == "Embedding":
        return "model.embed_tokens.weight"
    if sym == "LmHead":
        return "lm_head.weight"
    layer, role = sym.split(".")
    return f"model.layers.{layer[1:]}.{HF_OF[role]}.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory, cli):
    import json

    from vxc.demo import _tokenizer_json

    d = tmp_path_factory.mktemp("quant")
    for name, cfg in (("hf", CFG), ("hf_k", K_CFG)):
        mdir = B.build_hf(d / name, "llama", cfg, seed=41)
        r = cli("lower", mdir, "-o", d / f"{name}.vxir")
        assert r.exit_code == 0, r.output
    (d / "hf_k" / "tokenizer.json").write_text(json.dumps(_tokenizer_json(["<unk>", *"abcdefgh "])))
    return d


def _reference(mdir, replace):
    """transformers on ``mdir`` with each parameter ``replace(name, p)`` returns (not None) set to it."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    n = 0
    with torch.no_grad():
        for name, p in m.named_parameters():
            new = replace(name, p.detach().numpy().astype(np.float32))
            if new is not None:
                p.copy_(torch.from_numpy(np.ascontiguousarray(new)))
                n += 1
    ref = P.Reference.__new__(P.Reference)
    ref.m32, ref.m64 = m, copy.deepcopy(m).double()
    return ref, n


def _at_the_floor(name: str, out, ref, capsys) -> None:
    f = P.Family(name, build=None, reference="hf", vocab=103, padded_vocab=103)
    ref.f = f
    p = P.measure(f, out.parent, out, ref)
    with capsys.disabled():
        print(f"\n{name}: {p.row()}")
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
def test_quantized_model_runs_at_the_floor_of_the_dequantized_reference(src, scheme, cli, capsys):
    import gguf

    out = src / scheme / "q.vxir"
    r = cli("quantize", src / "hf.vxir", "-o", out, "--scheme", scheme)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert len(re.findall(rf"= {scheme}\(blocks \$t\d+\)", text)) == QUANTISED
    assert f'fact quantized {scheme} evidence "vxc quantize --scheme {scheme}: {QUANTISED} operands' in text
    assert re.search(r'^  file @w0 "q\.safetensors" size \d+ header_sha256 "[0-9a-f]{64}"$', text, re.M)
    # norms stay as stored
    assert re.search(r"^  operand %l0\.PreAttentionNorm f32\[64\] = \$t\d+ layer 0 role PreAttentionNorm$", text, re.M)
    T = gguf.GGMLQuantizationType[scheme.upper()]
    ref, n = _reference(src / "hf", lambda name, a: gguf.quants.dequantize(gguf.quants.quantize(a, T), T)
                        if any(k in name for k in HF_QUANTISED) else None)
    assert n == QUANTISED
    _at_the_floor(f"quantized-{scheme}", out, ref, capsys)


def _blocks_at_the_floor(name: str, src, out, got: dict[str, str], capsys) -> None:
    """The quantised model ``out`` at the floor of transformers with each quantised parameter replaced by gguf-py's
    decode of the blocks vxc wrote for it (``got``: operand -> format)."""
    import gguf
    from safetensors.numpy import load_file

    st = load_file(str(out.with_suffix(".safetensors")))
    by_name = {_hf_name(s): (f, st[s]) for s, f in got.items()}

    def decoded(pname, a):
        if pname not in by_name:
            return None
        f, blocks = by_name[pname]
        return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[f.upper()]).reshape(a.shape)

    ref, n = _reference(src / "hf_k", decoded)
    assert n == len(got)
    _at_the_floor(name, out, ref, capsys)


def test_q4_k_m_mix_and_parity(src, cli, capsys):
    """The mix is decided by the roles' declared more_bits classes (counts by hand above); the encoded model is
    at the floor of transformers on gguf-py's decode of the same blocks."""

    from vxc.ir.parser import parse
    from vxc.ir.printer import print_module

    out = src / "q4_k_m" / "q.vxir"
    r = cli("quantize", src / "hf_k.vxir", "-o", out, "--scheme", "q4_k_m")
    assert r.exit_code == 0, r.output
    assert "fell back" in r.stdout and "l0.FfnDown" in r.stdout
    text = out.read_text()
    assert print_module(parse(text, str(out))) == text
    got = dict(re.findall(r"^  operand %(\S+) f32\[\d+,\d+\] = (q\d_\w+)\(blocks \$t\d+\)", text, re.M))
    assert {f: list(got.values()).count(f) for f in K_MIX} == K_MIX and len(got) == sum(K_MIX.values())
    assert {s: got[s] for s in K_FORMATS} == K_FORMATS
    assert ('fact quantized q4_k_m evidence "vxc quantize --scheme q4_k_m: 16 operands of roles declared '
            "quantise=True encoded (12 q4_k, 1 q5_0, 2 q6_k, 1 q8_0; bytes of ggml's quantize_row_q4_K_ref") in text
    _blocks_at_the_floor("quantized-q4_k_m", src, out, got, capsys)
    # self-contained: the tokenizer came along, the pass pipeline takes it, and text runs
    assert (out.parent / "tokenizer.json").read_text() == (src / "hf_k" / "tokenizer.json").read_text()
    assert cli("passes", out).exit_code == 0
    r = cli("exec", out, "--prompt", "abc", "--max-new-tokens", "3")
    assert r.exit_code == 0, r.output


# q5_k_m: the same choices with q5_k where q4_k_m has q4_k, and q5_k's fallback q5_1 (by hand, as K_MIX)
K5_MIX = {"q5_k": 12, "q6_k": 2, "q5_1": 1, "q8_0": 1}


def test_q5_k_m_mix_and_parity(src, cli, capsys):
    """Q5_K_M: the roles' more_bits classes choose as for q4_k_m (counts by hand above; llama-quantize's own
    choices and bytes: tests/ggml_quant_check.py, identical on three files); at the floor of transformers on
    gguf-py's decode of the same blocks."""

    out = src / "q5_k_m" / "q.vxir"
    r = cli("quantize", src / "hf_k.vxir", "-o", out, "--scheme", "q5_k_m")
    assert r.exit_code == 0, r.output
    text = out.read_text()
    got = dict(re.findall(r"^  operand %(\S+) f32\[\d+,\d+\] = (q\d_\w+)\(blocks \$t\d+\)", text, re.M))
    assert {f: list(got.values()).count(f) for f in K5_MIX} == K5_MIX and len(got) == sum(K5_MIX.values())
    assert got["l0.FfnDown"] == "q5_1" and got["l1.AttnV"] == "q6_k" and got["l0.AttnQ"] == "q5_k"
    assert "fact quantized q5_k_m" in text and "quantize_row_q5_K_ref" in text
    _blocks_at_the_floor("quantized-q5_k_m", src, out, got, capsys)


# q3_k_m / q2_k on hf_k (2 layers, 4 query heads per 2 KV heads: n_gqa 2), by hand from llama.cpp's
# llama_tensor_get_type (tests/ggml_quant_check.py compares the tool's own choices and bytes on four files):
#   q3_k_m: q6_k the head; q5_k V of layers 0 and 1 (the value rule i < 2); q4_k O (the attn_out class); down
#           wants q4_k (no layer is below 2/16) and falls back to q5_0 (rows of 288); q3_k the rest (Q, K, gate,
#           up, the embedding)
#   q2_k:   q6_k the head; q3_k V (n_gqa 2 < 4) and O; down wants q3_k and falls back to q4_0; q2_k the rest
LOW_MIX = {"q3_k_m": {"q3_k": 9, "q5_k": 2, "q4_k": 2, "q5_0": 2, "q6_k": 1},
           "q2_k": {"q2_k": 9, "q3_k": 4, "q4_0": 2, "q6_k": 1}}
LOW_FORMATS = {"q3_k_m": {"l0.AttnV": "q5_k", "l1.AttnV": "q5_k", "l0.AttnO": "q4_k", "l1.FfnDown": "q5_0",
                          "LmHead": "q6_k", "Embedding": "q3_k", "l0.AttnQ": "q3_k"},
               "q2_k": {"l0.AttnV": "q3_k", "l1.AttnO": "q3_k", "l0.FfnDown": "q4_0", "LmHead": "q6_k",
                        "Embedding": "q2_k", "l1.FfnUp": "q2_k"}}


def test_q3_k_m_and_q2_k_choices(src, tmp_path):
    """The Q3_K_M and Q2_K mixes by the declared classes (by hand above), and the rules keyed on the layer count
    and n_gqa on a 16-layer model with 4 query heads per KV head (widths of 64: every k-quant falls back, so
    each fallback tells the format wanted: q5_k -> q5_1, q4_k -> q5_0, q3_k / q2_k -> q4_0, q6_k -> q8_0)."""
    from vxc.driver import load, run
    from vxc.quantize import choose_formats, n_gqa, quantisable_roles

    m = run(load(src / "hf_k.vxir"), "verify,bind,closure", emit=lambda s: None).module
    assert n_gqa(m) == 2
    for scheme, mix in LOW_MIX.items():
        formats, kept, fallbacks = choose_formats(m, scheme, quantisable_roles())
        assert {f: list(formats.values()).count(f) for f in mix} == mix and len(formats) == sum(mix.values())
        assert {s: formats[s] for s in LOW_FORMATS[scheme]} == LOW_FORMATS[scheme] and not kept
        assert sorted(s for s, _ in fallbacks) == ["l0.FfnDown", "l1.FfnDown"]
    mdir = B.build_hf(tmp_path / "hf16", "llama", dict(CFG, num_hidden_layers=16, num_key_value_heads=1), seed=5)
    m = run(load(mdir), "verify,bind,closure", emit=lambda s: None).module
    assert n_gqa(m) == 4
    f3 = choose_formats(m, "q3_k_m", quantisable_roles())[0]
    assert [f3[f"l{i}.FfnDown"] for i in (0, 1, 15)] == ["q5_1", "q5_0", "q5_0"]  # q5_k for i < 16/16 only
    assert [f3[f"l{i}.AttnV"] for i in (0, 1, 2, 15)] == ["q5_1", "q5_1", "q5_0", "q5_0"]  # q5_k for i < 2
    assert (f3["l3.AttnO"], f3["l3.AttnQ"], f3["LmHead"], f3["Embedding"]) == ("q5_0", "q4_0", "q8_0", "q4_0")
    f4 = choose_formats(m, "iq4_xs", quantisable_roles())[0]  # q5_k -> q5_1, q6_k -> q8_0, iq4_xs -> iq4_nl (rows of 64)
    assert [f4[f"l{i}.FfnDown"] for i in (0, 1, 2, 15)] == ["q5_1", "q5_1", "iq4_nl", "iq4_nl"]  # q5_k for i < 16/8
    assert {f4[f"l{i}.AttnV"] for i in range(16)} == {"q5_1"}  # q5_k: n_gqa 4
    assert (f4["LmHead"], f4["l3.AttnQ"], f4["Embedding"]) == ("q8_0", "iq4_nl", "iq4_nl")
    f2 = choose_formats(m, "q2_k", quantisable_roles())[0]
    assert {f2[f"l{i}.AttnV"] for i in range(16)} == {"q5_0"}  # q4_k: n_gqa 4
    assert (f2["l0.FfnDown"], f2["l7.AttnO"], f2["l7.AttnK"], f2["LmHead"]) == ("q4_0", "q4_0", "q4_0", "q8_0")


def test_q2_k_quantize_and_parity(src, cli, capsys):
    """vxc quantize --scheme q2_k writes the mix chosen above (the q2_k and q3_k encoders: ggml's bytes,
    tests/runtime/test_ggml_blocks.py); at the floor of transformers on gguf-py's decode of the same blocks."""
    out = src / "q2_k" / "q.vxir"
    r = cli("quantize", src / "hf_k.vxir", "-o", out, "--scheme", "q2_k")
    assert r.exit_code == 0, r.output
    text = out.read_text()
    got = dict(re.findall(r"^  operand %(\S+) f32\[\d+,\d+\] = (q\d_\w+)\(blocks \$t\d+\)", text, re.M))
    mix = LOW_MIX["q2_k"]
    assert {f: list(got.values()).count(f) for f in mix} == mix and len(got) == sum(mix.values())
    assert "fact quantized q2_k" in text and "quantize_row_q2_K_ref" in text
    assert "more_bits class value: q4_k where n_head/n_head_kv >= 4, else q3_k" in text
    _blocks_at_the_floor("quantized-q2_k", src, out, got, capsys)


# tq1_0 / tq2_0 on hf_k, by hand from llama.cpp's llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_TQ1_0 / TQ2_0: q6_k the
# (untied) head, q4_k the token embedding, the ternary format for Q, K, V, O, gate and up of both layers (rows of
# 256); down wants it too and falls back to q4_0 (rows of 288, as the tool falls back)
T_MIX = {"tq": 12, "q4_0": 2, "q4_k": 1, "q6_k": 1}


@pytest.mark.parametrize("scheme", ["tq1_0", "tq2_0"])
def test_ternary_schemes_and_parity(src, cli, capsys, scheme):
    """vxc quantize --scheme tq1_0 / tq2_0: the choices above (the declared head and embed classes), the ternary
    blocks gguf-py's encoder writes (tests/runtime/test_ggml_blocks.py), at the floor of transformers on gguf-py's
    decode of the same blocks."""
    out = src / scheme / "q.vxir"
    r = cli("quantize", src / "hf_k.vxir", "-o", out, "--scheme", scheme)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    got = dict(re.findall(r"^  operand %(\S+) f32\[\d+,\d+\] = (t?q\d_\w+)\(blocks \$t\d+\)", text, re.M))
    mix = {scheme if f == "tq" else f: n for f, n in T_MIX.items()}
    assert {f: list(got.values()).count(f) for f in mix} == mix and len(got) == sum(mix.values())
    assert (got["LmHead"], got["Embedding"], got["l0.FfnDown"], got["l1.AttnV"], got["l0.FfnUp"]) == (
        "q6_k", "q4_k", "q4_0", scheme, scheme)
    assert f"fact quantized {scheme}" in text and f"gguf.quants.quantize ({scheme})" in text
    assert "more_bits class head: q6_k; more_bits class embed: q4_k" in text
    _blocks_at_the_floor(f"quantized-{scheme}", src, out, got, capsys)


# iq4_nl / iq4_xs on hf_k (2 layers, n_gqa 2), by hand from llama.cpp's llama_tensor_get_type for IQ4_NL / IQ4_XS
# without an importance matrix: q6_k the head; V would take q5_k only where n_gqa >= 4, down only on layers i < 2/8
# (none); down's 288-wide rows fall back from iq4_xs to iq4_nl; the rest (Q, K, V, O, gate, up, the embedding) the
# base format. (tests/ggml_quant_check.py: llama-quantize's IQ4_NL / IQ4_XS choices and bytes on four files, identical)
IQ4_MIX = {"iq4_nl": {"iq4_nl": 15, "q6_k": 1}, "iq4_xs": {"iq4_xs": 13, "iq4_nl": 2, "q6_k": 1}}


@pytest.mark.parametrize("scheme", ["iq4_nl", "iq4_xs"])
def test_iq4_schemes_and_parity(src, cli, capsys, scheme):
    """vxc quantize --scheme iq4_nl / iq4_xs: the choices above, ggml's searched iq4 bytes (the encoders:
    tests/runtime/test_ggml_blocks.py), at the floor of transformers on gguf-py's decode of the same blocks."""
    out = src / scheme / "q.vxir"
    r = cli("quantize", src / "hf_k.vxir", "-o", out, "--scheme", scheme)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    got = dict(re.findall(r"^  operand %(\S+) f32\[\d+,\d+\] = (i?q\d_\w+)\(blocks \$t\d+\)", text, re.M))
    mix = IQ4_MIX[scheme]
    assert {f: list(got.values()).count(f) for f in mix} == mix and len(got) == sum(mix.values())
    assert (got["LmHead"], got["l0.FfnDown"], got["l1.AttnV"], got["Embedding"]) == ("q6_k", "iq4_nl", scheme, scheme)
    assert f"fact quantized {scheme}" in text and f"quantize_{scheme} without an importance matrix" in text
    _blocks_at_the_floor(f"quantized-{scheme}", src, out, got, capsys)


def test_more_bits_rule_and_tied_head():
    """use_more_bits by hand for 8 and 24 layers (half of V / down upgraded); a tied head's class is the
    embedding table's."""
    from vxc.quantize import more_bits_classes, use_more_bits

    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    classes = more_bits_classes()
    assert {r: classes[r] for r in ("AttnV", "FfnDown", "LmHead", "MlaKvBProj", "SharedExpertDown")} == \
        {"AttnV": "value", "FfnDown": "down", "LmHead": "head", "MlaKvBProj": "value", "SharedExpertDown": "down"}
    assert {r: classes[r] for r in ("AttnO", "MlaOutProj", "KdaOutProj")} == dict.fromkeys(
        ("AttnO", "MlaOutProj", "KdaOutProj"), "attn_out")
    assert classes["Embedding"] == "embed"
    assert not {"AttnQ", "AttnK", "FfnGate", "FfnUp", "Mamba2InProj", "Mamba2OutProj", "LinearAttnOutProj"} & set(classes)


def test_tied_embedding_takes_the_head_format(tmp_path, cli):
    from vxc.driver import load, run
    from vxc.quantize import choose_formats, quantisable_roles

    mdir = B.build_hf(tmp_path / "hf", "llama", dict(K_CFG, tie_word_embeddings=True), seed=3)
    m = run(load(mdir), "verify,bind,closure", emit=lambda s: None).module
    formats, kept, fallbacks = choose_formats(m, "q4_k_m", quantisable_roles())
    assert formats["Embedding"] == "q6_k" and "LmHead" not in formats
    assert formats["l0.AttnQ"] == "q4_k" and not kept and len(fallbacks) == LAYERS


def test_encoded_expert_banks_are_copied_as_stored(tmp_path, cli):
    """MXFP4 expert banks (not quantisable roles) are copied block for block, views and all; the model runs."""
    from safetensors.torch import load_file

    from tests.families import gpt_oss_support as G
    from vxc.ir.parser import parse_file

    mdir = G.MXFP4.build(tmp_path / "mx")
    out = tmp_path / "q" / "q.vxir"
    r = cli("quantize", mdir, "-o", out, "--scheme", "q8_0")
    assert r.exit_code == 0, r.output
    q = parse_file(out)
    banks = [o for o in q.operands if o.encoding == "mxfp4"]
    assert len(banks) == 2 * G.MINI["num_hidden_layers"] and all(o.part_names == ["blocks", "scales"] for o in banks)
    st, hf = load_file(str(out.with_suffix(".safetensors"))), load_file(str(mdir / "model.safetensors"))
    stored = {k: v for k, v in hf.items() if k.endswith(("_blocks", "_scales"))}
    assert sorted(v.shape for v in stored.values()) == sorted(st[f"{o.sym}.{p}"].shape for o in banks for p in o.part_names)
    for o in banks:
        for p in o.part_names:
            assert any(torch.equal(st[f"{o.sym}.{p}"], v) for v in stored.values()), (o.sym, p)
    assert cli("exec", out, "--tokens", "1,2,3", "--max-new-tokens", "2").exit_code == 0


def test_blocks_are_gguf_quants_bytes_and_keep_keeps(src, cli):
    import gguf
    from safetensors.torch import load_file

    out = src / "keep" / "k.vxir"
    r = cli("quantize", src / "hf.vxir", "-o", out, "--scheme", "q4_0", "--keep", "LmHead", "--keep", "FfnDown")
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert len(re.findall(r"= q4_0\(blocks", text)) == QUANTISED - 1 - LAYERS
    assert re.search(r"^  operand %LmHead f32\[103,64\] = \$t\d+ role LmHead$", text, re.M)
    assert "kept by --keep: LmHead, FfnDown" in text
    st = load_file(str(out.with_suffix(".safetensors")))
    hf = load_file(str(src / "hf" / "model.safetensors"))
    want = gguf.quants.quantize(hf["model.layers.1.self_attn.q_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(st["l1.AttnQ"].numpy(), want)
    assert torch.equal(st["LmHead"], hf["lm_head.weight"])


def test_refusals_leave_nothing_behind(src, cli, vxc_sub, tmp_path):
    out = tmp_path / "x.vxir"
    for args, msg in (
        (("--scheme", "q3_k"), "unknown scheme 'q3_k'; known: q8_0, q4_0, q4_1, q4_k_m, q5_k_m, q3_k_m, q2_k"),
        (("--scheme", "q8_0", "--keep", "Attn"), "--keep Attn: not a role; roles: "),
    ):
        r = cli("quantize", src / "hf.vxir", "-o", out, *args)
        assert r.exit_code != 0 and msg in r.stderr, r.output
    r = cli("quantize", tmp_path / "missing.vxir", "-o", out, "--scheme", "q8_0")
    assert r.exit_code != 0 and "no such IR file" in r.stderr
    bad = tmp_path / "bad.vxir"
    bad.write_text("vindex3 schema 6\nmodule \"m\" {\n  compute f99\n}\n")
    r = cli("quantize", bad, "-o", out, "--scheme", "q8_0")
    assert r.exit_code != 0 and "bad.vxir:3:" in r.stderr and "^" in r.stderr, r.output
    # an output whose directory is a file: a user sees a message, not a traceback
    r = vxc_sub("quantize", src / "hf.vxir", "-o", bad / "x.vxir", "--scheme", "q8_0")
    assert r.exit_code != 0 and "Traceback" not in r.stderr and r.stderr.strip(), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.vxir"]
    # a directory holding another model's tokenizer: refused before anything is written there
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    r = cli("quantize", src / "hf_k.vxir", "-o", other / "q.vxir", "--scheme", "q8_0")
    assert r.exit_code != 0 and "holds a different tokenizer" in r.stderr, r.output
    assert [p.name for p in other.iterdir()] == ["tokenizer.json"]


def test_quantize_with_int8_activations_and_lower_refuses_them_on_plain_weights(src, cli, tmp_path):
    """--activations int8_block32 declares the precision on every encoded operand (and on none else); the
    model runs, its logits within the int8 path's stated bound of the same file's fp32-activation run. On a
    model with nothing encoded, the declaration is refused and no IR is written."""
    from vxc.runtime.session import Session

    out = tmp_path / "a8" / "q.vxir"
    r = cli("quantize", src / "hf.vxir", "-o", out, "--scheme", "q4_0", "--activations", "int8_block32", "--json")
    assert r.exit_code == 0, r.output
    ops = [l for l in out.read_text().splitlines() if l.startswith("  operand ")]
    enc = [l for l in ops if "q4_0(blocks" in l]
    assert len(enc) == QUANTISED and all(l.endswith(" activations int8_block32") for l in enc)
    assert not any("activations" in l for l in ops if l not in enc)
    plain = tmp_path / "fp" / "q.vxir"
    assert cli("quantize", src / "hf.vxir", "-o", plain, "--scheme", "q4_0").exit_code == 0
    ids = list(range(3, 40))
    a8 = Session(P.engine_for(out, max_context=64)).prefill(ids)
    fp = Session(P.engine_for(plain, max_context=64)).prefill(ids)
    err = float((a8 - fp).abs().max())
    assert 1e-4 < err <= 0.1 * float(fp.abs().max()), err
    r = cli("lower", src / "hf", "-o", tmp_path / "x.vxir", "--activations", "int8_block32")
    assert r.exit_code != 0 and "has no ggml block-encoded operand" in r.stderr, r.output
    assert not (tmp_path / "x.vxir").exists()
