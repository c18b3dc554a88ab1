"""vxc — a compiler for large-language-model architectures (VINDEX3 IR)."""

__version__ = "0.1.0"
