"""Lowerings of further operator kinds, one module per kind; each registers itself
with ``vxc.codegen.lowering.register_block``. Import new modules here."""
from . import kda, mla  # noqa: F401,E402  (kda, mla)
from . import gated_delta  # noqa: F401,E402  (gated_delta)
from . import moe  # noqa: F401,E402  (moe)
