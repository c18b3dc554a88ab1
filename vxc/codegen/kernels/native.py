"""The native CPU library (``native/vxc_cpu.c``): build, load, ABI check, the ctypes call and the decode
capture. The C functions' Python bindings live in the kernel family files, each with its ctypes signature
(``declare``) next to the code that calls it.

A decode step is many small operations on a few KB of activations between GEMVs that stream the weights;
the torch twins spend most of that time in per-op dispatch and in temporaries (a Mamba2 step reads and
writes its [H, P, N] state four times). The native implementations run each such op in one pass, and the
GEMVs with AVX-512 (BF16 dot products for bf16 weights) over OpenMP threads shared with torch's own pool.

The library is compiled at first use (``vxc.native_build``, which ``python -m vxc.native_build`` runs ahead) with
the host C compiler into a cache directory (``VXC_CACHE_DIR``,
else ``$XDG_CACHE_HOME/vxc``, else ``~/.cache/vxc``) keyed by the source, flags, compiler and CPU;
``VXC_NATIVE=0`` turns it off, ``VXC_NATIVE_CFLAGS`` adds compiler flags (e.g. ``-mno-avx512f``). GCC code-generates
it in parallel on every CPU the process may use, and processes wanting the same library at once build it once.
``status()`` says whether it is loaded and, if not, why. Its ABI version is the ``VXC_ABI_VERSION`` the
source defines, checked against the loaded library's ``vxc_abi_version()``.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Optional

import torch
from torch import Tensor

from ...native_build import FLAGS, SOURCE, _build, _compiler, _cpu_key  # noqa: F401 (the build, without torch)
MAX_HEAD_DIM = 1024  # the attention / delta / MLA steps keep a few head rows on the stack

# ctypes argument types for the bindings' signatures
P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float

SIGNATURES: dict[str, list] = {}  # C symbol -> ctypes argtypes, filled by ``declare`` in the family files

_lib: Optional[ctypes.CDLL] = None
_why_not: Optional[str] = None
_tried = False


def abi_version() -> int:
    """The ``VXC_ABI_VERSION`` the C source defines."""
    m = re.search(r"^#define VXC_ABI_VERSION (\d+)$", SOURCE.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{SOURCE} defines no VXC_ABI_VERSION")
    return int(m.group(1))


def declare(symbol: str, *argtypes) -> str:
    """Declare the ctypes signature of the C function ``symbol`` (returns void); returns the symbol."""
    SIGNATURES[symbol] = list(argtypes)
    if _lib is not None:
        _bind(_lib, symbol)
    return symbol


def _bind(lib: ctypes.CDLL, symbol: str) -> None:
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = SIGNATURES[symbol], None


def amx_bf16() -> bool:
    """Whether the CPU advertises AMX bf16 tiles (torch's oneDNN half-precision kernels run on them; a choice
    between a native fp32-widening form and torch's bf16 one reads this)."""
    global _AMX
    if _AMX is None:
        _AMX = "amx_bf16" in _cpu_key().split()
    return _AMX


_AMX: Optional[bool] = None


_ON_LOAD: list = []  # set-up run on the library once loaded (tables handed to it): a failure leaves it unloaded


def on_load(fn) -> None:
    """Run ``fn(lib)`` when the library loads (now, if it already has)."""
    _ON_LOAD.append(fn)
    if _lib is not None:
        fn(_lib)


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
        want = abi_version()
        if lib.vxc_abi_version() != want:
            raise RuntimeError(f"library ABI {lib.vxc_abi_version()} != {want}")
        for symbol in SIGNATURES:
            _bind(lib, symbol)
        for fn in _ON_LOAD:
            fn(lib)
        if _limit:
            lib.vxc_set_threads(_limit)
    except Exception as e:  # a broken toolchain leaves the torch twins in charge, and says so
        _why_not = f"native kernels unavailable: {e}"
        return None
    _lib = lib
    return lib


_SET_THREADS = declare("vxc_set_threads", I)


def max_threads() -> int:
    """The thread count the library's parallel regions start from (OMP_NUM_THREADS, else the CPUs available; at
    most ``limit_threads``' count); like ``vxc_abi_version``, a query returning int, not a kernel (``SIGNATURES``
    holds the void kernels)."""
    lib = load()
    if lib is None:
        return 1
    fn = lib.vxc_max_threads
    fn.argtypes, fn.restype = [], ctypes.c_int
    n = int(fn())
    return min(n, _limit) if _limit else n


_limit: Optional[int] = None  # limit_threads' count (None: none)


def limit_threads(n: int) -> None:
    """At most ``n`` threads in this process's parallel regions from now on (a tensor-parallel rank sharing the
    machine with its neighbours): torch's, and the library's in the calling thread (OpenMP keeps the count per
    thread: a thread that steps an engine later calls :func:`apply_thread_limit`)."""
    global _limit
    import torch

    _limit = max(1, int(n))
    torch.set_num_threads(_limit)
    apply_thread_limit()


def apply_thread_limit() -> None:
    """Bring the calling thread's parallel regions under ``limit_threads``' count (nothing without one)."""
    if _limit and _lib is not None:
        _lib.vxc_set_threads(_limit)


def available() -> bool:
    return _lib is not None if _tried else load() is not None


def status() -> str:
    lib = load()
    if lib is None:
        return _why_not or "not loaded"
    return f"loaded ({'AVX-512 BF16' if lib.vxc_has_avx512bf16() else 'no AVX-512 BF16'})"


# ------------------------------------------------------------------------------------------------ recording
# A decode step made only of native calls can be captured (every call, with its raw arguments) and replayed
# without torch: ``vxc.runtime.replay``. While a Recorder is active, outputs come from its pool (the same
# buffers on every captured step, so the arguments of two captures line up), and a fallback to a twin (the
# dispatcher calls ``refuse_capture``) marks the capture as unusable.


class Recorder:
    def __init__(self, pool: list[Tensor] | None = None):
        self.calls: list[tuple[str, tuple]] = []
        self.labels: list[tuple[str, str]] = []  # each call's (vxc op, weight encoding) as the capture saw it
        self.label: tuple[str, str] = ("", "")  # the op being dispatched (set by the replay's dispatch guard)
        self.pool: list[Tensor] = [] if pool is None else pool
        self.next = 0
        self.failed: Optional[str] = None

    def out(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        i, self.next = self.next, self.next + 1
        if i == len(self.pool):
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # (the pool's own allocation is not work of the step being watched)
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


def empty(*shape: int, dtype: torch.dtype) -> Tensor:
    """An output buffer: fresh, or the capture's pooled one while recording."""
    return torch.empty(shape, dtype=dtype) if _rec is None else _rec.out(shape, dtype)


def call(symbol: str, *args) -> None:
    """Call the C function ``symbol`` (recorded while capturing)."""
    getattr(_lib, symbol)(*args)
    if _rec is not None:
        _rec.calls.append((symbol, args))
        _rec.labels.append(_rec.label)


def call_py(fn, *args: int) -> None:
    """Call the Python function ``fn`` with integer arguments (raw pointers, sizes), recorded while capturing like a
    C call: work that is not a C kernel but runs on the capture's pooled buffers alone (a collective writing into a
    fixed buffer), so a replay can repeat it as it is."""
    fn(*args)
    if _rec is not None:
        _rec.calls.append((fn, args))
        _rec.labels.append(_rec.label)


def tensor_at(address: int, numel: int, dtype: torch.dtype) -> Tensor:
    """A CPU tensor of ``numel`` elements viewing the memory at ``address`` (a buffer the caller keeps alive)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype, count=numel)


_COPY_ROWS = declare("vxc_copy_rows", P, L, P, L, L)


def dense_rows(t: Tensor) -> Tensor:
    """``t`` as a contiguous tensor: itself when it is; a native copy (a recorded call into an output buffer, so a
    captured step stays native) when its rows (dim 0) are dense blocks a fixed stride apart, e.g. a column slice of
    one projection's [B, total] output seen as [B, H, P]; else ``t.contiguous()``."""
    if t.is_contiguous() or t.dim() == 0 or _lib is None or t.device.type != "cpu":
        return t if t.is_contiguous() else t.contiguous()
    rows = t.shape[0]
    inner, expect = 1, 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return t.contiguous()
        expect *= size
        inner *= size
    out = empty(*t.shape, dtype=t.dtype)
    es = t.element_size()
    call(_COPY_ROWS, t.data_ptr(), t.stride(0) * es, out.data_ptr(), rows, inner * es)
    return out


def rounded(s: float, dtype: torch.dtype) -> float:
    """``s`` rounded to ``dtype`` (fp32 or bf16, to nearest even), as ``float(torch.tensor(s, dtype=dtype))`` gives it,
    without a torch op (a captured step runs only native calls)."""
    import struct

    try:
        bits = struct.unpack("<I", struct.pack("<f", s))[0]
    except OverflowError:  # (past the fp32 range: torch's rounding to ±inf)
        return float(torch.tensor(s, dtype=dtype))
    if dtype == torch.bfloat16 and (bits & 0x7F800000) != 0x7F800000:
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def refuse_capture(why: str) -> None:
    """Mark a step being captured as not replayable (work done outside native calls)."""
    if _rec is not None:
        _rec.failed = _rec.failed or why


# ------------------------------------------------------------------------------------------------ helpers

BF = {torch.bfloat16: 1, torch.float32: 0}  # the ``bf`` flag of a tensor's dtype
KV = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the ``kt`` code of a KV cache's element type
ACT = {"none": 0, "silu": 1, "sigmoid": 2}  # the C activation codes


def ok(*ts: Optional[Tensor]) -> bool:
    """Every tensor is a contiguous fp32/bf16 CPU tensor (or None)."""
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous() and t.dtype in BF) for t in ts)


def ok_cache(*ts: Tensor) -> bool:
    """Contiguous CPU KV caches of one element type that the attention kernels read (fp32, bf16 or f16: a cache may
    be narrower than the activations)."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in KV and t.dtype == ts[0].dtype for t in ts)


def row_stride(t: Tensor) -> Optional[int]:
    """The row stride of ``t`` seen as [rows, last dim] when its rows are dense (e.g. a column slice of one
    projection's output), else None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    if t.is_contiguous():
        return t.shape[-1]
    return t.stride(0) if t.dim() == 2 else None


def ok_rows(*ts: Optional[Tensor]) -> bool:
    """As ``ok``, but row-strided 2-d views are accepted (the kernel takes their row strides)."""
    return all(t is None or (t.device.type == "cpu" and t.dtype in BF and row_stride(t) is not None) for t in ts)


def ptr(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


# the reasons a native implementation gives for a call it does not cover (``registry.NotCovered``)
SEQUENCE = "a sequence (the native form is one token)"
OPERANDS = "operands not fp32/bf16 dense CPU tensors of the supported dtype combination"
LIMITS = "sizes past the native kernel's limits"
