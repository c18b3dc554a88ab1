"""qwen3_moe: Qwen3 attention + a softmax → top-k → renormalise MoE (and a dense SwiGLU layer), against
transformers 5.24's Qwen3MoeForCausalLM at the numerical floor, with the selected experts identical at every
token; the decode step replayed natively. The lowering is checked in tests/frontends/test_qwen3_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.families.moe_support import _one_thread  # noqa: F401  (fixture)
from tests.families.moe_support import assert_at_floor, measure_moe, print_row
from tests.families.qwen3_moe_support import built  # noqa: F401  (fixture)
from tests.families.qwen3_moe_support import FAMILY, VOCAB


def qwen3_router(layer):
    return getattr(layer.mlp, "gate", None) if hasattr(layer.mlp, "experts") else None


@pytest.fixture(scope="module")
def parity(built):
    mdir, ir = built
    return measure_moe(FAMILY, mdir, ir, qwen3_router)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.native
def test_decode_replay(built, dtype):
    """The softmax top-k router and the experts run natively for one token: the decode step is replayed
    bit-identically to the graph."""
    from tests.families.latent_support import assert_replay_bit_identical, prompt

    assert_replay_bit_identical(built[0], prompt(VOCAB, 20, seed=3), prompt(VOCAB, 12, seed=4), dtype)


def test_parity_at_floor_with_identical_expert_selection(parity, capsys):
    with capsys.disabled():
        print("\n" + print_row(parity))
    assert_at_floor(parity)
    assert parity.layers == 2 and parity.tokens == 48 + 32


def test_batched_decode_equals_single(built):
    """Sequence slots: a batched decode step per iteration equals each sequence's single-sequence decode
    (tests/runtime/batch_check.py)."""
    from tests.runtime import batch_check as BC

    BC.assert_batched(built[1], VOCAB)
