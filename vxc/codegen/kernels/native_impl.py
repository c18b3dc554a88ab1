"""Native CPU kernels: the torch twins' single-token hot loops as compiled C (``native/vxc_cpu.c``).

A decode step is many small operations on a few KB of activations between GEMVs that stream the weights;
the torch twins spend most of that time in per-op dispatch and in temporaries (a Mamba2 step reads and
writes its [H, P, N] state four times). These functions run each such op in one pass, and the GEMVs with
AVX-512 (BF16 dot products for bf16 weights) over OpenMP threads shared with torch's own pool.

Each function has the signature of its ``torch_impl`` twin and falls back to the twin for anything it does
not cover (other dtypes, non-contiguous operands, sequences where only the single-token form is native).
The library is compiled at first use with the host C compiler into a cache directory (``VXC_CACHE_DIR``,
else ``$XDG_CACHE_HOME/vxc``, else ``~/.cache/vxc``) keyed by the source, flags, compiler and CPU;
``VXC_NATIVE=0`` turns it off. ``status()`` says whether it is loaded and, if not, why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from . import torch_impl

SOURCE = Path(__file__).parent / "native" / "vxc_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *os.environ.get("VXC_NATIVE_CFLAGS", "").split()]
ABI_VERSION = 11
MAX_STATE_N = 1024  # the SSD step keeps B and C rows of N <= 1024 on the stack
MAX_HEAD_DIM = 1024  # the attention step keeps one query row and one output row on the stack

_lib: Optional[ctypes.CDLL] = None
_why_not: Optional[str] = None
_tried = False

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "vxc_gemv": [_P, _P, _P, _P, _L, _L, _I],
    "vxc_swiglu_up": [_P, _P, _P, _P, _L, _L, _I],
    "vxc_add_rmsnorm": [_P, _P, _P, _P, _P, _L, _L, _F, _I, _I, _I, _I],
    "vxc_gated_rmsnorm": [_P, _P, _P, _P, _L, _L, _L, _F, _I, _I, _I, _I, _L, _L],
    "vxc_conv1d_prefill": [_P, _P, _P, _P, _P, _L, _L, _L, _I, _I, _I, _I, _L],
    "vxc_conv1d_step": [_P, _P, _P, _P, _P, _L, _L, _I, _I, _I, _I],
    "vxc_moe_router_step": [_P, _P, _P, _P, _P, _P, _L, _L, _I, _L, _I, _F, _L, _L, _I, _I, _I],
    "vxc_delta_step": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _F, _F, _I, _I, _I],
    "vxc_sigmoid_gate_mul": [_P, _P, _P, _L, _I],
    "vxc_mla_decode": [_P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _F, _F, _I, _I, _I, _I, _I, _I, _I],
    "vxc_moe_ffn_step": [_P, _P, _P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _I, _I, _F, _F, _I],
    "vxc_ssd_step": [_P, _P, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _L, _L, _L, _L, _I, _I],
    "vxc_embedding": [_P, _P, _P, _L, _L, _L],
    "vxc_rotary": [_P, _P, _P, _P, _L, _L, _L, _L, _I, _I, _I],
    "vxc_attention_step": [_P, _P, _P, _P, _P, _P, _L, _F, _L, _L, _L, _L, _P, _L, _L, _P, _I, _I],
}

# the torch.ops.vxc operators with a native single-token form (the others always run their twins)
NATIVE_OPS = frozenset({"linear", "swiglu", "add_rmsnorm", "gated_rmsnorm", "conv1d_step", "ssd_step", "embedding",
                        "rotary", "attention", "moe_router", "moe_experts", "moe_shared", "gated_delta_step",
                        "sigmoid_gate_mul", "kda_step", "mla_decode"})
MAX_TOP_K = 64  # the MoE step sorts its selected experts on the stack  # (conv1d_prefill is native too, but only prefill runs it)


def _cache_dir() -> Path:
    if os.environ.get("VXC_CACHE_DIR"):
        return Path(os.environ["VXC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vxc"


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), cc, *version, _cpu_key()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"vxc_cpu-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(str(out.parent))
    except OSError:  # an unwritable cache (read-only home): a per-user temporary directory
        out = Path(tempfile.gettempdir()) / f"vxc-{os.getuid()}" / out.name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-800:]}")
        os.replace(tmp, out)  # atomic: concurrent builders never see a partial library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> Optional[ctypes.CDLL]:
    """The compiled library, building it on first call; None (with ``status()`` saying why) if unavailable."""
    global _lib, _why_not, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("VXC_NATIVE", "1") == "0":
        _why_not = "disabled by VXC_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _why_not = "no C compiler found (set CC)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        if lib.vxc_abi_version() != ABI_VERSION:
            raise RuntimeError(f"library ABI {lib.vxc_abi_version()} != {ABI_VERSION}")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    except Exception as e:  # a broken toolchain leaves the torch twins in charge, and says so
        _why_not = f"native kernels unavailable: {e}"
        return None
    _lib = lib
    return lib


def available() -> bool:
    return load() is not None


def status() -> str:
    lib = load()
    if lib is None:
        return _why_not or "not loaded"
    return f"loaded ({'AVX-512 BF16' if lib.vxc_has_avx512bf16() else 'no AVX-512 BF16'})"


# ------------------------------------------------------------------------------------------------ recording
# A decode step made only of native calls can be captured (every call, with its raw arguments) and replayed
# without torch: ``vxc.runtime.replay``. While a Recorder is active, outputs come from its pool (the same
# buffers on every captured step, so the arguments of two captures line up), and a fallback to a twin marks
# the capture as unusable.


class Recorder:
    def __init__(self, pool: list[Tensor] | None = None):
        self.calls: list[tuple[str, tuple]] = []
        self.pool: list[Tensor] = [] if pool is None else pool
        self.next = 0
        self.failed: Optional[str] = None

    def out(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        i, self.next = self.next, self.next + 1
        if i == len(self.pool):
            self.pool.append(torch.empty(shape, dtype=dtype))
        t = self.pool[i]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            self.failed = f"output {i} changed shape between captured steps ({list(t.shape)} → {list(shape)})"
            return torch.empty(shape, dtype=dtype)
        return t


_rec: Optional[Recorder] = None


class recording:
    """``with recording(rec):`` native calls are recorded into ``rec`` (and still run)."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def __enter__(self) -> Recorder:
        global _rec
        self.prev, _rec = _rec, self.rec
        return self.rec

    def __exit__(self, *exc) -> None:
        global _rec
        _rec = self.prev


def _empty(*shape: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype) if _rec is None else _rec.out(shape, dtype)


def _call(name: str, *args) -> None:
    getattr(_lib, name)(*args)
    if _rec is not None:
        _rec.calls.append((name, args))


def refuse_capture(why: str) -> None:
    """Mark a step being captured as not replayable (work done outside native calls)."""
    if _rec is not None:
        _rec.failed = _rec.failed or why


def _twin(name: str):
    fn = getattr(torch_impl, name)
    if _rec is not None:
        _rec.failed = f"{name} ran its torch twin (not covered natively)"
    return fn


# ------------------------------------------------------------------------------------------------ helpers

_BF = {torch.bfloat16: 1, torch.float32: 0}


def _ok(*ts: Optional[Tensor]) -> bool:
    """The library is built (building it on first use) and every tensor is a contiguous fp32/bf16 CPU tensor."""
    return (_lib is not None or load() is not None) and all(t is None or (t.device.type == "cpu" and t.is_contiguous() and t.dtype in _BF) for t in ts)


def _p(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


# ------------------------------------------------------------------------------------------------ kernels
# (same signatures as torch_impl; anything not covered goes to the twin)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    if x.shape[0] == 1 and _ok(x, weight, bias) and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype):
        N, K = weight.shape
        y = _empty(1, N, dtype=x.dtype)
        _call("vxc_gemv", weight.data_ptr(), x.data_ptr(), _p(bias), y.data_ptr(), N, K, _BF[x.dtype])
        return y
    return _twin("linear")(x, weight, bias)


def swiglu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    if x.shape[0] == 1 and _ok(x, w_gate, w_up, w_down) and x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype:
        N, K = w_gate.shape
        h = _empty(N, dtype=x.dtype)
        bf = _BF[x.dtype]
        _call("vxc_swiglu_up", w_gate.data_ptr(), w_up.data_ptr(), x.data_ptr(), h.data_ptr(), N, K, bf)
        y = _empty(1, w_down.shape[0], dtype=x.dtype)
        _call("vxc_gemv", w_down.data_ptr(), h.data_ptr(), None, y.data_ptr(), w_down.shape[0], N, bf)
        return y
    return _twin("swiglu")(x, w_gate, w_up, w_down)


def add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, zero_centred: bool,
                residual_fp32: bool) -> tuple[Tensor, Tensor]:
    res_dtype = torch.float32 if residual_fp32 else x.dtype
    if _ok(x, residual, weight) and (residual is None or residual.dtype == res_dtype) and x.dim() == 2:
        T, D = x.shape
        out, new_res = _empty(T, D, dtype=x.dtype), _empty(T, D, dtype=res_dtype)
        _call("vxc_add_rmsnorm", x.data_ptr(), _p(residual), weight.data_ptr(), out.data_ptr(), new_res.data_ptr(),
                             T, D, eps, int(zero_centred), int(residual_fp32), _BF[x.dtype], _BF[weight.dtype])
        return out, new_res
    return _twin("add_rmsnorm")(x, residual, weight, eps, zero_centred, residual_fp32)


_ACT = {"none": 0, "silu": 1, "sigmoid": 2}


def _rows(t: Tensor) -> Optional[int]:
    """The row stride of ``t`` seen as [rows, last dim] when its rows are dense (e.g. a column slice of one
    projection's output), else None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    if t.is_contiguous():
        return t.shape[-1]
    return t.stride(0) if t.dim() == 2 else None


def _okv(*ts: Optional[Tensor]) -> bool:
    """As ``_ok``, but row-strided 2-d views are accepted (the kernel takes their row strides)."""
    return (_lib is not None or load() is not None) and all(
        t is None or (t.device.type == "cpu" and t.dtype in _BF and _rows(t) is not None) for t in ts)


def gated_rmsnorm(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int, norm_before_gate: bool,
                  act: str) -> Tensor:
    if _okv(x, z) and _ok(weight) and z.dtype == x.dtype and z.shape == x.shape and act in _ACT:
        D = x.shape[-1]
        out = _empty(*x.shape, dtype=x.dtype)
        _call("vxc_gated_rmsnorm", x.data_ptr(), z.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // D, D,
              group_size, eps, int(norm_before_gate), _ACT[act], _BF[x.dtype], _BF[weight.dtype], _rows(x), _rows(z))
        return out
    return _twin("gated_rmsnorm")(x, z, weight, eps, group_size, norm_before_gate, act)


def conv1d_prefill(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    if (_okv(x) and _ok(weight, bias, conv_state) and x.dim() == 2 and (bias is None or bias.dtype == weight.dtype)
            and activation in _ACT and x.shape[1] == weight.shape[0] == conv_state.shape[0]
            and weight.shape[1] == conv_state.shape[1]):
        T, C = x.shape
        out = _empty(T, C, dtype=x.dtype)
        _call("vxc_conv1d_prefill", x.data_ptr(), weight.data_ptr(), _p(bias), conv_state.data_ptr(), out.data_ptr(),
              T, C, weight.shape[1], _ACT[activation], _BF[x.dtype], _BF[weight.dtype], _BF[conv_state.dtype], _rows(x))
        return out
    return _twin("conv1d_prefill")(x, weight, bias, activation, conv_state)


def conv1d_step(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, conv_state: Tensor) -> Tensor:
    if _ok(x, weight, bias, conv_state) and (bias is None or bias.dtype == weight.dtype) and x.dim() == 1:
        C, K = weight.shape
        out = _empty(*x.shape, dtype=x.dtype)
        _call("vxc_conv1d_step", x.data_ptr(), weight.data_ptr(), _p(bias), conv_state.data_ptr(), out.data_ptr(), C, K,
                             _ACT[activation], _BF[x.dtype], _BF[weight.dtype], _BF[conv_state.dtype])
        return out
    return _twin("conv1d_step")(x, weight, bias, activation, conv_state)


def ssd_step(x: Tensor, dt: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
             dt_min: float, dt_max: float, ssm_state: Tensor) -> Tensor:
    w_dtypes = {A_log.dtype, D.dtype, dt_bias.dtype}
    if (_ok(x, dt, A_log, B, C, D, dt_bias, ssm_state) and ssm_state.dtype == torch.float32 and len(w_dtypes) == 1
            and dt.dtype == B.dtype == C.dtype == x.dtype and B.shape[-1] <= MAX_STATE_N):
        H, P = x.shape
        G, N = B.shape
        out = _empty(*x.shape, dtype=x.dtype)
        clamp = not (dt_min == 0.0 and dt_max == float("inf"))
        _call("vxc_ssd_step", x.data_ptr(), dt.data_ptr(), A_log.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                          dt_bias.data_ptr(), dt_min, dt_max if clamp else 0.0, int(clamp), ssm_state.data_ptr(),
                          out.data_ptr(), H, P, G, N, _BF[x.dtype], _BF[A_log.dtype])
        return out
    return _twin("ssd_step")(x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, ssm_state)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    if _ok(table) and ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 1 and table.dim() == 2:
        out = _empty(ids.shape[0], table.shape[1], dtype=table.dtype)
        _call("vxc_embedding", ids.data_ptr(), table.data_ptr(), out.data_ptr(), ids.shape[0], table.shape[1],
              table.element_size())
        return out
    return _twin("embedding")(ids, table)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if (_ok(x, cos, sin) and x.dim() == 3 and cos.dtype == sin.dtype and cos.shape == sin.shape and cos.dim() == 2
            and x.shape[-1] <= MAX_HEAD_DIM):
        T, H, Dh = x.shape
        out = _empty(T, H, Dh, dtype=x.dtype)
        _call("vxc_rotary", x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, H, Dh, 2 * cos.shape[-1],
              int(interleaved), _BF[x.dtype], _BF[cos.dtype])
        return out
    return _twin("rotary")(x, cos, sin, interleaved)


def attention_step(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: int, scale: float,
                   window: int = 0, sinks: Optional[Tensor] = None) -> Optional[Tensor]:
    """One query token natively, the sliding-window ring included (position p at cache row p % rows once the
    positions outgrow the rows); None where not covered."""
    rows = k_cache.shape[0]
    if not (q.shape[0] == 1 and _ok(q, k, v, k_cache, v_cache, sinks)
            and q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and (sinks is None or (sinks.dim() == 1 and sinks.shape[0] == q.shape[1]))
            and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM and window >= 0
            and (start < rows or 0 < window <= rows)):
        return None
    _, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    out = _empty(1, Hq, Dv, dtype=q.dtype)
    scratch = _empty(rows * Hq, dtype=torch.float32)
    _call("vxc_attention_step", q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
          out.data_ptr(), start, scale, Hq, Hkv, Dk, Dv, scratch.data_ptr(), rows, window, _p(sinks),
          _BF[sinks.dtype] if sinks is not None else 0, _BF[q.dtype])
    return out


def attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: int, scale: float,
              window: int = 0, sinks: Optional[Tensor] = None) -> Tensor:
    if start + q.shape[0] <= k_cache.shape[0]:
        out = attention_step(q, k, v, k_cache, v_cache, start, scale, window, sinks)
        if out is not None:
            return out
    return _twin("attention")(q, k, v, k_cache, v_cache, start, scale, window, sinks)


def __getattr__(name: str):
    """Every other kernel is the torch twin's."""
    return _twin(name)


# ------------------------------------------------------------------------------------------------ MoE (one token)

_MOE_ACT = {"silu": 1, "clamped_glu": 3}


def _bank(t: Optional[Tensor], dtype: torch.dtype) -> bool:
    """A CPU bank [E, rows, cols] at ``dtype`` whose experts are each one contiguous matrix (the bank itself may
    be a slice of a wider one: its expert stride is passed)."""
    return t is None or (t.device.type == "cpu" and t.dtype == dtype and t.dim() == 3 and t.stride(2) == 1
                         and t.stride(1) == t.shape[2])


def moe_experts(x: Tensor, weights: Tensor, experts: Tensor, w_in: Tensor, w_up: Optional[Tensor], w_down: Tensor,
                b_in: Optional[Tensor], b_down: Optional[Tensor], layout: str, act: str, alpha: Optional[float],
                limit: Optional[float]) -> Optional[Tensor]:
    """The routed experts of one token natively; None where not covered (the caller then runs the twin)."""
    if not (x.shape[0] == 1 and _ok(x, b_in, b_down) and x.dtype in _BF and act in _MOE_ACT
            and all(_bank(t, x.dtype) for t in (w_in, w_up, w_down))
            and all(b is None or b.dtype == x.dtype for b in (b_in, b_down))
            and weights.dtype == torch.float32 and weights.is_contiguous() and experts.dtype == torch.int64
            and experts.is_contiguous() and experts.shape[1] <= MAX_TOP_K and weights.shape == experts.shape):
        if _rec is not None:
            _rec.failed = "moe_experts ran its torch twin (not covered natively)"
        return None
    E = w_down.shape[0]
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= E):  # the kernel indexes the banks
        raise ValueError(f"expert ids {experts.tolist()} outside 0..{E - 1}")
    d, I = x.shape[1], w_down.shape[2]
    out = _empty(1, d, dtype=x.dtype)
    _call("vxc_moe_ffn_step", x.data_ptr(), experts.data_ptr(), weights.data_ptr(), experts.shape[1], w_in.data_ptr(),
          _p(w_up), w_down.data_ptr(), _p(b_in), _p(b_down), None, None, out.data_ptr(), d, I, w_in.stride(0),
          0 if w_up is None else w_up.stride(0), w_down.stride(0), int(layout == "fused_interleaved"), _MOE_ACT[act],
          0.0 if alpha is None else alpha, 0.0 if limit is None else limit, _BF[x.dtype])
    return out


def moe_shared(x: Tensor, routed: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               branch_gate: Optional[Tensor]) -> Optional[Tensor]:
    """The shared expert of one token added to the routed sum, natively; None where not covered."""
    if not (x.shape[0] == 1 and _ok(x, routed, w_gate, w_up, w_down, branch_gate)
            and x.dtype == routed.dtype == w_gate.dtype == w_up.dtype == w_down.dtype
            and (branch_gate is None or (branch_gate.dtype == x.dtype and branch_gate.shape[0] == 1))):
        if _rec is not None:
            _rec.failed = "moe_shared ran its torch twin (not covered natively)"
        return None
    d, I = x.shape[1], w_down.shape[1]
    out = _empty(1, d, dtype=x.dtype)
    _call("vxc_moe_ffn_step", x.data_ptr(), None, None, 1, w_gate.data_ptr(), w_up.data_ptr(), w_down.data_ptr(),
          None, None, _p(branch_gate), routed.data_ptr(), out.data_ptr(), d, I, 0, 0, 0, 0, 1, 0.0, 0.0, _BF[x.dtype])
    return out


_ROUTER = {"softmax_topk": 1, "sigmoid_grouped": 2, "topk_softmax": 3}
MAX_ROUTER_EXPERTS = 4096  # the router step keeps its logits on the stack
MAX_ROUTER_GROUPS = 256


def _not_native(name: str) -> None:
    if _rec is not None:
        _rec.failed = f"{name} ran its torch twin (not covered natively)"


def moe_router(x: Tensor, weight: Tensor, bias: Optional[Tensor], selection_bias: Optional[Tensor], router: str,
               top_k: int, norm_topk_prob: bool, routed_scaling: float, n_group: int,
               topk_group: int) -> Optional[tuple[Tensor, Tensor]]:
    """The router of one token natively; None where not covered."""
    E, d = weight.shape
    aux = [t for t in (bias, selection_bias) if t is not None]
    if not (x.shape[0] == 1 and _ok(x, weight, *aux) and x.dtype == weight.dtype and router in _ROUTER
            and E <= MAX_ROUTER_EXPERTS and top_k <= MAX_TOP_K and n_group <= MAX_ROUTER_GROUPS
            and all(t.dim() == 1 and t.shape[0] == E for t in aux)):
        _not_native("moe_router")
        return None
    vals, idx = _empty(1, top_k, dtype=torch.float32), _empty(1, top_k, dtype=torch.int64)
    _call("vxc_moe_router_step", x.data_ptr(), weight.data_ptr(), _p(bias), _p(selection_bias), vals.data_ptr(),
          idx.data_ptr(), E, d, _ROUTER[router], top_k, int(norm_topk_prob), routed_scaling, n_group, topk_group,
          _BF[x.dtype], _BF[bias.dtype] if bias is not None else 0,
          _BF[selection_bias.dtype] if selection_bias is not None else 0)
    return vals, idx


def _delta_step(name: str, kda: bool, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                dt_bias: Tensor, state: Tensor, scale: float, l2_eps: float) -> Optional[Tensor]:
    if not (_ok(q, k, v, a, b, A_log, dt_bias, state) and q.dtype == k.dtype == v.dtype == a.dtype == b.dtype
            and A_log.dtype == dt_bias.dtype and state.dtype == torch.float32 and q.dim() == v.dim() == 2
            and q.shape[-1] <= MAX_HEAD_DIM and v.shape[-1] <= MAX_HEAD_DIM):
        _not_native(name)
        return None
    (Hk, Dk), (Hv, Dv) = q.shape, v.shape
    o = _empty(Hv, Dv, dtype=v.dtype)
    _call("vxc_delta_step", q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr(), A_log.data_ptr(),
          dt_bias.data_ptr(), state.data_ptr(), o.data_ptr(), Hk, Hv, Dk, Dv, scale, l2_eps, int(kda), _BF[v.dtype],
          _BF[A_log.dtype])
    return o


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                     state: Tensor, scale: float, l2_eps: float) -> Optional[Tensor]:
    """One gated-delta token natively (fp32 state); None where not covered."""
    return _delta_step("gated_delta_step", False, q, k, v, a, b, A_log, dt_bias, state, scale, l2_eps)


def kda_step(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
             state: Tensor, scale: float, l2_eps: float) -> Optional[Tensor]:
    """One KDA token natively (fp32 state, per-key-channel decay); None where not covered."""
    return _delta_step("kda_step", True, q, k, v, f, b, A_log, dt_bias, state, scale, l2_eps)


def sigmoid_gate_mul(x: Tensor, gate: Tensor) -> Optional[Tensor]:
    """``x · σ(gate)`` natively for up to one token's worth of values; None where not covered."""
    if not (_ok(x, gate) and x.dtype == gate.dtype and x.shape == gate.shape and x.numel() <= 65536):
        _not_native("sigmoid_gate_mul")
        return None
    out = _empty(*x.shape, dtype=x.dtype)
    _call("vxc_sigmoid_gate_mul", x.data_ptr(), gate.data_ptr(), out.data_ptr(), x.numel(), _BF[x.dtype])
    return out


def mla_decode(q: Tensor, kv: Tensor, norm_w: Tensor, eps: float, w_kvb: Tensor, cos: Optional[Tensor],
               sin: Optional[Tensor], cache: Tensor, start: int, scale: float, nope: int, interleaved: bool,
               split_out: bool) -> Optional[Tensor]:
    """One MLA token (absorbed attention over the latent rows) natively; None where not covered."""
    if not (q.shape[0] == 1 and kv.shape[0] == 1 and _ok(q, kv, norm_w, w_kvb, cos, sin, cache)
            and q.dtype == kv.dtype and (cos is None) == (sin is None)):
        _not_native("mla_decode")
        return None
    _, H, NP = q.shape
    R = norm_w.shape[0]
    P = NP - nope
    V = w_kvb.shape[0] // H - nope
    if not (R <= MAX_HEAD_DIM and NP <= 2 * MAX_HEAD_DIM and V <= MAX_HEAD_DIM and P <= MAX_HEAD_DIM
            and (cos is None or cos.shape == (1, P // 2))):
        _not_native("mla_decode")
        return None
    out = _empty(1, H, V, dtype=q.dtype)
    _call("vxc_mla_decode", q.data_ptr(), kv.data_ptr(), norm_w.data_ptr(), w_kvb.data_ptr(), _p(cos), _p(sin),
          cache.data_ptr(), out.data_ptr(), H, nope, P, V, R, start, eps, scale, int(interleaved), int(split_out),
          _BF[q.dtype], _BF[norm_w.dtype], _BF[w_kvb.dtype], _BF[cos.dtype] if cos is not None else 0,
          _BF[cache.dtype])
    return out
