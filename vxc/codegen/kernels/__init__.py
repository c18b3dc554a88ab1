"""vxc's kernel library: each kernel is one ``torch.ops.vxc.<name>`` operator with a table of implementations.

Importing this package registers the operators. Shapes omit the batch, which is always 1: sequences are
``[T, ...]``.

The pattern (``registry``): a kernel is declared once, in its family file, by its schema function —
``@kernel(name, mutates=(...))`` over a function whose annotations are the op's schema and whose body holds
the argument checks — with ``@k.fake`` (output shapes for tracing) and a table of implementations,
``@k.impl("torch")`` (the twin: computes in fp32, the CPU fallback and the test oracle; always required),
``@k.impl("triton")`` and ``@k.impl("native")`` (C from ``native/vxc_cpu.c`` through ctypes, declared with
``native.declare(symbol, *argtypes)`` next to the binding that calls it). One dispatcher,
``registry.select``, picks the implementation from the backend setting (``set_backend`` / ``backend``:
``auto | torch | triton | native``), the tensor's device and whether the native library is loaded. An
implementation that does not cover a call raises ``NotCovered(reason)``; the twin runs instead, the fallback
is counted (``fallbacks()``, ``report()``; ``vxc exec --json`` includes it) and a decode capture refuses.

- To add a kernel: declare it and its implementations in its family file (the twin at least); a C function
  goes into the same family's section of ``native/vxc_cpu.c``.
- To add a backend: a name in ``registry.IMPLEMENTATIONS`` and ``BACKENDS``, its rule in
  ``registry.select``, and ``.impl(name)`` functions in the family files: one more column.

Families: ``norms`` (add_rmsnorm, gated_rmsnorm), ``conv`` (conv1d_prefill, conv1d_step), ``ssd``
(ssd_prefill, ssd_step), ``attention`` (rotary, attention), ``dense`` (linear, swiglu, embedding), ``delta``
(gated_delta_prefill, gated_delta_step, sigmoid_gate_mul), ``kda`` (kda_prefill, kda_step), ``mla``
(mla_prefill, mla_decode), ``moe`` (moe_router, moe_experts, moe_shared). Shared pieces: ``native`` (the
library's build, load, ABI check, ctypes call and the decode-capture ``Recorder``), ``triton_common`` and
``torch_common`` (helpers of the Triton kernels and of the twins).
"""

from . import native
from .registry import (BACKENDS, KERNELS, NotCovered, backend, fallbacks, format_report, get_backend, report,
                       reset_fallbacks, select, set_backend)

import importlib as _importlib  # noqa: E402
import pkgutil as _pkgutil  # noqa: E402

# every other module of this package is a kernel family; importing it declares its kernels (no import list to
# keep: a new family file is found here)
_SHARED = frozenset({"native", "registry", "triton_common", "torch_common"})
FAMILIES = tuple(sorted(m.name for m in _pkgutil.iter_modules(__path__) if m.name not in _SHARED and not m.ispkg))
for _name in FAMILIES:
    _importlib.import_module(f"{__name__}.{_name}")
from . import attention, conv, dense, delta, kda, mla, moe, norms, ssd  # noqa: E402,F401  (names for __all__)

# the kernels with a native form: a decode step made of these alone can be captured and replayed
NATIVE_OPS = frozenset(name for name, k in KERNELS.items() if "native" in k.impls)

__all__ = ["BACKENDS", "FAMILIES", "KERNELS", "NATIVE_OPS", "NotCovered", "attention", "backend", "conv", "dense", "delta",
           "fallbacks", "format_report", "get_backend", "kda", "mla", "moe", "native", "norms", "report",
           "reset_fallbacks", "select", "set_backend", "ssd"]
