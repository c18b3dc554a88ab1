"""``vxc quantize`` (issue 12): the operands of roles declared ``quantise=True`` encoded in a ggml block format,
written with the IR that declares them; data preparation, checked before anything is written.

The reference is built independently of vxc's code: transformers' own model with each projection / embedding /
head parameter replaced by ``gguf.quants.dequantize(gguf.quants.quantize(p))`` (gguf-py, the format's
reference), compared at the fp32 floor; greedy identical; decode == prefill."""

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


@pytest.fixture(scope="module")
def src(tmp_path_factory, vxc_sub):
    d = tmp_path_factory.mktemp("quant")
    mdir = B.build_hf(d / "hf", "llama", CFG, seed=41)
    r = vxc_sub("lower", mdir, "-o", d / "m.vxir")
    assert r.exit_code == 0, r.stderr
    return d


def _reference(mdir, scheme: str):
    import gguf
    import transformers

    T = gguf.GGMLQuantizationType[scheme.upper()]
    m = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    n = 0
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(k in name for k in HF_QUANTISED):
                a = p.detach().numpy().astype(np.float32)
                p.copy_(torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(a, T), T))))
                n += 1
    assert n == QUANTISED
    ref = P.Reference.__new__(P.Reference)
    ref.m32, ref.m64 = m, copy.deepcopy(m).double()
    return ref


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
def test_quantized_model_runs_at_the_floor_of_the_dequantized_reference(src, scheme, vxc_sub, capsys):
    out = src / scheme / "q.vxir"
    r = vxc_sub("quantize", src / "m.vxir", "-o", out, "--scheme", scheme)
    assert r.exit_code == 0, r.stderr
    text = out.read_text()
    assert len(re.findall(rf"= {scheme}\(blocks \$t\d+\)", text)) == QUANTISED
    assert f'fact quantized {scheme} evidence "vxc quantize --scheme {scheme}: {QUANTISED} operands' in text
    assert re.search(r'^  file @w0 "q\.safetensors" size \d+ header_sha256 "[0-9a-f]{64}"$', text, re.M)
    # norms stay as stored
    assert re.search(r"^  operand %l0\.PreAttentionNorm f32\[64\] = \$t\d+ layer 0 role PreAttentionNorm$", text, re.M)
    f = P.Family(f"quantized-{scheme}", build=None, reference="hf", vocab=103, padded_vocab=103)
    ref = _reference(src / "hf", scheme)
    ref.f = f
    p = P.measure(f, out.parent, out, ref)
    with capsys.disabled():
        print(f"\nquantize {scheme}: {p.row()}")
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)


def test_blocks_are_gguf_quants_bytes_and_keep_keeps(src, vxc_sub):
    import gguf
    from safetensors.torch import load_file

    out = src / "keep" / "k.vxir"
    r = vxc_sub("quantize", src / "m.vxir", "-o", out, "--scheme", "q4_0", "--keep", "LmHead", "--keep", "FfnDown")
    assert r.exit_code == 0, r.stderr
    text = out.read_text()
    assert len(re.findall(r"= q4_0\(blocks", text)) == QUANTISED - 1 - LAYERS
    assert re.search(r"^  operand %LmHead f32\[103,64\] = \$t\d+ role LmHead$", text, re.M)
    st = load_file(str(out.with_suffix(".safetensors")))
    hf = load_file(str(src / "hf" / "model.safetensors"))
    want = gguf.quants.quantize(hf["model.layers.1.self_attn.q_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(st["l1.AttnQ"].numpy(), want)
    assert torch.equal(st["LmHead"], hf["lm_head.weight"])


def test_refusals_leave_nothing_behind(src, vxc_sub, tmp_path):
    out = tmp_path / "x.vxir"
    for args, msg in (
        (("--scheme", "q3_k"), "unknown scheme 'q3_k'; known: q8_0, q4_0, q4_1"),
        (("--scheme", "q8_0", "--keep", "Attn"), "--keep Attn: not a role; roles: "),
    ):
        r = vxc_sub("quantize", src / "m.vxir", "-o", out, *args)
        assert r.exit_code != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = vxc_sub("quantize", tmp_path / "missing.vxir", "-o", out, "--scheme", "q8_0")
    assert r.exit_code != 0 and "no such IR file" in r.stderr
    assert list(tmp_path.iterdir()) == []
