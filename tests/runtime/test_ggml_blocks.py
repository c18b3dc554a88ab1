"""ggml block formats (vxc.ir.ggml's table, vxc.runtime.ggml_blocks' codecs) against the ``gguf`` package's
reference (``gguf.constants``, ``gguf.quants``): the table's sizes and ids, fp32 decodes equal bit for bit,
encodes equal byte for byte, round trips within bounds derived from the formats, and the refusals."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import vxc.ir.ggml as G
from tests.gguf_support import put_f16_scales
from vxc.ir.ggml import ENCODINGS, GRID_ENCODINGS, GGMLError, logical_cols, row_bytes
from vxc.runtime.ggml_blocks import DEQUANTIZE, QUANTIZE, dequantize, quantize

ALL = sorted(ENCODINGS)
# ggml's reference encoders; gguf-py has none (tests/ggml_quant_check.py: llama.cpp)
K_ENCODES = ["q4_k", "q5_k", "q6_k", "q2_k", "q3_k"]
T_ENCODES = ["tq1_0", "tq2_0"]  # the ternary formats (256-value blocks; gguf-py encodes them)
I_ENCODES = ["iq4_nl", "iq4_xs"]  # ggml's searched non-linear 4-bit formats (gguf-py has no encoder for them)
ENCODES = sorted(set(QUANTIZE) - set(K_ENCODES) - set(T_ENCODES) - set(I_ENCODES))  # byte-exact with gguf.quants


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType(ENCODINGS[name].ggml_type)


def ref_dequantize(name: str, b: np.ndarray) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(b, qtype(name))))


def ref_quantize(name: str, x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # an f16 scale overflowing to inf is part of what is compared
        return gguf.quants.quantize(x, qtype(name))


def same_floats(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit on every non-NaN value (so -0.0 != +0.0), NaN exactly where the reference has NaN."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = torch.isnan(want)
    if not torch.equal(nan, torch.isnan(got)):
        return False
    g, w = got[~nan], want[~nan]
    return torch.equal(g.view(torch.int32), w.view(torch.int32))


# ---------------------------------------------------------------------------------------------- the table
def test_table_matches_gguf_constants():
    assert {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k"} <= set(ENCODINGS)
    for name, e in ENCODINGS.items():
        t = GGMLQuantizationType(e.ggml_type)
        assert t.name.lower() == name == e.name
        assert GGML_QUANT_SIZES[t] == (e.block_size, e.type_size), name
        assert sum(w for _, w in e.fields) == e.type_size
    assert set(DEQUANTIZE) == set(ENCODINGS)
    # every format but the grid i-quants, whose ggml encoders search a grid against an importance matrix (gguf-py
    # has none either): they are read, not written; iq4_nl / iq4_xs are written as llama-quantize writes them
    # without an importance matrix
    assert set(QUANTIZE) == set(ENCODINGS) - set(GRID_ENCODINGS)
    assert {"iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"} == set(GRID_ENCODINGS)


def test_ir_table_imports_neither_torch_nor_numpy():
    tree = ast.parse(Path(G.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert names <= {"__future__", "dataclasses"}, names


@pytest.mark.parametrize("name", ALL)
def test_row_bytes_and_logical_cols(name):
    e = ENCODINGS[name]
    for k in (0, 1, 3, 11):
        assert row_bytes(name, k * e.block_size) == k * e.type_size
        assert logical_cols(name, k * e.type_size) == k * e.block_size
    with pytest.raises(ValueError, match=name):
        row_bytes(name, e.block_size + 16)
    with pytest.raises(ValueError, match=name):
        logical_cols(name, e.type_size + 1)
    with pytest.raises(GGMLError, match=name):  # a VxcError too: a user-facing refusal
        row_bytes(name, -e.block_size)
    with pytest.raises(GGMLError, match=name):
        logical_cols(name, 2.0 * e.type_size)


def test_unknown_encodings_are_refused_by_name():
    for bad in ("q8_1", "Q4_K", "mxfp4", ""):
        for f in (lambda: row_bytes(bad, 256), lambda: logical_cols(bad, 144)):
            with pytest.raises(ValueError, match="unknown ggml block encoding"):
                f()
    with pytest.raises(GGMLError, match="q8_1"):
        dequantize("q8_1", torch.zeros(2, 36, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- decoding
# f16 scale values that stress the arithmetic: subnormal halves, the largest half, signed zeros, negatives
EXTREMES = np.array([2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -20, 6.1e-5, 6.0e4, 65504.0, -65504.0, 0.0, -0.0,
                     -1.0, -0.0123, 1e-3, 7.5, 300.0], dtype=np.float16)


def random_blocks(name: str, shape: tuple[int, ...], scales: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``shape`` (``[..., rows, row_bytes]``) with the f16 scale fields set per ``scales``:
    "normal" (random normal, finite), "extreme" (drawn from EXTREMES and random normals), or "raw" (left
    random: some are inf / NaN)."""
    e = ENCODINGS[name]
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if scales == "raw":
        return b
    blocks = b.reshape(-1, e.type_size)

    def draw(n: int) -> np.ndarray:
        v = (rng.standard_normal(n) * rng.choice([1e-3, 0.05, 1.0, 30.0], n)).astype(np.float16)
        if scales == "extreme":
            v = np.where(rng.random(n) < 0.7, rng.choice(EXTREMES, n), v).astype(np.float16)
        return v

    put_f16_scales(name, blocks, draw)
    return blocks.reshape(shape)


def shapes(name: str) -> list[tuple[int, ...]]:
    ts = ENCODINGS[name].type_size
    return [(1, ts), (5, 3 * ts), (3, 4, 2 * ts), (2, 3, 2, ts), (ts,)]


@pytest.mark.parametrize("scales", ["normal", "extreme", "raw"])
@pytest.mark.parametrize("name", ALL)
def test_dequantize_is_bit_exact_with_gguf(name, scales):
    rng = np.random.default_rng([ALL.index(name), len(scales)])
    for shape in shapes(name):
        b = random_blocks(name, shape, scales, rng)
        got = dequantize(name, torch.from_numpy(b))
        want = ref_dequantize(name, b)
        assert got.shape == (*shape[:-1], shape[-1] // ENCODINGS[name].type_size * ENCODINGS[name].block_size)
        assert same_floats(got, want), (name, scales, shape)
        if scales != "raw":
            assert not torch.isnan(got).any()


@pytest.mark.parametrize("name", ALL)
def test_dequantize_a_bank_of_many_blocks_and_non_contiguous_views(name):
    e = ENCODINGS[name]
    rng = np.random.default_rng(100 + ALL.index(name))
    bank = random_blocks(name, (4, 24, 6 * e.type_size), "extreme", rng)  # [E, rows, row_bytes]
    t = torch.from_numpy(bank)
    want = ref_dequantize(name, bank)
    assert same_floats(dequantize(name, t), want)
    # every other row of every other expert, and a row range cut at block boundaries: strided inputs
    assert same_floats(dequantize(name, t[::2, 1::3]), want[::2, 1::3].contiguous())
    cut = t[:, :, e.type_size:4 * e.type_size]
    assert not cut.is_contiguous()
    assert same_floats(dequantize(name, cut), want[:, :, e.block_size:4 * e.block_size].contiguous())


@pytest.mark.parametrize("name", ALL)
def test_dequantize_dtype_empty_and_refusals(name):
    e = ENCODINGS[name]
    rng = np.random.default_rng(7)
    b = torch.from_numpy(random_blocks(name, (3, 2 * e.type_size), "normal", rng))
    f32 = dequantize(name, b)
    assert f32.dtype == torch.float32
    assert torch.equal(dequantize(name, b, torch.bfloat16), f32.to(torch.bfloat16))
    assert dequantize(name, torch.zeros(0, e.type_size, dtype=torch.uint8)).shape == (0, e.block_size)
    assert dequantize(name, torch.zeros(4, 0, dtype=torch.uint8)).shape == (4, 0)
    with pytest.raises(ValueError, match=name):
        dequantize(name, torch.zeros(3, e.type_size + 2, dtype=torch.uint8))
    with pytest.raises(GGMLError, match="uint8"):
        dequantize(name, torch.zeros(3, e.type_size, dtype=torch.int8))
    with pytest.raises(GGMLError, match="0-d"):
        dequantize(name, torch.tensor(3, dtype=torch.uint8))


def test_dequantize_known_values():
    """Hand-built blocks, decoded from the layouts as documented (not from the reference)."""
    one, half = np.float16(1.0).tobytes(), np.float16(0.5).tobytes()
    q8 = torch.tensor(list(one + bytes(range(0, 64, 2))), dtype=torch.uint8)
    assert dequantize("q8_0", q8).tolist() == [float(v) for v in range(0, 64, 2)]
    # q4_0: byte j holds element j (low nibble) and element j+16 (high nibble); value d * (nibble - 8)
    q4 = torch.tensor(list(half + bytes([0x0F | 0x80] * 16)), dtype=torch.uint8)
    assert dequantize("q4_0", q4).tolist() == [3.5] * 16 + [0.0] * 16
    # q4_1: d * nibble + m
    q41 = torch.tensor(list(half + np.float16(-2.0).tobytes() + bytes([0x3A] * 16)), dtype=torch.uint8)
    assert dequantize("q4_1", q41).tolist() == [3.0] * 16 + [-0.5] * 16
    # q5_0: bit i of the 32-bit qh is element i's fifth bit
    qh = (1 << 0 | 1 << 17).to_bytes(4, "little")
    q5 = torch.tensor(list(one + qh + bytes([0x00] * 16)), dtype=torch.uint8)
    want = [-16.0] * 32
    want[0], want[17] = 0.0, 0.0
    assert dequantize("q5_0", q5).tolist() == want


def test_grid_formats_known_values():
    """Hand-built i-quant blocks against ggml-common.h's first grid entries (iq2xxs_grid[0] = 0x0808080808080808,
    iq3s_grid[0] = 0x01010101, iq1s_grid[0] = all -1, ksigns_iq2xs[1] = 0x81), not against the reference."""
    one = list(np.float16(1.0).tobytes())
    # iq2_xxs: all-zero codes -> grid entry 0 (eight 8s) times (1 * (0.5 + 0)) * 0.25 = 1.0
    b = torch.tensor(one + [0] * 64, dtype=torch.uint8)
    assert dequantize("iq2_xxs", b).tolist() == [1.0] * 256
    # group 0's second u32: scale 3 (top 4 bits), sign index 1 for its first 8 values (values 0 and 7 negative)
    aux = (3 << 28) | 1
    b = torch.tensor(one + [0] * 4 + list(aux.to_bytes(4, "little")) + [0] * 56, dtype=torch.uint8)
    want = [7.0] * 32 + [1.0] * 224
    want[0] = want[7] = -7.0
    assert dequantize("iq2_xxs", b).tolist() == want
    # iq3_s: grid entry 0 (four 1s) times d (1 + 2 * 0); sign bit 0 of byte 0 negates value 0; scale nibble 1 -> 3
    b = torch.tensor(one + [0] * 64 + [0] * 8 + [1] + [0] * 31 + [0x10, 0, 0, 0], dtype=torch.uint8)
    want = [1.0] * 32 + [3.0] * 32 + [1.0] * 192
    want[0] = -1.0
    assert dequantize("iq3_s", b).tolist() == want
    # iq1_s: grid entry 0 (eight -1) plus delta +0.125 times d (2 * 0 + 1); qh bit 15 makes group 1's delta -0.125
    b = torch.tensor(one + [0] * 32 + [0, 0, 0, 0x80] + [0] * 12, dtype=torch.uint8)
    assert dequantize("iq1_s", b).tolist() == [-0.875] * 32 + [-1.125] * 32 + [-0.875] * 192


# ---------------------------------------------------------------------------------------------- encoding
def inputs(rng: np.random.Generator, lead: tuple[int, ...], cols: int) -> dict[str, np.ndarray]:
    shape = (*lead, cols)
    normal = rng.standard_normal(shape).astype(np.float32)
    outliers = normal.copy()
    mask = rng.random(shape) < 0.03
    outliers[mask] *= 100
    zeros = normal.copy()
    zeros[..., 0, :] = 0.0
    zeros[..., 1, ::3] = -0.0  # signed zeros: the reference's d keeps the sign of the chosen maximum
    zeros[..., 1, 1::3] = 0.0
    zeros[..., 1, 2::3] = -0.0
    const = normal.copy()
    const[..., 0, :] = 0.75
    const[..., 1, :] = -3.25
    huge = normal.copy()
    huge[..., 0, 5] = 1e4
    huge[..., 1, 7] = -6.0e4
    ties = normal.copy()  # +a and -a both the absolute maximum: the first one wins (argmax)
    ties[..., 0, 3], ties[..., 0, 9] = 4.0, -4.0
    ties[..., 1, 3], ties[..., 1, 9] = -4.0, 4.0
    scaled = normal * np.float32(1e-3)
    tiny = normal * np.float32(1e-20)  # the f16 scale underflows to zero
    beyond = normal * np.float32(1e6)  # the f16 scale overflows to inf
    subnormal = normal * np.float32(1e-39)  # fp32 subnormals: 1 / d overflows, x * inf is cast to code 0
    zeros_pos = np.abs(normal)  # a zero minimum held by both +0.0 and -0.0, a positive maximum
    zeros_pos[..., ::4] = 0.0
    zeros_pos[..., 2::4] = -0.0
    halves = (rng.integers(-16, 16, shape) * 0.5).astype(np.float32)  # exact ties under the rounding
    return dict(normal=normal, outliers=outliers, zeros=zeros, const=const, huge=huge, ties=ties, scaled=scaled,
                tiny=tiny, beyond=beyond, subnormal=subnormal, halves=halves, zeros_pos=zeros_pos, allzero=np.zeros(shape, np.float32),
                negzero=np.full(shape, -0.0, np.float32))


def with_ggml_zero_signs(name: str, x: np.ndarray, want: np.ndarray) -> np.ndarray:
    """gguf-py's q4_1 / q5_1 bytes with a zero ``d`` / ``m`` given the sign ggml's first-occurrence min / max
    give it. numpy's ``min`` / ``max`` pick among +0.0 and -0.0 by SIMD lane order, so gguf-py's sign bit
    there is an accident of the machine; every other bit must match as it is."""
    if name not in ("q4_1", "q5_1"):
        return want
    levels = 15 if name == "q4_1" else 31
    ts = ENCODINGS[name].type_size
    w = want.reshape(-1, ts).copy()
    b = x.reshape(-1, 32)
    mn = np.take_along_axis(b, b.argmin(axis=1)[:, None], axis=1)
    mx = np.take_along_axis(b, b.argmax(axis=1)[:, None], axis=1)
    for at, value in ((0, (mx - mn) / np.float32(levels)), (2, mn)):
        cur = np.ascontiguousarray(w[:, at:at + 2]).view(np.float16)
        with np.errstate(over="ignore"):
            new = value.astype(np.float16)
        zero = cur == 0
        assert np.array_equal(new == 0, zero), "only the sign of a zero field may differ"
        w[:, at:at + 2] = np.where(zero, new, cur).view(np.uint8)
    return w.reshape(want.shape)


def test_signed_zero_rules():
    """The corners where the references' zero signs are pinned down here (ggml-quants.c / gguf-py)."""
    z = torch.zeros(1, 32)
    neg_first = z.clone()
    neg_first[0, 0] = -0.0
    pos_first = -z.clone()
    pos_first[0, 0] = 0.0
    for name in ("q4_1", "q5_1"):  # first-occurrence min and max: both x[0] here, so d = +0.0, m = x[0]
        assert quantize(name, neg_first)[0, :4].tolist() == [0, 0, 0, 0x80]
        assert quantize(name, pos_first)[0, :4].tolist() == [0, 0, 0, 0]
    for name in ("q4_0", "q5_0"):  # gguf-py: d = -(first element of largest magnitude) / 8
        assert quantize(name, neg_first)[0, :2].tolist() == [0, 0]
        assert quantize(name, pos_first)[0, :2].tolist() == [0, 0x80]
        for x in (neg_first, pos_first):
            assert np.array_equal(quantize(name, x).numpy(), ref_quantize(name, x.numpy()))


@pytest.mark.parametrize("name", ENCODES)
def test_quantize_is_byte_exact_with_gguf(name):
    rng = np.random.default_rng(200 + ENCODES.index(name))
    for lead in ((2,), (5, 3), (2, 3, 4)):
        for kind, x in inputs(rng, (*lead[:-1], max(lead[-1], 2)), 4 * 32).items():
            got = quantize(name, torch.from_numpy(x))
            want = with_ggml_zero_signs(name, x, ref_quantize(name, x))
            assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape
            assert np.array_equal(got.numpy(), want), (name, kind, lead)


@pytest.mark.parametrize("name", T_ENCODES)
def test_ternary_quantize_is_byte_exact_with_gguf_and_within_its_bound(name):
    """tq1_0 / tq2_0 encode as gguf-py's encoders do (d the block's absolute maximum, values -d, 0, d); the
    round trip errs by at most half a step (d / 2) plus the f16 rounding of d."""
    rng = np.random.default_rng(250 + T_ENCODES.index(name))
    for lead in ((2,), (5, 3)):
        for kind, x in inputs(rng, (*lead[:-1], max(lead[-1], 2)), 2 * 256).items():
            got = quantize(name, torch.from_numpy(x))
            assert np.array_equal(got.numpy(), ref_quantize(name, x)), (name, kind, lead)
            if kind == "beyond":
                continue
            back = dequantize(name, got).double().numpy().reshape(-1, 256)
            b = x.astype(np.float64).reshape(-1, 256)
            amax = np.abs(b).max(axis=1, keepdims=True)
            bound = amax / 2 + _f16_err(amax) + amax * 1e-6 + 1e-30
            err = np.abs(back - b)
            assert (err <= bound).all(), (name, kind, float((err - bound).max()))
            if kind == "normal":  # the codes are -1, 0 and 1, each taken
                codes = np.rint(np.where(amax > 0, back / np.where(amax > 0, np.abs(back).max(axis=1, keepdims=True), 1), 0))
                assert set(np.unique(codes).tolist()) == {-1.0, 0.0, 1.0}
    # a block holding exactly -d, 0 and d (and d / 2, which rounds away from zero) comes back exactly
    x = torch.tensor([[2.0, -2.0, 0.0, 1.0, -1.0] + [0.0] * 251])
    assert dequantize(name, quantize(name, x)).tolist()[0][:5] == [2.0, -2.0, 0.0, 2.0, -2.0]


@pytest.mark.parametrize("name", I_ENCODES)
def test_iq4_encoders_round_trip(name):
    """iq4_nl / iq4_xs: every decoded value is a level times its group's scale, the error is that of the nearest
    level under the searched scale (RMS within 9 % of the values' on normal inputs, where a 16-level grid gives ~7 %),
    and an all-zero group decodes to zeros."""
    rng = np.random.default_rng(260 + I_ENCODES.index(name))
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1, :32] = 0.0
    b = quantize(name, torch.from_numpy(x))
    back = dequantize(name, b).double().numpy()
    assert np.array_equal(back[1, :32], np.zeros(32))
    err = np.sqrt(((back - x) ** 2).mean()) / np.sqrt((x.astype(np.float64) ** 2).mean())
    assert 0.03 < err < 0.09, err


def _f16_err(v: np.ndarray) -> np.ndarray:
    """Bound on |v - f16(v)| for |v| <= 65504: half an ulp (2^-11 relative, 2^-25 for subnormal halves)."""
    return np.maximum(np.abs(v) * 2.0 ** -11, 2.0 ** -25)


def roundtrip_bound(name: str, x: np.ndarray) -> np.ndarray:
    """Per-element bound on |x - dequantize(quantize(x))|, from the format's definition (in float64): half a
    step, plus the error of storing the scale (and min) as f16, plus what the symmetric formats' clip of the
    top code costs the value opposite the maximum, plus a few fp32 ulps of the block's magnitude."""
    b = x.astype(np.float64).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    slack = amax * 1e-6 + 1e-30
    if name == "q8_0":
        d = amax / 127
        bound = d / 2 + 127 * _f16_err(d)
    elif name in ("q4_0", "q5_0"):
        half = 8 if name == "q4_0" else 16
        mx = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
        d = mx / -half
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(d == 0, 0.0, b / d)
        bound = np.abs(d) / 2 + np.maximum(0.0, s - (half - 0.5)) * np.abs(d) + half * _f16_err(d)
    else:
        levels = 15 if name == "q4_1" else 31
        mn = b.min(axis=1, keepdims=True)
        d = (b.max(axis=1, keepdims=True) - mn) / levels
        bound = d / 2 + levels * _f16_err(d) + _f16_err(mn)
    return np.broadcast_to(bound + slack, b.shape).reshape(x.shape)


@pytest.mark.parametrize("name", ENCODES)
def test_round_trip_error_within_the_format_bound(name):
    rng = np.random.default_rng(300 + ENCODES.index(name))
    for kind, x in inputs(rng, (3, 4), 8 * 32).items():
        if kind == "beyond":  # the scale is not representable in f16
            continue
        back = dequantize(name, quantize(name, torch.from_numpy(x))).double().numpy()
        err = np.abs(back - x.astype(np.float64))
        bound = roundtrip_bound(name, x)
        assert (err <= bound).all(), (name, kind, float((err - bound).max()))
        if kind == "normal":  # the bound is not vacuous: errors reach a fair part of it
            assert err.max() > 0.25 * bound.max()
    # all-zero blocks come back exactly zero
    z = torch.zeros(2, 64)
    assert torch.equal(dequantize(name, quantize(name, z)).abs(), z)


@pytest.mark.parametrize("name", sorted(QUANTIZE))
def test_quantize_refusals(name):
    bs = ENCODINGS[name].block_size
    with pytest.raises(ValueError, match=name):
        quantize(name, torch.zeros(2, bs + 16))
    with pytest.raises(GGMLError, match="finite"):
        quantize(name, torch.tensor([[math.nan] + [0.0] * (bs - 1)]))
    with pytest.raises(GGMLError, match="finite"):
        quantize(name, torch.tensor([[0.0] * (bs - 1) + [math.inf]]))
    with pytest.raises(GGMLError, match="floating"):
        quantize(name, torch.zeros(2, bs, dtype=torch.int32))
    # other float dtypes are taken as fp32, as the reference takes them
    x = torch.randn(3, 2 * bs, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(quantize(name, x), quantize(name, x.float()))
    assert quantize(name, torch.zeros(0, 2 * bs)).shape == (0, row_bytes(name, 2 * bs))


# ---------------------------------------------------------------------------------------------- k-quant encoders
def kquant_input(rows: int = 24, cols: int = 512) -> np.ndarray:
    """A platform-independent input (integer hashes, exact conversions; no RNG, no libm): values spread
    over 2^-60 .. 2^55 by row, outliers every 97th value of every 5th row, an all-zero row, a constant row,
    a positive row and a half row of -0.0."""
    i = np.arange(rows * cols, dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)
    g = (i * np.uint64(40503) + np.uint64(977)) % np.uint64(2**16)
    x = ((h.astype(np.float64) / 2**32 - 0.5) * (g.astype(np.float64) / 2**15 + 0.25)).astype(np.float32)
    x = x.reshape(rows, cols) * (2.0 ** np.arange(-60, 60, 120 // rows)[:rows, None]).astype(np.float32)
    x[::5, ::97] *= 64
    x[3] = 0.0
    x[4] = 0.375
    x[6] = np.abs(x[6])
    x[7, 256:] = -0.0
    return x


# sha256 of the bytes ggml's quantize_row_q4_K_ref / quantize_row_q6_K_ref (ggml-quants.c, llama.cpp as vendored
# by llama-cpp-python 0.3.36, called through libggml-base.so) write for kquant_input(); tests/ggml_quant_check.py
# compares many more inputs, and llama-quantize's own output, where that build exists
GGML_KQUANT_SHA256 = {
    "q4_k": "048d58aad55f70e5a66e1ffa028be08be1dc034c444088bd9f6a842383cb1029",
    "q6_k": "57332e10c64007079cc255e86dc6facceeb40ffd17611a695b090bd25898cbb4",
    # quantize_row_q5_K_ref, the same build and input (written there 2026-12-06; tests/ggml_quant_check.py then
    # found vxc's q5_k bytes identical on 16128 blocks of its inputs)
    "q5_k": "ff9ff0cf0a750871edb5e51d8f4f671739e6b76b02278ec98c0ba77870f19672",
    # quantize_row_q2_K_ref / quantize_row_q3_K_ref, the same build and input: these digests were computed from
    # ggml_quantize_chunk's output (libggml-base.so through tests/ggml_quant_check.Ggml), not from vxc's encoders;
    # tests/ggml_quant_check.py then found vxc's q2_k / q3_k bytes identical on the 8064 blocks of its inputs each
    "q2_k": "9db3b3fb9f0ecd6110325dd7cca7815c7b4e1a8658e4c61cb4d6642f58696a40",
    "q3_k": "27876d1336cfc59b1f664a58c1615ab680d63c2f9c9cc5bdc0e8e94f575f38dc",
    # quantize_iq4_nl / quantize_iq4_xs without an importance matrix (what llama-quantize runs for IQ4_NL / IQ4_XS;
    # not the _ref forms, which skip the scale search), the same build and input, from ggml_quantize_chunk's output;
    # tests/ggml_quant_check.py found vxc's bytes identical on its 150 inputs (2026-12-06)
    "iq4_nl": "53afae544efcf775ebf6eb707a24ff5ef908e8e74170414d0c01a7c0800a2676",
    "iq4_xs": "29bb77ff407f6d824d6fcc559ee8b6ed7f12d710a781f850b2c3516a1195b2e2",
}


@pytest.mark.parametrize("name", K_ENCODES + I_ENCODES)
def test_k_quant_bytes_are_ggml_reference_bytes(name):
    import hashlib

    got = quantize(name, torch.from_numpy(kquant_input()))
    assert got.shape == (24, row_bytes(name, 512))
    assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == GGML_KQUANT_SHA256[name]


def _kquant_groups(name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per group of a k-quant block (numpy, from ggml-common.h's layout): the value of code 0, the step
    between codes, and the codes' range ``(lo, step, qmax)``; the value of code q is ``lo + step * q``."""
    b = b.reshape(-1, ENCODINGS[name].type_size)
    f16 = lambda a: np.ascontiguousarray(a).view(np.float16).astype(np.float64)  # noqa: E731
    if name == "q2_k":  # scales[16] (low nibble: scale, high: min), qs[64], d, dmin
        d, dmin, s = f16(b[:, 80:82]), f16(b[:, 82:84]), b[:, 0:16].astype(np.int64)
        return -(dmin * (s >> 4)), d * (s & 15), 3
    if name == "q3_k":  # hmask[32], qs[64], scales[12], d; 6-bit scales - 32; code q is the value (q - 4) * step
        d, s = f16(b[:, 108:110]), b[:, 96:108].astype(np.int64)
        lo = np.concatenate((s[:, 0:8] & 15, s[:, 0:8] >> 4), axis=1)
        hi = np.concatenate([(s[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=1)
        step = d * ((lo | (hi << 4)) - 32)
        return -4 * step, step, 7
    if name in ("q4_k", "q5_k"):  # (the same d, dmin and scale bytes; 4- or 5-bit codes)
        d, dmin, s = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16].astype(np.int64)
        sc = np.concatenate((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), axis=1)
        mn = np.concatenate((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), axis=1)
        return -(dmin * mn), d * sc, 15 if name == "q4_k" else 31
    d, s = f16(b[:, 208:210]), np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float64)
    return -32 * (d * s), d * s, 63


@pytest.mark.parametrize("name", K_ENCODES)
def test_k_quant_round_trip_picks_the_nearest_code(name):
    """Every value decodes to the code nearest to it (clipped to the group's codes) under the scales its block
    stores, read back independently (numpy, the documented layout): what the reference's last pass computes,
    within fp32 rounding of ``(x + dm) / d``. The search for the scales is judged by the error it reaches:
    below q4_1's / q5_0's (q3_k: q2_k's) on the same values (more bits per group well spent), and far below
    the range. q2_k / q3_k: 16-value groups, codes 0..3 and -4..3 (``(q - 4) * step``)."""
    rng = np.random.default_rng(500 + K_ENCODES.index(name))
    gs = 32 if name in ("q4_k", "q5_k") else 16
    # q2_k (2.6 bits a value) and q3_k (3.4) have no 32-value format as small
    baseline = {"q2_k": None, "q3_k": "q2_k", "q4_k": "q4_1", "q5_k": "q5_1", "q6_k": "q5_0"}[name]
    for kind, x in {**inputs(rng, (4, 3), 2 * 256), "hashed": kquant_input()}.items():
        b = quantize(name, torch.from_numpy(x)).numpy()
        back = ref_dequantize(name, b).double().numpy().reshape(-1, gs)
        with np.errstate(invalid="ignore"):  # inf * 0 where an f16 d overflowed (checked finite below)
            lo, step, qmax = _kquant_groups(name, b)
        lo, step = lo.reshape(-1, 1), step.reshape(-1, 1)
        xs = x.astype(np.float64).reshape(-1, gs)
        finite = (np.isfinite(step) & np.isfinite(lo))[:, 0]  # rows of 2^40 and more: the f16 d overflows
        live = finite & (step != 0)[:, 0]
        ideal = np.clip(np.round((xs[live] - lo[live]) / step[live]), 0, qmax)
        best = np.abs(xs[live] - (lo[live] + step[live] * ideal))
        err = np.abs(xs[live] - back[live])
        slack = 1e-5 * np.abs(step[live]) + 1e-6 * np.abs(xs[live]) + 1e-37
        assert (err <= best + slack).all(), (name, kind, float((err - best - slack).max()))
        flat = finite & ~live  # a zero step: every value decodes to the group's offset
        assert np.array_equal(back[flat], np.broadcast_to(lo[flat], back[flat].shape)), (name, kind)
        # the f16 d may overflow: on the hashed rows of 2^40 and more; q2_k's d (a 16-value group's step / 15, the
        # group's range / 45) also on "beyond"'s values of about 1e6
        assert kind in ("hashed", *(["beyond"] if name == "q2_k" else [])) or finite.all(), (name, kind)
        if kind in ("normal", "outliers", "scaled"):
            e = np.sqrt(np.mean((back - xs) ** 2))
            if baseline is not None:
                b2 = dequantize(baseline, quantize(baseline, torch.from_numpy(x))).double().numpy().reshape(-1, gs)
                assert e < np.sqrt(np.mean((b2 - xs) ** 2)), (name, kind)
            assert e < 0.06 * (xs.max() - xs.min()), (name, kind)
    if name in QUANTIZE:
        z = torch.zeros(2, 512)
        assert torch.equal(dequantize(name, quantize(name, z)), z)
        assert quantize(name, z).count_nonzero() == 0


# ---------------------------------------------------------------------------------------------- devices
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_results_equal_cpu_results():
    rng = np.random.default_rng(400)
    for name in ALL:
        e = ENCODINGS[name]
        b = torch.from_numpy(random_blocks(name, (3, 17, 5 * e.type_size), "extreme", rng))
        assert same_floats(dequantize(name, b.cuda()).cpu(), dequantize(name, b))
    for name in sorted(QUANTIZE):
        for kind, x in inputs(rng, (3, 4), 2 * ENCODINGS[name].block_size).items():
            t = torch.from_numpy(x)
            assert torch.equal(quantize(name, t.cuda()).cpu(), quantize(name, t)), (name, kind)
