"""Lowerings of further operator kinds, one module per kind; each registers itself
with ``vxc.codegen.lowering.register_block``. Import new modules here."""
from . import moe  # noqa: F401,E402  (moe)
from . import gated_delta  # noqa: F401,E402  (gated_delta)
