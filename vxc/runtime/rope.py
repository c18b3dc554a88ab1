"""Rotary tables from declared attributes: inverse frequencies per rope type,
then cos/sin for absolute positions 0..max_context-1 (fp32)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(a: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2], attention factor multiplying cos and sin)."""
    dim, base, kind = a["rotary_dim"], a["rotary_base"], a["rope_type"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    factor = 1.0
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / a["rope_factor"]
    elif kind == "llama3":
        f, lo, hi, old = a["rope_factor"], a["rope_low_freq_factor"], a["rope_high_freq_factor"], a["rope_original_max_position"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    else:
        raise NotImplementedError(f"rope_type {kind} has no table implementation yet")
    return inv, factor


def tables(a: dict[str, Any], max_context: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    inv, factor = inv_freq(a)
    pos = torch.arange(max_context, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(pos, inv)
    return (freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device)
