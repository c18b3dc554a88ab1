"""Declaring a kernel, its table of implementations, and the one dispatcher that picks among them.

A kernel is declared once, by its schema function::

    @kernel("linear")
    def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        '''argument checks (raise ValueError); the annotations are the op's schema'''

    @linear.fake
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @linear.impl("torch")          # the twin: always required
    def linear_twin(x, weight, bias): ...

    @linear.impl("triton")
    def linear_triton(x, weight, bias): ...

    @linear.impl("native")         # may raise NotCovered(reason) for a call it does not cover
    def linear_native(x, weight, bias): ...

``kernel`` registers ``torch.ops.vxc.<name>`` (``torch.library.Library("vxc", "DEF")``: the schema inferred from
the annotations by ``torch.library.infer_schema``, ``mutates`` naming the arguments written in place; one
``CompositeExplicitAutograd`` kernel, the dispatcher below; the fake by ``torch.library.register_fake``). Not
``torch.library.custom_op``: its device wrapper imports ``torch._dynamo`` at an op's first call — 1.1 s and
~140 MB of RSS (sympy, torch.distributed.tensor, onnx …) in the first prefill of every process, the largest part
of what a small GGUF model's peak RSS carried beyond its weights. A call runs the checks (the schema
function's body, skipped when it has none), then the implementation ``select`` names for the backend setting
and the device of the argument ``device_arg``:

- ``auto`` (default): ``triton`` on CUDA tensors; on CPU ``native`` when the library is loaded, else ``torch``;
- ``torch``: the twin everywhere; ``triton``: Triton everywhere (CPU tensors need Triton's interpreter);
- ``native``: the C library on CPU (an error if it is unavailable), the twin on CUDA.

When the selected implementation is missing from the kernel's table, or raises ``NotCovered``, the twin runs
instead and the fallback is recorded — kernel, selected backend, reason, count — in ``fallbacks()`` /
``report()``; a decode step being captured for replay is refused (``native.refuse_capture``). A new backend
is one more column: a name in ``IMPLEMENTATIONS``, a rule in ``select``, ``.impl(name)`` functions.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Callable, Optional

import torch
from torch import Tensor

from . import native
from .triton_common import INTERPRETED

_LIB = torch.library.Library("vxc", "DEF")  # every torch.ops.vxc operator (kept alive: dropping it unregisters them)

BACKENDS = ("auto", "torch", "triton", "native")
IMPLEMENTATIONS = ("torch", "triton", "native")


class NotCovered(Exception):
    """Raised by an implementation for a call it does not cover (its argument is the reason, a short constant
    phrase); the dispatcher runs the twin instead and records the fallback."""


KERNELS: dict[str, "Kernel"] = {}
_fallbacks: Counter = Counter()  # (kernel, selected backend, reason) -> calls
_backend = "auto"


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    _backend = name


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the body with the backend ``name``, restoring the previous one after."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def select(tensor: Tensor) -> str:
    """The implementation (``torch``, ``triton`` or ``native``) a call on ``tensor`` runs under the current backend."""
    b = _backend
    if tensor.is_cuda:
        return "torch" if b in ("torch", "native") else "triton"
    if b == "auto":
        return "native" if native.available() else "torch"
    if b == "triton" and not INTERPRETED:
        raise RuntimeError(
            "the triton backend on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported"
        )
    if b == "native" and not native.available():
        raise RuntimeError(f"the native backend is unavailable: {native.status()}")
    return b


def _no_checks() -> None:
    """(a schema function without checks)"""


def _has_body(fn: Callable) -> bool:
    return fn.__code__.co_code != _no_checks.__code__.co_code


class Kernel:
    """One ``torch.ops.vxc`` operator: its declaration and its table of implementations."""

    def __init__(self, name: str, schema: Callable, mutates: tuple[str, ...], device_arg: int):
        self.name, self.mutates, self.device_arg = name, tuple(mutates), device_arg
        self.checks: Optional[Callable] = schema if _has_body(schema) else None
        self.impls: dict[str, Callable] = {}
        self.__doc__ = schema.__doc__
        _LIB.define(name + torch.library.infer_schema(schema, mutates_args=self.mutates))
        _LIB.impl(name, self._run, "CompositeExplicitAutograd")
        self.op = getattr(torch.ops.vxc, name)

    def impl(self, backend_name: str) -> Callable[[Callable], Callable]:
        """Decorator: ``fn`` is this kernel's ``backend_name`` implementation (same arguments as the op)."""
        if backend_name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {backend_name!r}; expected one of {IMPLEMENTATIONS}")

        def register(fn: Callable) -> Callable:
            self.impls[backend_name] = fn
            return fn

        return register

    def fake(self, fn: Callable) -> Callable:
        """Decorator: the op's fake (output shapes and dtypes for tracing)."""
        torch.library.register_fake(f"vxc::{self.name}", fn, lib=_LIB)
        return fn

    @property
    def twin(self) -> Callable:
        return self.impls["torch"]

    def __call__(self, *args):
        return self.op(*args)

    def _run(self, *args):
        if self.checks is not None:
            self.checks(*args)
        chosen = select(args[self.device_arg])
        fn = self.impls.get(chosen)
        if fn is None:
            return self._fallback(chosen, f"no {chosen} implementation", args)
        try:
            return fn(*args)
        except NotCovered as e:
            return self._fallback(chosen, str(e), args)

    def _fallback(self, chosen: str, reason: str, args: tuple):
        _fallbacks[(self.name, chosen, reason)] += 1
        native.refuse_capture(f"{self.name} ran its torch twin ({reason})")
        return self.impls["torch"](*args)


def kernel(name: str, *, mutates: tuple[str, ...] = (), device_arg: int = 0) -> Callable[[Callable], Kernel]:
    """Declare ``torch.ops.vxc.<name>`` from its schema function (see the module docstring)."""

    def declare(schema: Callable) -> Kernel:
        if name in KERNELS:
            raise ValueError(f"kernel {name!r} is declared twice")
        KERNELS[name] = k = Kernel(name, schema, mutates, device_arg)
        return k

    return declare


# ------------------------------------------------------------------------------------------------ the report


def fallbacks() -> dict[str, dict[str, dict[str, int]]]:
    """The calls that ran the twin instead of the selected implementation since the last ``reset_fallbacks``:
    ``{kernel: {selected backend: {reason: calls}}}`` (kernels in declaration order)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for name in KERNELS:
        for (k, chosen, reason), n in _fallbacks.items():
            if k == name:
                out.setdefault(k, {}).setdefault(chosen, {})[reason] = n
    return out


def reset_fallbacks() -> None:
    _fallbacks.clear()


def report() -> dict:
    """The kernel layer's state for ``vxc exec --json``: the backend setting, the native library's status and
    the fallbacks recorded so far (``fallbacks()``)."""
    return {"backend": _backend, "native": native.status(), "fallbacks": fallbacks()}


def format_report(rep: Optional[dict] = None) -> str:
    """``report()`` as lines of text (``vxc exec --kernel-report``)."""
    rep = report() if rep is None else rep
    lines = [f"kernels: backend {rep['backend']} · native {rep['native']}"]
    if not rep["fallbacks"]:
        lines.append("  no fallbacks: every call ran its selected implementation")
    for name, by_backend in rep["fallbacks"].items():
        for chosen, reasons in by_backend.items():
            for reason, n in reasons.items():
                lines.append(f"  {name}: {chosen} → torch twin × {n} ({reason})")
    return "\n".join(lines)
