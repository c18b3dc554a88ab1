"""Batched decode (sequence slots, one step for B sequences) equals single-sequence decode, on every runtime
miniature (tests/runtime/batch_check.py says what is checked); the family miniatures under tests/families
run the same check from their own modules. Also: the slot bookkeeping of the state provider and describe."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import batch_check as BC
from tests.runtime import parity_table as P


@pytest.mark.parametrize("name", sorted(P.FAMILIES))
def test_batched_decode_equals_single(lab, name):
    _, ir = lab.built(name)
    r = BC.assert_batched(ir, P.FAMILIES[name].vocab)
    assert r["rows"] == sum(BC.NEW_TOKENS) - len(BC.NEW_TOKENS)  # every token after the first came from a batched row
