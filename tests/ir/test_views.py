"""The binding model's view algebra: shapes (vxc.ir.views) and tensors (vxc.runtime.views).

Expected results are written out by hand or computed by independent
indexing (explicit index lists, numpy, per-element loops), never by the code
under test.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vxc.ir.module import BankPart, Operand, Tensor, Transform
from vxc.ir.roles import Role
from vxc.ir.views import ViewError, encoded_shape, operand_shape, view_shape
from vxc.runtime.views import FP4_VALUES, apply_view, decode_mxfp4, stack_bank


def S(dim, a, b):
    return Transform("slice", dim=dim, start=a, stop=b)


def G(dim, groups, *takes):
    return Transform("gather", dim=dim, groups=groups, takes=list(takes))


def R(*shape):
    return Transform("reshape", shape=tuple(shape))


def T(d1, d2):
    return Transform("transpose", dim=d1, dim2=d2)


def arange(*shape):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n).reshape(shape)


# ---------------------------------------------------------------- each kind, by hand


def test_slice():
    t = arange(4, 6)  # t[r, c] = 6r + c
    v = apply_view(t, [S(1, 2, 5)])
    assert v.tolist() == [[2, 3, 4], [8, 9, 10], [14, 15, 16], [20, 21, 22]]
    assert view_shape((4, 6), [S(1, 2, 5)]) == (4, 3)
    assert apply_view(t, [S(0, 3, 4)]).tolist() == [[18, 19, 20, 21, 22, 23]]


def test_gather_several_takes_group_major():
    t = arange(12, 2)  # 12 rows = 3 groups of 4; row r is [2r, 2r+1]
    v = apply_view(t, [G(0, 3, (0, 1), (2, 4))])
    # take [0:1]: row 0 of groups 0,1,2; then take [2:4]: rows 2,3 of each group
    rows = [0, 4, 8, 2, 3, 6, 7, 10, 11]
    assert v.tolist() == [[2 * r, 2 * r + 1] for r in rows]
    assert view_shape((12, 2), [G(0, 3, (0, 1), (2, 4))]) == (9, 2)


def test_gather_on_an_inner_dim_and_repeated_takes():
    t = arange(2, 6)  # dim 1: 2 groups of 3
    v = apply_view(t, [G(1, 2, (1, 3), (0, 1), (0, 1))])
    assert v.tolist() == [[1, 2, 4, 5, 0, 3, 0, 3], [7, 8, 10, 11, 6, 9, 6, 9]]


def test_gather_single_group_is_a_concatenation_of_slices():
    t = arange(7, 2)
    v = apply_view(t, [G(0, 1, (5, 7), (0, 2))])
    assert v[:, 0].tolist() == [10, 12, 0, 2]


def test_reshape():
    t = arange(2, 3, 4)
    v = apply_view(t, [R(6, -1)])
    assert v.shape == (6, 4) and v[5].tolist() == [20, 21, 22, 23]
    assert view_shape((2, 3, 4), [R(-1)]) == (24,)
    assert view_shape((1, 1, 5, 1), [R(5)]) == (5,)  # A_log stored [1,1,H,1]
    assert view_shape((9, 1, 4), [R(9, 4)]) == (9, 4)  # conv stored [C,1,k]


def test_transpose():
    t = arange(2, 3, 4)  # t[a,b,c] = 12a + 4b + c
    v = apply_view(t, [T(0, 2)])
    assert v.shape == (4, 3, 2)
    assert v[3, 1, 1].item() == 12 * 1 + 4 * 1 + 3
    assert view_shape((2, 3, 4), [T(1, 1)]) == (2, 3, 4)  # identity


def test_chain():
    # experts stored [E, in, out] → [E, out, in], then the first 2 output rows of expert-major view
    t = arange(3, 4, 5)
    xs = [T(1, 2), S(1, 1, 3), R(-1, 4)]
    v = apply_view(t, xs)
    assert view_shape((3, 4, 5), xs) == (6, 4) == tuple(v.shape)
    # expert e, out o (1..2), in i  ->  t[e, i, o] = 20e + 5i + o
    assert v.tolist() == [[20 * e + 5 * i + o for i in range(4)] for e in range(3) for o in (1, 2)]


def test_empty_chain_is_identity():
    t = arange(3, 2)
    assert apply_view(t, []) is t
    assert view_shape((3, 2), []) == (3, 2)
    assert view_shape((), []) == ()


# ---------------------------------------------------------------- model layouts


def test_qwen3_next_grouped_qkvz_split():
    # in_proj_qkvz: per key head h the rows [q_h (Dk) | k_h (Dk) | v_h (r*Dv) | z_h (r*Dv)]
    hk, dk, r, dv, d = 4, 3, 2, 5, 7
    gen = torch.Generator().manual_seed(0)
    q = [torch.randn(dk, d, generator=gen) for _ in range(hk)]
    k = [torch.randn(dk, d, generator=gen) for _ in range(hk)]
    v = [torch.randn(r * dv, d, generator=gen) for _ in range(hk)]
    z = [torch.randn(r * dv, d, generator=gen) for _ in range(hk)]
    fused = torch.cat([torch.cat([q[h], k[h], v[h], z[h]]) for h in range(hk)])
    assert fused.shape == (hk * (2 * dk + 2 * r * dv), d)
    qkv = apply_view(fused, [G(0, hk, (0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv))])
    assert torch.equal(qkv, torch.cat(q + k + v))  # q of all heads | k of all heads | v of all heads
    zz = apply_view(fused, [G(0, hk, (2 * dk + r * dv, 2 * dk + 2 * r * dv))])
    assert torch.equal(zz, torch.cat(z))
    assert view_shape(fused.shape, [G(0, hk, (0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + r * dv))]) == (hk * (2 * dk + r * dv), d)


def test_qwen3_next_query_gate_interleaved_per_head():
    # q_proj: per head [query (Dh) | gate (Dh)]
    heads, dh, d = 3, 4, 5
    query = [torch.full((dh, d), float(h)) + torch.arange(dh * d).reshape(dh, d) / 100 for h in range(heads)]
    gate = [-x for x in query]
    fused = torch.cat([torch.cat([query[h], gate[h]]) for h in range(heads)])
    assert torch.equal(apply_view(fused, [G(0, heads, (0, dh))]), torch.cat(query))
    assert torch.equal(apply_view(fused, [G(0, heads, (dh, 2 * dh))]), torch.cat(gate))


def test_interleaved_gate_up_columns():
    # gpt-oss style: gate_up [E, d, 2I] with gate at even columns, up at odd ones
    e_, d, inter = 2, 3, 5
    gate = torch.arange(e_ * d * inter).reshape(e_, d, inter) * 10
    up = -gate - 1
    gate_up = torch.empty(e_, d, 2 * inter, dtype=gate.dtype)
    for c in range(inter):  # interleave by an explicit loop
        gate_up[:, :, 2 * c] = gate[:, :, c]
        gate_up[:, :, 2 * c + 1] = up[:, :, c]
    g = apply_view(gate_up, [G(2, inter, (0, 1)), T(1, 2)])
    u = apply_view(gate_up, [G(2, inter, (1, 2)), T(1, 2)])
    assert g.shape == (e_, inter, d)
    assert torch.equal(g, gate.transpose(1, 2)) and torch.equal(u, up.transpose(1, 2))


def test_bank_then_view():
    experts = [arange(4, 3) + 100 * e for e in range(5)]
    bank = stack_bank(experts)
    assert bank.shape == (5, 4, 3)
    for e in range(5):
        assert torch.equal(bank[e], experts[e])
    v = apply_view(bank, [T(1, 2), S(2, 1, 3)])
    assert v[4].tolist() == [[403, 406], [404, 407], [405, 408]]


def test_stack_bank_refuses_mismatches():
    with pytest.raises(ViewError, match="at least one"):
        stack_bank([])
    with pytest.raises(ViewError, match="expert 2"):
        stack_bank([torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 2)])
    with pytest.raises(ViewError, match="expert 1"):
        stack_bank([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])


# ---------------------------------------------------------------- random chains vs an independent implementation


def _reference(a: np.ndarray, transforms) -> np.ndarray:
    """The semantics again, by explicit index lists (no unflatten/narrow/cat)."""
    for t in transforms:
        if t.kind == "slice":
            a = np.take(a, list(range(t.start, t.stop)), axis=t.dim)
        elif t.kind == "gather":
            size = a.shape[t.dim] // t.groups
            idx = [g * size + r for a_, b_ in t.takes for g in range(t.groups) for r in range(a_, b_)]
            a = np.take(a, idx, axis=t.dim)
        elif t.kind == "reshape":
            a = a.reshape(t.shape)
        elif t.kind == "transpose":
            a = np.swapaxes(a, t.dim, t.dim2)
    return a


def _divisors(n):
    return [g for g in range(1, n + 1) if n % g == 0]


@st.composite
def chains(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    cur, xs = shape, []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["slice", "gather", "reshape", "transpose"]))
        dim = draw(st.integers(0, len(cur) - 1))
        if kind == "slice":
            a = draw(st.integers(0, cur[dim] - 1))
            t = S(dim, a, draw(st.integers(a + 1, cur[dim])))
        elif kind == "gather":
            groups = draw(st.sampled_from(_divisors(cur[dim])))
            size = cur[dim] // groups
            takes = []
            for _ in range(draw(st.integers(1, 3))):
                a = draw(st.integers(0, size - 1))
                takes.append((a, draw(st.integers(a + 1, size))))
            t = G(dim, groups, *takes)
        elif kind == "reshape":
            n = int(np.prod(cur))
            dims, rest = [], n
            while rest > 1 and len(dims) < 3:
                f = draw(st.sampled_from(_divisors(rest)))
                dims.append(f)
                rest //= f
            dims.append(rest)
            if draw(st.booleans()):
                dims[draw(st.integers(0, len(dims) - 1))] = -1
            t = R(*dims)
        else:
            t = T(dim, draw(st.integers(0, len(cur) - 1)))
        cur = view_shape(cur, [t])
        xs.append(t)
    return shape, xs


@settings(max_examples=300, deadline=None)
@given(chains())
def test_random_chains_agree(case):
    shape, xs = case
    t = arange(*shape)
    v = apply_view(t, xs)
    assert tuple(v.shape) == view_shape(shape, xs)
    assert np.array_equal(v.numpy(), _reference(t.numpy(), xs))


@settings(max_examples=200, deadline=None)
@given(chains(), st.data())
def test_random_broken_steps_are_refused_by_both(case, data):
    shape, xs = case
    cur = view_shape(shape, xs)
    dim = data.draw(st.integers(0, len(cur) - 1))
    bad = data.draw(st.sampled_from([
        S(dim, 0, cur[dim] + 1), S(dim, cur[dim], cur[dim]), S(len(cur), 0, 1),
        G(dim, cur[dim] + 1, (0, 1)), G(dim, 1), G(dim, 1, (0, cur[dim] + 1)), G(dim, 1, (1, 1)),
        R(int(np.prod(cur)) + 1), R(-1, -1), T(0, len(cur)),
    ]))
    chain = xs + [bad]  # the broken step meets the shape reached after xs
    with pytest.raises(ViewError, match=f"^transform {len(xs)} "):
        view_shape(shape, chain)
    with pytest.raises(ViewError):
        apply_view(arange(*shape), chain)


# ---------------------------------------------------------------- errors: clear messages

ERRORS = [
    ((8, 3), [S(0, 4, 9)], "transform 0 (slice 0 [4:9]) on shape [8,3]: stop 9 exceeds dim 0 of size 8"),
    ((8, 3), [S(0, 4, 4)], "slice needs 0 <= start < stop, got [4:4]"),
    ((8, 3), [S(0, 5, 2)], "slice needs 0 <= start < stop"),
    ((8, 3), [S(0, -1, 2)], "slice needs 0 <= start < stop"),
    ((8, 3), [S(2, 0, 1)], "dim 2 is out of range for rank 2"),
    ((8, 3), [S(-1, 0, 1)], "dim -1 is out of range for rank 2"),
    ((10, 3), [G(0, 3, (0, 1))], "dim 0 of size 10 is not divisible by 3 groups"),
    ((12, 3), [G(0, 3, (2, 5))], "take [2:5] exceeds the group size 4 (12 / 3 groups)"),
    ((12, 3), [G(0, 3, (0, 1), (2, 2))], "take [2:2] is empty"),
    ((12, 3), [G(0, 3)], "gather needs at least one take"),
    ((12, 3), [G(0, 0, (0, 1))], "groups must be >= 1"),
    ((12, 3), [G(2, 1, (0, 1))], "dim 2 is out of range for rank 2"),
    ((4, 6), [R(5, 5)], "element count differs: 24 elements cannot be viewed as 25"),
    ((4, 6), [R(-1, 5)], "cannot infer the -1 dim: 24 elements are not a multiple of 5"),
    ((4, 6), [R(-1, -1)], "at most one reshape dim may be -1"),
    ((4, 6), [R(0, 6)], "reshape dims must be positive"),
    ((4, 6), [T(0, 2)], "dim2 2 is out of range for rank 2"),
    ((4, 6), [T(-1, 0)], "dim -1 is out of range"),
    ((4, 6), [Transform("flip")], "unknown transform kind 'flip'"),
    ((4, 6), [T(0, 1), S(1, 0, 5)], "transform 1 (slice 1 [0:5]) on shape [6,4]: stop 5 exceeds dim 1 of size 4"),
    ((-1, 6), [], "stored shape [-1,6]: dims must be non-negative"),
]


@pytest.mark.parametrize("shape, xs, message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_view_errors(shape, xs, message):
    with pytest.raises(ViewError) as info:
        view_shape(shape, xs)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
    if all(s >= 0 for s in shape):
        with pytest.raises(ViewError) as info2:
            apply_view(arange(*shape), xs)
        assert str(info2.value) == str(info.value)


# ---------------------------------------------------------------- MXFP4


def test_encoded_shape():
    assert encoded_shape("mxfp4", {"blocks": (6, 3, 16), "scales": (6, 3)}) == (6, 96)
    assert encoded_shape("mxfp4", {"scales": (4, 6, 3), "blocks": (4, 6, 3, 16)}) == (4, 6, 96)  # a bank
    assert encoded_shape("mxfp4", [(6, 3, 16), (6, 3)]) == (6, 96)


@pytest.mark.parametrize("enc, parts, message", [
    ("nvfp4", {"blocks": (6, 3, 16), "scales": (6, 3)}, "unknown encoding 'nvfp4'"),
    ("mxfp4", {"blocks": (6, 3, 16)}, "mxfp4 needs parts blocks, scales, got blocks"),
    ("mxfp4", {"blocks": (6, 3, 16), "scales": (6, 3), "bias": (6,)}, "needs parts"),
    ("mxfp4", [(6, 3, 16)], "needs 2 parts"),
    ("mxfp4", {"blocks": (6, 3, 8), "scales": (6, 3)}, "last dim must be 16 bytes"),
    ("mxfp4", {"blocks": (6, 3, 16), "scales": (6, 4)}, "scales [6,4] must be [6,3]"),
    ("mxfp4", {"blocks": (6, 3, 16), "scales": (2, 6, 3)}, "scales [2,6,3] must be [6,3]"),
    ("mxfp4", {"blocks": (3, 16), "scales": (3,)}, "must be [..., out, blocks, 16]"),
])
def test_encoded_shape_errors(enc, parts, message):
    with pytest.raises(ViewError) as info:
        encoded_shape(enc, parts)
    assert message in str(info.value)


def test_decode_mxfp4_by_hand():
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)  # 1 output row, 2 blocks
    blocks[0, 0, 0] = 0x21  # low nibble 1 (0.5) → element 0, high nibble 2 (1.0) → element 1
    blocks[0, 0, 1] = 0xF8  # low 8 (-0) → element 2, high 15 (-6) → element 3
    blocks[0, 0, 15] = 0x07  # low 7 (6) → element 30, high 0 → element 31
    blocks[0, 1, 0] = 0x7E  # low 14 (-4) → element 32, high 7 (6) → element 33
    blocks[0, 1, 3] = 0x93  # low 3 (1.5) → element 38, high 9 (-0.5) → element 39
    scales = torch.tensor([[128, 124]], dtype=torch.uint8)  # ×2, ×1/8
    out = decode_mxfp4(blocks, scales, torch.float32)
    expected = [0.0] * 64
    expected[0], expected[1], expected[2], expected[3], expected[30] = 1.0, 2.0, -0.0, -12.0, 12.0
    expected[32], expected[33], expected[38], expected[39] = -0.5, 0.75, 0.1875, -0.0625
    assert out.shape == (1, 64) and out.dtype == torch.float32
    assert out[0].tolist() == expected
    assert torch.signbit(out[0, 2]) and not torch.signbit(out[0, 4])  # -0 stays -0, +0 stays +0


def _loop_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    lead, g = blocks.shape[:-2], blocks.shape[-2]
    out = np.zeros(lead + (g * 32,), dtype=np.float64)
    for idx in np.ndindex(*lead):
        for b in range(g):
            s = 2.0 ** (int(scales[idx + (b,)]) - 127)
            for j in range(16):
                byte = int(blocks[idx + (b, j)])
                out[idx + (b * 32 + 2 * j,)] = FP4_VALUES[byte & 0xF] * s
                out[idx + (b * 32 + 2 * j + 1,)] = FP4_VALUES[byte >> 4] * s
    return out


def test_decode_mxfp4_against_a_per_element_loop():
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(2, 3, 4, 16), dtype=np.uint8)  # a bank: 2 experts, 3 rows, 4 blocks
    scales = rng.integers(100, 150, size=(2, 3, 4), dtype=np.uint8)
    scales[0, 0, :] = [0, 1, 254, 255]  # the extremes: subnormal fp32 results, overflow to inf
    ref = _loop_decode(blocks, scales)
    bt, sc = torch.from_numpy(blocks), torch.from_numpy(scales)
    out64 = decode_mxfp4(bt, sc, torch.float64)
    assert out64.shape == (2, 3, 128)
    assert np.array_equal(out64.numpy(), ref)
    np.testing.assert_array_equal(np.signbit(out64.numpy()), np.signbit(ref))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = decode_mxfp4(bt, sc, dtype)
        assert out.dtype == dtype
        want = torch.from_numpy(ref).to(dtype)  # the exact value, rounded once
        assert torch.equal(out, want), dtype


def test_decode_mxfp4_errors():
    b = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ViewError, match="uint8"):
        decode_mxfp4(b.to(torch.int16), torch.zeros(2, 3, dtype=torch.uint8), torch.float32)
    with pytest.raises(ViewError, match=r"scales \[2,4\] must be \[2,3\]"):
        decode_mxfp4(b, torch.zeros(2, 4, dtype=torch.uint8), torch.float32)
    with pytest.raises(ViewError, match="last dim must be 16"):
        decode_mxfp4(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), torch.float32)


# ---------------------------------------------------------------- operands


def test_operand_shape():
    tensors = {
        "w": Tensor("w", "bf16", (12, 5), "w", file="w0"),
        "bank": Tensor("bank", "bf16", (5, 7), "e.{e}.w", experts=4, parts=[BankPart("w0", 0, 3)]),
        "blk": Tensor("blk", "u8", (6, 2, 16), "e.{e}.blocks", experts=3, parts=[BankPart("w0", 0, 2)]),
        "scl": Tensor("scl", "u8", (6, 2), "e.{e}.scales", experts=3, parts=[BankPart("w0", 0, 2)]),
    }
    assert operand_shape(Operand("a", "bf16", (4, 5), ["w"], Role.AttnQ, transforms=[G(0, 2, (0, 2))]), tensors) == (4, 5)
    assert operand_shape(Operand("b", "bf16", (4, 7, 5), ["bank"], Role.PerExpertGate, transforms=[T(1, 2)]), tensors) == (4, 7, 5)
    enc = Operand("c", "bf16", (3, 64, 6), ["blk", "scl"], Role.ExpertDown, encoding="mxfp4",
                  part_names=["blocks", "scales"], transforms=[T(1, 2)])
    assert operand_shape(enc, tensors) == (3, 64, 6)
    with pytest.raises(ViewError, match=r"operand %d: transform 0 \(slice 0 \[0:13\]\) on shape \[12,5\]"):
        operand_shape(Operand("d", "bf16", (13, 5), ["w"], Role.AttnQ, transforms=[S(0, 0, 13)]), tensors)
    with pytest.raises(ViewError, match=r"operand %e: unknown tensor \$nope"):
        operand_shape(Operand("e", "bf16", (1,), ["nope"], Role.AttnQ), tensors)
    with pytest.raises(ViewError, match="operand %f: mxfp4 needs parts blocks, scales"):
        operand_shape(Operand("f", "bf16", (1,), ["blk", "scl"], Role.ExpertDown, encoding="mxfp4", part_names=["b", "s"]), tensors)


def test_ir_views_does_not_import_torch():
    code = "import sys, vxc.ir.views; assert 'torch' not in sys.modules, 'vxc.ir.views imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
