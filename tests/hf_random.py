"""Random transformers models with weights a wrong implementation cannot hide behind.

A transformers model straight from ``from_config`` is a poor test subject: norm weights all start at their
initial value (a skipped norm weight, or ``w`` read as ``1 + w``, would pass), the reference's decay-rate
init (``A_log`` up to log 16) decays a recurrent state to nothing within a token or two (a wrong recurrence
would pass), and a router's selection bias (``e_score_correction_bias``) starts at 0 (a router ignoring it
would pass).  :func:`random_hf_model` builds the model and :func:`perturb_init` moves those tensors.

Used by the family miniatures (``tests/families/latent_support.py``, ``tests/families/qwen3_next_support.py``)
and by the benchmark's shaped models (``benchmarks/benchlib/models.py``); they differ only in ``norm_std`` and
``dt_bias`` (see the callers).
"""

from __future__ import annotations

import math

import torch


def perturb_init(model: torch.nn.Module, generator: torch.Generator, *, norm_std: float, dt_bias: str) -> None:
    """In place, in parameter order, drawing from ``generator``: every ``norm.weight`` / ``layernorm.weight``
    gets ``norm_std * N(0, 1)`` added; ``dt_bias`` becomes ``0.5 * N(0, 1)`` (``dt_bias="set"``) or gets it
    added (``dt_bias="add"``); ``A_log`` becomes log-uniform decay rates exp(A_log) in [0.05, 2]; then every
    ``e_score_correction_bias`` buffer becomes ``0.1 * N(0, 1)``."""
    if dt_bias not in ("set", "add"):
        raise ValueError(f"dt_bias must be 'set' or 'add', not {dt_bias!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(norm_std * torch.randn(p.shape, generator=generator))
            elif name.endswith("dt_bias"):
                spread = 0.5 * torch.randn(p.shape, generator=generator)
                p.add_(spread) if dt_bias == "add" else p.copy_(spread)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(2.0), generator=generator))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=generator))


def random_hf_model(cfg, seed: int, *, norm_std: float, dt_bias: str):
    """``AutoModelForCausalLM.from_config(cfg)`` in eval mode, initialised under ``torch.manual_seed(seed)``
    and then perturbed by :func:`perturb_init` with a generator seeded ``seed + 1``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    perturb_init(model, torch.Generator().manual_seed(seed + 1), norm_std=norm_std, dt_bias=dt_bias)
    return model
