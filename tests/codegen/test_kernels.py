"""Tests of the kernel library ``vxc.codegen.kernels``.

(a) Every torch twin against a naive oracle written here straight from the math (loops, direct formulas, fp64),
(b) every Triton kernel against its torch twin at awkward shapes that need several Triton blocks, in fp32
    (tight) and bf16 (loose), and (c) prefill-then-decode chains against one prefill, on both backends.

How Triton 3.9 reads TRITON_INTERPRET (triton/knobs.py, triton/runtime/jit.py): ``knobs.runtime.interpret`` is
an ``env_bool`` read from the environment on every access; what it decides is made by ``@triton.jit``, which
returns an interpreted instead of a compiled kernel when the flag is set *as it decorates*. That happens for
vxc's kernels when ``vxc.codegen.kernels`` is imported, and for the library functions they call (``tl.zeros``,
``tl.sum``: ``@jit`` functions of ``triton.language.standard``) when triton itself is imported. So the flag
must be set before triton is first imported; torch 2.13's own import does not import triton, so it is set here
after torch (to leave CUDA machines compiled) and before vxc. If another test module imported triton first
without it, this process cannot run Triton on CPU: the Triton tests then run in a fresh process with the flag
set, and each reports its outcome there (``triton_test``). With CUDA they run compiled, on CUDA tensors.
"""

import inspect
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.library import opcheck  # noqa: E402

from vxc.codegen import kernels  # noqa: E402
from vxc.codegen.kernels.attention import attention_twin, rotary_twin  # noqa: E402
from vxc.codegen.kernels.conv import conv1d_prefill_twin, conv1d_step_twin  # noqa: E402
from vxc.codegen.kernels.dense import embedding_twin, linear_twin, swiglu_twin  # noqa: E402
from vxc.codegen.kernels.norms import add_rmsnorm_twin, gated_rmsnorm_twin  # noqa: E402
from vxc.codegen.kernels.ssd import ssd_prefill_twin, ssd_step_twin  # noqa: E402
from vxc.codegen.kernels.ssd import ssd_recurrent_reference  # noqa: E402
from vxc.codegen.kernels.torch_common import exp_clamped  # noqa: E402
from vxc.codegen.kernels.triton_common import INTERPRETED  # noqa: E402

TRITON_IN_PROCESS = torch.cuda.is_available() or INTERPRETED

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.vxc
INF = math.inf

# fp32: both sides compute in fp32. bf16: outputs round to 8 bits (and Triton's interpreter truncates rather
# than rounds when it casts to bf16), so a couple of bf16 ulps.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rand(*shape, scale=1.0, dtype=torch.float32, device=DEVICE):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def cpu(*shape, scale=1.0):
    """Inputs of the twin-vs-naive tests, which run on CPU whatever the machine."""
    return rand(*shape, scale=scale, device="cpu")


def assert_close(actual, expected, dtype=torch.float32):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def close_to_naive(actual, naive):
    """A twin (fp32) against a naive fp64 oracle."""
    torch.testing.assert_close(actual.double(), naive, **TOLERANCE[torch.float32])


def triton(op, *args, **kwargs):
    with kernels.backend("triton"):
        return op(*args, **kwargs)


_TRITON_TESTS: list[str] = []


def triton_test(test):
    """Mark a test that runs Triton kernels. Where this process cannot run them (see the module docstring),
    the test instead asserts the outcome it had, same id, in a fresh process with TRITON_INTERPRET=1."""
    _TRITON_TESTS.append(test.__name__)
    if TRITON_IN_PROCESS:
        return test

    def outcome_in_subprocess(request, triton_subprocess_failures, **params):
        node = request.node.name
        assert node in triton_subprocess_failures, f"{node} did not run in the Triton subprocess"
        failure = triton_subprocess_failures[node]
        assert failure is None, failure

    # pytest reads the test's parameters (and so its parametrize arguments) from the signature
    fixtures = ("request", "triton_subprocess_failures")
    parameters = [*inspect.signature(test).parameters.values()]
    parameters += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in fixtures]
    outcome_in_subprocess.__signature__ = inspect.Signature(parameters)
    outcome_in_subprocess.__name__ = test.__name__
    outcome_in_subprocess.pytestmark = getattr(test, "pytestmark", [])
    return outcome_in_subprocess


@pytest.fixture(scope="session")
def triton_subprocess_failures(tmp_path_factory):
    """``{test id: None if it passed else its failure text}`` for this file's Triton tests, run in a fresh
    process with TRITON_INTERPRET=1."""
    report = tmp_path_factory.mktemp("triton") / "report.xml"
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    command += ["-k", " or ".join(_TRITON_TESTS)]
    run = subprocess.run(
        command, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[2],
        capture_output=True, text=True,
    )
    assert report.exists(), f"the Triton subprocess wrote no report:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    failures = {}
    for case in ElementTree.parse(report).iter("testcase"):
        problems = [child for child in case if child.tag in ("failure", "error", "skipped")]
        text = "\n".join(f"{problem.get('message', '')}\n{problem.text or ''}" for problem in problems)
        failures[case.get("name")] = text or None
    return failures


# ----------------------------------------------------------------------------------------- naive oracles


def naive_rmsnorm(x, weight, eps):
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        out[t] = x[t] / torch.sqrt((x[t] ** 2).mean() + eps) * weight
    return out


def naive_conv(x, weight, bias, activation, state):
    """Inputs in time order, the K state columns first; output t sees the K inputs ending at x[t]."""
    K = weight.shape[1]
    seq = list(state.double().T) + list(x.double())
    w = weight.double()
    ys = []
    for t in range(x.shape[0]):
        y = sum(w[:, j] * seq[t + 1 + j] for j in range(K))
        if bias is not None:
            y = y + bias.double()
        ys.append(F.silu(y) if activation == "silu" else y)
    return torch.stack(ys), torch.stack(seq[-K:]).T


def naive_ssd(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, state):
    """The recurrence token by token, head by head, in fp64."""
    x, dt, B, C, state = x.double(), dt.double(), B.double(), C.double(), state.double().clone()
    T, H, _ = x.shape
    heads_per_group = H // B.shape[1]
    y = torch.empty_like(x)
    for t in range(T):
        for h in range(H):
            g = h // heads_per_group
            step = F.softplus(dt[t, h] + dt_bias[h].double())
            if (dt_min, dt_max) != (0.0, INF):
                step = step.clamp(dt_min, dt_max)
            decay = torch.exp(-step * torch.exp(A_log[h].double()))
            state[h] = decay * state[h] + step * torch.outer(x[t, h], B[t, g])
            y[t, h] = state[h] @ C[t, g] + D[h].double() * x[t, h]
    return y, state


def naive_rotary(x, cos, sin, interleaved):
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = cos.shape[-1]
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = cos[:, None, i], sin[:, None, i]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def naive_attention(q, k, v, k_cache, v_cache, start, scale, window, sinks):
    T, Hq, _ = q.shape
    keys, values = k_cache.double().clone(), v_cache.double().clone()
    keys[start : start + T], values[start : start + T] = k.double(), v.double()
    group = Hq // k.shape[1]
    out = torch.empty(T, Hq, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        pos = start + t
        rows = [s for s in range(pos + 1) if window == 0 or s > pos - window]
        for h in range(Hq):
            logits = keys[rows, h // group] @ q[t, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            weights = torch.exp(logits - logits.max())
            weights = weights / weights.sum()
            out[t, h] = weights[: len(rows)] @ values[rows, h // group]
    return out, keys, values


# --------------------------------------------------------------------------------- (a) twins vs naive


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_twin(zero_centred, with_residual):
    x, residual, weight = cpu(37, 200), cpu(37, 200), cpu(200)
    normed, new_residual = add_rmsnorm_twin(
        x, residual if with_residual else None, weight, 1e-6, zero_centred, residual_fp32=False
    )
    r = x.double() + (residual.double() if with_residual else 0.0)
    close_to_naive(new_residual, r)
    close_to_naive(normed, naive_rmsnorm(r, 1.0 + weight.double() if zero_centred else weight.double(), 1e-6))


def test_add_rmsnorm_residual_dtypes():
    x, residual, weight = rand(5, 16, dtype=torch.bfloat16), rand(5, 16), rand(16)
    normed, kept = ops.add_rmsnorm(x, residual, weight, 1e-6, False, True)
    assert (normed.dtype, kept.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(kept, x.float() + residual)
    assert ops.add_rmsnorm(x, None, weight, 1e-6, False, False)[1].dtype == torch.bfloat16


@pytest.mark.parametrize("norm_before_gate, act", [(False, "silu"), (True, "sigmoid")])
def test_gated_rmsnorm_twin(norm_before_gate, act):
    x, z, weight = cpu(37, 200), cpu(37, 200), cpu(200)
    out = gated_rmsnorm_twin(x, z, weight, 1e-5, 50, norm_before_gate, act)
    x, z, weight = x.double(), z.double(), weight.double()
    gate = F.silu(z) if act == "silu" else torch.sigmoid(z)
    h = x if norm_before_gate else x * gate
    expected = torch.cat([naive_rmsnorm(h[:, g : g + 50], weight[g : g + 50], 1e-5) for g in range(0, 200, 50)], 1)
    close_to_naive(out, expected * gate if norm_before_gate else expected)


@pytest.mark.parametrize("T", [37, 2])
def test_conv1d_prefill_twin(T):
    x, weight, bias, state = cpu(T, 97), cpu(97, 4), cpu(97), cpu(97, 4)
    expected_y, expected_state = naive_conv(x, weight, bias, "silu", state)
    close_to_naive(conv1d_prefill_twin(x, weight, bias, "silu", state), expected_y)
    close_to_naive(state, expected_state)


def test_conv1d_step_twin():
    x, weight, state = cpu(97), cpu(97, 4), cpu(97, 4)
    expected_y, expected_state = naive_conv(x[None], weight, None, "none", state)
    close_to_naive(conv1d_step_twin(x, weight, None, "none", state), expected_y[0])
    close_to_naive(state, expected_state)


def ssd_inputs(T, H=6, P=12, G=2, N=10, dtype=torch.float32, device=DEVICE):
    def r(*shape, scale=1.0):
        return rand(*shape, scale=scale, dtype=dtype, device=device)

    x, dt, B, C = r(T, H, P), r(T, H), r(T, G, N), r(T, G, N)
    A_log, D, dt_bias = r(H, scale=0.5).float(), r(H).float(), r(H, scale=0.5).float()
    return x, dt, A_log, B, C, D, dt_bias


@pytest.mark.parametrize("T, chunk_size", [(37, 16), (5, 16), (32, 8), (150, 256)])
@pytest.mark.parametrize("dt_limit", [(0.0, INF), (0.05, 0.8)])
def test_ssd_prefill_twin(T, chunk_size, dt_limit):
    """Chunked SSD with a short last chunk (37 = 16+16+5), a sequence shorter than one chunk, exact chunks,
    and a declared chunk longer than the CPU's blocking (150 tokens of chunk 256: blocks of 64, 64, 22)."""
    inputs = ssd_inputs(T, device="cpu")
    state = cpu(6, 12, 10)
    expected_y, expected_state = naive_ssd(*inputs, *dt_limit, state)
    y = ssd_prefill_twin(*inputs, *dt_limit, state, chunk_size)
    close_to_naive(y, expected_y)
    close_to_naive(state, expected_state)


def test_exp_clamped():
    """Exponents below UNDERFLOW (-60) count as -60: never a subnormal or an exp(-inf); the rest are exp itself."""
    d = torch.tensor([0.0, -1.5, -59.0, -61.0, -88.0, -100.0, -math.inf])
    got = exp_clamped(d)
    e60 = math.exp(-60.0)
    torch.testing.assert_close(got, torch.tensor([1.0, math.exp(-1.5), math.exp(-59.0), e60, e60, e60, e60]),
                               rtol=1e-6, atol=0.0)
    assert (got >= torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("T", [150, 37])
def test_ssd_prefill_twin_strong_decay(T):
    """Decay rates of a real Mamba2 init (A in [-16, -1], dt ~ softplus(N(0, 1) + 1)): over a 64-token block
    the exponents reach -100 and beyond, where exp would give subnormals; the flushed twin still matches the
    fp64 recurrence."""
    H, P, G, N = 6, 12, 2, 10
    x, dt, B, C = cpu(T, H, P), cpu(T, H) + 1.0, cpu(T, G, N), cpu(T, G, N)
    A_log = torch.log(torch.linspace(1.0, 16.0, H, dtype=torch.float64)).float()
    D, dt_bias = cpu(H), cpu(H, scale=0.5)
    state = cpu(H, P, N)
    expected_y, expected_state = naive_ssd(x, dt, A_log, B, C, D, dt_bias, 0.0, INF, state)
    y = ssd_prefill_twin(x, dt, A_log, B, C, D, dt_bias, 0.0, INF, state, 256)
    close_to_naive(y, expected_y)
    close_to_naive(state, expected_state)


def test_ssd_recurrent_reference_and_step_twin():
    inputs = ssd_inputs(9, device="cpu")
    state = cpu(6, 12, 10)
    expected_y, expected_state = naive_ssd(*inputs, 0.0, INF, state)
    y, final = ssd_recurrent_reference(*inputs, 0.0, INF, state)
    close_to_naive(y, expected_y)
    close_to_naive(final, expected_state)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [12, 20])
def test_rotary_twin(interleaved, rotary_dim):
    x, cos, sin = cpu(37, 6, 20), cpu(37, rotary_dim // 2), cpu(37, rotary_dim // 2)
    close_to_naive(rotary_twin(x, cos, sin, interleaved), naive_rotary(x, cos, sin, interleaved))


ATTENTION_CASES = [  # (Hq, Hkv, window, sinks)
    (6, 6, 0, False),
    (6, 2, 0, False),
    (6, 3, 4, False),
    (6, 2, 0, True),
    (4, 1, 5, True),
]


def attention_inputs(T, Hq, Hkv, S=48, Dk=20, Dv=12, dtype=torch.float32, device=DEVICE):
    """q, k, v and caches already holding older rows."""
    shapes = [(T, Hq, Dk), (T, Hkv, Dk), (T, Hkv, Dv), (S, Hkv, Dk), (S, Hkv, Dv)]
    return tuple(rand(*shape, dtype=dtype, device=device) for shape in shapes)


@pytest.mark.parametrize("Hq, Hkv, window, with_sinks", ATTENTION_CASES)
def test_attention_twin(Hq, Hkv, window, with_sinks):
    start, T = 5, 9
    q, k, v, k_cache, v_cache = attention_inputs(T, Hq, Hkv, device="cpu")
    k_cache[start + T :], v_cache[start + T :] = math.nan, math.nan  # never read: a read would show as NaN
    sinks = cpu(Hq) if with_sinks else None
    expected, keys, values = naive_attention(q, k, v, k_cache, v_cache, start, 0.3, window, sinks)
    out = attention_twin(q, k, v, k_cache, v_cache, start, 0.3, window, sinks)
    close_to_naive(out, expected)
    close_to_naive(k_cache[: start + T], keys[: start + T])
    close_to_naive(v_cache[: start + T], values[: start + T])


def test_linear_swiglu_embedding_twins():
    x, weight, bias = cpu(37, 200), cpu(97, 200, scale=0.1), cpu(97)
    close_to_naive(linear_twin(x, weight, bias), x.double() @ weight.double().T + bias.double())
    w_gate, w_up, w_down = (cpu(*s, scale=0.1) for s in [(70, 200), (70, 200), (200, 70)])
    xd = x.double()
    expected = (F.silu(xd @ w_gate.double().T) * (xd @ w_up.double().T)) @ w_down.double().T
    close_to_naive(swiglu_twin(x, w_gate, w_up, w_down), expected)
    ids, table = torch.tensor([3, 0, 49, 3, 17]), cpu(50, 200)
    close_to_naive(embedding_twin(ids, table), torch.stack([table[i].double() for i in ids.tolist()]))


def test_fp32_gemm_takes_onednn_and_keeps_its_values(monkeypatch):
    """fp32 GEMMs of 2 or more contiguous CPU rows run on oneDNN (``dense.ONEDNN_FP32``, 1.5-1.8x MKL on the
    prefill's shapes), at fp32's floor against fp64 (bias or none, awkward sizes, long sums), the same values on a
    second call; one row, bf16 and strided operands keep ``F.linear``. Where the build has no oneDNN linear the
    twin is F.linear throughout."""
    from vxc.codegen.kernels import dense

    if dense.ONEDNN_FP32 is None:
        pytest.skip("this torch build has no mkldnn::_linear_pointwise")
    calls = []
    real = dense.ONEDNN_FP32
    monkeypatch.setattr(dense, "ONEDNN_FP32", lambda *a: calls.append(a) or real(*a))
    for T, K, N, with_bias in [(2, 200, 97, True), (37, 2101, 131, False), (129, 640, 1030, True)]:
        x, w, b = cpu(T, K), cpu(N, K, scale=K ** -0.5), cpu(N)
        bias = b if with_bias else None
        n = len(calls)
        got = dense.gemm(x, w, bias)
        assert len(calls) == n + 1
        want = x.double() @ w.double().T + (b.double() if with_bias else 0)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)
        assert torch.equal(got, dense.gemm(x, w, bias))
        close_to_naive(linear_twin(x, w, bias), want)
    n = len(calls)
    x, w = cpu(5, 64), cpu(33, 64)
    for args in [(x[:1], w), (x.bfloat16(), w.bfloat16()), (x.t().contiguous().t()[:, :60], w[:, :60])]:
        dense.gemm(*args)
    assert len(calls) == n


# ------------------------------------------------------------------------------ (b) Triton vs the twins


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "residual_dtype, zero_centred, residual_fp32",
    [(None, False, False), ("same", False, False), (torch.float32, True, True), ("same", True, False)],
)
def test_add_rmsnorm_triton(dtype, residual_dtype, zero_centred, residual_fp32):
    x, weight = rand(37, 200, dtype=dtype), rand(200)
    if residual_dtype is not None:
        residual = rand(37, 200, dtype=dtype if residual_dtype == "same" else residual_dtype)
    else:
        residual = None
    args = (x, residual, weight, 1e-6, zero_centred, residual_fp32)
    for actual, expected in zip(triton(ops.add_rmsnorm, *args), add_rmsnorm_twin(*args)):
        assert_close(actual, expected, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate, act", [(False, "silu"), (True, "sigmoid")])
def test_gated_rmsnorm_triton(dtype, norm_before_gate, act):
    x, z, weight = rand(37, 200, dtype=dtype), rand(37, 200, dtype=dtype), rand(200)
    args = (x, z, weight, 1e-5, 40, norm_before_gate, act)
    assert_close(triton(ops.gated_rmsnorm, *args), gated_rmsnorm_twin(*args), dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, with_bias, activation", [(37, True, "silu"), (37, False, "none"), (2, True, "silu")])
def test_conv1d_prefill_triton(dtype, T, with_bias, activation):
    x, weight, bias = rand(T, 97, dtype=dtype), rand(97, 4, dtype=dtype), rand(97, dtype=dtype)
    state = rand(97, 4)  # an fp32 history for a bf16 stream
    args = (x, weight, bias if with_bias else None, activation)
    state_triton, state_torch = state.clone(), state.clone()
    assert_close(triton(ops.conv1d_prefill, *args, state_triton), conv1d_prefill_twin(*args, state_torch), dtype)
    assert_close(state_triton, state_torch, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_step_triton(dtype):
    x, weight, bias, state = (rand(*shape, dtype=dtype) for shape in [(97,), (97, 4), (97,), (97, 4)])
    state_triton, state_torch = state.clone(), state.clone()
    actual = triton(ops.conv1d_step, x, weight, bias, "silu", state_triton)
    assert_close(actual, conv1d_step_twin(x, weight, bias, "silu", state_torch), dtype)
    assert_close(state_triton, state_torch, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, dt_limit", [(37, (0.0, INF)), (70, (0.05, 0.8)), (3, (0.0, INF))])
def test_ssd_prefill_triton(dtype, T, dt_limit):
    inputs = ssd_inputs(T, dtype=dtype)
    state = rand(6, 12, 10)
    state_triton, state_torch = state.clone(), state.clone()
    actual = triton(ops.ssd_prefill, *inputs, *dt_limit, state_triton, 16)
    assert_close(actual, ssd_prefill_twin(*inputs, *dt_limit, state_torch, 16), dtype)
    assert_close(state_triton, state_torch, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dt_limit", [(0.0, INF), (0.05, 0.8)])
def test_ssd_step_triton(dtype, dt_limit):
    x, dt, A_log, B, C, D, dt_bias = (t[0] if t.dim() > 1 else t for t in ssd_inputs(1, P=40, dtype=dtype))
    state = rand(6, 40, 10)
    state_triton, state_torch = state.clone(), state.clone()
    actual = triton(ops.ssd_step, x, dt, A_log, B, C, D, dt_bias, *dt_limit, state_triton)
    assert_close(actual, ssd_step_twin(x, dt, A_log, B, C, D, dt_bias, *dt_limit, state_torch), dtype)
    assert_close(state_triton, state_torch, dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [12, 20])
def test_rotary_triton(dtype, interleaved, rotary_dim):
    x, cos, sin = rand(37, 6, 20, dtype=dtype), rand(37, rotary_dim // 2), rand(37, rotary_dim // 2)
    assert_close(triton(ops.rotary, x, cos, sin, interleaved), rotary_twin(x, cos, sin, interleaved), dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, window, with_sinks", ATTENTION_CASES)
@pytest.mark.parametrize("start, T", [(5, 37), (40, 1)])
def test_attention_triton(dtype, Hq, Hkv, window, with_sinks, start, T):
    q, k, v, k_cache, v_cache = attention_inputs(T, Hq, Hkv, S=start + T + 3, dtype=dtype)
    k_cache[start + T :], v_cache[start + T :] = math.nan, math.nan  # never read: a read would show as NaN
    sinks = rand(Hq) if with_sinks else None
    caches_triton = (k_cache.clone(), v_cache.clone())
    actual = triton(ops.attention, q, k, v, *caches_triton, start, 0.3, window, sinks)
    expected = attention_twin(q, k, v, k_cache, v_cache, start, 0.3, window, sinks)
    assert_close(actual, expected, dtype)
    assert_close(caches_triton[0][: start + T], k_cache[: start + T], dtype)
    assert_close(caches_triton[1][: start + T], v_cache[: start + T], dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, with_bias", [(37, True), (1, False)])
def test_linear_triton(dtype, T, with_bias):
    x, weight, bias = rand(T, 200, dtype=dtype), rand(97, 200, scale=0.1, dtype=dtype), rand(97, dtype=dtype)
    args = (x, weight, bias if with_bias else None)
    assert_close(triton(ops.linear, *args), linear_twin(*args), dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [37, 1])
def test_swiglu_triton(dtype, T):
    x = rand(T, 200, dtype=dtype)
    w_gate, w_up, w_down = (rand(*s, scale=0.1, dtype=dtype) for s in [(70, 200), (70, 200), (200, 70)])
    assert_close(triton(ops.swiglu, x, w_gate, w_up, w_down), swiglu_twin(x, w_gate, w_up, w_down), dtype)


@triton_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_triton(dtype):
    ids, table = torch.tensor([3, 0, 49, 3, 17], device=DEVICE), rand(50, 1100, dtype=dtype)
    assert torch.equal(triton(ops.embedding, ids, table), embedding_twin(ids, table))


# ----------------------------------------------------------------- (c) prefill then decode == one prefill


BACKENDS = ["torch", "triton"]


@triton_test
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv1d_prefill_then_steps(backend):
    x, weight, bias = rand(37, 97), rand(97, 4), rand(97)
    initial = rand(97, 4)
    state_full, state = initial.clone(), initial.clone()
    with kernels.backend(backend):
        y_full = ops.conv1d_prefill(x, weight, bias, "silu", state_full)
        ys = [ops.conv1d_prefill(x[:30], weight, bias, "silu", state)]
        ys += [ops.conv1d_step(x[t], weight, bias, "silu", state)[None] for t in range(30, 37)]
    assert_close(torch.cat(ys), y_full)
    assert_close(state, state_full)


@triton_test
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_prefill_then_steps(backend):
    inputs = ssd_inputs(37)
    x, dt, A_log, B, C, D, dt_bias = inputs
    initial = rand(6, 12, 10)
    expected_y, expected_state = ssd_recurrent_reference(*inputs, 0.0, INF, initial)
    state_full, state = initial.clone(), initial.clone()
    with kernels.backend(backend):
        y_full = ops.ssd_prefill(*inputs, 0.0, INF, state_full, 16)
        ys = [ops.ssd_prefill(x[:20], dt[:20], A_log, B[:20], C[:20], D, dt_bias, 0.0, INF, state, 16)]
        ys += [ops.ssd_step(x[t], dt[t], A_log, B[t], C[t], D, dt_bias, 0.0, INF, state)[None] for t in range(20, 37)]
    for y, final in [(y_full, state_full), (torch.cat(ys), state)]:
        assert_close(y, expected_y)
        assert_close(final, expected_state)


@triton_test
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hq, Hkv, window, with_sinks", [(6, 2, 0, False), (6, 3, 4, True)])
def test_attention_prefill_then_decode(backend, Hq, Hkv, window, with_sinks):
    T, S = 37, 40
    q, k, v, _, _ = attention_inputs(T, Hq, Hkv)
    sinks = rand(Hq) if with_sinks else None

    def empty_caches():
        return torch.zeros(S, Hkv, 20, device=DEVICE), torch.zeros(S, Hkv, 12, device=DEVICE)

    with kernels.backend(backend):
        full = ops.attention(q, k, v, *empty_caches(), 0, 0.3, window, sinks)
        caches = empty_caches()
        outs = [ops.attention(q[:30], k[:30], v[:30], *caches, 0, 0.3, window, sinks)]
        for t in range(30, T):
            outs.append(ops.attention(q[t : t + 1], k[t : t + 1], v[t : t + 1], *caches, t, 0.3, window, sinks))
    assert_close(torch.cat(outs), full)


# ------------------------------------------------------------------------- registration and dispatch


def opcheck_cases():
    T, H, P, G, N = 5, 4, 8, 2, 6
    yield ops.add_rmsnorm, (rand(T, 16, dtype=torch.bfloat16), rand(T, 16), rand(16), 1e-6, True, True)
    yield ops.add_rmsnorm, (rand(T, 16), None, rand(16), 1e-6, False, False)
    yield ops.gated_rmsnorm, (rand(T, 12), rand(T, 12), rand(12), 1e-5, 4, False, "silu")
    yield ops.conv1d_prefill, (rand(T, 9), rand(9, 4), None, "silu", rand(9, 4))
    yield ops.conv1d_step, (rand(9), rand(9, 4), rand(9), "none", rand(9, 4))
    ssd = (rand(H), rand(G, N), rand(G, N), rand(H), rand(H), 0.0, INF, rand(H, P, N))
    yield ops.ssd_prefill, (rand(T, H, P), rand(T, H), rand(H), rand(T, G, N), rand(T, G, N), *ssd[3:], 4)
    yield ops.ssd_step, (rand(H, P), rand(H), *ssd)
    yield ops.rotary, (rand(T, 3, 10), rand(T, 4), rand(T, 4), True)
    q, k, v, k_cache, v_cache = attention_inputs(T, 4, 2, S=16, Dk=8, Dv=8)
    yield ops.attention, (q, k, v, k_cache, v_cache, 3, 0.3, 4, rand(4))
    yield ops.linear, (rand(T, 12), rand(5, 12), rand(5))
    yield ops.swiglu, (rand(T, 12), rand(5, 12), rand(5, 12), rand(12, 5))
    yield ops.embedding, (torch.tensor([1, 4, 0], device=DEVICE), rand(5, 8))


@triton_test
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    """Schemas, mutation declarations and fakes (the shapes torch.fx / torch.compile trace with)."""
    with kernels.backend(backend):
        for op, args in opcheck_cases():
            opcheck(op.default, args)


def test_backend_switch():
    tensor = torch.zeros(1, device=DEVICE)
    assert kernels.get_backend() == "auto"
    from vxc.codegen.kernels import native

    if native.available():
        assert kernels.select(torch.zeros(1)) == "native"  # CPU tensors: the native kernels
        with kernels.backend("native"):
            assert kernels.select(torch.zeros(1)) == "native"
    else:  # VXC_NATIVE=0 (or no compiler): the twins, and forcing native is an error that says why
        assert kernels.select(torch.zeros(1)) == "torch"
        with kernels.backend("native"), pytest.raises(RuntimeError, match="native backend is unavailable"):
            kernels.select(torch.zeros(1))
    with kernels.backend("triton"):
        assert kernels.get_backend() == "triton"
        if TRITON_IN_PROCESS:
            assert kernels.select(tensor) == "triton"
        else:
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                kernels.select(tensor)
        with kernels.backend("torch"):
            assert kernels.select(tensor) == "torch"
    assert kernels.get_backend() == "auto"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.set_backend("cuda")


def test_argument_checks():
    with pytest.raises(ValueError, match="activation"):
        ops.conv1d_step(rand(4), rand(4, 3), None, "sigmoid", rand(4, 3))
    with pytest.raises(ValueError, match="group_size"):
        ops.gated_rmsnorm(rand(2, 12), rand(2, 12), rand(12), 1e-5, 5, False, "silu")
    with pytest.raises(ValueError, match="do not fit"):
        ops.attention(rand(3, 2, 8), rand(3, 2, 8), rand(3, 2, 8), rand(4, 2, 8), rand(4, 2, 8), 2, 0.3)
