"""The pass manager through ``vxc passes`` / ``vxc describe``: textual
pipelines, print-after instrumentation, the ``state`` pass on an IR that
already carries regions, refusing models, malformed IR text, and the
Graphviz picture."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import GOLDEN
from tests.passes.test_closure import native_header_only
from tests import builders

HEADER = re.compile(r"^// -----// IR Dump After (Failure )?(\w+) //----- //$", re.M)
ALL = ["verify", "bind", "closure", "state", "plan"]


def _golden(name: str, stage: str) -> str:
    return (GOLDEN / "test_witnesses" / f"test_golden_ir[{name}-{stage}].vxir").read_text()


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusing") / "mini-noD"
    return native_header_only(d, builders.MINI_NATIVE_MAMBA2, drop=["backbone.layers.2.mixer.D"])


def test_pipeline_text(witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", "verify,bind,closure")
    assert r.exit_code == 0, r.output
    assert r.stdout == "ok: verify,bind,closure\n"
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", " verify , bind,closure,state,plan ")
    assert r.exit_code == 0 and r.stdout == "ok: verify,bind,closure,state,plan\n"


@pytest.mark.parametrize("pipeline", ["verify,fuse_everything", "verify,,nope", "closre"])
def test_unknown_pass(pipeline, witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", pipeline)  # in-process: a crash raises here
    assert r.exit_code != 0
    assert "Traceback" not in r.stderr
    assert "unknown pass" in r.stderr and "known passes: verify, bind, closure, state, plan" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_print_after_unknown_or_absent(witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", "verify,bind", "--print-after", "nope")
    assert r.exit_code != 0 and "unknown pass" in r.stderr
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", "verify,bind", "--print-after", "closure")
    assert r.exit_code != 0 and "not in the pipeline" in r.stderr


def test_print_after_closure(witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--pipeline", "verify,bind,closure", "--print-after", "closure")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("// -----// IR Dump After closure //----- //\nvindex3 schema 6\n")
    assert HEADER.findall(r.stdout) == [("", "closure")]
    # the dump is the IR text (model_dir relative to the working directory here)
    body = r.stdout.split("\n", 1)[1]
    golden = _golden("mamba2-780m", "closure")
    strip = lambda t: [ln for ln in t.splitlines() if not ln.strip().startswith("source ")]  # noqa: E731
    assert strip(body) == strip(golden)


def test_print_after_repeatable(witnesses, cli):
    r = cli("passes", witnesses["mamba2attn-250m.oute-dialect"], "--print-after", "state", "--print-after", "bind")
    assert r.exit_code == 0, r.output
    assert [p for _, p in HEADER.findall(r.stdout)] == ["bind", "state"]  # pipeline order
    after_bind, after_state = re.split(HEADER, r.stdout)[3], re.split(HEADER, r.stdout)[6]
    assert "state kv kv_rows" not in after_bind and "state kv kv_rows" in after_state


def test_print_after_all(witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--print-after-all")
    assert r.exit_code == 0, r.output
    assert [p for _, p in HEADER.findall(r.stdout)] == ALL
    assert r.stdout.startswith("// -----// IR Dump After verify //----- //\n")
    plan = r.stdout.split("// -----// IR Dump After plan //----- //\n", 1)[1]
    assert plan.startswith("plan ")
    r = cli("passes", witnesses["mamba2-780m"], "--print-after-all", "--pipeline", "verify,bind")
    assert [p for _, p in HEADER.findall(r.stdout)] == ["verify", "bind"]


def test_passes_json(witnesses, cli):
    r = cli("passes", witnesses["mamba2-780m"], "--print-after", "closure", "--json")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["ok"] is True and j["pipeline"] == ",".join(ALL)
    assert list(j["dumps"]) == ["// -----// IR Dump After closure //----- //"]


def test_passes_on_refusing_model_dir(refusing, cli):
    r = cli("passes", refusing)
    assert r.exit_code != 0
    assert r.stdout.splitlines() == ["refused: 1 finding (closure)",
                                     "  layer 2 mamba2: required role Mamba2D is not bound  [missing-operand]"]
    j = json.loads(cli("passes", refusing, "--json").stdout)
    assert j["refused"] is True and j["count"] == 1


def test_print_after_failure(refusing, cli):
    r = cli("passes", refusing, "--print-after-failure")
    assert r.exit_code != 0
    assert HEADER.findall(r.stdout) == [("Failure ", "closure")]
    assert r.stdout.startswith("// -----// IR Dump After Failure closure //----- //\nvindex3 schema 6\n")
    dump, refusal = r.stdout.split("\nrefused: ", 1)
    assert "backbone.layers.2.mixer.dt_bias" in dump  # the IR as closure saw it
    assert refusal.startswith("1 finding (closure)")
    # without the flag: no dump
    assert HEADER.findall(cli("passes", refusing).stdout) == []


def _in_witness_root(witness_root, name: str, text: str):
    """Write an IR next to the witness dirs so its relative model_dir resolves."""
    p = witness_root / name
    p.write_text(text)
    return p


def test_state_pass_accepts_equal_regions(witness_root, cli):
    text = _golden("mamba2attn-250m.oute-dialect", "state")
    p = _in_witness_root(witness_root, "250m-state.vxir", text)
    r = cli("passes", p, "--pipeline", "verify,bind,closure,state", "--print-after", "state")
    assert r.exit_code == 0, r.output
    assert r.stdout.split("\n", 1)[1] == text  # regions unchanged, nothing added


@pytest.mark.parametrize("edit", [
    ("state conv conv_history [3328,4] compute fixed", "state conv conv_history [3328,3] compute fixed"),
    ("state ssm recurrent [48,64,128] f32 fixed", "state ssm recurrent [48,64,128] compute fixed"),
    ("state conv conv_history [3328,4] compute fixed", "state conv conv_history [3328,4] compute per_token"),
    ("state conv conv_history [3328,4] compute fixed\n", ""),
], ids=["shape", "precision", "growth", "removed"])
def test_state_pass_reports_edited_region(edit, witness_root, cli):
    text = _golden("mamba2-780m", "state")
    at = text.index("  layer 7 {\n")
    old, new = edit
    i = text.index(old, at)
    edited = text[:i] + new + text[i + len(old):]
    p = _in_witness_root(witness_root, "780m-edited.vxir", edited)
    r = cli("passes", p, "--pipeline", "verify,bind,closure,state")
    assert r.exit_code != 0
    lines = r.stdout.splitlines()
    assert lines[0] == "refused: 1 finding (state)"
    assert lines[1].startswith("  layer 7 mamba2: declared state [") and lines[1].endswith("[state-mismatch]")
    j = json.loads(cli("passes", p, "--pipeline", "verify,bind,closure,state", "--json").stdout)
    (f,) = j["findings"]
    assert f["code"] == "state-mismatch" and f["layer"] == 7
    assert f["expected"] == ["ssm recurrent [48,64,128] f32 fixed", "conv conv_history [3328,4] compute fixed"]
    assert f["actual"] != f["expected"]


def test_describe_dot(witnesses, tmp_path, cli):
    dot = tmp_path / "pic" / "250m.dot"
    r = cli("describe", witnesses["mamba2attn-250m.oute-dialect"], "--dot", dot, "--json")
    assert r.exit_code == 0, r.output
    text = dot.read_text()
    assert text.startswith("digraph ") and text.rstrip().endswith("}")
    for i in range(32):
        assert f'label="layer {i}"' in text
    assert text.count('label="conv_qkv"') == 4 and text.count('label="mamba2"') == 28
    assert text.count("kv: kv_rows") == 4 and text.count("ssm: recurrent") == 28
    assert text.count("conv: conv_history") == 32
    assert "[2×16×128] per token" in text and "[6144×4] fixed" in text


def test_describe_context(witnesses, cli):
    r = cli("describe", witnesses["mamba2attn-250m.oute-dialect"], "--json", "--context", "4096")
    s = json.loads(r.stdout)["state"]
    per = s["fixed_bytes"] + 4096 * s["per_token_bytes"]
    assert s["at_context"] == {"tokens": 4096, "sequences": 1, "bytes_per_sequence": per, "bytes": per}
    assert s["at_context"]["bytes"] == 30_072_832 + 4096 * 32_768
    r = cli("describe", witnesses["mamba2attn-250m.oute-dialect"], "--context", "4096")
    assert f"at 4,096 tokens: {30_072_832 + 4096 * 32_768:,} bytes" in r.stdout


# ---------------------------------------------------------------- malformed IR text


def _bad(tmp_path, text: str):
    p = tmp_path / "bad.vxir"
    p.write_text(text)
    return p


def _line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


@pytest.mark.parametrize("case", ["missing-equals", "unknown-role", "truncated", "unknown-dtype"])
def test_malformed_vxir(case, tmp_path, cli, vxc_sub):
    text = _golden("mamba2-780m", "closure")
    lines = text.splitlines(keepends=True)
    if case == "truncated":
        bad = text[:300]
        n = 5
        col = lines[4].index('"', lines[4].index("header_sha256")) + 1
    else:
        n = _line_of(text, "operand %l3.Mamba2D ")
        old, new = {"missing-equals": (" = $", " $"), "unknown-role": ("role Mamba2D", "role Mamba2Dee"),
                    "unknown-dtype": (" f32[48] = ", " f31[48] = ")}[case]
        lines[n - 1] = lines[n - 1].replace(old, new)
        bad = "".join(lines)
        tok = {"missing-equals": "$", "unknown-role": "Mamba2Dee", "unknown-dtype": "f31"}[case]
        col = lines[n - 1].index(tok) + 1
    p = _bad(tmp_path, bad)
    # in-process (a crash raises here); one case also in a subprocess, through ``describe``, which
    # shares the loader and starts without torch (``passes`` imports vxc.codegen)
    r = cli("passes", p)
    if case == "missing-equals":
        sub = vxc_sub("describe", p)
        assert sub.exit_code != 0 and "Traceback" not in sub.stderr
        assert sub.stderr == r.stderr
    assert r.exit_code != 0
    assert "Traceback" not in r.stderr
    err = r.stderr.splitlines()
    assert len(err) == 3, err
    assert err[0].startswith(f"{p}:{n}:{col}: error: "), err[0]
    src = bad.splitlines()[n - 1]
    assert err[1].strip() == src.strip()
    # the caret sits under the offending column of the echoed line
    assert err[2].rstrip().endswith("^") and len(err[2].rstrip()) - len(err[1]) + len(src) == col
