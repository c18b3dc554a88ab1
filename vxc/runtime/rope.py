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
    elif kind == "yarn":
        inv, factor = yarn_inv_freq(a)
    else:
        raise NotImplementedError(f"rope_type {kind} has no table implementation yet")
    return inv, factor


def yarn_inv_freq(a: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: per frequency, a ramp between extrapolation (base frequency) and interpolation
    (frequency / rope_factor) over the correction range given by rope_beta_fast / rope_beta_slow
    at rope_original_max_position (rounded outward when rope_truncate); cos and sin are multiplied
    by rope_attention_factor. Every parameter is a declared attribute."""
    for k in ("rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_original_max_position", "rope_attention_factor", "rope_truncate"):
        if k not in a:
            raise ValueError(f"rope_type yarn needs the attribute {k}")
    dim, base, f = a["rotary_dim"], a["rotary_base"], a["rope_factor"]
    fast, slow, old = a["rope_beta_fast"], a["rope_beta_slow"], a["rope_original_max_position"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if a["rope_truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (f * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(a["rope_attention_factor"])


def tables(a: dict[str, Any], max_context: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    inv, factor = inv_freq(a)
    pos = torch.arange(max_context, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(pos, inv)
    return (freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device)
