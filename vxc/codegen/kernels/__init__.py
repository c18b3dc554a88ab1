"""vxc's kernel library: each kernel is one ``torch.ops.vxc.<name>`` operator.

Importing this package registers the operators. Every operator has a torch twin (``torch_impl``: the test
oracle and the CPU fallback), a Triton implementation (``triton_impl``) and, for the single-token hot loops,
native C (``native_impl``: the default CPU path when the host compiler could build it); ``set_backend`` /
``backend`` choose between them (see ``dispatch``). Shapes omit the batch, which is always 1: sequences are ``[T, ...]``.

Operators: add_rmsnorm, gated_rmsnorm, conv1d_prefill, conv1d_step, ssd_prefill, ssd_step, rotary,
attention, linear, swiglu, embedding.
"""

from . import native_impl, ops, torch_impl, triton_impl
from . import delta  # noqa: F401,E402  (vxc::gated_delta_prefill/step, vxc::sigmoid_gate_mul)
from . import kda, mla  # noqa: F401,E402  (vxc::kda_prefill/step, vxc::mla_prefill/decode)
from . import moe  # noqa: F401,E402  (vxc::moe_router/moe_experts/moe_shared/mxfp4_dequant)
from .dispatch import BACKENDS, backend, get_backend, set_backend

__all__ = ["BACKENDS", "backend", "get_backend", "native_impl", "ops", "set_backend", "torch_impl", "triton_impl"]
