"""The native CPU kernels (the ``native`` implementations of the kernel families, compiled from
``native/vxc_cpu.c``) against their torch twins.

Shapes are awkward on purpose: GEMV rows not a multiple of the 4-row block, reduction lengths not a multiple of
the 16/32-lane vector (the masked tails), more than one OpenMP chunk. fp32 is compared tightly (only the
summation order differs); bf16 within one rounding of the output (the native code rounds where the twin
materialises bf16 values, but its fp32 sums run in another order, so an output may land one ulp away).
Everything here must run natively: a native implementation that declined (``NotCovered``) would not return at
all, and each call is recorded, the recorder holding the native call.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests import references as R
from vxc.codegen import kernels
from vxc.codegen.kernels import attention, conv, delta, dense, kda, mla, moe, norms, ssd
from vxc.codegen.kernels import native as N

pytestmark = pytest.mark.native

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def r(*shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape) * scale).to(dtype)


def native(fn, *args, expect: str):
    """Run a native implementation, asserting that it made the native call ``expect``."""
    assert N.available(), N.status()
    rec = N.Recorder()
    with N.recording(rec):
        out = fn(*args)
    assert rec.failed is None, rec.failed
    assert [name for name, _ in rec.calls][:1] == [expect], rec.calls
    return out


def close(a, b, dtype, exact=None):
    """``a`` (native) vs ``b`` (twin); in fp32 with an fp64 evaluation ``exact`` given, at the kernel's floor
    (long sums whose order differs between the AVX-512 and AVX2 builds), else within TOL."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if exact is not None and dtype == torch.float32:
        R.assert_kernel_at_floor(a, b, exact)
        return
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


def test_library_builds_and_is_the_cpu_default():
    assert N.available(), N.status()
    assert N.status().startswith("loaded")
    assert kernels.select(torch.zeros(1)) == "native"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N_out, K, bias", [(1001, 777, True), (6, 33, False), (3, 16, True), (257, 64, False)])
def test_gemv(dtype, N_out, K, bias):
    x, w = r(1, K, dtype=dtype), r(N_out, K, scale=K ** -0.5, dtype=dtype)
    b = r(N_out, dtype=dtype) if bias else None
    close(native(dense.linear_native, x, w, b, expect="vxc_gemv"), dense.linear_twin(x, w, b), dtype)
    # fp32 against fp64, independently of the twin
    if dtype == torch.float32:
        exact = x.double() @ w.double().T + (b.double() if bias else 0.0)
        torch.testing.assert_close(native(dense.linear_native, x, w, b, expect="vxc_gemv").double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    x = r(1, 203, dtype=dtype)
    wg, wu, wd = r(70, 203, scale=0.1, dtype=dtype), r(70, 203, scale=0.1, dtype=dtype), r(203, 70, scale=0.1, dtype=dtype)
    close(native(dense.swiglu_native, x, wg, wu, wd, expect="vxc_swiglu_up"), dense.swiglu_twin(x, wg, wu, wd), dtype)


def test_swiglu_prefill_form():
    """fp32 past the batched rows (a prefill chunk): torch's GEMMs with silu(g) · u in one native pass, at the twin's
    tolerance and against fp64; a capture is refused (the GEMMs are not native calls); bf16 keeps the twin."""
    T, K, H = 45, 203, 70
    x = r(T, K)
    wg, wu, wd = r(H, K, scale=0.1), r(H, K, scale=0.1), r(K, H, scale=0.1)
    rec = N.Recorder()
    with N.recording(rec):
        got = dense.swiglu_native(x, wg, wu, wd)
    assert [name for name, _ in rec.calls] == ["vxc_gated_act"] and "swiglu" in rec.failed
    g, u = x.double() @ wg.double().T, x.double() @ wu.double().T
    close(got, dense.swiglu_twin(x, wg, wu, wd), torch.float32, exact=(torch.nn.functional.silu(g) * u) @ wd.double().T)
    with pytest.raises(kernels.NotCovered):
        dense.swiglu_native(x.bfloat16(), wg.bfloat16(), wu.bfloat16(), wd.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, K", [(2, 203), (3, 768), (5, 203), (6, 389), (16, 203), (7, 2101), (9, 389), (8, 1040),
                                  (12, 1553), (13, 1040), (16, 1024), (4, 512), (10, 768), (15, 1553)])
def test_gemv_and_swiglu_over_rows(dtype, T, K):
    """A batched decode step's rows (T <= dense.GEMV_MAX_ROWS): one pass over the weights for every row, each row
    bit-identical to the same row alone (so a batched step gives each sequence its single-sequence values), and
    at the twin's tolerance; fp32 against fp64 too. Past the bound the BLAS GEMM (the twin) runs. Rows of x in
    fours and a remainder, short (one-stream dot) and long (four-row dot, K > 2048) weight rows; 1 to 4 groups of
    four rows over K walked in chunks of 512 values (fp32), with and without a tail (1040: two chunks and 16 values,
    no tail; 1553: three chunks, 16 values, a tail of 1; 512 and 1024: whole chunks), of 384 values (bf16: 768 two
    whole chunks, 1553 four and a tail of 17, 1040 two, 256 values and a tail of 16); 1 to 3 rows of x past a
    multiple of 4 (the block's last, partial group from 5 rows: 5, 6, 7, 9, 10, 13, 15)."""
    x, w, b = r(T, K, dtype=dtype), r(1001, K, scale=K ** -0.5, dtype=dtype), r(1001, dtype=dtype)
    y = native(dense.linear_native, x, w, b, expect="vxc_gemv_rows")
    for t in range(T):
        assert torch.equal(y[t:t + 1], native(dense.linear_native, x[t:t + 1].clone(), w, b, expect="vxc_gemv"))
    close(y, dense.linear_twin(x, w, b), dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-5)
    wg, wu, wd = r(70, K, scale=0.1, dtype=dtype), r(70, K, scale=0.1, dtype=dtype), r(K, 70, scale=0.1, dtype=dtype)
    h = native(dense.swiglu_native, x, wg, wu, wd, expect="vxc_swiglu_up_rows")
    for t in range(T):
        assert torch.equal(h[t:t + 1], native(dense.swiglu_native, x[t:t + 1].clone(), wg, wu, wd, expect="vxc_swiglu_up"))
    # fp32: at the kernel's floor against fp64 too (a 2101-term sum's order differs between the AVX-512 and AVX2
    # builds by more than a fixed tolerance)
    g, u = x.double() @ wg.double().T, x.double() @ wu.double().T
    close(h, dense.swiglu_twin(x, wg, wu, wd), dtype, exact=(torch.nn.functional.silu(g) * u) @ wd.double().T)
    with pytest.raises(kernels.NotCovered):
        dense.linear_native(r(dense.GEMV_MAX_ROWS + 1, K, dtype=dtype), w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centred, residual, residual_fp32", [(False, True, True), (True, True, False),
                                                                   (False, False, False), (True, False, True)])
@pytest.mark.parametrize("width", [3, 7, 201, 4099, 9000])
def test_add_rmsnorm(dtype, zero_centred, residual, residual_fp32, width):
    """Bit-identical to the twin (torch's fp32 norm): the sum of squares in torch's own order (the scalar rows under
    8 values, 8-lane vectors above, the cascade folding every 16 rows of 32 from 512 values), the same rsqrt and
    the same two roundings. An fp64 scale, one ulp off in ~15 % of the values, had moved a Kimi-Linear miniature's
    logits to 2.4x the reference's own fp32 error on an AMD Zen 4."""
    x, w = r(5, width, dtype=dtype), r(width, dtype=dtype)
    res = r(5, width, dtype=torch.float32 if residual_fp32 else dtype) if residual else None
    got = native(norms.add_rmsnorm_native, x, res, w, 1e-6, zero_centred, residual_fp32, expect="vxc_add_rmsnorm")
    want = norms.add_rmsnorm_twin(x, res, w, 1e-6, zero_centred, residual_fp32)
    assert torch.equal(got[0], want[0]), (got[0] - want[0]).abs().max()
    assert torch.equal(got[1], want[1])  # the residual is one exact sum, rounded once


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate, act, group", [(False, "silu", 67), (True, "sigmoid", 201)])
def test_gated_rmsnorm(dtype, norm_before_gate, act, group):
    x, z, w = r(3, 201, dtype=dtype), r(3, 201, dtype=dtype), r(201, dtype=dtype)
    got = native(norms.gated_rmsnorm_native, x, z, w, 1e-5, group, norm_before_gate, act, expect="vxc_gated_rmsnorm")
    close(got, norms.gated_rmsnorm_twin(x, z, w, 1e-5, group, norm_before_gate, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_kernels_take_a_prefill_chunk(dtype):
    """gated_act (each activation), scale and activation run natively at a prefill chunk's size (128 x 2048 values:
    they had fallen back to torch past 65536, a Gemma 3 prefill's gelu products included; bf16 is widened by chunks
    of 512 values, and a width of 2047 leaves a chunk's tail at every row): on two threads, equal to one thread and
    to the same values one row at a time, and at the twin's tolerance."""
    from vxc.codegen.kernels import activation, elementwise

    lib = N.load()
    for width in (2048, 2047):
        g, u = r(128, width, dtype=dtype), r(128, width, dtype=dtype)
        calls = [(elementwise.gated_act_native, elementwise.gated_act_twin, (g, u, a), "vxc_gated_act")
                 for a in ("none", "silu", "gelu_tanh")]
        calls += [(elementwise.scale_native, elementwise.scale_twin, (g, 0.37), "vxc_scale"),
                  (activation.activation_native, activation.activation_twin, (g, "relu2"), "vxc_activation")]
        for fn, twin, args, name in calls:
            try:
                lib.vxc_set_threads(2)
                two = native(fn, *args, expect=name)
                lib.vxc_set_threads(1)
                one = native(fn, *args, expect=name)
            finally:
                lib.vxc_set_threads(max(1, torch.get_num_threads()))
            assert torch.equal(one, two), name
            row = tuple(a[5:6] if isinstance(a, torch.Tensor) else a for a in args)
            assert torch.equal(native(fn, *row, expect=name)[0], two[5]), name
            close(two, twin(*args), dtype)


def test_gated_rmsnorm_rows_do_not_depend_on_the_thread_count():
    """A batched step's few wide rows (8 x 3072: the rows go to two threads) give each row the values one thread
    gives it, and each row alone."""
    lib = N.load()
    x, z, w = r(8, 3072), r(8, 3072), r(3072)
    args = (x, z, w, 1e-5, 3072, False, "silu")
    try:
        lib.vxc_set_threads(2)
        two = native(norms.gated_rmsnorm_native, *args, expect="vxc_gated_rmsnorm")
        lib.vxc_set_threads(1)
        one = native(norms.gated_rmsnorm_native, *args, expect="vxc_gated_rmsnorm")
    finally:
        lib.vxc_set_threads(max(1, torch.get_num_threads()))
    assert torch.equal(one, two)
    for t in (0, 5):
        alone = native(norms.gated_rmsnorm_native, x[t:t + 1], z[t:t + 1], w, 1e-5, 3072, False, "silu", expect="vxc_gated_rmsnorm")
        assert torch.equal(alone[0], two[t])
    close(two, norms.gated_rmsnorm_twin(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rmsnorm_row_strided(dtype):
    # x and z as column slices of one [T, 3D+5] projection (as the Mamba2 in_proj split hands them over), T * D
    # large enough to split the rows across threads
    T_, D = 70, 603
    proj = r(T_, 3 * D + 5, dtype=dtype)
    z, x = proj[:, :D], proj[:, D + 5: 2 * D + 5]
    w = r(D, dtype=dtype)
    got = native(norms.gated_rmsnorm_native, x, z, w, 1e-5, 201, False, "silu", expect="vxc_gated_rmsnorm")
    close(got, norms.gated_rmsnorm_twin(x, z, w, 1e-5, 201, False, "silu"), dtype)
    assert got.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T_, bias, activation", [(1, True, "silu"), (2, False, "none"), (3, True, "silu"),
                                                  (61, True, "silu"), (47, False, "none")])
def test_conv1d_prefill(dtype, T_, bias, activation):
    # T_ < K - 1 keeps part of the old history in the new one; x is a row-strided column slice; C * T_ for 61 and
    # 47 tokens splits the rows across threads
    C, K = 701, 4
    proj = r(T_, C + 9, dtype=dtype)
    x, w = proj[:, 4: 4 + C], r(C, K, scale=0.5, dtype=dtype)
    b = r(C, dtype=dtype) if bias else None
    s0 = r(C, K, dtype=dtype)
    s1, s2 = s0.clone(), s0.clone()
    got = native(conv.conv1d_prefill_native, x, w, b, activation, s1, expect="vxc_conv1d_prefill")
    close(got, conv.conv1d_prefill_twin(x, w, b, activation, s2), dtype)
    assert torch.equal(s1, s2)  # the new history holds raw inputs, exactly
    xx = torch.cat([s0.double(), x.double().T], 1)  # [C, K + T]: the old history, then the inputs
    assert torch.equal(s1.double(), xx[:, -K:])
    if dtype == torch.float32:  # and against the convolution written out, in fp64
        want = torch.stack([(xx[:, t + 1: t + 1 + K] * w.double()).sum(1) for t in range(T_)])
        if bias:
            want = want + b.double()
        if activation == "silu":
            want = want * torch.sigmoid(want)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias, activation", [(True, "silu"), (False, "none")])
def test_conv1d_step(dtype, bias, activation):
    C, K = 97, 4
    x, w = r(C, dtype=dtype), r(C, K, dtype=dtype)
    b = r(C, dtype=dtype) if bias else None
    s1 = r(C, K, dtype=dtype)
    s2 = s1.clone()
    got = native(conv.conv1d_step_native, x, w, b, activation, s1, expect="vxc_conv1d_step")
    close(got, conv.conv1d_step_twin(x, w, b, activation, s2), dtype)
    assert torch.equal(s1, s2)  # the history shifts exactly


@pytest.mark.parametrize("x_dt, w_dt, s_dt", [(torch.bfloat16, torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.float32, torch.bfloat16),
                                              (torch.float32, torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_conv1d_step_mixed_dtypes_wide(x_dt, w_dt, s_dt, activation):
    """The conv step where the activations, the weight and the history have different dtypes (a Mamba2 step in
    bf16 keeps an fp32 history; each combination has its own instance of the K = 4 loop), over 600 channels (the
    activation runs 256 channels at a time: two whole pieces and a part) and 3 rows on slots out of order: against
    an fp64 convolution of the same values (the history shifted exactly, the output rounded once to x's dtype),
    and each row of the rows form bit-identical to the single-row step on its own slot."""
    C, K, S = 600, 4, 5
    x, w, b = r(3, C, dtype=x_dt), r(C, K, dtype=w_dt), r(C, dtype=w_dt)
    states = r(S, C, K, dtype=s_dt)
    slots = torch.tensor([3, 0, 4], dtype=torch.int64)
    alone, outs = states.clone(), []
    tol = 2e-2 if x_dt == torch.bfloat16 else 1e-5
    for i, s in enumerate(slots.tolist()):
        hist = torch.cat([states[s, :, 1:].double(), x[i].double()[:, None]], dim=1)
        want = (hist * w.double()).sum(-1) + b.double()
        if activation == "silu":
            want = want * torch.sigmoid(want)
        outs.append(native(conv.conv1d_step_native, x[i].clone(), w, b, activation, alone[s], expect="vxc_conv1d_step"))
        assert torch.equal(alone[s], hist.to(s_dt))  # the history shifted exactly
        torch.testing.assert_close(outs[-1].double(), want, rtol=tol, atol=tol)
    assert torch.equal(alone[[1, 2]], states[[1, 2]])  # slots not stepped are untouched
    rows = native(conv.conv1d_step_rows_native, x, w, b, activation, states, slots, expect="vxc_conv1d_step_rows")
    assert torch.equal(rows, torch.stack(outs)) and torch.equal(states, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.05, 0.8)])
def test_ssd_step(dtype, dt_limit):
    H, P, G, Nst = 6, 12, 2, 37
    x, dt, B, C = r(H, P, dtype=dtype), r(H, dtype=dtype), r(G, Nst, dtype=dtype), r(G, Nst, dtype=dtype)
    A_log, D, dt_bias = r(H, scale=0.5), r(H), r(H, scale=0.5)
    s1 = r(H, P, Nst)
    s2 = s1.clone()
    got = native(ssd.ssd_step_native, x, dt, A_log, B, C, D, dt_bias, *dt_limit, s1, expect="vxc_ssd_step")
    close(got, ssd.ssd_step_twin(x, dt, A_log, B, C, D, dt_bias, *dt_limit, s2), dtype)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H, P, G, Nst", [(37, 6, 5, 2, 19), (150, 4, 7, 2, 128), (70, 3, 8, 1, 48), (1, 2, 3, 1, 16)])
def test_ssd_prefill_is_the_recurrence_and_equals_its_steps(dtype, T, H, P, G, Nst):
    """``vxc_ssd_prefill`` against the fp64 recurrence (tests/codegen/test_kernels.naive_ssd) at the fp32
    kernel floor, and bit for bit the state and outputs of T ``vxc_ssd_step`` calls: N = 128 / 48 / 16 take the
    vector form (two state rows at a time, an odd P's last row alone; tokens in blocks of 64: 150 = 64 + 64 + 22),
    N = 19 the scalar one; the clamped dt too."""
    from tests.codegen.test_kernels import naive_ssd

    x, dt, B, C = r(T, H, P, dtype=dtype), r(T, H, dtype=dtype), r(T, G, Nst, dtype=dtype), r(T, G, Nst, dtype=dtype)
    A_log, D, dt_bias = r(H, scale=0.5), r(H), r(H, scale=0.5)
    s0 = r(H, P, Nst)
    for dt_limit in ((0.0, math.inf), (0.05, 0.8)):
        s1, s2 = s0.clone(), s0.clone()
        got = native(ssd.ssd_prefill_native, x, dt, A_log, B, C, D, dt_bias, *dt_limit, s1, 16, expect="vxc_ssd_prefill")
        steps = torch.stack([ssd.ssd_step_native(x[t], dt[t], A_log, B[t], C[t], D, dt_bias, *dt_limit, s2)
                             for t in range(T)])
        assert torch.equal(got, steps) and torch.equal(s1, s2)
        want_y, want_s = naive_ssd(x, dt, A_log, B, C, D, dt_bias, *dt_limit, s0)
        if dtype == torch.float32:
            s_twin = s0.clone()
            y_twin = ssd.ssd_prefill_twin(x, dt, A_log, B, C, D, dt_bias, *dt_limit, s_twin, 16)
            R.assert_kernel_at_floor(got, y_twin, want_y, "ssd_prefill y")
            R.assert_kernel_at_floor(s1, s_twin, want_s, "ssd_prefill state")
        else:  # bf16 outputs: one rounding of the fp32 values
            torch.testing.assert_close(got.float(), want_y.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved, R, T_", [(False, 12, 1), (True, 20, 1), (False, 20, 1),
                                                (False, 96, 37), (True, 64, 37)])
def test_rotary(dtype, interleaved, R, T_):
    # T_=37: 37 tokens x 14 heads x 130 dims, past the kernel's threshold for splitting rows across threads
    H, Dh = (6, 20) if T_ == 1 else (14, 130)
    x, cos, sin = r(T_, H, Dh, dtype=dtype), r(T_, R // 2), r(T_, R // 2)
    close(native(attention.rotary_native, x, cos, sin, interleaved, expect="vxc_rotary"), attention.rotary_twin(x, cos, sin, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, start", [(6, 2, 0), (6, 6, 13), (4, 1, 40)])
def test_attention_step(dtype, Hq, Hkv, start):
    S, Dk, Dv = 48, 20, 12
    q, k, v = r(1, Hq, Dk, dtype=dtype), r(1, Hkv, Dk, dtype=dtype), r(1, Hkv, Dv, dtype=dtype)
    kc, vc = r(S, Hkv, Dk, dtype=dtype), r(S, Hkv, Dv, dtype=dtype)
    kc[start + 1:], vc[start + 1:] = math.nan, math.nan  # rows past the position are never read
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, start, 0.3, expect="vxc_attention_step")
    want = attention.attention_twin(q, k, v, kc2, vc2, start, 0.3)
    close(got, want, dtype)
    assert torch.equal(kc[: start + 1], kc2[: start + 1]) and torch.equal(vc[: start + 1], vc2[: start + 1])
    # and against the softmax written out (fp32)
    if dtype == torch.float32:
        keys = kc[: start + 1].repeat_interleave(Hq // Hkv, 1)
        vals = vc[: start + 1].repeat_interleave(Hq // Hkv, 1)
        p = (torch.einsum("hd,shd->hs", q[0].double(), keys.double()) * 0.3).softmax(-1)
        torch.testing.assert_close(got[0].double(), torch.einsum("hs,shd->hd", p, vals.double()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hq, Hkv, Dk, Dv, start", [
    (8, 2, 128, 128, 300),   # a group of 2, 128-wide heads, past the threshold for splitting across threads
    (4, 1, 64, 64, 70),      # one KV head shared by 4: the group split into tiles across threads
    (9, 3, 64, 64, 130),     # groups of 3: a pair and a single in the weighted sum
    (6, 6, 32, 256, 50),     # no grouping; 256-wide values: two 128-channel blocks
    (16, 2, 48, 192, 40),    # a 48-wide key (32 + a 16 tail); 192-wide values: three 64-channel blocks
    (24, 1, 16, 64, 20),     # 24 query heads on one KV head: tiles of at most 8
])
def test_attention_step_wide_heads(Hq, Hkv, Dk, Dv, start):
    """fp32 heads whose widths are whole 16-float vectors (the AVX-512 path: one K / V row read per KV group, the
    weighted sum in registers) against the twin and the softmax written out in fp64."""
    S = start + 9
    q, k, v = r(1, Hq, Dk), r(1, Hkv, Dk), r(1, Hkv, Dv)
    kc, vc = r(S, Hkv, Dk), r(S, Hkv, Dv)
    kc[start + 1:], vc[start + 1:] = math.nan, math.nan  # rows past the position are never read
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, start, 0.3, expect="vxc_attention_step")
    want = attention.attention_twin(q, k, v, kc2, vc2, start, 0.3)
    close(got, want, torch.float32)
    keys = kc[: start + 1].repeat_interleave(Hq // Hkv, 1)
    vals = vc[: start + 1].repeat_interleave(Hq // Hkv, 1)
    p = (torch.einsum("hd,shd->hs", q[0].double(), keys.double()) * 0.3).softmax(-1)
    torch.testing.assert_close(got[0].double(), torch.einsum("hs,shd->hd", p, vals.double()), rtol=1e-5, atol=1e-5)


def _attention_on_both_backends(caches, q, k, v, pos, scale, window=0, sinks=None):
    """torch.ops.vxc.attention under the native and the torch backend, each on its own (K, V) cache of ``caches``;
    returns the outputs by backend and the native run's recorder."""
    outs, native_rec = {}, None
    for b, (kc, vc) in caches.items():
        rec = N.Recorder()
        with kernels.backend(b), N.recording(rec):
            outs[b] = torch.ops.vxc.attention(q, k, v, kc, vc, pos, scale, window, sinks)
        if b == "native":
            native_rec = rec
    return outs, native_rec


@pytest.mark.parametrize("window, sinks", [(0, True), (7, True), (7, False)])
def test_attention_steps_wide_heads_window_sinks_ring(window, sinks):
    """Forty steps of 64-wide heads (the AVX-512 path) with sinks, a sliding window and a ring of rows, natively
    against the torch backend."""
    Hq, Hkv, Dk, Dv = 8, 2, 64, 64
    rows = window if window else 48
    snk = r(Hq) if sinks else None
    caches = {b: (torch.zeros(rows, Hkv, Dk), torch.zeros(rows, Hkv, Dv)) for b in ("native", "torch")}
    for pos in range(40):
        q, k, v = r(1, Hq, Dk), r(1, Hkv, Dk), r(1, Hkv, Dv)
        outs, rec = _attention_on_both_backends(caches, q, k, v, pos, 0.3, window, snk)
        assert [n for n, _ in rec.calls] == ["vxc_attention_step"] and rec.failed is None, (rec.calls, rec.failed)
        close(outs["native"], outs["torch"], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, sinks", [(0, True), (5, False), (5, True)])
def test_attention_steps_window_sinks_ring(dtype, window, sinks):
    """Twenty single-token steps through torch.ops.vxc.attention, natively against the torch backend: with
    sinks, a sliding window, and (window 5 in a ring of 5 rows) positions that wrap the cache."""
    Hq, Hkv, Dk, Dv = 4, 2, 20, 12
    rows = window if window else 24
    snk = r(Hq, dtype=dtype) if sinks else None
    caches = {b: (torch.zeros(rows, Hkv, Dk, dtype=dtype), torch.zeros(rows, Hkv, Dv, dtype=dtype))
              for b in ("native", "torch")}
    for pos in range(20):
        q, k, v = r(1, Hq, Dk, dtype=dtype), r(1, Hkv, Dk, dtype=dtype), r(1, Hkv, Dv, dtype=dtype)
        outs, rec = _attention_on_both_backends(caches, q, k, v, pos, 0.3, window, snk)
        assert [n for n, _ in rec.calls] == ["vxc_attention_step"] and rec.failed is None, (rec.calls, rec.failed)
        close(outs["native"], outs["torch"], dtype)
        assert torch.equal(caches["native"][0], caches["torch"][0]) and torch.equal(caches["native"][1], caches["torch"][1])


def _softmax_attention_fp64(q, kc, vc, start, scale, window=0, sinks=None):
    """Causal GQA softmax attention written out in fp64: query t (position start + t) over cache rows
    max(0, pos - window + 1)..pos; sinks add one logit per head to the denominator."""
    T, Hq, _ = q.shape
    group = Hq // kc.shape[1]
    keys, vals = kc.double().repeat_interleave(group, 1), vc.double().repeat_interleave(group, 1)
    out = torch.empty(T, Hq, vc.shape[-1], dtype=torch.float64)
    for t in range(T):
        pos = start + t
        lo = max(0, pos - window + 1) if window else 0
        logits = torch.einsum("hd,shd->hs", q[t].double(), keys[lo:pos + 1]) * scale
        if sinks is not None:
            logits = torch.cat([logits, sinks.double()[:, None]], 1)
        p = logits.softmax(-1)[:, : pos + 1 - lo]
        out[t] = torch.einsum("hs,shd->hd", p, vals[lo:pos + 1])
    return out


@pytest.mark.parametrize("T, start, Hq, Hkv, Dk, Dv, window, sinks", [
    (37, 0, 6, 2, 64, 64, 0, False),      # 32 queries a unit (group 2): a short second unit; 2 key blocks, the last partial
    (50, 13, 8, 8, 48, 80, 0, False),     # no grouping (64 queries a unit); a 48-wide key, 80-wide values (64 + a tail)
    (129, 70, 16, 8, 128, 128, 0, False),  # the 0.6B softmax-decoder heads; a chunk after 70 cached positions
    (70, 9, 9, 3, 64, 192, 0, False),     # groups of 3 (21 queries a unit, 63 rows); 192-wide values: 128 + 64
    (33, 10, 4, 1, 32, 20, 7, True),      # a 7-position window and sinks; values narrower than a vector
    (40, 0, 24, 1, 16, 64, 16, True),     # 24 query heads on one KV head: 2 queries a unit
    (3, 200, 6, 2, 64, 64, 0, False),     # three tokens after 200: every unit reads 7 blocks for 3 queries
    (2, 0, 2, 1, 8, 8, 0, False),         # below the threshold for threads
])
def test_attention_prefill(T, start, Hq, Hkv, Dk, Dv, window, sinks):
    """T > 1 fp32 queries over a cache that holds every position (the blocked native kernel with its online
    softmax) against the twin and the softmax written out in fp64: the new rows written into the cache, rows past
    the last position never read."""
    rows = start + T + 5
    q, k, v = r(T, Hq, Dk), r(T, Hkv, Dk), r(T, Hkv, Dv)
    kc, vc = r(rows, Hkv, Dk), r(rows, Hkv, Dv)
    kc[start + T:], vc[start + T:] = math.nan, math.nan
    snk = r(Hq) if sinks else None
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, start, 0.3, window, snk, expect="vxc_attention_prefill")
    want = attention.attention_twin(q, k, v, kc2, vc2, start, 0.3, window, snk)
    close(got, want, torch.float32)
    assert torch.equal(kc[: start + T], kc2[: start + T]) and torch.equal(vc[: start + T], vc2[: start + T])
    exact = _softmax_attention_fp64(q, kc[: start + T], vc[: start + T], start, 0.3, window, snk)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, start, Hq, Hkv, D, window, sinks", [
    (129, 70, 16, 8, 128, 0, False),  # the 0.6B softmax-decoder heads after 70 cached positions
    (64, 0, 4, 1, 256, 512, False),   # a Gemma-3-shaped local layer whose window hides nothing
    (33, 10, 4, 1, 32, 7, True),      # a 7-position window and sinks (the twin's fp32 einsum path)
    (40, 30, 6, 2, 64, 16, False),    # a window hiding rows (the twin's masked SDPA)
])
def test_attention_prefill_bf16_without_amx(T, start, Hq, Hkv, D, window, sinks, monkeypatch):
    """bf16 queries on a CPU without AMX tiles take the native prefill (fp32 inside): within a bf16 rounding of the
    twin (torch's SDPA in bf16, or its fp32 einsums where sinks join) and of the softmax in fp64, the cache rows as
    the twin writes them."""
    monkeypatch.setattr(N, "_AMX", False)
    dt = torch.bfloat16
    q, k, v = r(T, Hq, D, dtype=dt), r(T, Hkv, D, dtype=dt), r(T, Hkv, D, dtype=dt)
    kc, vc = r(start + T, Hkv, D, dtype=dt), r(start + T, Hkv, D, dtype=dt)
    snk = r(Hq, dtype=dt) if sinks else None
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, start, 0.3, window, snk, expect="vxc_attention_prefill")
    close(got, attention.attention_twin(q, k, v, kc2, vc2, start, 0.3, window, snk), dt)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    exact = _softmax_attention_fp64(q.double(), kc.double(), vc.double(), start, 0.3, window, snk)
    torch.testing.assert_close(got.double(), exact, **TOL[dt])


@pytest.mark.parametrize("kv", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_attention_prefill_in_chunks_then_steps_equals_the_torch_backend(kv):
    """A 45-token prompt as chunks of 20, 20 and 5 and then ten single-token steps through torch.ops.vxc.attention,
    natively (the prefill kernel, then the step kernel) against the torch backend on its own cache — an fp32 cache,
    or an f16 / bf16 one (--kv-dtype: the prefill kernel widening blocks): equal caches, outputs within the fp32
    kernel tolerance."""
    Hq, Hkv, Dk, Dv, rows = 8, 2, 64, 64, 64
    caches = {b: (torch.zeros(rows, Hkv, Dk, dtype=kv), torch.zeros(rows, Hkv, Dv, dtype=kv)) for b in ("native", "torch")}
    pos = 0
    for T in (20, 20, 5, *([1] * 10)):
        q, k, v = r(T, Hq, Dk), r(T, Hkv, Dk), r(T, Hkv, Dv)
        outs, rec = _attention_on_both_backends(caches, q, k, v, pos, 0.125)
        want = "vxc_attention_prefill" if T > 1 else "vxc_attention_step"
        assert [n for n, _ in rec.calls] == [want] and rec.failed is None, (rec.calls, rec.failed)
        close(outs["native"], outs["torch"], torch.float32)
        assert torch.equal(caches["native"][0], caches["torch"][0]) and torch.equal(caches["native"][1], caches["torch"][1])
        pos += T


def test_attention_prefill_kernel_bf16_form():
    """The kernel's bf16 form (K / V widened block by block; the op sends it fp32 only) against the twin, within a
    bf16 rounding of the output."""
    dt = torch.bfloat16
    T, start, Hq, Hkv, D = 40, 9, 8, 2, 64
    q, k, v = r(T, Hq, D, dtype=dt), r(T, Hkv, D, dtype=dt), r(T, Hkv, D, dtype=dt)
    kc, vc = r(start + T, Hkv, D, dtype=dt), r(start + T, Hkv, D, dtype=dt)
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention._attention_prefill_native, q, k, v, kc, vc, start, 0.125, 0, None, expect="vxc_attention_prefill")
    close(got, attention.attention_twin(q, k, v, kc2, vc2, start, 0.125), dt)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_attention_prefill_bf16_follows_the_cpu(amx, monkeypatch):
    """bf16 sequences keep torch's fused half-precision kernel where the CPU has AMX tiles, and take the native
    form (fp32 inside, within a bf16 rounding of the twin) where it has not."""
    dt = torch.bfloat16
    monkeypatch.setattr(N, "_AMX", amx)
    q, k, v = r(6, 4, 16, dtype=dt), r(6, 2, 16, dtype=dt), r(6, 2, 16, dtype=dt)
    kc, vc = torch.zeros(32, 2, 16, dtype=dt), torch.zeros(32, 2, 16, dtype=dt)
    if amx:
        with pytest.raises(kernels.NotCovered):
            attention.attention_native(q, k, v, kc, vc, 0, 0.3, 0, None)
        return
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, 0, 0.3, 0, None, expect="vxc_attention_prefill")
    close(got, attention.attention_twin(q, k, v, kc2, vc2, 0, 0.3), dt)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_attention_prefill_chunks_through_a_sliding_window_ring(sinks, kv):
    """A 7-position window held as a ring of 7 rows: chunks of 5, 6 and 9 tokens (each wraps the ring, the last
    by more than its length) and then steps, natively against the torch backend on its own ring — of fp32 rows, or
    f16 / bf16 ones (the ring's linearised copy keeps the cache's element type, so a wrapping chunk's new rows are
    rounded as in the linear case)."""
    Hq, Hkv, Dk, Dv, window = 6, 2, 32, 16, 7
    snk = r(Hq) if sinks else None
    caches = {b: (torch.zeros(window, Hkv, Dk, dtype=kv), torch.zeros(window, Hkv, Dv, dtype=kv)) for b in ("native", "torch")}
    pos = 0
    for T in (5, 6, 9, 1, 1):
        q, k, v = r(T, Hq, Dk), r(T, Hkv, Dk), r(T, Hkv, Dv)
        outs, rec = _attention_on_both_backends(caches, q, k, v, pos, 0.3, window, snk)
        want = "vxc_attention_prefill" if T > 1 else "vxc_attention_step"
        assert [n for n, _ in rec.calls] == [want], rec.calls
        assert T == 1 or pos + T <= window or "ring linearised" in (rec.failed or ""), rec.failed
        close(outs["native"], outs["torch"], torch.float32)
        assert torch.equal(caches["native"][0], caches["torch"][0]) and torch.equal(caches["native"][1], caches["torch"][1])
        pos += T


def test_embedding():
    for dtype in DTYPES:
        ids, table = torch.tensor([3, 0, 49, 3]), r(50, 33, dtype=dtype)
        assert torch.equal(native(dense.embedding_native, ids, table, expect="vxc_embedding"), F.embedding(ids, table))


def test_uncovered_cases_run_the_twin_and_say_so(monkeypatch):
    """Non-contiguous weights, sequences where only the single-token form is native, kernels with no native
    form: the native implementation declines (``NotCovered``), the op runs the twin, a capture is refused and
    the fallback is counted."""
    kernels.reset_fallbacks()
    x, w = r(1, 40), r(40, 30).T  # a transposed view
    with pytest.raises(kernels.NotCovered):
        dense.linear_native(x, w, None)
    rec = N.Recorder()
    with N.recording(rec):
        got = torch.ops.vxc.linear(x, w, None)
    assert rec.calls == [] and "linear ran its torch twin" in rec.failed
    torch.testing.assert_close(got, dense.linear_twin(x, w, None))
    rec = N.Recorder()  # a bf16 sequence on a CPU with AMX tiles: torch's fused half-precision kernel
    monkeypatch.setattr(N, "_AMX", True)
    q, k, v = r(2, 4, 8, dtype=torch.bfloat16), r(2, 2, 8, dtype=torch.bfloat16), r(2, 2, 8, dtype=torch.bfloat16)
    kc, vc = r(16, 2, 8, dtype=torch.bfloat16), r(16, 2, 8, dtype=torch.bfloat16)
    with N.recording(rec):
        torch.ops.vxc.attention(q, k, v, kc, vc, 3, 0.3)
    assert "attention ran its torch twin" in rec.failed
    rec = N.Recorder()
    with N.recording(rec):
        torch.ops.vxc.ssd_prefill(r(5, 2, 4), r(5, 2), r(2), r(5, 1, 1025), r(5, 1, 1025), r(2), r(2), 0.0, math.inf,
                                  r(2, 4, 1025), 4)  # a state past the native form's N <= 1024
    assert "ssd_prefill ran its torch twin" in rec.failed
    rec = N.Recorder()
    with N.recording(rec):  # a transposed (non-contiguous) conv weight
        torch.ops.vxc.conv1d_prefill(r(5, 8), r(4, 8).T, None, "silu", r(8, 4))
    assert "conv1d_prefill ran its torch twin" in rec.failed
    assert kernels.fallbacks() == {
        "conv1d_prefill": {"native": {N.OPERANDS: 1}},
        "ssd_prefill": {"native": {N.LIMITS: 1}},
        "attention": {"native": {N.OPERANDS: 1}},
        "linear": {"native": {N.OPERANDS: 1}},
    }


def test_ops_dispatch_to_native_on_cpu():
    """``torch.ops.vxc.*`` on CPU tensors reaches the native code under the default backend, the twin
    under ``backend("torch")``."""
    x, w = r(1, 50), r(20, 50)
    rec = N.Recorder()
    with N.recording(rec):
        torch.ops.vxc.linear(x, w, None)
        with kernels.backend("torch"):
            torch.ops.vxc.linear(x, w, None)
    assert [n for n, _ in rec.calls] == ["vxc_gemv"]


# ------------------------------------------------------------------------------------------------ MoE, one token

def _moe_banks(E, rows, d, I, dtype, scale=0.3):
    return r(E, rows, d, scale=scale, dtype=dtype), r(E, d, I, scale=scale, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_separate_silu(dtype):
    # d, I not multiples of the 4-row block or the vector width; the gate and up banks are slices of one fused
    # bank (expert stride 2I·d), as a qwen3_moe checkpoint binds them; experts listed out of order

    E, d, I = 9, 203, 45
    gate_up, w_down = _moe_banks(E, 2 * I, d, I, dtype)
    gate, up = gate_up[:, :I], gate_up[:, I:]
    x = r(1, d, dtype=dtype)
    experts = torch.tensor([[7, 2, 5, 0]])
    weights = torch.rand(1, 4)
    args = (x, weights, experts, gate, up, w_down, None, None, "separate", "silu", None, None)
    got = native(lambda *a: moe.experts_native(*a), *args, expect="vxc_moe_ffn_step")
    close(got, moe.experts_twin(*args), dtype, R.experts_fp64(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_fused_clamped_glu_biases(dtype):

    E, d, I = 6, 130, 37  # I odd: the last interleaved block holds one gate/up pair
    w_in, w_down = _moe_banks(E, 2 * I, d, I, dtype, scale=0.8)
    b_in, b_down = r(E, 2 * I, dtype=dtype), r(E, d, dtype=dtype)
    x = r(1, d, scale=2.0, dtype=dtype)
    experts, weights = torch.tensor([[4, 1]]), torch.rand(1, 2)
    args = (x, weights, experts, w_in, None, w_down, b_in, b_down, "fused_interleaved", "clamped_glu", 1.702, 7.0)
    gu = x.float() @ w_in[4].float().T + b_in[4].float()
    assert float(gu[:, 0::2].max()) > 7.0 and float(gu[:, 1::2].abs().max()) > 7.0  # the clamps are exercised
    got = native(lambda *a: moe.experts_native(*a), *args, expect="vxc_moe_ffn_step")
    close(got, moe.experts_twin(*args), dtype, R.experts_fp64(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_moe_shared(dtype, gated):

    d, I = 77, 50
    x, routed = r(1, d, dtype=dtype), r(1, d, dtype=dtype)
    g, u, dn = r(I, d, scale=0.3, dtype=dtype), r(I, d, scale=0.3, dtype=dtype), r(d, I, scale=0.3, dtype=dtype)
    bg = r(1, d, scale=0.3, dtype=dtype) if gated else None
    got = native(lambda *a: moe.shared_native(*a), x, routed, g, u, dn, bg, expect="vxc_moe_ffn_step")
    close(got, moe.shared_twin(x, routed, g, u, dn, bg), dtype, R.shared_fp64(x, routed, g, u, dn, bg))


def test_moe_ops_take_the_native_path_for_up_to_16_tokens():
    """Through torch.ops.vxc: up to 16 tokens (a batched decode step's rows) run natively — the router one recorded call
    per token, the experts and the shared expert one call for all the tokens from two on — each row exactly what the
    same token alone gives; 17 tokens run the twin."""

    E, d, I = 5, 40, 24
    gate, w_down = _moe_banks(E, I, d, I, torch.float32)
    up = r(E, I, d, scale=0.3)
    W = r(E, d, scale=0.5)
    wg, wu, wd = r(I, d, scale=0.3), r(I, d, scale=0.3), r(d, I, scale=0.3)
    for T_, expect_native in ((1, True), (3, True), (16, True), (17, False)):
        x = r(T_, d)
        experts = torch.stack([torch.randperm(E)[:2] for _ in range(T_)])
        weights = torch.rand(T_, 2)
        rec = N.Recorder()
        with N.recording(rec):
            got = torch.ops.vxc.moe_experts(x, weights, experts, gate, up, w_down, None, None, "separate", "silu",
                                            None, None)
            vals, idx = torch.ops.vxc.moe_router(x, W, None, None, "softmax_topk", 2, True, 1.0, 1, 1)
            shared = torch.ops.vxc.moe_shared(x, got, wg, wu, wd, None)
        names = [n for n, _ in rec.calls]
        ffn = ["vxc_moe_ffn_step"] if T_ == 1 else ["vxc_moe_ffn_rows"]
        assert (names == ffn + ["vxc_moe_router_step"] * T_ + ffn) == expect_native, names
        assert (rec.failed is None) == expect_native
        close(got, moe.experts_twin(x, weights, experts, gate, up, w_down, None, None, "separate", "silu", None, None),
              torch.float32)
        if expect_native and T_ > 1:
            for t in range(T_):
                one = torch.ops.vxc.moe_experts(x[t:t + 1], weights[t:t + 1], experts[t:t + 1], gate, up, w_down, None,
                                                None, "separate", "silu", None, None)
                assert torch.equal(got[t:t + 1], one)
                v1, i1 = torch.ops.vxc.moe_router(x[t:t + 1], W, None, None, "softmax_topk", 2, True, 1.0, 1, 1)
                assert torch.equal(vals[t:t + 1], v1) and torch.equal(idx[t:t + 1], i1)
                assert torch.equal(shared[t:t + 1], torch.ops.vxc.moe_shared(x[t:t + 1], one, wg, wu, wd, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["separate", "fused_interleaved"])
def test_moe_rows_are_each_rows_one_token_call(dtype, layout):
    """vxc_moe_ffn_rows (a batched step's experts, each selected expert read once for all the rows that chose it)
    gives every row the bits the one-token call gives it: experts shared between rows and not, a row whose experts
    all belong to another rank, the clamped GLU with biases (fused) and SwiGLU (separate), banks holding experts 3..8
    of 12; and the shared expert, σ-gated per row."""
    E, d, I, lo = 12, 70, 29, 3  # I odd: the fused layout's last block holds one gate/up pair
    fused = layout == "fused_interleaved"
    w_in, w_down = _moe_banks(E, 2 * I if fused else I, d, I, dtype, scale=0.8)
    w_up = None if fused else r(E, I, d, scale=0.8, dtype=dtype)
    b_in = r(E, 2 * I, dtype=dtype) if fused else None
    b_down = r(E, d, dtype=dtype) if fused else None
    act, alpha, limit = ("clamped_glu", 1.702, 7.0) if fused else ("silu", None, None)
    held = lambda t: None if t is None else t[lo:lo + 6]  # noqa: E731
    T = 11
    x = r(T, d, scale=2.0, dtype=dtype)
    experts = torch.tensor([[4, 7, 1, 8], [7, 4, 3, 5], [0, 1, 2, 11], [8, 3, 4, 7], [5, 6, 7, 8], [3, 4, 5, 6],
                            [9, 4, 10, 3], [4, 8, 7, 3], [6, 5, 1, 0], [3, 8, 4, 9], [7, 6, 5, 4]])
    weights = torch.rand(T, 4)
    args = (weights, experts, held(w_in), held(w_up), held(w_down), held(b_in), held(b_down), layout, act, alpha, limit,
            lo)
    got = native(lambda *a: moe.experts_native(*a), x, *args, expect="vxc_moe_ffn_rows")
    for t in range(T):
        one = native(lambda *a: moe.experts_native(*a), x[t:t + 1], weights[t:t + 1], experts[t:t + 1], *args[2:],
                     expect="vxc_moe_ffn_step")
        assert torch.equal(got[t:t + 1], one), t
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # experts 0, 1, 2, 11: none held
    mask = ((experts >= lo) & (experts < lo + 6)).float()  # the held slots: the others add nothing
    exact = R.experts_fp64(x, weights * mask, experts, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit)
    close(got, moe.experts_twin(x, *args), dtype, exact)
    routed = r(T, d, dtype=dtype)
    g, u, dn, bg = r(I, d, scale=0.3, dtype=dtype), r(I, d, scale=0.3, dtype=dtype), r(d, I, scale=0.3, dtype=dtype), \
        r(1, d, scale=0.3, dtype=dtype)
    shared = native(lambda *a: moe.shared_native(*a), x, routed, g, u, dn, bg, expect="vxc_moe_ffn_rows")
    for t in range(T):
        one = native(lambda *a: moe.shared_native(*a), x[t:t + 1], routed[t:t + 1], g, u, dn, bg, expect="vxc_moe_ffn_step")
        assert torch.equal(shared[t:t + 1], one), t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("router, norm, n_group, topk_group, biases", [
    ("softmax_topk", True, 1, 1, False), ("softmax_topk", False, 1, 1, False),
    ("sigmoid_grouped", True, 4, 2, True), ("sigmoid_grouped", False, 1, 1, True),
    ("topk_softmax", False, 1, 1, True)])
def test_moe_router(dtype, router, norm, n_group, topk_group, biases):

    E, d, k = 36, 93, 5
    x, W = r(1, d, dtype=dtype), r(E, d, scale=0.5, dtype=dtype)
    bias = r(E, dtype=dtype) if biases and router == "topk_softmax" else None
    sel = r(E, scale=0.3) if biases and router == "sigmoid_grouped" else None
    args = (x, W, bias, sel, router, k, norm, 2.5, n_group, topk_group)
    vals, idx = native(lambda *a: moe.router_native(*a), *args, expect="vxc_moe_router_step")
    want_vals, want_idx = moe.router_twin(*args)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(vals, want_vals, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hk, Hv, Dk, Dv", [(2, 6, 20, 37), (3, 3, 64, 16)])
def test_gated_delta_step(dtype, Hk, Hv, Dk, Dv):

    q, k, v = r(Hk, Dk, dtype=dtype), r(Hk, Dk, dtype=dtype), r(Hv, Dv, dtype=dtype)
    a, b = r(Hv, dtype=dtype), r(Hv, dtype=dtype)
    A_log, dt_bias = r(Hv, scale=0.5), r(Hv, scale=0.5)
    a[0] = 25.0  # softplus past its linear threshold
    _delta_step_vs_twin(delta.gated_delta_step_native, delta.gated_delta_step_twin, dtype, q, k, v, a, b, A_log, dt_bias,
                        r(Hv, Dk, Dv, scale=0.3))


def _delta_step_vs_twin(fn, twin, dtype, q, k, v, a, b, A_log, dt_bias, state):
    """One delta-rule step natively and by its twin from the same state: outputs and new states agree."""
    s1, s2 = state.clone(), state.clone()
    got = native(fn, q, k, v, a, b, A_log, dt_bias, s1, q.shape[-1] ** -0.5, 1e-6, expect="vxc_delta_step")
    want = twin(q, k, v, a, b, A_log, dt_bias, s2, q.shape[-1] ** -0.5, 1e-6).to(dtype)
    close(got, want, dtype)
    torch.testing.assert_close(s1, s2, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_mul(dtype):

    x, g = r(1, 301, dtype=dtype), r(1, 301, scale=3.0, dtype=dtype)
    close(native(delta.sigmoid_gate_mul_native, x, g, expect="vxc_sigmoid_gate_mul"), delta.sigmoid_gate_mul_twin(x, g), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H, D", [(3, 20), (2, 64)])
def test_kda_step(dtype, H, D):

    q, k, v = r(H, D, dtype=dtype), r(H, D, dtype=dtype), r(H, D, dtype=dtype)
    f, b = r(H * D, scale=2.0, dtype=dtype), r(H, dtype=dtype)
    f[3] = 30.0  # softplus past its linear threshold
    A_log, dt_bias = r(H, scale=0.5), r(H * D, scale=0.5)
    _delta_step_vs_twin(kda.kda_step_native, kda.kda_step_twin, dtype, q, k, v, f, b, A_log, dt_bias, r(H, D, D, scale=0.3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, split_out", [("none", False), ("half", False), ("interleaved", False),
                                               ("interleaved", True)])
def test_mla_decode(dtype, layout, split_out):
    # H 5, nope 12 + rope 6, v 7, latent 20; 9 earlier rows in the latent cache, the token at position 9

    H, NOPE, P, V, R, start = 5, 12, 6, 7, 20, 9
    q, kv = r(1, H, NOPE + P, dtype=dtype), r(1, R + P, dtype=dtype)
    norm_w, w_kvb = r(R, scale=0.5) + 1.0, r(H * (NOPE + V), R, scale=R ** -0.5, dtype=dtype)
    cos = sin = None
    if layout != "none":
        ang = torch.rand(1, P // 2) * 6.0
        cos, sin = torch.cos(ang), torch.sin(ang)
    c0 = r(16, R + P, dtype=dtype)
    c1, c2 = c0.clone(), c0.clone()
    args = (q, kv, norm_w, 1e-6, w_kvb, cos, sin)
    tail = (start, 0.23, NOPE, layout == "interleaved", split_out)
    got = native(mla.mla_decode_native, *args, c1, *tail, expect="vxc_mla_decode")
    want = mla.mla_decode_twin(*args, c2, *tail).to(dtype)
    close(got, want, dtype)
    close(c1, c2, dtype)
    assert torch.equal(c1[start, :R], c2[start, :R])  # the latent row's norm is the twin's to the bit
    assert torch.equal(c1[:start], c0[:start]) and torch.equal(c1[start + 1:], c0[start + 1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_adds_only_the_experts_its_banks_hold(dtype):
    """Tensor parallel: banks holding experts 4..7 of 12 (expert_offset 4), fused layout with biases: the slots
    selecting 1 and 9 (other ranks' experts, ids past the banks on both sides) add nothing; the held ones add
    their expert with its biases, checked against an fp64 evaluation over the whole bank of the held slots only.
    The three ranks' parts add up to the whole bank's result."""
    E, d, I = 12, 40, 24
    w_in, w_down = _moe_banks(E, 2 * I, d, I, dtype)
    b_in, b_down = r(E, 2 * I, dtype=dtype), r(E, d, dtype=dtype)
    x = r(1, d, dtype=dtype)
    experts, weights = torch.tensor([[9, 5, 1, 7]]), torch.rand(1, 4)
    part = lambda lo, *a: (w_in[lo:lo + 4], None, w_down[lo:lo + 4], b_in[lo:lo + 4], b_down[lo:lo + 4], *a)  # noqa: E731
    tail = ("fused_interleaved", "silu", None, None)
    args = (x, weights, experts, *part(4, *tail), 4)
    got = native(lambda *a: moe.experts_native(*a), *args, expect="vxc_moe_ffn_step")
    held = [1, 3]  # the slots of experts 5 and 7
    exact = R.experts_fp64(x, weights[:, held], experts[:, held], w_in, None, w_down, b_in, b_down, *tail)
    close(got, moe.experts_twin(*args), dtype, exact)
    if dtype == torch.float32:
        assert (got.double() - exact).abs().max() < 1e-4 * exact.abs().max()  # not the other slots' sum
    parts = [native(lambda *a: moe.experts_native(*a), x, weights, experts, *part(lo, *tail), lo, expect="vxc_moe_ffn_step")
             for lo in (0, 4, 8)]
    whole = moe.experts_twin(x, weights, experts, w_in, None, w_down, b_in, b_down, *tail)
    close(sum(p.float() for p in parts).to(dtype), whole, dtype,
          R.experts_fp64(x, weights, experts, w_in, None, w_down, b_in, b_down, *tail))
    none = moe.experts_native(x, weights, torch.tensor([[0, 1, 2, 3]]), *part(4, *tail), 4)  # no slot held: zeros
    assert torch.equal(none, torch.zeros_like(none))


# ------------------------------------------------------------------ KV caches narrower than the activations

KV_NARROW = [torch.float16, torch.bfloat16]


def _half_extremes(dtype):
    """K / V values whose rounding to ``dtype`` is delicate: ties, subnormals, the largest finite values and past
    them (to inf), signed zeros."""
    if dtype == torch.float16:
        vals = [65504.0, 65519.99, 65520.0, -70000.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1.5 * 2.0 ** -24,
                6.0e-5, -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, -(1.0 + 2.0 ** -11), 1e-8, 0.333333]
    else:
        vals = [3.0e38, -3.3e38, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1e-39, -0.0, 0.333333, 2.0 ** -133]
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("kv", KV_NARROW)
def test_attention_step_narrow_cache_stores_torchs_rounding(kv):
    """An fp32 step into an f16 / bf16 cache writes its K / V row rounded exactly as torch's cast (round to nearest
    even, subnormals, overflow to inf) — the prefill writes rows with that cast."""
    Hq, Hkv, D = 4, 2, 16
    vals = _half_extremes(kv)
    k = vals.repeat(Hkv * D // len(vals) + 1)[: Hkv * D].reshape(1, Hkv, D)
    v = -k.flip(-1)
    kc, vc = torch.zeros(8, Hkv, D, dtype=kv), torch.zeros(8, Hkv, D, dtype=kv)
    native(attention.attention_native, r(1, Hq, D) * 0, k, v, kc, vc, 3, 0.1, expect="vxc_attention_step")
    assert torch.equal(kc[3].view(torch.int16), k[0].to(kv).view(torch.int16))
    assert torch.equal(vc[3].view(torch.int16), v[0].to(kv).view(torch.int16))


@pytest.mark.parametrize("kv", KV_NARROW)
@pytest.mark.parametrize("Hq, Hkv, Dk, Dv, start", [
    (16, 8, 128, 128, 150),  # the 0.6B softmax-decoder heads: blocks of 16 positions and a tail of 7
    (9, 3, 64, 64, 40),      # groups of 3
    (6, 2, 20, 12, 13),      # widths that are no whole vector: the per-position path
    (4, 1, 48, 192, 33),     # a 48-wide key, 192-wide values
])
def test_attention_step_narrow_cache(kv, Hq, Hkv, Dk, Dv, start):
    """fp32 queries over an f16 / bf16 cache against the twin on the same cache and against the softmax written
    out in fp64 over the cache's values (widening is exact, so the cache's rounding is the only difference from an
    fp32 cache): within the fp32 kernel tolerance of both."""
    S = start + 5
    q, k, v = r(1, Hq, Dk), r(1, Hkv, Dk), r(1, Hkv, Dv)
    kc, vc = r(S, Hkv, Dk).to(kv), r(S, Hkv, Dv).to(kv)
    kc[start + 1:], vc[start + 1:] = math.nan, math.nan  # rows past the position are never read
    kc2, vc2 = kc.clone(), vc.clone()
    got = native(attention.attention_native, q, k, v, kc, vc, start, 0.3, expect="vxc_attention_step")
    want = attention.attention_twin(q, k, v, kc2, vc2, start, 0.3)
    assert got.dtype == torch.float32 and torch.equal(kc[: start + 1], kc2[: start + 1]) and torch.equal(vc[: start + 1], vc2[: start + 1])
    close(got, want, torch.float32)
    exact = _softmax_attention_fp64(q, kc[: start + 1], vc[: start + 1], start, 0.3)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", KV_NARROW)
def test_attention_rows_narrow_cache_equal_the_single_row_steps(kv):
    """The B-row step over an f16 / bf16 [S, 2, rows, Hkv, D] region gives each row exactly the single-row step on
    that slot's cache (the same rounding on write, the same sums)."""
    S, Hq, Hkv, D, rows = 3, 16, 8, 128, 64
    kvbuf = r(S, 2, rows, Hkv, D).to(kv)
    single = kvbuf.clone()
    starts, slots = torch.tensor([40, 17, 3]), torch.tensor([2, 0, 1])
    q, k, v = r(3, Hq, D), r(3, Hkv, D), r(3, Hkv, D)
    got = native(attention.attention_rows_native, q, k, v, kvbuf, starts, 0.09, 0, None, slots, expect="vxc_attention_step_rows")
    for b in range(3):
        s = int(slots[b])
        one = attention.attention_native(q[b:b + 1], k[b:b + 1], v[b:b + 1], single[s, 0], single[s, 1], int(starts[b]), 0.09)
        assert torch.equal(got[b:b + 1], one), b
    assert torch.equal(kvbuf, single)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, kv", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                       (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                       (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("Hq, Hkv, D, rows, window, sinks", [
    (16, 8, 128, 160, 0, False),  # the 0.6B softmax-decoder shape: blocks of 16 positions and a tail, 128-wide V sums
    (4, 1, 256, 96, 0, True),     # one KV head of 256 (Gemma-3-shaped), sinks
    (6, 2, 64, 40, 24, True),     # a sliding window in a ring of 40 rows (positions past the rows): 64-wide V sums
    (6, 3, 48, 50, 0, False),     # 48-wide heads: the per-position path
])
def test_attention_rows_equal_the_single_row_steps(threads, dtype, kv, Hq, Hkv, D, rows, window, sinks):
    """The B-row step — a row per work unit, its positions outermost (every KV group of a block of positions, so the
    cache is read a whole row at a time) — gives each row exactly the one-token step on its slot: five rows at
    positions from 3 (under one block of 16) to the last row of the cache or, in a ring, far past it, on one thread
    and on two; fp32 and bf16 activations over fp32 / f16 / bf16 caches; the same K / V rows written."""
    lib = N.load()
    n_slots = 6
    kvbuf = r(n_slots, 2, rows, Hkv, D).to(kv)
    single = kvbuf.clone()
    starts = [3, 17, 45, 100, 150] if window else [3, 17, 33, min(70, rows - 2), rows - 1]
    starts, slots = torch.tensor(starts), torch.tensor([4, 0, 2, 5, 1])
    q, k, v = r(5, Hq, D, dtype=dtype), r(5, Hkv, D, dtype=dtype), r(5, Hkv, D, dtype=dtype)
    snk = r(Hq, dtype=dtype) if sinks else None
    try:
        lib.vxc_set_threads(threads)
        got = native(attention.attention_rows_native, q, k, v, kvbuf, starts, 0.09, window, snk, slots,
                     expect="vxc_attention_step_rows")
        for b in range(5):
            s = int(slots[b])
            one = attention.attention_native(q[b:b + 1], k[b:b + 1], v[b:b + 1], single[s, 0], single[s, 1],
                                             int(starts[b]), 0.09, window, snk)
            assert torch.equal(got[b:b + 1], one), b
    finally:
        lib.vxc_set_threads(max(1, torch.get_num_threads()))
    assert torch.equal(kvbuf, single)


def test_narrow_cache_on_the_scalar_build():
    """The build without AVX-512, AVX2 or F16C (the portable f16 conversion both ways): the stored rows are torch's
    rounding and the step is at the twin, as above. (The AVX2 build runs this whole file in CI's second pass.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, VXC_NATIVE_CFLAGS="-mno-avx512f -mno-avx2 -mno-f16c")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__,
                        "-k", "(narrow and not scalar_build) or f16"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_attention_prefill_takes_split_views():
    """A conv-QKV layer's q / k / v are column views of one fused tensor (not contiguous): the prefill kernel takes
    them (q copied dense, k / v written into the cache by torch) instead of declining to the twin."""
    T, Hq, Hkv, D = 12, 4, 2, 16
    fused = r(T, (Hq + 2 * Hkv) * D)
    q, k, v = fused.split([Hq * D, Hkv * D, Hkv * D], -1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    kc, vc = torch.zeros(T, Hkv, D), torch.zeros(T, Hkv, D)
    got = native(attention.attention_native, q, k, v, kc, vc, 0, 0.25, expect="vxc_attention_prefill")
    close(got, attention.attention_twin(q, k, v, torch.zeros(T, Hkv, D), torch.zeros(T, Hkv, D), 0, 0.25), torch.float32)
    torch.testing.assert_close(got.double(), _softmax_attention_fp64(q, k, v, 0, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", KV_NARROW)
@pytest.mark.parametrize("layout", ["none", "half"])
def test_mla_decode_narrow_latent_cache(kv, layout):
    """fp32 activations over f16 / bf16 latent rows (--kv-dtype): the written row is the twin's (torch's rounding
    of the same fp32 values) and the absorbed attention is at the twin within the fp32 kernel tolerance."""
    H, NOPE, P, V, R, start = 5, 12, 6, 7, 20, 9
    q, kv_in = r(1, H, NOPE + P), r(1, R + P)
    norm_w, w_kvb = r(R, scale=0.5) + 1.0, r(H * (NOPE + V), R, scale=R ** -0.5)
    cos = sin = None
    if layout != "none":
        ang = torch.rand(1, P // 2) * 6.0
        cos, sin = torch.cos(ang), torch.sin(ang)
    c0 = r(16, R + P).to(kv)
    c1, c2 = c0.clone(), c0.clone()
    args = (q, kv_in, norm_w, 1e-6, w_kvb, cos, sin)
    tail = (start, 0.23, NOPE, False, False)
    got = native(mla.mla_decode_native, *args, c1, *tail, expect="vxc_mla_decode")
    want = mla.mla_decode_twin(*args, c2, *tail)
    close(got, want, torch.float32)
    assert c1.dtype == kv and torch.equal(c1, c2)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
def test_attention_steps_blocks_of_16_through_a_ring(kv):
    """Sixty steps of 64-wide heads in a ring of 21 rows (window 21, sinks): from position 16 on the scores run in
    blocks of 16 positions whose rows wrap the ring, then a tail; natively against the torch backend."""
    Hq, Hkv, D, window = 8, 2, 64, 21
    snk = r(Hq)
    caches = {b: (torch.zeros(window, Hkv, D, dtype=kv), torch.zeros(window, Hkv, D, dtype=kv)) for b in ("native", "torch")}
    for pos in range(60):
        q, k, v = r(1, Hq, D), r(1, Hkv, D), r(1, Hkv, D)
        outs, rec = _attention_on_both_backends(caches, q, k, v, pos, 0.3, window, snk)
        assert [n for n, _ in rec.calls] == ["vxc_attention_step"] and rec.failed is None, (rec.calls, rec.failed)
        close(outs["native"], outs["torch"], torch.float32)
        assert torch.equal(caches["native"][0], caches["torch"][0]) and torch.equal(caches["native"][1], caches["torch"][1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_and_delta_rows_equal_the_single_row_steps(threads, dtype):
    """The B-row SSD and delta-rule (gated delta, KDA) steps — one parallel region over every (row, head) pair — give
    each row exactly its single-row step on its slot's state, and leave each slot's state as that step does; on one
    thread and on two. Rows in a different order from their slots, one slot left alone."""
    lib = N.load()
    Bn, slots = 3, torch.tensor([2, 0, 3])
    H, P_, G, Nn = 6, 16, 2, 32
    A_log, D, dt_bias = r(H, scale=0.5), r(H), r(H, scale=0.5)
    x, dt, Bm, Cm = r(Bn, H, P_, dtype=dtype), r(Bn, H, dtype=dtype), r(Bn, G, Nn, dtype=dtype), r(Bn, G, Nn, dtype=dtype)
    states = r(4, H, P_, Nn)
    Hk, Hv, Dk, Dv = 2, 4, 32, 48
    q, k, v = r(Bn, Hk, Dk, dtype=dtype), r(Bn, Hk, Dk, dtype=dtype), r(Bn, Hv, Dv, dtype=dtype)
    b = r(Bn, Hv, dtype=dtype)
    a_g, a_k = r(Bn, Hv, dtype=dtype), r(Bn, Hv * Dk, dtype=dtype)
    dA, dbias_g, dbias_k = r(Hv, scale=0.5), r(Hv, scale=0.5), r(Hv * Dk, scale=0.5)
    dstates = {False: r(4, Hv, Dk, Dv, scale=0.1), True: r(4, Hv, Dk, Dv, scale=0.1)}
    try:
        lib.vxc_set_threads(threads)
        st1 = states.clone()
        got = native(ssd.ssd_step_rows_native, x, dt, A_log, Bm, Cm, D, dt_bias, 0.001, 0.1, states, slots,
                     expect="vxc_ssd_step_rows")
        for i in range(Bn):
            s = int(slots[i])
            one = native(ssd.ssd_step_native, x[i], dt[i], A_log, Bm[i], Cm[i], D, dt_bias, 0.001, 0.1, st1[s],
                         expect="vxc_ssd_step")
            assert torch.equal(got[i], one), i
        assert torch.equal(states, st1)
        for kda in (False, True):
            a, dbias = (a_k, dbias_k) if kda else (a_g, dbias_g)
            st = dstates[kda]
            st1 = st.clone()
            got = native(delta.delta_step_rows_native, kda, q, k, v, a, b, dA, dbias, st, 0.17, 1e-6, slots,
                         expect="vxc_delta_step_rows")
            for i in range(Bn):
                s = int(slots[i])
                one = native(delta.delta_step_native, kda, q[i], k[i], v[i], a[i], b[i], dA, dbias, st1[s], 0.17, 1e-6,
                             expect="vxc_delta_step")
                assert torch.equal(got[i], one), (kda, i)
            assert torch.equal(st, st1), kda
    finally:
        lib.vxc_set_threads(max(1, torch.get_num_threads()))
