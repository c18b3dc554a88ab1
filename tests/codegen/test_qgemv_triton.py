"""``vxc::qgemv``'s Triton implementation (``kernels/quant.py``): every ggml encoding of the table read straight from
their blocks, decoded in registers; a GEMV for few rows of x, a ``tl.dot`` GEMM from ``TRITON_DOT_FROM`` rows.

Under the CPU interpreter (each case re-runs itself in a fresh process with TRITON_INTERPRET=1 when triton was
imported without it, ``tests/triton_support.py``):

- the kernel against the fp32 twin and an fp64 oracle from gguf-py's decoding at the kernel floor, on awkward
  shapes (rows not a multiple of either tile, 1-5 blocks per row, B = 1, 3 on the GEMV and 17, 70 on the GEMM);
- its decoder bit for bit against ``gguf.quants.dequantize``, including blocks of random bytes whose f16 scales
  are subnormal, infinite or NaN; ``qembedding``'s Triton form against its twin; other encodings NotCovered;
- a GGUF llama miniature mixing every covered encoding (q4_k and q6_k on the 256-column projections), run end
  to end with every kernel on the Triton backend, at the floor of transformers loading the same file, with no
  fallback to a twin.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import quants as gq

from tests import references as R
from tests.codegen.test_qgemv import make_blocks, oracle, qtype
from tests.triton_support import triton_case as triton_case_for
from vxc.codegen import kernels
from vxc.codegen.kernels import qdense, quant
from vxc.codegen.kernels.triton_common import INTERPRETED
from vxc.ir.ggml import ENCODINGS, GRID_ENCODINGS

triton_case = triton_case_for(torch.cuda.is_available() or INTERPRETED)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
COVERED = tuple(quant.TRITON_ENCODINGS)
# (rows, blocks per row, B): GEMV tiles of 32 rows x 4 rows of x, GEMM tiles of 64 rows x 16..64 rows of x
SHAPES = ((37, 1, 1), (70, 3, 3), (5, 5, 17), (131, 2, 17), (33, 4, 70))
# every covered encoding in one file: the k-quants where a row is 256 values (attn_output: 4 heads x 64,
# ffn_down: ffn = 256), the 32-value formats elsewhere (d = 64)
CFG = {"vocab": 96, "d": 64, "ffn": 256, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 64, "eps": 1e-5,
       "theta": 10000.0, "context": 128}
FILE_ENCODINGS = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K",
                  "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q4_0",
                  "blk.1.attn_output": "Q5_K", "blk.1.ffn_down": "Q3_K", "blk.1.attn_q": "Q5_0",
                  "blk.1.attn_k": "Q5_1", "blk.2.ffn_down": "Q2_K", "blk.2.attn_output": "TQ1_0"}
# (only two matrices a layer have 256-value rows: tq2_0, the one covered encoding not in the file, shares tq1_0's path
# through the model and has its own decoder tested above at the kernel floor and bit for bit)
IN_FILE = tuple(e for e in COVERED if e != "tq2_0")


def _x(rng: np.random.Generator, B: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((B, cols)).astype(np.float32))


@triton_case
def test_triton_qgemv_at_the_floor():
    for name in COVERED:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        for rows, nblk, B in SHAPES:
            b = make_blocks(name, rows, nblk, rng)
            blocks, x = torch.from_numpy(b), _x(rng, B, nblk * ENCODINGS[name].block_size)
            got = quant.qgemv_triton(name, blocks.to(DEV), x.to(DEV)).cpu()
            assert got.dtype == torch.float32 and got.shape == (B, rows)
            R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x), oracle(name, b, x),
                                     f"triton {name} {rows}x{nblk} blocks B={B}")
            # int8_block32 activations: x as its int8 blocks' values, against the oracle from the definition
            from tests.codegen.test_qgemv_a8 import A8, oracle as oracle_a8

            got = quant.qgemv_triton(name, blocks.to(DEV), x.to(DEV), A8).cpu()
            R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x, A8), oracle_a8(name, b, x),
                                     f"triton {name} {rows}x{nblk} blocks B={B} {A8}")
        # bf16 x is widened exactly on load: the fp32 call's bits, on both paths
        for B in (3, 17):
            xb = _x(rng, B, 2 * ENCODINGS[name].block_size).to(torch.bfloat16).to(DEV)
            bl = torch.from_numpy(make_blocks(name, 37, 2, rng)).to(DEV)
            assert torch.equal(quant.qgemv_triton(name, bl, xb), quant.qgemv_triton(name, bl, xb.float())), (name, B)


def _random_bytes(name: str, rows: int, nblk: int, rng: np.random.Generator) -> np.ndarray:
    """Every byte random, the f16 scales included (subnormal, infinite and NaN scales among them), plus a few
    blocks whose scales are +-0 and the extremes of f16."""
    e = ENCODINGS[name]
    b = rng.integers(0, 256, size=(rows * nblk, e.type_size), dtype=np.uint8)
    at = 0
    for field, width in e.fields:
        if field.endswith(":f16"):
            special = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, np.inf], dtype=np.float16)
            b[:len(special), at:at + 2] = special.reshape(-1, 1).view(np.uint8)
        at += width
    return b.reshape(rows, nblk * e.type_size)


def _same_bits(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    want_t = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))
    nan = torch.isnan(want_t)
    assert torch.equal(torch.isnan(got), nan), what
    assert torch.equal(got[~nan].view(torch.int32), want_t[~nan].view(torch.int32)), what


@triton_case
def test_triton_decoder_bit_exact_and_qembedding():
    for name in COVERED:
        rng = np.random.default_rng(zlib.crc32(b"bits " + name.encode()))
        for b in (make_blocks(name, 37, 3, rng), _random_bytes(name, 19, 2, rng)):
            blocks = torch.from_numpy(b).to(DEV)
            _same_bits(quant.dequantize_triton(name, blocks).cpu(), gq.dequantize(b, qtype(name)), name)
        # the embedding's rows, gathered (repeats, the last row, out of order), bit for bit its twin's
        table = torch.from_numpy(make_blocks(name, 41, 2, rng))
        ids = torch.tensor([40, 0, 7, 7, 23, 1, 40, 5, 9, 12, 3, 31, 2, 8, 16, 39, 11, 22], dtype=torch.int64)
        got = qdense.qembedding_triton(ids.to(DEV), name, table.to(DEV)).cpu()
        assert torch.equal(got.view(torch.int32), qdense.qembedding_twin(ids, name, table).view(torch.int32)), name
    # an encoding without a Triton decoder (every one of the table has one now: one is taken out here):
    # NotCovered, and through the dispatcher the twin runs, recorded
    assert set(COVERED) == set(ENCODINGS) - {"iq4_nl", "iq4_xs", *GRID_ENCODINGS}  # (tq1_0 / tq2_0 included)
    _uncovered_runs_the_twin("iq4_nl", "iq4_xs", *GRID_ENCODINGS)
    saved = dict(quant.TRITON_ENCODINGS)
    del quant.TRITON_ENCODINGS["q3_k"]
    try:
        _uncovered_runs_the_twin("q3_k")
    finally:
        quant.TRITON_ENCODINGS.clear()
        quant.TRITON_ENCODINGS.update(saved)


def _uncovered_runs_the_twin(*names: str) -> None:
    for name in names:
        rng = np.random.default_rng(1)
        b = make_blocks(name, 5, 1, rng)
        blocks, x = torch.from_numpy(b), _x(rng, 2, ENCODINGS[name].block_size)
        with pytest.raises(kernels.NotCovered):
            quant.qgemv_triton(name, blocks, x)
        kernels.reset_fallbacks()
        with kernels.backend("triton"):
            y = torch.ops.vxc.qgemv(name, blocks.to(DEV), x.to(DEV)).cpu()
        if DEV == "cpu":  # the twin on the same backend: the same bits
            assert torch.equal(y, quant.qgemv_twin(name, blocks, x)), name
        else:  # the twin on CUDA (cuBLAS) against the CPU's: another GEMM, at the kernel floor (seen on an H200)
            R.assert_kernel_at_floor(y, quant.qgemv_twin(name, blocks, x), oracle(name, b, x), f"{name} twin on {DEV}")
        assert kernels.fallbacks() == {"qgemv": {"triton": {quant.TRITON_ENCODING: 1}}}, kernels.fallbacks()


@triton_case
def test_triton_qmoe_shared_at_the_floor():
    """The shared expert over blocks (Triton GEMVs), σ-gated per token, added to the routed sum."""
    rng = np.random.default_rng(zlib.crc32(b"qmoe_shared"))
    d, inter, B = 64, 96, 3
    names = ("q4_0", "q8_0", "q4_1")
    wg, wu = (make_blocks(n, inter, d // 32, rng) for n in names[:2])
    wd = make_blocks(names[2], d, inter // 32, rng)
    x, routed = _x(rng, B, d), _x(rng, B, d)
    bg = torch.from_numpy((rng.standard_normal((1, d)) * 0.2).astype(np.float32))
    args = (x, routed, names[0], torch.from_numpy(wg), names[1], torch.from_numpy(wu), names[2], torch.from_numpy(wd), bg)
    got = qdense.qmoe_shared_triton(*(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)).cpu()
    g, u = oracle(names[0], wg, x), oracle(names[1], wu, x)
    want = routed.double() + torch.sigmoid(x.double() @ bg.double().T) * oracle(names[2], wd, g * torch.sigmoid(g) * u)
    R.assert_kernel_at_floor(got, qdense.qmoe_shared_twin(*args), want, "triton qmoe_shared")


@triton_case
def test_triton_forms_in_a_bf16_session():
    """A bf16 session's encoded forms on Triton: x widened to fp32 (exact), the products and the gating summed in
    fp32, the gated h and the output rounded to bf16 — within a bf16 rounding of the twin's (GEMV and GEMM tiles);
    the gathered rows bit for bit the twin's."""
    rng = np.random.default_rng(zlib.crc32(b"bf16 session"))
    names = ("q4_k", "q8_0", "q6_k")
    wg, wu = (torch.from_numpy(make_blocks(n, 256, 256 // ENCODINGS[n].block_size, rng)) for n in names[:2])
    wd = torch.from_numpy(make_blocks(names[2], 70, 1, rng))
    bias = torch.from_numpy(rng.standard_normal(256).astype(np.float32)).to(torch.bfloat16)
    for B in (3, 17):
        x = _x(rng, B, 256).to(torch.bfloat16)
        dev = [a.to(DEV) for a in (x, wg, wu, wd, bias)]
        pairs = [(qdense.qlinear_triton(dev[0], names[0], dev[1], dev[4]), qdense.qlinear_twin(x, names[0], wg, bias)),
                 (qdense.qswiglu_triton(dev[0], names[0], dev[1], names[1], dev[2], names[2], dev[3]),
                  qdense.qswiglu_twin(x, names[0], wg, names[1], wu, names[2], wd))]
        for got, twin in pairs:
            assert got.dtype == twin.dtype == torch.bfloat16
            g, t = got.cpu().float(), twin.float()
            # one bf16 rounding of the output, and for qswiglu of h (an element of h on the other side of a bf16
            # step in one of the two moves the sum by its ulp times a weight): within 2^-7 of the largest value
            assert float((g - t).abs().max()) <= 2.0 ** -7 * float(t.abs().max()), float((g - t).abs().max())
    ids = torch.tensor([5, 0, 255, 5, 17], dtype=torch.int64)
    got = qdense.qembedding_triton(ids.to(DEV), names[1], wu.to(DEV), "bf16").cpu()
    assert got.dtype == torch.bfloat16 and torch.equal(got, qdense.qembedding_twin(ids, names[1], wu, "bf16"))


@triton_case
def test_gguf_miniature_end_to_end_on_triton(tmp_path, monkeypatch, vxc_sub):
    import transformers

    from tests.gguf_support import write_llama_gguf
    from tests.runtime import parity_table as P

    monkeypatch.setenv("VXC_ENCODED", "1")
    write_llama_gguf(tmp_path / "m.gguf", CFG, encodings=FILE_ENCODINGS, seed=5)
    r = vxc_sub("lower", tmp_path / "m.gguf", "-o", tmp_path / "m.vxir")
    assert r.exit_code == 0, r.stderr
    text = (tmp_path / "m.vxir").read_text()
    for enc in IN_FILE:
        assert f"= {enc}(blocks " in text, enc

    f = P.Family("gguf-triton", build=None, reference="hf", vocab=CFG["vocab"], padded_vocab=CFG["vocab"],
                 prompt_len=24, split=18)  # prefill of 24 (the tl.dot GEMM), then single-token steps (the GEMV)
    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    load = transformers.AutoModelForCausalLM.from_pretrained
    ref.m32 = load(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ref.m64 = load(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).double().eval()
    calls = {"qlinear": 0, "qswiglu": 0, "qembedding": 0}
    for k in calls:
        impls = kernels.KERNELS[k].impls
        fn = impls["triton"]
        monkeypatch.setitem(impls, "triton", lambda *a, _fn=fn, _k=k: (calls.__setitem__(_k, calls[_k] + 1), _fn(*a))[1])
    if DEV != "cpu":  # the engines on the GPU, their logits compared on the CPU (the harness builds CPU engines)
        engine_for, runs = P.engine_for, P.vxc_runs
        monkeypatch.setattr(P, "engine_for", lambda ir, **kw: engine_for(ir, device=DEV, **kw))
        monkeypatch.setattr(P, "vxc_runs", lambda *a: (lambda r: (r[0].cpu(), r[1].cpu(), r[2]))(runs(*a)))
    kernels.reset_fallbacks()
    with kernels.backend("triton"):
        p = P.measure(f, tmp_path, tmp_path / "m.vxir", ref, n_new=6)
    assert all(calls.values()), calls  # every encoded form ran its Triton implementation
    assert kernels.fallbacks() == {}, kernels.format_report()
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.greedy_match, (p.argmax, p.greedy_vxc, p.greedy_ref)
    assert p.deterministic, p.row()
