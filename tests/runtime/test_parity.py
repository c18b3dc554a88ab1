"""Every wave-1 family at its reference's numerical floor (VINDEX3.md).

Per family, on a miniature with random weights and awkward sizes, fp32, a
48-token prompt (three SSD chunks of 16):

- vxc's logits [positions, padded vocab] within tol of the reference, fp32 and fp64;
- argmax agreement at every position whose reference top-2 margin exceeds
  10 x tol, with few positions excluded;
- a 32-token greedy continuation identical to the reference's own cached
  greedy loop, with at least 8 distinct tokens;
- prefill 0..n equal to prefill 0..37 then step 37..n, within tol;
- two runs (fresh engines) bit-identical.
"""

from __future__ import annotations

import pytest

from tests.runtime import parity_table as P

FAMILIES = list(P.FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_floor_is_measured(lab, name):
    """The floor is a real measurement, the logits spread over several units."""
    p = lab.parity(name)
    f = lab.family(name)
    assert p.shape == (f.prompt_len, f.padded_vocab)  # logits keep the padded vocab width
    assert p.max_abs_logit > 4.0
    assert 0.0 < p.fp32_vs_fp64 < 1e-3 and 0.0 < p.full_vs_step < 1e-3
    assert p.tol == max(2 * p.floor, 1e-5 * p.max_abs_logit)
    assert p.tol < 1e-3  # a loose tolerance would make the comparison vacuous


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_within_floor(lab, name):
    p = lab.parity(name)
    print(f"{name}: max-abs {p.err:.3e} (vs fp64 {p.err64:.3e}), floor {p.floor:.3e}, tol {p.tol:.3e}")
    assert p.err <= p.tol, f"{name}: vxc vs reference fp32 max-abs {p.err:.3e} > tol {p.tol:.3e}"
    assert p.err64 <= p.tol, f"{name}: vxc vs reference fp64 max-abs {p.err64:.3e} > tol {p.tol:.3e}"


@pytest.mark.parametrize("name", FAMILIES)
def test_argmax_agreement(lab, name):
    p = lab.parity(name)
    print(f"{name}: argmax agreement {p.argmax:.3f}, {p.excluded} of {p.positions} positions excluded")
    assert p.argmax == 1.0
    assert p.excluded <= 2, f"{name}: {p.excluded} near-tie positions excluded; choose another seed"


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_continuation(lab, name):
    p = lab.parity(name)
    f = lab.family(name)
    assert len(p.greedy_vxc) == P.GREEDY_NEW == 32
    assert all(0 <= t < f.vocab for t in p.greedy_vxc)  # never a padding id
    assert p.greedy_vxc == p.greedy_ref, f"{name}: vxc {p.greedy_vxc} vs reference {p.greedy_ref}"
    assert p.distinct >= P.MIN_DISTINCT, f"{name}: only {p.distinct} distinct tokens"


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_then_step(lab, name):
    p = lab.parity(name)
    assert p.err_step <= p.tol, f"{name}: prefill-then-step vs full prefill {p.err_step:.3e} > tol {p.tol:.3e}"
    assert p.err_step_ref <= p.tol


@pytest.mark.parametrize("name", FAMILIES)
def test_two_runs_bit_identical(lab, name):
    assert lab.parity(name).deterministic


def test_parity_table_prints(lab, capsys):
    rows = [lab.parity(n).row() for n in FAMILIES]
    table = P.format_table(rows)
    with capsys.disabled():
        print("\n" + table)
    assert table.count("\n") == len(FAMILIES) + 1
    assert "DIFFER" not in table and " NO" not in table
