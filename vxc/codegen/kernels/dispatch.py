"""Which implementation a ``torch.ops.vxc`` op runs: the backend switch.

``"auto"`` (the default) runs Triton on CUDA tensors and, on CPU tensors, the native kernels
(``native_impl``: compiled C for the single-token hot loops, the torch twins for everything else) when they
could be built, the torch twins otherwise; ``"triton"`` and ``"torch"`` force one implementation for every
tensor, ``"native"`` forces the native kernels on CPU (an error if they are unavailable). Triton on CPU tensors needs Triton's interpreter:
``TRITON_INTERPRET=1`` in the environment before triton (and so vxc.codegen.kernels) is first imported.
"""

import contextlib
from collections.abc import Iterator
from types import ModuleType

from torch import Tensor

from . import native_impl, torch_impl, triton_impl

BACKENDS = ("auto", "torch", "triton", "native")

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


def use_triton(tensor: Tensor) -> bool:
    """Whether an op called on ``tensor`` runs its Triton implementation under the current backend."""
    if _backend in ("torch", "native") or (_backend == "auto" and not tensor.is_cuda):
        return False
    if not tensor.is_cuda and not triton_impl.INTERPRETED:
        raise RuntimeError(
            "the triton backend on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported"
        )
    return True


def implementation(tensor: Tensor) -> ModuleType:
    """The module (``native_impl``, ``torch_impl`` or ``triton_impl``) whose function an op called on
    ``tensor`` runs."""
    if use_triton(tensor):
        return triton_impl
    if _backend == "torch" or tensor.is_cuda:
        return torch_impl
    if native_impl.available():
        return native_impl
    if _backend == "native":
        raise RuntimeError(f"the native backend is unavailable: {native_impl.status()}")
    return torch_impl
