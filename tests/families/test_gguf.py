"""GGUF files as input (issue 12): ``vxc lower model.gguf`` keeps every tensor at its stored ggml encoding
(encoded operands ``q4_k(blocks $t)`` …), and the lowered model runs at the numerical floor of transformers 5.24
loading the same file (``from_pretrained(dir, gguf_file=…)``, which dequantises with its own code), greedy
continuations identical, decode == prefill. Miniatures are written with the ``gguf`` package's writer, mixing
the encodings a Q4_K_M file mixes (q4_k, q6_k, q8_0) and the 32-value blocks (q4_0, q4_1)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.gguf_support import MINI_LLAMA, MIXED, write_llama_gguf
from tests.runtime import parity_table as P

ARCHS = {
    "llama": dict(MINI_LLAMA),
    "qwen2": dict(MINI_LLAMA),
    # transformers' qwen3 GGUF loader ignores attention.key_length and keeps Qwen3Config's head_dim=128
    "qwen3": dict(MINI_LLAMA, heads=2, kv_heads=1, head_dim=128),
}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory, vxc_sub):
    out = {}
    for i, (arch, cfg) in enumerate(ARCHS.items()):
        d = tmp_path_factory.mktemp(f"gguf-{arch}")
        write_llama_gguf(d / "m.gguf", cfg, arch=arch, seed=11 + i)
        r = vxc_sub("lower", d / "m.gguf", "-o", d / "m.vxir")
        assert r.exit_code == 0, r.stderr
        out[arch] = d
    return out


def test_lowering_keeps_every_stored_encoding(lowered):
    text = (lowered["llama"] / "m.vxir").read_text()
    assert re.search(r'^  file @w0 "m\.gguf" format gguf size \d+ header_sha256 "[0-9a-f]{64}"$', text, re.M)
    # every quantised tensor is u8 blocks, read by an operand declaring its ggml encoding
    for name, ggml in MIXED.items():
        key = f"{name}.weight" if name in ("token_embd", "output") else f"blk.0.{name}.weight"
        m = re.search(rf'^  tensor (\$t\d+) u8\[(\d+),(\d+)\] @w0 "{re.escape(key)}"$', text, re.M)
        assert m, key
        sym = re.escape(m.group(1))
        enc = ggml.lower()
        assert re.search(rf"^  operand %\S+ f32\[\d+,\d+\] = {enc}\(blocks {sym}\)", text, re.M), (key, enc)
    # 256 values in 144 bytes (q4_k), 34 bytes per 32 (q8_0): the stored byte shapes of a 256-wide row
    assert re.search(r'tensor \$t\d+ u8\[256,144\] @w0 "blk\.0\.attn_q\.weight"', text)
    assert re.search(r'tensor \$t\d+ u8\[300,272\] @w0 "token_embd\.weight"', text)
    assert text.count("rotary_layout=interleaved") == MINI_LLAMA["layers"]  # llama.cpp's permuted Q/K rows
    q2 = (lowered["qwen2"] / "m.vxir").read_text()
    assert q2.count("rotary_layout=half") == MINI_LLAMA["layers"] and "q_bias=true" in q2


def test_print_parse_round_trip(lowered):
    from vxc.ir.parser import parse_file
    from vxc.ir.printer import print_module

    for d in lowered.values():
        text = (d / "m.vxir").read_text()
        assert print_module(parse_file(d / "m.vxir")) == text


def _reference(d: Path, f: P.Family) -> P.Reference:
    import transformers

    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    ref.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf", dtype=torch.float32).eval()
    ref.m64 = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf", dtype=torch.float32).double().eval()
    return ref


@pytest.mark.parametrize("resident", ["encoded", "decoded"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_parity_with_transformers_on_the_same_file(lowered, arch, resident, capsys, monkeypatch):
    """``encoded`` (the default): the weights stay as stored blocks, read by qgemv (native on CPU) in every
    projection, the FFN and the head, and the embedding decodes the rows it gathers; ``decoded``
    (``VXC_ENCODED=0``): decoded to fp32 at load. Both at the fp32 floor."""
    monkeypatch.setenv("VXC_ENCODED", "1" if resident == "encoded" else "0")
    V = MINI_LLAMA["vocab"]
    f = P.Family(f"gguf-{arch}", build=None, reference="hf", vocab=V, padded_vocab=V)
    p = P.measure(f, lowered[arch], lowered[arch] / "m.vxir", _reference(lowered[arch], f))
    with capsys.disabled():
        print(f"\n{arch} ({resident}): {p.row()}")
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.deterministic


def test_decoded_weights_equal_the_gguf_reference_dequantisation(lowered):
    """Each encoded operand, as the runtime decodes it, equals gguf.quants.dequantize of the stored bytes."""
    import gguf
    import numpy as np

    from vxc.driver import model_dir_of
    from vxc.ir.parser import parse_file
    from vxc.runtime.weights import Weights

    d = lowered["llama"]
    m = parse_file(d / "m.vxir")
    w = Weights(m, model_dir_of(m, d / "m.vxir"))
    reader = gguf.GGUFReader(str(d / "m.gguf"))
    by_name = {t.name: t for t in reader.tensors}
    tensors = m.tensor_table()
    seen = set()
    for o in m.operands:
        if o.encoding is None:
            continue
        t = by_name[tensors[o.sources[0]].key]
        want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))).float()
        got = w.operand(o, torch.float32, "cpu")
        assert torch.equal(got, want.reshape(got.shape)), t.name
        seen.add(o.encoding)
    assert seen == {e.lower() for e in MIXED.values()}


# ---------------------------------------------------------------- refusals


def test_unknown_architecture_and_tensor_types_are_refused(tmp_path, vxc_sub):
    import gguf
    import numpy as np

    p = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(p), "rwkv7")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = vxc_sub("lower", p, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "GGUF architecture 'rwkv7' is not supported; supported: llama, qwen2, qwen3, qwen3moe, gemma3, qwen3next, kimi-linear, mamba2" in r.stderr

    p = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        qt = gguf.GGMLQuantizationType.Q8_K  # (ggml's intermediate type: never a stored weight)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor(name, np.zeros((8, 256 // block * size), np.uint8), raw_shape=(8, 256 // block * size), raw_dtype=qt)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = vxc_sub("lower", p, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "2 tensor(s) of a type vxc does not decode" in r.stderr
    assert "blk.0.attn_q.weight: ggml type Q8_K" in r.stderr and "blk.0.attn_k.weight: ggml type Q8_K" in r.stderr
    assert not (tmp_path / "x.vxir").exists()


def test_a_gguf_cut_inside_its_header_is_refused_as_such(lowered, tmp_path, vxc_sub):
    src = (lowered["llama"] / "m.gguf").read_bytes()
    cut = tmp_path / "head.gguf"
    cut.write_bytes(src[:200])  # the magic, the counts and part of the metadata
    r = vxc_sub("lower", cut, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "head.gguf: not a readable GGUF file: it has GGUF's magic, but its header is cut short or corrupt (200 bytes)" \
        in r.stderr, r.stderr
    assert not (tmp_path / "x.vxir").exists()


def test_a_truncated_or_changed_gguf_is_refused(lowered, tmp_path, vxc_sub):
    src = lowered["llama"] / "m.gguf"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    r = vxc_sub("lower", cut, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "cut.gguf" in r.stderr and ("truncated" in r.stderr or "not a readable GGUF file" in r.stderr), r.stderr
    # the IR refuses a file whose header changed after lowering (same size, one metadata byte flipped)
    d = tmp_path / "changed"
    d.mkdir()
    raw = bytearray(src.read_bytes())
    i = raw.index(b"general.name") + len("general.name") + 4 + 8  # past the value's type (u32) and length (u64)
    raw[i] ^= 0x01
    (d / "m.gguf").write_bytes(bytes(raw))
    ir = (lowered["llama"] / "m.vxir").read_text()
    (d / "m.vxir").write_text(ir)
    r = vxc_sub("exec", d / "m.vxir", "--tokens", "1,2", "--max-new-tokens", "1")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "header sha256 differs from the IR's" in r.stderr, r.stderr


def test_describe_reports_weight_bytes_per_encoding(lowered, describe_json):
    """Bytes per encoding equal the GGUF tensor sizes (the gguf package's n_bytes, summed independently); a
    decode step streams every weight whole except the embedding, of which one row (untied head here)."""
    import gguf

    d = lowered["llama"]
    w = describe_json(d / "m.vxir")["weights"]
    reader = gguf.GGUFReader(str(d / "m.gguf"))
    want: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        want[name] = want.get(name, 0) + int(t.n_bytes)
    assert {k: v["bytes"] for k, v in w["by_encoding"].items()} == want
    assert w["total_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row = int(emb.n_bytes) // MINI_LLAMA["vocab"]
    assert w["decode_step_bytes"] == w["total_bytes"] - int(emb.n_bytes) + row


def test_encoded_weights_stay_resident_as_stored(lowered, monkeypatch):
    """With fp32 compute the engine registers each encoded operand's stored blocks — a view of the file's
    mapping, not a decoded copy — and the lowering reads them with the encoded kernel forms."""
    monkeypatch.setenv("VXC_ENCODED", "1")
    eng = P.engine_for(lowered["llama"] / "m.vxir", max_context=64)
    kernels = {c.kernel for c in eng.lowered["decode"].groups()}
    assert {"qlinear", "qswiglu", "qembedding"} <= kernels and not {"linear", "swiglu", "embedding"} & kernels
    blocks = {n: b for n, b in eng.root.named_buffers() if n.startswith("wq_")}
    assert blocks and all(b.dtype == torch.uint8 for b in blocks.values())
    mapped = eng.weights.files["w0"].bytes
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    assert all(lo <= b.data_ptr() < hi for b in blocks.values())  # zero-copy views of the mapping
    assert not any(n.startswith("w_") and b.dim() == 2 for n, b in eng.root.named_buffers())  # no decoded matrix


def _assert_bf16_as_near_as_transformers(logits: torch.Tensor, m32, ids: list[int]) -> None:
    """bf16 ``logits`` as far from transformers' fp32 logits of ``ids`` as transformers' own bf16 run of the same
    model (``m32``, cast in place) is: RMS error at most 1.25x its, max-abs at most 1.5x. (On these 40-token
    miniatures the max over ~12000 logits moves with the reference's own build — transformers' bf16 max error on
    the qwen2 file 0.369 with torch's AVX-512 kernels, 0.338 with its AVX2 ones, vxc's 0.432 in both — where the RMS
    ratio stays 1.05-1.06; the real-model tier holds max-abs to 1.25x over 200-token paragraphs.)"""
    V = logits.shape[-1]
    with torch.no_grad():
        r32 = m32(torch.tensor([ids])).logits[0, :, :V]
        h16 = m32.to(torch.bfloat16)(torch.tensor([ids])).logits[0, :, :V].float()
    d, dh = logits.float() - r32, h16 - r32
    rms, hf_rms = float(d.pow(2).mean().sqrt()), float(dh.pow(2).mean().sqrt())
    err, hf_err = float(d.abs().max()), float(dh.abs().max())
    assert 0 < rms <= 1.25 * hf_rms and err <= 1.5 * hf_err, (rms, hf_rms, err, hf_err)


@pytest.mark.native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_session_reads_the_stored_blocks(lowered, arch, monkeypatch):
    """A bf16 session keeps the encoded weights as stored blocks too (no bf16 copy: ~2-3.5x the bytes of these
    formats): the products take bf16 x, sum in fp32 over the weights' exact values and round once to bf16, the
    gather rounds its rows. Its logits are bf16, as far from transformers' fp32 logits on the same file as
    transformers' own bf16 run is (_assert_bf16_as_near_as_transformers), and its replayed steps bit-identical to
    the graph's (the rounding is a native call, so a step stays replayed)."""
    from vxc.runtime.session import Session

    monkeypatch.setenv("VXC_ENCODED", "1")
    d = lowered[arch]
    ir = d / "m.vxir"
    eng = P.engine_for(ir, max_context=64, dtype=torch.bfloat16)
    kernels = {c.kernel for c in eng.lowered["decode"].groups()}
    assert {"qlinear", "qswiglu", "qembedding"} <= kernels and not {"linear", "swiglu", "embedding"} & kernels
    blocks = {n: b for n, b in eng.root.named_buffers() if n.startswith("wq_")}
    assert blocks and all(b.dtype == torch.uint8 for b in blocks.values())
    assert not any(n.startswith("w_") and b.dim() == 2 for n, b in eng.root.named_buffers())  # no decoded matrix
    fp32 = {n: b for n, b in P.engine_for(ir, max_context=64).root.named_buffers() if n.startswith("wq_")}
    assert {n: b.numel() for n, b in blocks.items()} == {n: b.numel() for n, b in fp32.items()}  # the same blocks
    graph = P.engine_for(ir, max_context=64, dtype=torch.bfloat16, replay=False)

    g = torch.Generator().manual_seed(7)
    V = MINI_LLAMA["vocab"]
    ids = torch.randint(0, V, (40,), generator=g).tolist()  # past TILED_FROM: the decoded-tile prefill in bf16
    s = Session(eng)
    full = s.prefill(ids)
    assert full.dtype == torch.bfloat16
    import transformers

    m32 = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf", dtype=torch.float32).eval()
    _assert_bf16_as_near_as_transformers(full[:, :V], m32, ids)

    def steps(engine):
        t = Session(engine)
        t.prefill(ids[:12])
        return [t.step(x) for x in ids[12:24]]

    got, want = steps(eng), steps(graph)
    assert eng.replay_status().startswith("replaying"), eng.replay_status()
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"


# ---------------------------------------------------------------- real trained weights




@pytest.mark.native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_encoded_decode_is_replayed_bit_identically(lowered, arch, monkeypatch):
    """qlinear (with qwen2's biases), qswiglu and qembedding have native forms: a decode step over the resident
    blocks is captured and replayed, bit-identical to running the graph."""
    from vxc.runtime.session import Session

    monkeypatch.setenv("VXC_ENCODED", "1")
    ir = lowered[arch] / "m.vxir"
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, MINI_LLAMA["vocab"], (24,), generator=g).tolist()

    def steps(engine):
        s = Session(engine)
        s.prefill(ids[:12])
        return [s.step(t) for t in ids[12:]]

    rep = P.engine_for(ir, max_context=64)
    got = steps(rep)
    assert rep.replay_status().startswith("replaying"), rep.replay_status()
    want = steps(P.engine_for(ir, max_context=64, replay=False))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"


# ---------------------------------------------------------------- int8_block32 activations


def test_lower_notes_the_fp32_activation_products(lowered, vxc_sub, tmp_path):
    """``vxc lower x.gguf`` keeps the exact fp32 products by default and says so, naming how many encoded operands
    and the int8_block32 option; lowered with int8_block32 it says nothing of it."""
    d = lowered["llama"]
    r = vxc_sub("lower", d / "m.gguf", "-o", tmp_path / "x.vxir")
    assert r.exit_code == 0, r.stderr
    text = (tmp_path / "x.vxir").read_text()
    encoded = len(re.findall(r"^  operand %\S+ \S+ = (?!mxfp4)[a-z0-9_]+\(blocks ", text, re.M))
    assert encoded >= 5, text
    assert f"note: {encoded} ggml-encoded operands multiply fp32 activations as given" in r.stdout, r.stdout
    assert "--activations int8_block32" in r.stdout
    r = vxc_sub("lower", d / "m.gguf", "-o", tmp_path / "y.vxir", "--activations", "int8_block32")
    assert r.exit_code == 0 and "note:" not in r.stdout, r.stdout


@pytest.fixture(scope="module")
def lowered_a8(lowered, vxc_sub):
    """The llama miniature's file lowered again with ``--activations int8_block32``."""
    d = lowered["llama"]
    r = vxc_sub("lower", d / "m.gguf", "-o", d / "a8.vxir", "--activations", "int8_block32")
    assert r.exit_code == 0, r.stderr
    return d / "a8.vxir"


def test_activations_are_declared_per_encoded_operand(lowered, lowered_a8, describe_json):
    from vxc.ir.parser import parse_file
    from vxc.ir.printer import print_module

    text = lowered_a8.read_text()
    ops = [l for l in text.splitlines() if l.startswith("  operand ")]
    encoded = [l for l in ops if re.search(r"= (q\d_\w+|q\d_k)\(blocks", l)]
    assert len(encoded) >= len(MIXED)
    assert all(l.endswith(" activations int8_block32") for l in encoded)
    assert not any("activations" in l for l in ops if l not in encoded)  # the norms: plain f32, none declared
    assert print_module(parse_file(lowered_a8)) == text
    # the rest of the IR is the plain lowering's
    plain = (lowered["llama"] / "m.vxir").read_text()
    assert text.replace(" activations int8_block32", "") == plain
    w = describe_json(lowered_a8)["weights"]
    assert w["activations"] == {"int8_block32": len(encoded)}
    assert "activations" not in describe_json(lowered["llama"] / "m.vxir")["weights"]


def test_activations_refusals(lowered, tmp_path, vxc_sub):
    text = (lowered["llama"] / "m.vxir").read_text()
    # on a plain (not block-encoded) operand, and an unknown precision: located parse errors
    lines = text.splitlines()
    line = next(i for i, l in enumerate(lines) if l.startswith("  operand ") and "(blocks" not in l)
    lines[line] += " activations int8_block32"
    bad = tmp_path / "bad.vxir"
    bad.write_text("\n".join(lines) + "\n")
    r = vxc_sub("passes", bad, "--pipeline", "verify")
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert f"{line + 1}:" in r.stderr and "is not ggml block-encoded" in r.stderr and "^" in r.stderr, r.stderr
    bad.write_text(text.replace("role AttnQ", "role AttnQ activations int4", 1))
    r = vxc_sub("passes", bad, "--pipeline", "verify")
    assert r.exit_code != 0 and "unknown activation precision 'int4' (known: int8_block32)" in r.stderr, r.stderr
    # asked of a model with nothing encoded / an unknown precision: refused, no output left behind
    r = vxc_sub("lower", lowered["llama"] / "m.gguf", "-o", tmp_path / "x.vxir", "--activations", "fp8")
    assert r.exit_code != 0 and "unknown activation precision 'fp8'" in r.stderr and not (tmp_path / "x.vxir").exists()


def test_int8_activations_against_transformers(lowered, lowered_a8, capsys, monkeypatch):
    """The int8_block32 path is not at the fp32 floor by construction (each projection's input carries ~0.4 %
    rounding per block); its stated tolerance on this random-weight miniature: logits within 10 % of the
    largest |logit|, argmax agreement >= 95 % where the reference margin is clear (10x the fp32 tolerance),
    greedy 32 identical, and decode == prefill at the fp32 floor (each row is quantised on its own). The fp32
    path of the same file is at the floor; the two differ by far more than it (the declaration is honoured)."""
    monkeypatch.setenv("VXC_ENCODED", "1")
    V = MINI_LLAMA["vocab"]
    f = P.Family("gguf-llama-a8", build=None, reference="hf", vocab=V, padded_vocab=V)
    ref = _reference(lowered["llama"], f)
    p = P.measure(f, lowered["llama"], lowered_a8, ref)
    with capsys.disabled():
        print(f"\nllama int8_block32: {p.row()}")
    assert p.err <= 0.10 * p.max_abs_logit, p.row()
    assert p.argmax >= 0.95 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)
    assert p.err_step <= p.tol and p.deterministic, p.row()
    assert p.err > 20 * p.tol  # not the fp32 path


@pytest.mark.native
def test_int8_weights_are_packed_at_load(lowered_a8, monkeypatch):
    """An engine makes the packed copies of its int8_block32 matrices while it loads, before any prefill's
    short-lived buffers exist: the first prefill and decode pack nothing more."""
    from vxc.codegen.kernels import native as N
    from vxc.codegen.kernels import quant
    from vxc.runtime.session import Session

    lib = N.load()
    tb = lib.vxc_qpack_tile_bytes
    tb.argtypes, tb.restype = [N.I, N.L], N.L
    if tb(quant.NATIVE_ENCODINGS["q4_0"], 256) <= 0:
        pytest.skip("this build has no packed layout (AVX-512 only)")
    from torch.utils.weak import WeakIdKeyDictionary

    monkeypatch.setenv("VXC_ENCODED", "1")
    monkeypatch.setattr(quant, "_PACKED", WeakIdKeyDictionary())  # (engines of earlier tests share the blocks)
    eng = P.engine_for(lowered_a8, max_context=64)
    blocks = dict(eng.root.named_buffers())
    products = [b for n, b in blocks.items() if n.startswith("wq_") and "Embedding" not in n]
    assert products and all(b in quant._PACKED for b in products)
    # the untied embedding table is only gathered: no packed copy of it
    assert not any(b in quant._PACKED for n, b in blocks.items() if n.startswith("wq_") and "Embedding" in n)
    loaded = quant.packed_bytes()
    s = Session(eng)
    s.prefill(list(range(3, 40)))
    s.step(5)
    assert quant.packed_bytes() == loaded


@pytest.mark.native
def test_fp32_prefill_attention_runs_natively(lowered):
    """A prompt's softmax attention runs the native prefill kernel end to end (it fell back to the torch twin, and
    torch's fused kernel, before there was one): no attention fallback is recorded over a chunked prefill."""
    from vxc.codegen import kernels
    from vxc.runtime.session import Session

    eng = P.engine_for(lowered["llama"] / "m.vxir", max_context=64, prefill_chunk=16)
    kernels.reset_fallbacks()
    Session(eng).prefill(list(range(3, 40)))
    assert "attention" not in kernels.fallbacks(), kernels.fallbacks()


def test_prefill_chunk_follows_the_plans_products(lowered, lowered_a8, monkeypatch):
    """A prompt's prefill runs in chunks of 128 tokens where the plan multiplies with int8_block32 activations (the
    packed products' cost is per row of x: a smaller chunk halves the activations at the prefill's peak at no loss of
    speed), of 256 otherwise (torch's GEMMs want the larger chunk); an explicit chunk wins."""
    from vxc.runtime.engine import PREFILL_CHUNK, PREFILL_CHUNK_PACKED

    assert (PREFILL_CHUNK, PREFILL_CHUNK_PACKED) == (256, 128)
    monkeypatch.setenv("VXC_ENCODED", "1")
    assert P.engine_for(lowered_a8, max_context=64).prefill_chunk == 128
    assert P.engine_for(lowered["llama"] / "m.vxir", max_context=64).prefill_chunk == 256
    assert P.engine_for(lowered_a8, max_context=64, prefill_chunk=40).prefill_chunk == 40


@pytest.mark.native
def test_int8_activation_decode_is_replayed_bit_identically(lowered_a8, monkeypatch):
    from vxc.runtime.session import Session

    monkeypatch.setenv("VXC_ENCODED", "1")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MINI_LLAMA["vocab"], (20,), generator=g).tolist()

    def steps(engine):
        s = Session(engine)
        s.prefill(ids[:10])
        return [s.step(t) for t in ids[10:]]

    rep = P.engine_for(lowered_a8, max_context=64)
    kernels = {c.kernel: c.args[-1] for c in rep.lowered["decode"].groups() if c.kernel in ("qlinear", "qswiglu")}
    assert kernels and set(kernels.values()) == {"int8_block32"}, kernels
    got = steps(rep)
    assert rep.replay_status().startswith("replaying"), rep.replay_status()
    want = steps(P.engine_for(lowered_a8, max_context=64, replay=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- qwen3moe: encoded expert banks

MOE_CFG = dict(MINI_LLAMA, heads=2, kv_heads=1, head_dim=128, experts=5, top_k=2, moe_ffn=96)
MOE_ENC = {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q4_1",
           "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0", "output": "Q6_K"}


@pytest.fixture(scope="module")
def lowered_moe(tmp_path_factory, vxc_sub):
    d = tmp_path_factory.mktemp("gguf-qwen3moe")
    write_llama_gguf(d / "m.gguf", MOE_CFG, encodings=MOE_ENC, arch="qwen3moe", seed=5)
    r = vxc_sub("lower", d / "m.gguf", "-o", d / "m.vxir")
    assert r.exit_code == 0, r.stderr
    return d


def _moe_reference(d: Path, f: P.Family) -> P.Reference:
    """transformers on the same file. Its GGUF config mapping drops expert_feed_forward_length (5.24 keeps
    Qwen3MoeConfig's default 768), so the width is passed; norm_topk_prob it sets true as llama.cpp does. The
    experts' eager loop: the grouped matmul refuses fp64."""
    import transformers

    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    kw = dict(gguf_file="m.gguf", dtype=torch.float32, moe_intermediate_size=MOE_CFG["moe_ffn"])
    ref.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(d), **kw).eval()
    ref.m64 = transformers.AutoModelForCausalLM.from_pretrained(str(d), **kw).double().eval()
    assert ref.m32.config.norm_topk_prob and ref.m32.config.num_experts == MOE_CFG["experts"]
    for m in (ref.m32, ref.m64):
        m.set_experts_implementation("eager")
    return ref


@pytest.mark.parametrize("resident", ["encoded", "decoded"])
def test_qwen3moe_at_the_floor_with_encoded_banks(lowered_moe, resident, capsys, monkeypatch):
    """A qwen3moe file (q/k-normed attention, every FFN 5 experts top-2 renormalised, the three banks q4_k /
    q8_0 / q4_0 as ggml stores them [E, rows, cols]): at the fp32 floor of transformers loading the same file.
    ``encoded``: the banks stay resident as the file's blocks (``qmoe_experts``: each selected expert's matrices
    read in place, no decoded copy); ``decoded``: decoded at load."""
    monkeypatch.setenv("VXC_ENCODED", "1" if resident == "encoded" else "0")
    text = (lowered_moe / "m.vxir").read_text()
    assert text.count("ffn moe ") == MOE_CFG["layers"] and "norm_topk_prob=true (default)" in text
    assert re.search(r'tensor \$t\d+ u8\[5,96,144\] @w0 "blk\.0\.ffn_gate_exps\.weight"', text)
    assert "fact moe_renormalise true" in text
    V = MINI_LLAMA["vocab"]
    f = P.Family("gguf-qwen3moe", build=None, reference="hf", vocab=V, padded_vocab=V)
    p = P.measure(f, lowered_moe, lowered_moe / "m.vxir", _moe_reference(lowered_moe, f))
    with capsys.disabled():
        print(f"\nqwen3moe ({resident}): {p.row()}")
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
    assert p.greedy_match and p.distinct >= P.MIN_DISTINCT and p.deterministic, (p.greedy_vxc, p.greedy_ref)
    if resident == "encoded":
        eng = P.engine_for(lowered_moe / "m.vxir", max_context=64)
        kernels = {c.kernel for c in eng.lowered["decode"].groups()}
        assert "qmoe_experts" in kernels and "moe_experts" not in kernels
        banks = {n: b for n, b in eng.root.named_buffers() if b.dim() == 3}
        assert len(banks) == 3 * MOE_CFG["layers"] and all(b.dtype == torch.uint8 for b in banks.values()), banks.keys()


@pytest.mark.native
def test_qwen3moe_encoded_decode_is_replayed_bit_identically(lowered_moe, monkeypatch):
    from vxc.runtime.session import Session

    monkeypatch.setenv("VXC_ENCODED", "1")
    ids = list(range(3, 21))

    def steps(engine):
        s = Session(engine)
        s.prefill(ids[:9])
        return [s.step(t) for t in ids[9:]]

    rep = P.engine_for(lowered_moe / "m.vxir", max_context=64)
    got = steps(rep)
    assert rep.replay_status().startswith("replaying"), rep.replay_status()
    want = steps(P.engine_for(lowered_moe / "m.vxir", max_context=64, replay=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.native
def test_qwen3moe_bf16_session_reads_the_banks(lowered_moe, monkeypatch):
    """A bf16 session on the qwen3moe file keeps its expert banks (and every other matrix) as the stored blocks:
    qmoe_experts widens x and the routing weights to fp32 (exact), sums in fp32 and rounds once to bf16. As far from
    transformers' fp32 logits as transformers' own bf16 run (_assert_bf16_as_near_as_transformers; here far nearer:
    RMS 0.03 against 0.11), replayed steps bit-identical to the graph's."""
    from vxc.runtime.session import Session

    monkeypatch.setenv("VXC_ENCODED", "1")
    ir = lowered_moe / "m.vxir"
    eng = P.engine_for(ir, max_context=64, dtype=torch.bfloat16)
    kernels = {c.kernel for c in eng.lowered["decode"].groups()}
    assert {"qmoe_experts", "qlinear", "qembedding"} <= kernels and not {"moe_experts", "linear"} & kernels
    banks = {n: b for n, b in eng.root.named_buffers() if b.dim() == 3}
    assert len(banks) == 3 * MOE_CFG["layers"] and all(b.dtype == torch.uint8 for b in banks.values()), banks.keys()
    ids = list(range(3, 43))
    full = Session(eng).prefill(ids)
    assert full.dtype == torch.bfloat16
    V = MINI_LLAMA["vocab"]
    ref = _moe_reference(lowered_moe, P.Family("gguf-qwen3moe", build=None, reference="hf", vocab=V, padded_vocab=V))
    _assert_bf16_as_near_as_transformers(full[:, :V], ref.m32, ids)

    def steps(engine):
        s = Session(engine)
        s.prefill(ids[:9])
        return [s.step(t) for t in ids[9:20]]

    got = steps(eng)
    assert eng.replay_status().startswith("replaying"), eng.replay_status()
    want = steps(P.engine_for(ir, max_context=64, dtype=torch.bfloat16, replay=False))
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("which", ["fp32", "a8", "bf16"])
def test_batched_decode_equals_single(lowered, lowered_a8, which, monkeypatch):
    """Sequence slots on the encoded weights: a batched decode step (the block GEMM over B rows) equals each
    sequence's single-sequence decode (tests/runtime/batch_check.py); with int8_block32 activations too (each row
    quantised on its own, so B rows and one row compute the same products), and in a bf16 session on the same blocks
    (each row's fp32 sums as its single step's, so the same bf16 roundings)."""
    from tests.runtime import batch_check as BC

    monkeypatch.setenv("VXC_ENCODED", "1")
    ir = lowered_a8 if which == "a8" else lowered["llama"] / "m.vxir"
    BC.assert_batched(ir, MINI_LLAMA["vocab"], **({"dtype": torch.bfloat16} if which == "bf16" else {}))


# a Q5_K_M-style mix: q5_k in most matrices (the native q5_k decoders), q6_k where the mix keeps more bits
Q5_K_M = {"token_embd": "Q5_K", "attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
          "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q6_K"}


# the low-bit k-quants: q2_k and q3_k side by side in one file (Q2_K / Q3_K_M files mix them with q4_k..q6_k)
Q2_Q3 = {"token_embd": "Q3_K", "attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q3_K", "attn_output": "Q2_K",
         "ffn_gate": "Q2_K", "ffn_up": "Q3_K", "ffn_down": "Q3_K", "output": "Q6_K"}
# mix -> (encodings, the operands of each checked format, the file's seed: random weights whose greedy text does
# not loop on a few tokens)
# llama.cpp's IQ4 files: iq4_xs (256-value super-blocks), iq4_nl (its 32-value form, the fallback of rows that are
# not whole super-blocks)
IQ4 = {"token_embd": "IQ4_XS", "attn_q": "IQ4_NL", "attn_k": "IQ4_XS", "attn_v": "IQ4_XS", "attn_output": "IQ4_NL",
       "ffn_gate": "IQ4_NL", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_XS", "output": "Q6_K"}
# llama.cpp's IQ1 / IQ2 / IQ3 files: every grid format in one file (the embedding's rows and each product's)
GRID = {"token_embd": "IQ3_S", "attn_q": "IQ2_XXS", "attn_k": "IQ2_XS", "attn_v": "IQ3_XXS", "attn_output": "IQ2_S",
        "ffn_gate": "IQ1_S", "ffn_up": "IQ1_M", "ffn_down": "IQ3_S", "output": "Q6_K"}
# llama.cpp's TQ1_0 / TQ2_0 files: the ternary formats (q4_k embedding, q6_k head as its quantize tool writes them),
# both in one file
TERNARY = {"token_embd": "Q4_K", "attn_q": "TQ1_0", "attn_k": "TQ2_0", "attn_v": "TQ1_0", "attn_output": "TQ2_0",
           "ffn_gate": "TQ1_0", "ffn_up": "TQ2_0", "ffn_down": "TQ1_0", "output": "Q6_K"}
MIXES = {"q5_k_m": (Q5_K_M, {"q5_k": 1 + 5 * MINI_LLAMA["layers"]}, 29),
         "iq1+iq2+iq3": (GRID, {"iq3_s": 1 + MINI_LLAMA["layers"], **{e: MINI_LLAMA["layers"] for e in (
             "iq2_xxs", "iq2_xs", "iq3_xxs", "iq2_s", "iq1_s", "iq1_m")}}, 2),
         "q2_k+q3_k": (Q2_Q3, {"q3_k": 1 + 4 * MINI_LLAMA["layers"], "q2_k": 3 * MINI_LLAMA["layers"]}, 7),
         "iq4_nl+iq4_xs": (IQ4, {"iq4_xs": 1 + 4 * MINI_LLAMA["layers"], "iq4_nl": 3 * MINI_LLAMA["layers"]}, 3),
         "tq1_0+tq2_0": (TERNARY, {"tq1_0": 4 * MINI_LLAMA["layers"], "tq2_0": 3 * MINI_LLAMA["layers"]}, 5)}


@pytest.mark.parametrize("activations", ["fp32", "int8_block32"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_k_quant_mix_file_against_transformers(tmp_path, vxc_sub, capsys, monkeypatch, activations, mix):
    """q5_k (and q2_k / q3_k) read natively (qgemv, the int8 row kernel, the embedding's rows) on a Q5_K_M-style
    file (and one mixing q2_k and q3_k). fp32
    activations: at the floor of transformers on the same file, greedy identical, decode == prefill.
    int8_block32 is another numerical definition (each activation block rounded to int8): on this file its own
    torch twin is 1.72 from transformers' fp32 logits at a largest |logit| of 11.3 (q5_k's random blocks carry
    larger weights than the mixed file's), and two computations of it whose activations differ by a rounding
    (prefill and decode, native and twin) differ where a value lands in another int8 step (0.15-0.2 here). So
    the int8 run is held to: argmax agreement >= 95 % with transformers where its margin is clear, and the
    native kernels' logits within 5 % of the largest |logit| of the twin's with the same argmax at >= 95 % of
    positions (a wrong q5_k decode moves a weight by a whole 16 steps of its scale: far outside that). Each
    q5_k product alone is at the kernel floor of its twin in tests/codegen/test_qgemv_a8.py."""
    from vxc.codegen.kernels import quant

    encodings, counts, seed = MIXES[mix]
    assert set(counts) <= set(quant.NATIVE_ENCODINGS)
    monkeypatch.setenv("VXC_ENCODED", "1")
    write_llama_gguf(tmp_path / "m.gguf", MINI_LLAMA, encodings=encodings, seed=seed)
    extra = ("--activations", activations) if activations != "fp32" else ()
    r = vxc_sub("lower", tmp_path / "m.gguf", "-o", tmp_path / "m.vxir", *extra)
    assert r.exit_code == 0, r.stderr
    text = (tmp_path / "m.vxir").read_text()
    for enc, n in counts.items():
        assert text.count(f"= {enc}(blocks") == n, enc
    V = MINI_LLAMA["vocab"]
    f = P.Family(f"gguf-{mix}-{activations}", build=None, reference="hf", vocab=V, padded_vocab=V)
    from vxc.codegen import kernels

    kernels.reset_fallbacks()
    p = P.measure(f, tmp_path, tmp_path / "m.vxir", _reference(tmp_path, f))
    with capsys.disabled():
        print(f"\n{mix} ({activations}): {p.row()}")
    assert p.deterministic, p.row()
    # every kernel ran its native form, the 48-token prefill included (the grid formats' decoded-tile products once
    # handed on a transposed view, and every op after them fell back to its torch twin)
    assert kernels.fallbacks() == {}, kernels.fallbacks()
    if activations == "fp32":
        assert p.greedy_match and p.distinct >= P.MIN_DISTINCT, (p.greedy_vxc, p.greedy_ref)
        assert p.argmax == 1.0 and p.excluded < p.positions // 4, p.row()
        assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
        return
    assert p.argmax >= 0.95 and p.excluded < p.positions // 4, p.row()
    assert p.err > 20 * p.tol  # not the fp32 path
    from vxc.codegen.kernels import registry

    before = registry.get_backend()
    registry.set_backend("torch")
    try:
        twin = P.vxc_runs(P.engine_for(tmp_path / "m.vxir", max_context=256), P.prompt_ids(f), f.split, 2)[0]
    finally:
        registry.set_backend(before)
    V = MINI_LLAMA["vocab"]
    assert float((p.logits - twin).abs().max()) <= 0.05 * p.max_abs_logit
    assert float((p.logits[:, :V].argmax(-1) == twin[:, :V].argmax(-1)).double().mean()) >= 0.95
