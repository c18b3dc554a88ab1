"""vxc's on-disk cache directory: ``VXC_CACHE_DIR``, else ``$XDG_CACHE_HOME/vxc``, else ``~/.cache/vxc``. It holds
what is derived from inputs and safe to lose (the native library built for this CPU, parsed GGUF headers); every
entry is validated against its input when read."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("VXC_CACHE_DIR"):
        return Path(os.environ["VXC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vxc"
