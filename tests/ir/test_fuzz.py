"""Bad input never crashes (issue 11): seeded mutations of the golden IRs are each accepted, a located
syntax error or an itemised refusal (``tests/fuzzing.py``; ``benchmarks/fuzz_ir.py`` runs 10,000)."""

from __future__ import annotations

import time

import pytest

from tests import fuzzing
from vxc.ir.diagnostics import IRSyntaxError

SEEDS = range(42_000_000, 42_000_300)  # 300 cases, a block of their own (the script's --seed 42)


def test_fuzz_cases_never_crash():
    fuzzing.corpus()  # parsed before the cap
    crashes, counts = [], dict.fromkeys(fuzzing.OUTCOMES, 0)
    t0 = time.perf_counter()
    with fuzzing.memory_cap(4 << 30):
        for seed in SEEDS:
            case, out = fuzzing.run_case(seed)
            counts[out.kind] += 1
            if out.kind == fuzzing.CRASH:
                crashes.append(f"{case.title()}\n    → {out.where}: {out.detail}")
    dt = time.perf_counter() - t0
    assert not crashes, f"{len(crashes)} of {len(SEEDS)} cases crashed ({counts}):\n" + "\n".join(crashes)
    # the mutations reach every outcome (a fuzzer that only makes syntax errors tests little)
    assert all(counts[k] > 0 for k in (fuzzing.ACCEPTED, fuzzing.SYNTAX, fuzzing.REFUSAL)), counts
    assert dt < 45, f"{len(SEEDS)} cases took {dt:.1f} s"


def test_cases_are_reproducible():
    a, b = fuzzing.make_case(1234), fuzzing.make_case(1234)
    assert (a.data, a.mutations, a.source) == (b.data, b.mutations, b.source)
    assert fuzzing.make_case(1235).data != a.data


def test_the_corpus_covers_every_operator_kind_and_encoding_and_is_accepted():
    from vxc.ir.ggml import ENCODINGS as GGML
    from vxc.ir.operators import OPERATORS
    from vxc.ir.parser import parse
    from vxc.ir.views import ENCODINGS

    kinds, encodings, formats = set(), set(), set()
    for name, text in fuzzing.corpus():
        assert fuzzing.classify(text.encode()).kind == fuzzing.ACCEPTED, name
        m = parse(text)
        kinds |= {op.kind for layer in m.layers for op in layer.ops()} | {op.kind for op in m.model_ops()}
        encodings |= {o.encoding for o in m.operands}
        formats |= {f.format for f in m.files}
    assert kinds == set(OPERATORS)
    assert encodings == {None} | set(ENCODINGS) | set(GGML)
    assert formats == {"safetensors", "gguf"}


# ---------------------------------------------------------------- the classifier itself


def _good() -> str:
    return dict(fuzzing.corpus())["test_witnesses/test_golden_ir[mamba2-780m-state].vxir"]


def test_classifier_accepts_a_good_text():
    assert fuzzing.classify(_good().encode()).kind == fuzzing.ACCEPTED


def test_classifier_syntax_error():
    assert fuzzing.classify(_good().replace("vindex3 schema", "vindex3 schemax", 1).encode()).kind == fuzzing.SYNTAX
    assert fuzzing.classify(b"\xff").kind == fuzzing.SYNTAX
    assert fuzzing.classify(b"").kind == fuzzing.SYNTAX


def test_classifier_refusal():
    text = _good()
    line = next(x for x in text.splitlines() if x.strip().startswith("operand"))
    assert fuzzing.classify(text.replace(line + "\n", "", 1).encode()).kind == fuzzing.REFUSAL  # missing-operand


def test_classifier_crash(monkeypatch):
    from vxc.passes.closure import Closure

    def boom(self, ctx):
        raise KeyError("synthetic")

    monkeypatch.setattr(Closure, "run", boom)
    out = fuzzing.classify(_good().encode())
    assert out.kind == fuzzing.CRASH and "KeyError" in out.detail and "synthetic" in out.detail, out


def test_classifier_badly_located_syntax_error_is_a_crash(monkeypatch):
    from vxc.ir import parser

    def nowhere(filename, text, line, col, message):
        return IRSyntaxError(filename, text, 0, 0, message)

    monkeypatch.setattr(parser, "_error", nowhere)
    out = fuzzing.classify(b"vindex3 schemax 6")
    assert out.kind == fuzzing.CRASH and "outside the text" in out.detail, out


def test_classifier_non_round_trip_is_a_crash(monkeypatch):
    from vxc.ir import printer

    real, calls = printer.print_module, []

    def drifting(m):  # every other print differs
        calls.append(1)
        return real(m) + "\n" * (len(calls) % 2 == 0)

    monkeypatch.setattr(printer, "print_module", drifting)
    out = fuzzing.classify(_good().encode())
    assert out.kind == fuzzing.CRASH and "fixed point" in out.detail, out


def test_classifier_timeout_is_a_crash(monkeypatch):
    from vxc.passes.closure import Closure

    def forever(self, ctx):
        while True:
            pass

    monkeypatch.setattr(Closure, "run", forever)
    out = fuzzing.classify(_good().encode(), seconds=0.3)
    assert out.kind == fuzzing.CRASH and "timeout" in out.detail, out


def test_classifier_memory_error_is_a_crash(monkeypatch):
    from vxc.passes.closure import Closure

    def hog(self, ctx):
        return [0] * (1 << 40)

    monkeypatch.setattr(Closure, "run", hog)
    with fuzzing.memory_cap(1 << 30):
        out = fuzzing.classify(_good().encode())
    assert out.kind == fuzzing.CRASH and "MemoryError" in out.detail, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_mutator_runs(seed):
    import random

    for fn, _ in fuzzing.TEXT_MUTATORS:
        text, desc = fn(random.Random(seed), _good())
        assert isinstance(text, str) and desc
    for fn, _ in fuzzing.BYTE_MUTATORS:
        data, desc = fn(random.Random(seed), _good().encode())
        assert isinstance(data, bytes) and desc
