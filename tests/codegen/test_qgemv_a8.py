"""``int8_block32`` activations (issue 12): an encoded operand may declare that the products reading it quantise
their input per 32-value block to int8 (``activations int8_block32`` in the IR), as llama.cpp's q8_0 dot products
do. ``vxc_qgemv_a8`` sums each weight group times its x block exactly in integers (AVX-512 VNNI, AVX2
maddubs, or plain ints) and scales once per group.

The oracle here is written from the definition, independently of vxc: x quantised with numpy (d = amax / 127
in fp32, q = round-half-even(x / d), 0 for an all-zero block), the weights decoded by gguf-py's own
``gguf.quants.dequantize``, the product of the two dequantised operands in fp64. The native kernel and the torch
twin (``dequantize_activations`` then the fp32 matmul) are held at the kernel floor of that oracle; the
activation precision is shown to matter (the fp32-activation product is far outside that floor).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tests import references as R
from tests.codegen.test_qgemv import NATIVE, make_blocks, qtype
from vxc.codegen.kernels import native as N
from vxc.codegen.kernels import qdense, quant
from vxc.ir.ggml import ENCODINGS, GGMLError

A8 = "int8_block32"


def np_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax == 0, np.float32(0), np.round(g / d))
    return q.astype(np.int8).reshape(x.shape), d[..., 0]


def oracle(name: str, blocks: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """fp64 (d q) Wᵀ: x quantised by numpy, W decoded by gguf-py."""
    from gguf import quants as gq

    q, d = np_quantize(x.float().numpy())
    xd = torch.from_numpy(q.reshape(q.shape[0], -1, 32).astype(np.float64) * d[..., None].astype(np.float64))
    w = torch.from_numpy(np.ascontiguousarray(gq.dequantize(blocks, qtype(name)))).double()
    return xd.reshape(q.shape) @ w.T


PACKED = {"q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0"}  # the encodings with a 16-row packed form (AVX-512 builds)


def has_packed(name: str) -> bool:
    if name not in PACKED or not N.available():
        return False
    lib = N.load()
    fn = lib.vxc_qpack_tile_bytes
    fn.argtypes, fn.restype = [N.I, N.L], N.L
    return fn(quant.NATIVE_ENCODINGS[name], 256) > 0


def run_native(name, blocks, x, packed: bool | None = None):
    """The native int8_block32 product, asserting the kernel it ran: the packed one where the build has it
    (``packed=False``: the row kernel, quant.PACK off)."""
    assert N.available(), N.status()
    rec = N.Recorder()
    prev = quant.PACK
    quant.PACK = packed is not False
    try:
        with N.recording(rec):
            y = quant.qgemv_native(name, blocks, x, A8)
    finally:
        quant.PACK = prev
    assert rec.failed is None, rec.failed
    want = "vxc_qgemv_a8p" if packed is not False and has_packed(name) else "vxc_qgemv_a8"
    assert [c for c, _ in rec.calls] == [want], rec.calls
    return y


def test_twin_quantisation_is_the_definition():
    """``quantize_activations`` gives numpy's integers and scales bit for bit, incl. an all-zero block, a
    block with one non-zero value, ties at .5 and huge / tiny magnitudes."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = 0.0
    x[1, 40] = -3.0
    x[2, :32] = np.arange(32, dtype=np.float32) - 16.5  # amax 16.5: x / d hits many .5 ties? (d = 16.5 / 127)
    x[3] *= 1e30
    x[4] *= 1e-30
    q, d = quant.quantize_activations(torch.from_numpy(x))
    qn, dn = np_quantize(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float32
    assert np.array_equal(q.numpy(), qn) and np.array_equal(d.numpy(), dn)
    assert int(q.abs().max()) == 127 and q[0, :32].eq(0).all() and int(q[1, 40]) == -127
    if N.available():  # the C library's quantisation, what vxc_qgemv_a8 multiplies by: the same bits
        qc, dc = quant.quantize_activations_native(torch.from_numpy(x))
        assert np.array_equal(qc.numpy(), qn) and np.array_equal(dc.numpy(), dn)


SHAPES = [(37, 1), (131, 3), (3, 5), (64, 8)]  # (rows, blocks per row): odd 32-value block counts too


@pytest.mark.native
@pytest.mark.parametrize("B", [1, 9])
@pytest.mark.parametrize("rows, nblk", SHAPES)
@pytest.mark.parametrize("name", NATIVE)
def test_native_at_the_floor(name, rows, nblk, B):
    rng = np.random.default_rng(zlib.crc32(f"a8 {name} {rows} {nblk} {B}".encode()))
    b = make_blocks(name, rows, nblk, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((B, nblk * ENCODINGS[name].block_size)).astype(np.float32))
    if x.shape[1] > 32:
        x[0, :32] = 0.0  # an all-zero block
    got = run_native(name, blocks, x)
    twin = quant.qgemv_twin(name, blocks, x, A8)
    assert got.dtype == twin.dtype == torch.float32 and got.shape == twin.shape == (B, rows)
    exact = oracle(name, b, x)
    R.assert_kernel_at_floor(got, twin, exact, f"{name} {rows}x{nblk} blocks B={B} int8 activations")
    if has_packed(name):  # the row kernel too (what the other encodings and non-AVX-512 builds run)
        R.assert_kernel_at_floor(run_native(name, blocks, x, packed=False), twin, exact, f"{name} row kernel")
    # the declaration matters: the fp32-activation product is far outside that floor
    fl = R.kernel_floor_and_tolerance(twin, exact)
    assert (quant.qgemv_twin(name, blocks, x).double() - exact).abs().max() > 20 * fl["tol"], name
    # rows of x never interact: each row alone gives its row of the B-row product, bit for bit (the packed
    # kernel takes up to 8 rows of x per pass over a tile: rows 0..7 and the ninth row come from different passes)
    for i in range(B if B > 1 else 0):
        assert torch.equal(run_native(name, blocks, x[i:i + 1].contiguous())[0], got[i]), (name, i)


@pytest.mark.native
@pytest.mark.parametrize("name", ["q2_k", "q3_k", "iq4_xs", "tq1_0"])
def test_expanded_tiles_from_many_rows_equal_their_rows_alone(name):
    """From 16 (q3_k, iq4_xs) / 32 (q2_k) / 9 (tq1_0) rows of x an AVX-512 VNNI + VBMI build expands a packed tile
    before the products (a prefill's path): q3_k / q2_k into their values times their sub-block scales, iq4_xs into
    its levels and group scales, tq1_0's base-3 digits into tq2_0's 2-bit codes. At the floor of the twin, and every row bit for bit the row computed alone (the one-row path,
    which combines q3_k / q2_k sub-block sums in integers the same way)."""
    rng = np.random.default_rng(zlib.crc32(f"expand {name}".encode()))
    b = make_blocks(name, 37, 4, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((41, 1024)).astype(np.float32))
    got = run_native(name, blocks, x)
    R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x, A8), oracle(name, b, x), f"{name} 41 rows")
    for i in (0, 7, 8, 31, 32, 40):
        assert torch.equal(run_native(name, blocks, x[i:i + 1].contiguous())[0], got[i]), (name, i)


@pytest.mark.native
@pytest.mark.parametrize("B", [5, 6, 7, 13])
def test_q6_k_rows_split_into_passes_equal_their_rows_alone(B):
    """The packed q6_k product takes 6 and 7 rows of x as a pass of 4 and the rest (its 6- and 7-row instances ran at
    half speed), 8 and more in passes of 4: at the floor of the twin, and every row bit for bit the row alone."""
    rng = np.random.default_rng(zlib.crc32(f"q6_k passes {B}".encode()))
    b = make_blocks("q6_k", 37, 4, rng)
    blocks = torch.from_numpy(b)
    x = torch.from_numpy(rng.standard_normal((B, 1024)).astype(np.float32))
    got = run_native("q6_k", blocks, x)
    R.assert_kernel_at_floor(got, quant.qgemv_twin("q6_k", blocks, x, A8), oracle("q6_k", b, x), f"q6_k {B} rows")
    for i in range(B):
        assert torch.equal(run_native("q6_k", blocks, x[i:i + 1].contiguous())[0], got[i]), i


@pytest.mark.native
@pytest.mark.parametrize("name", NATIVE)
def test_bf16_x_is_quantised_from_its_exact_fp32_values(name):
    rng = np.random.default_rng(5)
    blocks = torch.from_numpy(make_blocks(name, 37, 3, rng))
    x = torch.randn(3, 3 * ENCODINGS[name].block_size).to(torch.bfloat16)
    assert torch.equal(run_native(name, blocks, x), run_native(name, blocks, x.float()))
    assert torch.equal(run_native(name, blocks, x, packed=False), run_native(name, blocks, x.float(), packed=False))


@pytest.mark.native
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packing_in_runs_of_rows_gives_the_whole_matrix_packed_at_once(name, monkeypatch):
    """The packed copy is made PACK_ROWS rows at a time (each run's source pages dropped as it is done): runs
    of one 16-row tile, the last one short (37 rows), give the bytes of one run over the whole matrix."""
    if not has_packed(name):
        pytest.skip("this build has no packed layout for it (AVX-512 only)")
    rng = np.random.default_rng(zlib.crc32(f"runs {name}".encode()))
    b = make_blocks(name, 37, 1 if ENCODINGS[name].block_size == 256 else 8, rng)
    code, cols = quant.NATIVE_ENCODINGS[name], b.shape[1] // ENCODINGS[name].type_size * ENCODINGS[name].block_size
    whole = quant._packed(code, torch.from_numpy(b.copy()), 37, cols)
    monkeypatch.setattr(quant, "PACK_ROWS", 16)
    runs = quant._packed(code, torch.from_numpy(b.copy()), 37, cols)
    assert whole.numel() == runs.numel() > 0 and torch.equal(whole, runs)


@pytest.mark.native
@pytest.mark.parametrize("name", sorted(PACKED))
def test_a_packed_copy_takes_the_stored_bytes(name):
    """A tile of 16 rows holds exactly the bytes of its 16 stored rows (ggml's type sizes, from gguf-py): the
    packed copy that replaces the file's pages in memory is no larger than they are. q4_k's tiles had held its
    6-bit scales and mins unpacked, 2368 bytes per 16 x 256 values for 2304 stored."""
    from gguf.constants import GGML_QUANT_SIZES

    if not has_packed(name):
        pytest.skip("this build has no packed layout for it (AVX-512 only)")
    fn = N.load().vxc_qpack_tile_bytes
    fn.argtypes, fn.restype = [N.I, N.L], N.L
    block, type_size = GGML_QUANT_SIZES[qtype(name)]
    for cols in (256, 1024, 3072):
        assert fn(quant.NATIVE_ENCODINGS[name], cols) == 16 * (cols // block) * type_size, (name, cols)


@pytest.mark.native
def test_packed_copy_is_made_once_and_dropped_with_its_blocks():
    import gc

    if not has_packed("q4_0"):
        pytest.skip("this build has no packed layout (AVX-512 only)")
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(make_blocks("q4_0", 37, 4, rng))
    x = torch.randn(2, 128)
    gc.collect()  # packed copies of blocks an earlier test left for the collector go now, not between the counts
    before = quant.packed_bytes()
    y1 = run_native("q4_0", blocks, x)
    # 3 tiles of 16 rows (37 padded to 48) x 4 groups x (32 B of f16 scales + 256 B of nibbles)
    assert quant.packed_bytes() - before == 3 * 4 * 288
    y2 = run_native("q4_0", blocks, x)
    assert torch.equal(y1, y2) and quant.packed_bytes() - before == 3 * 4 * 288
    del blocks
    gc.collect()
    assert quant.packed_bytes() == before


@pytest.mark.native
@pytest.mark.parametrize("gate, up", [("q4_0", "q4_0"), ("q4_k", "q8_0"), ("q6_k", "q5_0"), ("q4_1", "q4_k"), ("q5_k", "q5_k"),
                                     ("q3_k", "q2_k"), ("iq4_xs", "iq4_nl"), ("tq1_0", "tq2_0")])
def test_qswiglu_gate_and_up_in_one_pass(gate, up):
    """With int8_block32 activations on packed copies, silu(gate) * up is one call (vxc_qswiglu_a8p) over both
    matrices' tiles: bit for bit the two products and vxc_qsilu_mul it replaces (x quantised once or per
    encoding), at row counts off the 16-row tile and batches off the 8-row pass; without packed copies (the row
    kernel) the three calls remain."""
    if not (has_packed(gate) and has_packed(up)):
        pytest.skip("this build has no packed layout (AVX-512 only)")
    rng = np.random.default_rng(zlib.crc32(f"fused {gate} {up}".encode()))
    rows, d = 37, 512
    wg = torch.from_numpy(make_blocks(gate, rows, d // ENCODINGS[gate].block_size, rng))
    wu = torch.from_numpy(make_blocks(up, rows, d // ENCODINGS[up].block_size, rng))
    for B in (1, 8, 9, 21):
        x = torch.from_numpy(rng.standard_normal((B, d)).astype(np.float32))
        rec = N.Recorder()
        with N.recording(rec):
            h = qdense._gate_up_packed(x, gate, wg, up, wu, A8)
        assert [c for c, _ in rec.calls] == ["vxc_qswiglu_a8p"], rec.calls
        g, u = run_native(gate, wg, x), run_native(up, wu, x)
        want = torch.empty_like(g)
        N.call(qdense._QSILU_MUL, g.data_ptr(), u.data_ptr(), want.data_ptr(), g.numel())
        assert torch.equal(h, want), (gate, up, B)
    x = torch.randn(3, d)
    assert qdense._gate_up_packed(x, gate, wg, up, wu, "fp32") is None  # fp32 activations: the products as before
    prev = quant.PACK
    quant.PACK = False
    try:
        assert qdense._gate_up_packed(x, gate, wg, up, wu, A8) is None  # the row kernel: three calls
    finally:
        quant.PACK = prev


@pytest.mark.native
def test_qlinear_and_qswiglu_take_the_declared_activations():
    """The composite forms pass the precision to each projection (native == twin at the floor; the
    fp32-activation result differs)."""
    rng = np.random.default_rng(9)
    d, f = 96, 160
    wg, wu = (torch.from_numpy(make_blocks("q4_0", f, d // 32, rng)) for _ in range(2))
    wd = torch.from_numpy(make_blocks("q8_0", d, f // 32, rng))
    x = torch.randn(3, d)
    bias = torch.randn(f)
    args = (x, "q4_0", wg, "q4_0", wu, "q8_0", wd)
    y = qdense.qswiglu_native(*args, A8)
    R.assert_kernel_at_floor(y, qdense.qswiglu_twin(*args, A8), qdense.qswiglu_twin(*args, A8).double(), "qswiglu")
    assert (y - qdense.qswiglu_twin(*args)).abs().max() > 1e-4
    yl = qdense.qlinear_native(x, "q4_0", wg, bias, A8)
    ref = oracle("q4_0", wg.numpy(), x) + bias.double()
    R.assert_kernel_at_floor(yl, qdense.qlinear_twin(x, "q4_0", wg, bias, A8), ref, "qlinear")
    with pytest.raises(GGMLError, match="unknown activation precision 'int4'"):
        torch.ops.vxc.qlinear(x, "q4_0", wg, bias, "int4")


def test_opcheck_with_activations():
    from torch.library import opcheck

    blocks = torch.from_numpy(make_blocks("q4_k", 6, 1, np.random.default_rng(0)))
    x = torch.randn(2, 256)
    opcheck(torch.ops.vxc.qgemv.default, ("q4_k", blocks, x, A8), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(GGMLError, match="unknown activation precision"):
        torch.ops.vxc.qgemv("q4_k", blocks, x, "fp8")


def _rss_of_range(lo: int, hi: int) -> int:
    """Resident bytes of [lo, hi) in this process (/proc/self/pagemap: bit 63 = present)."""
    import struct

    n = 0
    with open("/proc/self/pagemap", "rb") as f:
        for page in range(lo // 4096, (hi + 4095) // 4096):
            f.seek(8 * page)
            (e,) = struct.unpack("<Q", f.read(8))
            n += 4096 if e >> 63 else 0
    return n


def test_drop_pages_releases_only_a_file_mappings_pages(tmp_path):
    """After packing, the source blocks' pages leave RSS when they are a view of a weights file's mapping (and
    read back identical from the file); an ordinary tensor is never touched."""
    import hashlib
    import json
    import struct

    from safetensors.torch import save_file

    from vxc.runtime.weights import MappedFile, drop_pages

    t = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)
    p = tmp_path / "w.safetensors"
    save_file({"w": t}, str(p))
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f = MappedFile(p, len(raw), hashlib.sha256(raw[8:8 + n]).hexdigest(), "w0")
    view = f.tensor("w")
    assert torch.equal(view, t)  # every page faulted in
    lo, hi = view.data_ptr(), view.data_ptr() + view.numel()
    before = _rss_of_range(lo, hi)
    assert before >= 60 * 4096
    released = drop_pages(view)
    assert released >= 62 * 4096 and _rss_of_range(lo, hi) <= before - released + 4096
    assert torch.equal(view, t)  # read again from the file
    other = t.clone()
    assert drop_pages(other) == 0 and torch.equal(other, t)
    assert json.loads(raw[8:8 + n])["w"]["shape"] == [64, 4096]


@pytest.mark.native
@pytest.mark.parametrize("act", ["fp32", A8])
def test_qmoe_experts_native_matches_its_twin(act):
    """Routed SwiGLU experts over encoded banks [E, rows, row_bytes] (qdense.qmoe_experts): native (tokens
    gathered per expert, one block GEMV each) against the twin (each selected expert decoded), 3 tokens, top-2
    of 5, an expert chosen twice and one never; and the twin against an fp64 evaluation from gguf-py's decoding."""
    from gguf import quants as gq

    assert N.available(), N.status()
    rng = np.random.default_rng(11)
    E, d, I_ = 5, 64, 96
    banks = {"gate": ("q4_0", (E, I_, d)), "up": ("q8_0", (E, I_, d)), "down": ("q5_0", (E, d, I_))}
    blocks = {}
    for k, (enc, (e, r, c)) in banks.items():
        blocks[k] = torch.from_numpy(make_blocks(enc, e * r, c // 32, rng).reshape(e, r, -1))
    x = torch.randn(3, d)
    experts = torch.tensor([[0, 3], [3, 1], [4, 0]], dtype=torch.int64)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]], dtype=torch.float32)
    args = (x, weights, experts, "q4_0", blocks["gate"], "q8_0", blocks["up"], "q5_0", blocks["down"], None, None,
            "separate", "silu", None, None, 0, act)
    rec = N.Recorder()
    with N.recording(rec):
        got = qdense.qmoe_experts_native(*args)
    assert [c for c, _ in rec.calls] == ["vxc_qmoe"] and rec.failed is None
    twin = qdense.qmoe_experts_twin(*args)
    # fp64 from the definition (fp32 activations only: the int8 path's twin is its definition)
    if act == "fp32":
        def dq(k, e):
            enc = banks[k][0]
            return torch.from_numpy(np.ascontiguousarray(gq.dequantize(blocks[k][e].numpy(), qtype(enc)))).double()

        exact = torch.zeros(3, d, dtype=torch.float64)
        for t in range(3):
            for j in range(2):
                e = int(experts[t, j])
                h = torch.nn.functional.silu(x[t].double() @ dq("gate", e).T) * (x[t].double() @ dq("up", e).T)
                exact[t] += float(weights[t, j]) * (h @ dq("down", e).T)
        R.assert_kernel_at_floor(got, twin, exact, "qmoe fp32")
    else:
        R.assert_kernel_at_floor(got, twin, twin.double(), "qmoe int8_block32")
        assert (got - qdense.qmoe_experts_twin(*args[:-1])).abs().max() > 1e-4  # the precision is honoured


def test_qmoe_experts_hold_a_range_of_experts():
    """Tensor parallel: banks holding experts [lo, hi) of 5 (their blocks cut by whole experts, ``expert_offset``
    lo): native and twin add only the selected experts the banks hold — each equal to the whole bank's result with
    the other slots' weights zeroed — and the parts [0, 2) + [2, 5) add up to the whole."""
    rng = np.random.default_rng(12)
    E, d, I_ = 5, 64, 96
    blocks = {k: torch.from_numpy(make_blocks(enc, E * r, c // 32, rng).reshape(E, r, -1))
              for k, (enc, r, c) in {"gate": ("q4_0", I_, d), "up": ("q8_0", I_, d), "down": ("q5_0", d, I_)}.items()}
    x = torch.randn(3, d)
    experts = torch.tensor([[0, 3], [3, 1], [4, 0]], dtype=torch.int64)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]], dtype=torch.float32)

    def run(fn, w, lo, hi):
        return fn(x, w, experts, "q4_0", blocks["gate"][lo:hi], "q8_0", blocks["up"][lo:hi], "q5_0",
                  blocks["down"][lo:hi], None, None, "separate", "silu", None, None, lo)

    whole = run(qdense.qmoe_experts_twin, weights, 0, E)
    parts = []
    for lo, hi in ((0, 2), (2, 5)):
        mine = weights * ((experts >= lo) & (experts < hi))
        want = run(qdense.qmoe_experts_twin, mine, 0, E)
        got, twin = run(qdense.qmoe_experts_native, weights, lo, hi), run(qdense.qmoe_experts_twin, weights, lo, hi)
        torch.testing.assert_close(twin, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - whole).abs().max() > 1e-3  # a part, not the whole
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)
