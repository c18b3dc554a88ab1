"""Named passes over the IR and the pass manager."""

from .context import Context
from .findings import Finding, Refusal
from .manager import DEFAULT_PIPELINE, LOWER_PIPELINE, PASSES, PassManager, parse_pipeline

__all__ = ["Context", "Finding", "Refusal", "DEFAULT_PIPELINE", "LOWER_PIPELINE", "PASSES", "PassManager", "parse_pipeline"]
