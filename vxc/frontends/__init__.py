"""Frontends: the only place in vxc that knows model families, config
dialects and checkpoint tensor spellings. Each turns a model directory into
declared IR facts."""

from .common import FrontendError
from .registry import lower, resolve, supported

__all__ = ["FrontendError", "lower", "resolve", "supported"]
