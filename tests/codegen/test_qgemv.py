"""``vxc::qgemv``: the GEMV read straight from ggml block-quantised weights (``kernels/quant.py``).

The native kernel (q8_0, q4_0, q4_1, q4_k, q6_k decoded in registers) and the torch twin (decode with
``vxc.runtime.ggml_blocks``, then an fp32 matmul) against an fp64 oracle: the weights decoded by gguf-py's own
``gguf.quants.dequantize`` (fp32 values, exact), widened to fp64, times x in fp64. Native is held within the
kernel's floor tolerance of both the twin and the oracle (``references.assert_kernel_at_floor``).

Blocks: the 32-value formats encoded by ``gguf.quants.quantize`` from random normal weights; the k-quants, which
gguf-py cannot encode, random bytes with their f16 scales set to realistic small values (both signs). Sizes are
awkward on purpose: rows not a multiple of the 4-row tile (37, 131, 3), 1-3 and 5 blocks per row, B = 1, 3 and
more rows of x than one register pass holds (5, 9).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from tests import references as R
from tests.gguf_support import put_f16_scales
from vxc.codegen import kernels
from vxc.codegen.kernels import native as N
from vxc.codegen.kernels import quant
from vxc.ir.ggml import ENCODINGS, GGMLError

NATIVE = list(quant.NATIVE_ENCODINGS)
ENCODERS = {"q8_0", "q4_0", "q4_1"}  # what gguf-py quantises (and the table covers)


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def make_blocks(name: str, rows: int, nblk: int, rng: np.random.Generator) -> np.ndarray:
    """u8 [rows, nblk * type_size]: a realistic ``rows x nblk * block_size`` weight in ``name``."""
    e = ENCODINGS[name]
    cols = nblk * e.block_size
    if name in ENCODERS:
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return np.ascontiguousarray(gq.quantize(w, qtype(name)))
    b = rng.integers(0, 256, size=(rows * nblk, e.type_size), dtype=np.uint8)
    put_f16_scales(name, b, lambda n: rng.standard_normal(n) * 2e-3)
    return b.reshape(rows, nblk * e.type_size)


def oracle(name: str, blocks: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """fp64 ``x Wᵀ`` with W decoded by gguf-py."""
    w = torch.from_numpy(np.ascontiguousarray(gq.dequantize(blocks, qtype(name)))).double()
    return x.double() @ w.T


def run_native(name: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The native implementation, asserting that it made the native call."""
    assert N.available(), N.status()
    rec = N.Recorder()
    with N.recording(rec):
        y = quant.qgemv_native(name, blocks, x)
    assert rec.failed is None, rec.failed
    assert [c for c, _ in rec.calls] == ["vxc_qgemv"], rec.calls
    return y


SHAPES = [(37, 1), (131, 3), (37, 2), (3, 5), (131, 5), (8, 1)]  # (rows, blocks per row)


@pytest.mark.native
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("rows, nblk", SHAPES)
@pytest.mark.parametrize("name", NATIVE)
def test_native_at_the_floor(name, rows, nblk, B):
    rng = np.random.default_rng(zlib.crc32(f"{name} {rows} {nblk} {B}".encode()))
    b = make_blocks(name, rows, nblk, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((B, nblk * ENCODINGS[name].block_size)).astype(np.float32))
    got = run_native(name, blocks, x)
    twin = quant.qgemv_twin(name, blocks, x)
    assert got.dtype == twin.dtype == torch.float32 and got.shape == twin.shape == (B, rows)
    R.assert_kernel_at_floor(got, twin, oracle(name, b, x), f"{name} {rows}x{nblk} blocks B={B}")


@pytest.mark.native
@pytest.mark.parametrize("B", [2, 4, 5, 9])
@pytest.mark.parametrize("name", NATIVE)
def test_more_rows_of_x_than_one_pass(name, B):
    """B past the register tile (4 rows of x per pass with AVX-512, 2 with AVX2): passes over the same tile."""
    rng = np.random.default_rng(B)
    b = make_blocks(name, 37, 2, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((B, 2 * ENCODINGS[name].block_size)).astype(np.float32))
    got = run_native(name, blocks, x)
    R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x), oracle(name, b, x), f"{name} B={B}")
    # each row of x alone gives the same bits: rows of x never interact
    for i in range(B):
        assert torch.equal(run_native(name, blocks, x[i:i + 1].contiguous())[0], got[i])


@pytest.mark.native
@pytest.mark.parametrize("name", NATIVE)
def test_bf16_activations(name):
    """bf16 x is widened exactly: the result is the fp32 call's, bit for bit."""
    rng = np.random.default_rng(7)
    blocks = torch.from_numpy(make_blocks(name, 37, 3, rng))
    x = torch.randn(3, 3 * ENCODINGS[name].block_size).to(torch.bfloat16)
    assert torch.equal(run_native(name, blocks, x), run_native(name, blocks, x.float()))


@pytest.mark.native
def test_extreme_scales():
    """f16 scales at the ends of the range (subnormal halves, ±65504, signed zeros) decode as gguf-py decodes
    them: native at the floor of the oracle."""
    rng = np.random.default_rng(3)
    extremes = np.array([2.0 ** -24, -(2.0 ** -24), 6.1e-5, 65504.0, -65504.0, 0.0, -0.0, 1e-3, -7.5], dtype=np.float16)
    for name in NATIVE:
        e = ENCODINGS[name]
        b = make_blocks(name, 37, 3, rng).reshape(-1, e.type_size).copy()
        put_f16_scales(name, b, lambda n: rng.choice(extremes, n))
        b = b.reshape(37, 3 * e.type_size)
        blocks = torch.from_numpy(b)
        x = torch.randn(2, 3 * e.block_size)
        R.assert_kernel_at_floor(run_native(name, blocks, x), quant.qgemv_twin(name, blocks, x),
                                 oracle(name, b, x), name)


@pytest.mark.native
@pytest.mark.parametrize("name", NATIVE)
def test_the_op_dispatches_to_native(name):
    rng = np.random.default_rng(11)
    blocks = torch.from_numpy(make_blocks(name, 131, 2, rng))
    x = torch.randn(1, 2 * ENCODINGS[name].block_size)
    kernels.reset_fallbacks()
    rec = N.Recorder()
    with N.recording(rec):
        y = torch.ops.vxc.qgemv(name, blocks, x)
    assert rec.failed is None and [c for c, _ in rec.calls] == ["vxc_qgemv"]
    assert kernels.fallbacks() == {}
    assert torch.equal(y, quant.qgemv_native(name, blocks, x))


def test_every_table_encoding_has_a_native_decoder():
    assert set(NATIVE) == set(ENCODINGS)


@pytest.mark.native
@pytest.mark.parametrize("name", ["q3_k", "q8_0"])
def test_an_encoding_without_a_native_decoder_runs_the_twin_visibly(name, monkeypatch):
    """An encoding the native table lacks (every one of ggml's table has a decoder now: one is taken out of it
    here) raises NotCovered, the twin runs, the fallback is counted."""
    monkeypatch.setattr(quant, "NATIVE_ENCODINGS", {k: v for k, v in quant.NATIVE_ENCODINGS.items() if k != name})
    rng = np.random.default_rng(5)
    e = ENCODINGS[name]
    b = rng.integers(0, 256, size=(6, 2 * e.type_size), dtype=np.uint8)
    put_f16_scales(name, b.reshape(-1, e.type_size), lambda n: np.full(n, 1e-3))  # finite f16 fields
    blocks, x = torch.from_numpy(b), torch.randn(2, 2 * e.block_size)
    with pytest.raises(kernels.NotCovered, match="native decoder"):
        quant.qgemv_native(name, blocks, x)
    kernels.reset_fallbacks()
    y = torch.ops.vxc.qgemv(name, blocks, x)
    assert kernels.fallbacks() == {"qgemv": {"native": {quant.ENCODING: 1}}}
    R.assert_kernel_at_floor(y, quant.qgemv_twin(name, blocks, x), oracle(name, b, x), name)
    kernels.reset_fallbacks()


@pytest.mark.native
def test_non_contiguous_blocks_are_not_covered():
    rng = np.random.default_rng(1)
    full = torch.from_numpy(make_blocks("q8_0", 8, 4, rng))
    blocks = full[:, :2 * 34]  # a column slice: rows not dense
    x = torch.randn(1, 64)
    with pytest.raises(kernels.NotCovered):
        quant.qgemv_native("q8_0", blocks, x)
    kernels.reset_fallbacks()
    torch.testing.assert_close(torch.ops.vxc.qgemv("q8_0", blocks, x), quant.qgemv_twin("q8_0", blocks.contiguous(), x))
    assert kernels.fallbacks() == {"qgemv": {"native": {N.OPERANDS: 1}}}
    kernels.reset_fallbacks()


@pytest.mark.parametrize("name", NATIVE)
def test_refusals_name_the_encoding(name):
    e = ENCODINGS[name]
    blocks = torch.zeros(4, 2 * e.type_size, dtype=torch.uint8)
    x = torch.randn(1, 2 * e.block_size)
    # a row of partial blocks
    with pytest.raises(GGMLError, match=f"{name}: a row of {2 * e.type_size + 1} bytes is not a whole number"):
        torch.ops.vxc.qgemv(name, torch.zeros(4, 2 * e.type_size + 1, dtype=torch.uint8), x)
    # whole blocks, but not x's columns
    with pytest.raises(GGMLError, match=f"{name}: blocks \\[4, {3 * e.type_size}\\] hold rows of {3 * e.block_size} values"):
        torch.ops.vxc.qgemv(name, torch.zeros(4, 3 * e.type_size, dtype=torch.uint8), x)
    with pytest.raises(GGMLError, match=f"{name}: qgemv's blocks must be uint8"):
        torch.ops.vxc.qgemv(name, blocks.to(torch.int8), x)
    with pytest.raises(GGMLError, match=f"{name}: qgemv's x must be a floating"):
        torch.ops.vxc.qgemv(name, blocks, x[0])
    assert isinstance(GGMLError(""), ValueError)


def test_unknown_encoding_is_refused():
    with pytest.raises(GGMLError, match="unknown ggml block encoding 'q9_0'"):
        torch.ops.vxc.qgemv("q9_0", torch.zeros(2, 34, dtype=torch.uint8), torch.randn(1, 32))


def test_twin_is_the_decoded_matmul():
    """The twin's weights are gguf-py's decoded values exactly (fp32), so the twin is one fp32 matmul of them."""
    rng = np.random.default_rng(2)
    for name in NATIVE:
        b = make_blocks(name, 5, 2, rng)
        x = torch.randn(3, 2 * ENCODINGS[name].block_size)
        w = torch.from_numpy(np.ascontiguousarray(gq.dequantize(b, qtype(name))))
        torch.testing.assert_close(quant.qgemv_twin(name, torch.from_numpy(b), x), x @ w.T, rtol=0, atol=0)


def test_empty_and_opcheck():
    from torch.library import opcheck

    blocks = torch.from_numpy(make_blocks("q4_0", 6, 2, np.random.default_rng(0)))
    x = torch.randn(2, 64)
    opcheck(torch.ops.vxc.qgemv.default, ("q4_0", blocks, x), test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.vxc.qgemv("q4_0", blocks[:0], x).shape == (2, 0)
    assert torch.ops.vxc.qgemv("q4_0", blocks, x[:0]).shape == (0, 6)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoded_forms_opcheck_in_the_session_dtype(dtype):
    """The encoded forms' fake (meta) outputs carry the dtype their implementations return — x's (qmoe_shared:
    routed's; qembedding: out_dtype) — in fp32 and bf16 sessions, so tracing a decode step (torch.compile) sees the
    real graph's dtypes."""
    from torch.library import opcheck

    ops = torch.ops.vxc
    utils = ("test_schema", "test_faketensor")
    rng = np.random.default_rng(3)
    g, u = (torch.from_numpy(make_blocks("q4_0", 96, 2, rng)) for _ in range(2))
    d = torch.from_numpy(make_blocks("q8_0", 64, 3, rng))
    x, routed, bias = torch.randn(3, 64, dtype=dtype), torch.randn(3, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    opcheck(ops.qlinear.default, (x, "q4_0", g, bias, "fp32"), test_utils=utils)
    opcheck(ops.qswiglu.default, (x, "q4_0", g, "q4_0", u, "q8_0", d, "fp32"), test_utils=utils)
    opcheck(ops.qmoe_shared.default, (x, routed, "q4_0", g, "q4_0", u, "q8_0", d, torch.randn(1, 64, dtype=dtype),
                                      "fp32"), test_utils=utils)
    name = "fp32" if dtype == torch.float32 else "bf16"
    opcheck(ops.qembedding.default, (torch.tensor([0, 5, 95]), "q4_0", g, name), test_utils=utils)
    assert ops.qlinear(x, "q4_0", g, bias, "fp32").dtype == ops.qembedding(torch.tensor([1]), "q4_0", g, name).dtype == dtype

FALLBACK_CHECK = r"""
import numpy as np, torch
from tests.codegen import test_qgemv as T
from vxc.codegen.kernels import native as N
assert N.available(), N.status()
for name in T.NATIVE:
    for rows, nblk, B in ((37, 3, 1), (131, 1, 3), (3, 5, 5)):
        rng = np.random.default_rng(rows * nblk * B)
        b = T.make_blocks(name, rows, nblk, rng)
        x = torch.from_numpy(rng.standard_normal((B, nblk * T.ENCODINGS[name].block_size)).astype(np.float32))
        blocks = torch.from_numpy(b)
        T.R.assert_kernel_at_floor(T.run_native(name, blocks, x), T.quant.qgemv_twin(name, blocks, x),
                                   T.oracle(name, b, x), name)
        # int8_block32 activations on this build's integer path (AVX2 maddubs / plain ints)
        from tests.codegen import test_qgemv_a8 as A
        T.R.assert_kernel_at_floor(A.run_native(name, blocks, x), T.quant.qgemv_twin(name, blocks, x, A.A8),
                                   A.oracle(name, b, x), name + " int8_block32")
print("ok")
"""


@pytest.mark.native
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-f16c"])
def test_fallback_builds(flags):
    """The AVX2 + FMA build and the scalar one (no F16C either: the portable half conversion) give the same
    results at the floor. Each builds the library once into the cache (a few seconds)."""
    if "avx512f" not in Path("/proc/cpuinfo").read_text() and flags == "-mno-avx512f":
        pytest.skip("this build is the default one here")
    env = dict(os.environ, VXC_NATIVE_CFLAGS=flags)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", FALLBACK_CHECK], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.native
@pytest.mark.parametrize("rows, nblk", [(37, 1), (131, 3), (3, 5)])
@pytest.mark.parametrize("name", NATIVE)
def test_native_decode_bit_exact(name, rows, nblk):
    """``vxc_qdequant`` (the prefill tiles' decoder, and the weights the GEMV forms in registers) gives every
    weight exactly as gguf-py's ``dequantize``, extreme f16 scales included."""
    rng = np.random.default_rng(zlib.crc32(f"decode {name} {rows} {nblk}".encode()))
    e = ENCODINGS[name]
    b = make_blocks(name, rows, nblk, rng).reshape(-1, e.type_size).copy()
    extremes = np.array([2.0 ** -24, -(2.0 ** -24), 6.1e-5, 65504.0, -65504.0, -0.0, 1e-3, -7.5], dtype=np.float16)
    put_f16_scales(name, b, lambda n: rng.choice(extremes, n), rng.random(b.shape[0]) < 0.3)
    b = b.reshape(rows, nblk * e.type_size)
    want = np.ascontiguousarray(gq.dequantize(b, qtype(name))).astype(np.float32)
    got = quant.dequantize_native(name, torch.from_numpy(b)).numpy()
    assert got.shape == want.shape
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{name}: {int((~same).sum())} weights differ from gguf-py's decode"
    # vxc_qdequant_bf16 (a bf16 prefill's tiles): gguf-py's value rounded to nearest-even by torch, bit for bit
    want16 = torch.from_numpy(want).to(torch.bfloat16)
    got16 = torch.full((rows, want.shape[1]), 7.0, dtype=torch.bfloat16)
    N.call(quant._QDEQUANT_BF16, quant.NATIVE_ENCODINGS[name], torch.from_numpy(b).data_ptr(), got16.data_ptr(), 0,
           rows, want.shape[1])
    same16 = (got16.view(torch.int16) == want16.view(torch.int16)) | (want16.isnan() & got16.isnan())
    assert bool(same16.all()), f"{name}: {int((~same16).sum())} bf16 weights differ from gguf-py's decode rounded"


@pytest.mark.native
@pytest.mark.parametrize("name", ["q4_0", "q4_k", "q6_k"])
def test_fp32_rows_at_the_floor_past_one_register_pass(name):
    """A prefill's many fp32 rows of x run in registers (never the tiled GEMM) and stay at the fp32 floor."""
    rng = np.random.default_rng(11)
    b = make_blocks(name, 21, 2, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((quant.TILED_FROM + 7, 2 * ENCODINGS[name].block_size)).astype(np.float32))
    got = run_native(name, blocks, x)
    R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x), oracle(name, b, x), f"{name} fp32 prefill")


@pytest.mark.native
def test_grid_formats_without_their_tables_decode_to_nan(tmp_path):
    """The grids reach the C library from gguf-py at its load (vxc_set_iq_tables). A second copy of the library that
    was never handed them (its own statics) decodes every grid weight to NaN — never to a silent wrong value — and
    says so (vxc_iq_ready); the loaded one holds them."""
    import ctypes
    import shutil

    assert N.available(), N.status()
    assert N.load().vxc_iq_ready() == 1
    copy = tmp_path / "bare.so"
    shutil.copy(N.load()._name, copy)
    bare = ctypes.CDLL(str(copy))
    assert bare.vxc_iq_ready() == 0
    rng = np.random.default_rng(3)
    for name in ("iq2_xxs", "iq3_s", "iq1_m"):
        blocks = torch.from_numpy(make_blocks(name, 3, 1, rng))
        out = torch.zeros(3, 256)
        bare.vxc_qdequant(quant.NATIVE_ENCODINGS[name], ctypes.c_void_p(blocks.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                          ctypes.c_long(0), ctypes.c_long(3), ctypes.c_long(256))
        assert torch.isnan(out).all(), name
        assert not torch.isnan(quant.dequantize_native(name, blocks)).any(), name


@pytest.mark.native
@pytest.mark.parametrize("grid, entry, value", [("iq3_s", 7, 17), ("iq2_xs", 300, 9), ("iq2_s", 1000, 42), ("iq2_xxs", 0, -8)])
def test_grid_tables_outside_their_packed_ranges_are_refused(tmp_path, grid, entry, value):
    """The integer row kernels hold the iq3_s grid as nibbles (values 1 .. 15) and the iq2 grids as 2-bit codes of
    8, 25, 43. A table with any other value there is refused whole (vxc_set_iq_tables returns -2) and the library
    stays without tables (its grid formats NaN), never packed into a silently different grid."""
    import ctypes
    import shutil

    assert N.available(), N.status()
    copy = tmp_path / "fresh.so"
    shutil.copy(N.load()._name, copy)
    lib = ctypes.CDLL(str(copy))
    names = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s")
    parts = [quant.grid_table(n).reshape(-1).clone() for n in names]
    width = 4 if grid.startswith("iq3") else 8
    parts[names.index(grid)][width * entry] = value
    blob = torch.cat(parts + [quant.ksigns_table().view(torch.int8)])
    assert lib.vxc_set_iq_tables(ctypes.c_void_p(blob.data_ptr()), ctypes.c_long(blob.numel())) == -2, grid
    assert lib.vxc_iq_ready() == 0
    good = torch.cat([quant.grid_table(n).reshape(-1) for n in names] + [quant.ksigns_table().view(torch.int8)])
    assert lib.vxc_set_iq_tables(ctypes.c_void_p(good.data_ptr()), ctypes.c_long(good.numel())) == 0
    assert lib.vxc_iq_ready() == 1
    # a refused hand-over changes nothing the library holds, even where its other tables are valid but different
    # (here every grid entry of the other formats moved by one): the products stay the loaded library's, bit for bit
    moved = [p.reshape(-1, 4 if n.startswith("iq3") else 8).roll(1, 0).reshape(-1) for n, p in zip(names, parts)]
    moved[names.index(grid)] = parts[names.index(grid)]
    bad = torch.cat(moved + [quant.ksigns_table().view(torch.int8)])
    assert lib.vxc_set_iq_tables(ctypes.c_void_p(bad.data_ptr()), ctypes.c_long(bad.numel())) == -2
    lib.vxc_qgemv_a8.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long,
                                 ctypes.c_long, ctypes.c_long, ctypes.c_int]
    rng = np.random.default_rng(5)
    for other in names:
        blocks = torch.from_numpy(make_blocks(other, 5, 2, rng))
        x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
        y = torch.empty(3, 5)
        lib.vxc_qgemv_a8(quant.NATIVE_ENCODINGS[other], blocks.data_ptr(), x.data_ptr(), y.data_ptr(), 5, 512, 3, 0)
        assert torch.equal(y, quant.qgemv_native(other, blocks, x, "int8_block32")), (grid, other)


@pytest.mark.native
@pytest.mark.parametrize("name", ["iq2_xs", "iq3_s", "iq1_m"])
@pytest.mark.parametrize("activations", ["fp32", "int8_block32"])
def test_grid_formats_prefill_in_decoded_tiles(name, activations):
    """The grid formats' fp32 path (no register GEMM) runs TILED_FROM rows of x and more as decoded fp32 tiles into
    torch's fp32 GEMM (under int8_block32 too where the build has no integer path: x first rounded to its int8
    blocks), at the floor of the twin and the fp64 oracle; below TILED_FROM rows, the row kernel."""
    assert N.available(), N.status()
    rng = np.random.default_rng(17)
    b = make_blocks(name, 21, 2, rng)
    blocks = torch.from_numpy(b)
    cols = 2 * ENCODINGS[name].block_size
    tiled = "vxc_qgemv_a8" if activations != "fp32" and quant._grid_a8() else "vxc_qdequant"
    for B, calls in ((quant.TILED_FROM + 7, [tiled]),
                     (quant.TILED_FROM - 1, ["vxc_qgemv_a8" if activations != "fp32" else "vxc_qgemv"])):
        x = torch.from_numpy(rng.standard_normal((B, cols)).astype(np.float32))
        rec = N.Recorder()
        with N.recording(rec):
            got = quant.qgemv_native(name, blocks, x, activations)
        assert [c for c, _ in rec.calls] == calls, rec.calls
        xo = quant.dequantize_activations(x) if activations != "fp32" else x
        R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x, activations), oracle(name, b, xo),
                                 f"{name} {activations} B={B}")


@pytest.mark.native
@pytest.mark.parametrize("nblk", [2, 3])
@pytest.mark.parametrize("name", ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"])
def test_grid_int8_gemm_at_the_floor(name, nblk):
    """Under int8_block32 an AVX-512 VNNI build runs 16 rows of x and more (a prefill, a large batch) through tiles of
    weight rows expanded once into signed int8 values against x transposed in tiles of 16 rows: the same exact
    integer sums per scale group as the one-row kernel, summed in floats per group rather than per four-value lane.
    At 37 weight rows (two whole 16-row tiles and a partial one) and 19 rows of x (a whole x tile and a padded
    one): at the floor of the twin and the fp64 oracle, and so is each row run alone (the row kernel), and rows 3 or 7
    at a time (its instances for up to 4 and up to 8 rows). Three
    super-blocks a row too: the iq2 grids' byte-plane expansion (VBMI builds) takes them in pairs, the last alone."""
    assert N.available(), N.status()
    if not quant._grid_a8():
        pytest.skip("this build has no integer path for the grid formats (AVX-512 VNNI only)")
    rng = np.random.default_rng(23 + nblk)
    b = make_blocks(name, 37, nblk, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((19, nblk * ENCODINGS[name].block_size)).astype(np.float32))
    twin = quant.qgemv_twin(name, blocks, x, "int8_block32")
    want = oracle(name, b, quant.dequantize_activations(x))
    R.assert_kernel_at_floor(quant.qgemv_native(name, blocks, x, "int8_block32"), twin, want, f"{name} int8 gemm")
    rows = torch.cat([quant.qgemv_native(name, blocks, x[i:i + 1].contiguous(), "int8_block32") for i in range(19)])
    R.assert_kernel_at_floor(rows, twin, want, f"{name} int8 rows alone")
    # a few rows of x at once (a batched decode step): the row kernels' instances for up to 4 rows and up to 8
    for n in (3, 7):
        some = torch.cat([quant.qgemv_native(name, blocks, x[i:i + n].contiguous(), "int8_block32") for i in range(0, 19, n)])
        R.assert_kernel_at_floor(some, twin, want, f"{name} int8 rows {n} at a time")


@pytest.mark.native
@pytest.mark.parametrize("name", ["q8_0", "q4_1", "q4_k"])
def test_bf16_prefill_tiles(name):
    """From TILED_FROM bf16 rows of x, tiles of rows are decoded (vxc_qdequant_bf16) and multiplied by torch's bf16
    GEMM. Against the fp64 product of the same x with the weights rounded to bf16 (what decoding at load
    gives): within one rounding of the result to bf16 (2^-8 relative, fp32 accumulation) plus an
    fp32-accumulation term."""
    assert N.available(), N.status()
    dtype = torch.bfloat16
    rng = np.random.default_rng(5)
    rows = 300  # five tiles of 64 rows (TILE_BYTES forced small below), the last partial
    b = make_blocks(name, rows, 3, rng)
    blocks = torch.from_numpy(b)
    cols = 3 * ENCODINGS[name].block_size
    x = torch.from_numpy(rng.standard_normal((quant.TILED_FROM + 3, cols)).astype(np.float32)).to(dtype)
    old = quant.TILE_BYTES
    quant.TILE_BYTES = 64 * cols * 2  # 64 bf16 rows a tile: five tiles, the last partial
    try:
        rec = N.Recorder()
        with N.recording(rec):
            got = quant.qgemv_native(name, blocks, x)
    finally:
        quant.TILE_BYTES = old
    assert [c for c, _ in rec.calls] == ["vxc_qdequant_bf16"] * 5, rec.calls
    assert rec.failed is not None  # a step with torch's GEMM in it is never replayed
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], rows)
    wh = torch.from_numpy(np.ascontiguousarray(gq.dequantize(b, qtype(name)))).to(dtype).double()
    exact = x.double() @ wh.T
    scale = x.double().abs() @ wh.abs().T
    rel = 2.0 ** -8
    err = (got.double() - exact).abs()
    bound = rel * exact.abs() + 1e-6 * scale + 1e-30
    assert bool((err <= bound).all()), f"{name} {dtype}: worst excess {float((err - bound).max()):.3e}"


# ------------------------------------------------------------------------------------- composite native forms
# qlinear / qswiglu / qembedding (kernels/qdense.py) as native calls only, so a decode step over encoded weights
# replays. Each against an fp64 oracle from gguf-py's decoded weights (silu in fp64) and the fp32 twin.


def _native_calls(fn, *args):
    assert N.available(), N.status()
    rec = N.Recorder()
    with N.recording(rec):
        y = fn(*args)
    assert rec.failed is None, rec.failed
    return y, [c for c, _ in rec.calls]


@pytest.mark.native
@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("B", [1, 3])
def test_qlinear_native_with_and_without_bias(name, B):
    from vxc.codegen.kernels import qdense

    rng = np.random.default_rng(zlib.crc32(f"ql{name}{B}".encode()))
    rows, nblk = 37, 2
    b = make_blocks(name, rows, nblk, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((B, nblk * ENCODINGS[name].block_size)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32))
    y, calls = _native_calls(qdense.qlinear_native, x, name, blocks, bias)
    assert calls == ["vxc_qgemv", "vxc_qbias"]
    R.assert_kernel_at_floor(y, qdense.qlinear_twin(x, name, blocks, bias), oracle(name, b, x) + bias.double(),
                             f"{name} qlinear+bias")
    y0, calls0 = _native_calls(qdense.qlinear_native, x, name, blocks, None)
    assert calls0 == ["vxc_qgemv"]
    R.assert_kernel_at_floor(y0, qdense.qlinear_twin(x, name, blocks, None), oracle(name, b, x), f"{name} qlinear")


@pytest.mark.native
@pytest.mark.parametrize("names", [("q4_k", "q4_k", "q6_k"), ("q8_0", "q4_0", "q4_1")])
@pytest.mark.parametrize("B", [1, 2])
def test_qswiglu_native(names, B):
    from vxc.codegen.kernels import qdense

    g_enc, u_enc, d_enc = names
    rng = np.random.default_rng(zlib.crc32(f"qs{names}{B}".encode()))
    d, inter = 256, 512  # rows a multiple of 256 for the k-quants' blocks in both directions
    wg, wu = make_blocks(g_enc, inter, d // ENCODINGS[g_enc].block_size, rng), make_blocks(u_enc, inter, d // ENCODINGS[u_enc].block_size, rng)
    wd = make_blocks(d_enc, d, inter // ENCODINGS[d_enc].block_size, rng)
    x = torch.from_numpy(rng.standard_normal((B, d)).astype(np.float32))
    args = (x, g_enc, torch.from_numpy(wg), u_enc, torch.from_numpy(wu), d_enc, torch.from_numpy(wd))
    y, calls = _native_calls(qdense.qswiglu_native, *args)
    assert calls == ["vxc_qgemv", "vxc_qgemv", "vxc_qsilu_mul", "vxc_qgemv"]
    g, u = oracle(g_enc, wg, x), oracle(u_enc, wu, x)
    h = g * torch.sigmoid(g) * u
    R.assert_kernel_at_floor(y, qdense.qswiglu_twin(*args), oracle(d_enc, wd, h), f"{names} qswiglu")


@pytest.mark.native
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("B", [1, 3])
def test_qmoe_shared_native(gated, B):
    """A shared expert over blocks added to the routed sum, scaled by σ(x·branch gate) per token (or not)."""
    from vxc.codegen.kernels import qdense

    names = ("q4_0", "q8_0", "q4_k")
    rng = np.random.default_rng(zlib.crc32(f"qsh{gated}{B}".encode()))
    d, inter = 256, 512
    wg, wu = (make_blocks(n, inter, d // ENCODINGS[n].block_size, rng) for n in names[:2])
    wd = make_blocks(names[2], d, inter // ENCODINGS[names[2]].block_size, rng)
    x = torch.from_numpy(rng.standard_normal((B, d)).astype(np.float32))
    routed = torch.from_numpy(rng.standard_normal((B, d)).astype(np.float32))
    bg = torch.from_numpy((rng.standard_normal((1, d)) * 0.2).astype(np.float32)) if gated else None
    args = (x, routed, names[0], torch.from_numpy(wg), names[1], torch.from_numpy(wu), names[2], torch.from_numpy(wd), bg)
    y, calls = _native_calls(qdense.qmoe_shared_native, *args)
    assert calls == ["vxc_qgemv", "vxc_qgemv", "vxc_qsilu_mul", "vxc_qgemv", "vxc_shared_add"]
    g, u = oracle(names[0], wg, x), oracle(names[1], wu, x)
    h = oracle(names[2], wd, g * torch.sigmoid(g) * u)
    s = torch.sigmoid(x.double() @ bg.double().T) if gated else torch.ones(B, 1, dtype=torch.float64)
    want = routed.double() + s * h
    R.assert_kernel_at_floor(y, qdense.qmoe_shared_twin(*args), want, f"qmoe_shared gated={gated}")
    if gated:  # the gate is applied: without it the result is far off
        assert (y.double() - (routed.double() + h)).abs().max() > 1e-2


@pytest.mark.native
@pytest.mark.parametrize("name", NATIVE)
def test_qembedding_native_is_bit_exact(name):
    """The gathered rows decoded in C equal gguf-py's decoding of those rows bit for bit (first, last, repeats)."""
    from vxc.codegen.kernels import qdense

    rng = np.random.default_rng(zlib.crc32(f"qe{name}".encode()))
    b = make_blocks(name, 41, 2, rng)
    ids = torch.tensor([0, 40, 7, 7, 19], dtype=torch.int64)
    y, calls = _native_calls(qdense.qembedding_native, ids, name, torch.from_numpy(b))
    assert calls == ["vxc_qembedding"]
    want = torch.from_numpy(np.ascontiguousarray(gq.dequantize(b[ids.numpy()], qtype(name)))).float()
    assert torch.equal(y, want) and torch.equal(y.view(torch.int32), want.view(torch.int32))


@pytest.mark.native
@pytest.mark.parametrize("name", ["iq3_s", "iq2_xs", "iq1_m"])
def test_grid_prefill_tiles_feed_bias_and_gating(name):
    """qgemv's decoded-tile path (the grid formats with fp32 activations, TILED_FROM rows of x and more) returns
    ``[B, rows]`` row-major as its other paths do: qlinear adds its bias and qswiglu multiplies silu(gate) by up on
    that memory in native calls. (A transposed view there once summed the wrong elements from a 32-token prompt on:
    qswiglu's relative error ~1.4, a qwen2-style bias added across rows.) Against fp64 oracles of both ops, and the
    rows past TILED_FROM equal to the same rows run below it, within the floor."""
    from vxc.codegen.kernels import qdense

    assert N.available(), N.status()
    rng = np.random.default_rng(41)
    cols = ENCODINGS[name].block_size  # one 256-value super-block a row
    g, u, d = (make_blocks(name, r, 1, rng) for r in (cols, cols, 24))  # gate / up [256, 256], down [24, 256]
    gt, ut, dt = (torch.from_numpy(a) for a in (g, u, d))
    bias = torch.from_numpy(rng.standard_normal(cols).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((quant.TILED_FROM + 5, cols)).astype(np.float32))
    xd = x.double()
    wg, wu, wd = (torch.from_numpy(np.ascontiguousarray(gq.dequantize(a, qtype(name)))).double() for a in (g, u, d))
    want_lin = xd @ wg.T + bias.double()
    want_ffn = (torch.nn.functional.silu(xd @ wg.T) * (xd @ wu.T)) @ wd.T
    lin = qdense.qlinear_native(x, name, gt, bias)
    ffn = qdense.qswiglu_native(x, name, gt, name, ut, name, dt)
    assert lin.is_contiguous() and ffn.is_contiguous()
    R.assert_kernel_at_floor(lin, qdense.qlinear_twin(x, name, gt, bias), want_lin, f"{name} qlinear + bias, tiles")
    R.assert_kernel_at_floor(ffn, qdense.qswiglu_twin(x, name, gt, name, ut, name, dt), want_ffn, f"{name} qswiglu, tiles")
    few = x[:5].contiguous()  # below TILED_FROM: the row kernel
    R.assert_kernel_at_floor(qdense.qswiglu_native(few, name, gt, name, ut, name, dt), ffn[:5], want_ffn[:5],
                             f"{name} qswiglu, row kernel against tiles")
