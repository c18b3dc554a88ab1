"""Greedy choice: ``sampling.greedy`` (numpy's argmax) chooses exactly what ``torch.argmax`` chooses."""

from __future__ import annotations

import torch

from vxc.runtime.sampling import Sampler, greedy


def _cases():
    g = torch.Generator().manual_seed(3)
    yield torch.randn(151936, generator=g)
    yield torch.randn(7, generator=g)
    t = torch.zeros(1000)  # ties: the first maximal index
    t[[17, 400, 999]] = 2.0
    yield t
    yield torch.full((64,), float("-inf"))  # every value -inf: index 0
    n = torch.randn(5000, generator=g)
    n[[1234, 4000]] = float("nan")  # a NaN wins, the first one
    n[10] = float("inf")
    yield n
    i = torch.randn(300, generator=g)
    i[[5, 250]] = float("inf")
    yield i
    yield torch.tensor([1e-45, 0.0, -0.0, 1e-45])  # subnormal ties
    yield torch.tensor([-0.0, 0.0])  # -0 == 0: the first
    yield torch.randn(8, 999, generator=g)[:, 3]  # a strided view
    yield torch.randn(2, 513, generator=g)[1, :500]  # a vocabulary cut of a row


def test_greedy_is_torch_argmax():
    for x in _cases():
        assert greedy(x) == int(torch.argmax(x)), x[:8]
    # not fp32 / needing grad: torch's own argmax
    h = torch.randn(100, dtype=torch.float16)
    assert greedy(h) == int(torch.argmax(h))
    r = torch.randn(100, requires_grad=True)
    assert greedy(r) == int(torch.argmax(r))


def test_sampler_greedy_ignores_padding_ids():
    x = torch.zeros(10)
    x[8] = 5.0  # a padding id (at or beyond the vocabulary) is never chosen
    x[3] = 1.0
    assert Sampler(vocab=8)(x) == 3
    assert Sampler(vocab=10)(x) == 8
    assert Sampler(vocab=8)(x.to(torch.bfloat16)) == 3
