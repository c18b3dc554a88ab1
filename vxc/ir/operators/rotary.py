"""Rotary attributes shared by attention operators."""

from __future__ import annotations

from .decl import attr

ROTARY_ATTRS = (
    attr("rotary_dim", "int", min=0, doc="leading dims of each head that rotate (0 = none)"),
    attr("rotary_base", "float"),
    attr("rotary_layout", "enum", "half", "interleaved", "none"),
    attr("rope_type", "enum", "default", "linear", "llama3", "yarn"),
    attr("rope_factor", "float", optional=True),
    attr("rope_low_freq_factor", "float", optional=True),
    attr("rope_high_freq_factor", "float", optional=True),
    attr("rope_original_max_position", "int", optional=True, min=0),
    attr("rope_beta_fast", "float", optional=True),
    attr("rope_beta_slow", "float", optional=True),
    attr("rope_attention_factor", "float", optional=True),
    attr("rope_truncate", "bool", optional=True, doc="yarn: round the correction range outward to whole dims"),
)
