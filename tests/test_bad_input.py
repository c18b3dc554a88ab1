"""Bad input gets a named, located error and loses nothing (issue 11, first items): a failed ``vxc lower``
leaves an existing output file untouched; IR that is not UTF-8 or holds an integer literal past Python's
digit limit is a located syntax error; a bank naming 10**12 experts is refused without being expanded."""

from __future__ import annotations

import re
import resource
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import GOLDEN

PRECIOUS = "an earlier IR the user wants to keep\n"


def _outputs_untouched(out: Path) -> None:
    assert out.read_text() == PRECIOUS
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left beside it


@pytest.mark.parametrize("damage", ["no config", "truncated weights", "missing tensor"])
def test_failed_lower_keeps_an_existing_output(minis, tmp_path, cli, damage):
    src = minis["hf_llama"]
    bad = tmp_path / "model"
    shutil.copytree(src, bad)
    if damage == "no config":
        (bad / "config.json").unlink()
    else:
        (st,) = sorted(bad.glob("*.safetensors"))
        if damage == "truncated weights":
            st.write_bytes(st.read_bytes()[: st.stat().st_size // 3])
        else:
            from safetensors.torch import load_file, save_file

            tensors = load_file(str(st))
            del tensors[sorted(k for k in tensors if "layers.0" in k)[0]]
            save_file(tensors, str(st))
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / "model.vxir"
    out.write_text(PRECIOUS)
    r = cli("lower", bad, "-o", out)
    assert r.exit_code != 0 and "Traceback" not in r.stdout + r.stderr
    _outputs_untouched(out)


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _golden_text() -> str:
    return (GOLDEN / "test_witnesses" / "test_golden_ir[mamba2-780m-state].vxir").read_text()


def test_non_utf8_ir_is_a_located_error(tmp_path, cli):
    text = _golden_text()
    lines = text.splitlines(keepends=True)
    bad = "".join(lines[:6]).encode() + b'module "x\xff\xfe" {\n' + "".join(lines[7:]).encode()
    f = tmp_path / "bad.vxir"
    f.write_bytes(bad)
    for cmd in (["passes", f], ["describe", f], ["exec", f, "--tokens", "1"]):
        r = cli(*cmd)
        out = r.stdout + r.stderr
        assert r.exit_code != 0 and "Traceback" not in out, cmd
        assert f"{f}:7:10: error: the file is not UTF-8 text (byte 0xff)" in out, out
        assert "^" in out


def test_huge_integer_literal_is_a_located_error(tmp_path, cli):
    text = _golden_text()
    assert "chunk_size=256" in text
    f = tmp_path / "big.vxir"
    f.write_text(text.replace("chunk_size=256", "chunk_size=" + "9" * 5000, 1))
    r = cli("passes", f)
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert "error: invalid literal" in out and f"{f}:" in out


def test_a_bank_of_a_trillion_experts_is_refused_without_expanding_it(tmp_path, cli):
    text = None
    for p in sorted(GOLDEN.rglob("*.vxir")):
        t = p.read_text()
        if " bank " in t and " experts " in t:
            text = t
            break
    assert text is not None, "no golden IR with an expert bank"
    m = re.search(r" experts (\d+) (@\w+) 0\.\.(\d+)", text)
    assert m, "bank syntax changed"
    huge = text.replace(m.group(0), f" experts {m.group(1)} {m.group(2)} 0..1000000000000", 1)
    f = tmp_path / "huge.vxir"
    f.write_text(huge)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    # a regression fails here instead of taking the machine down: 4 GB more address space than now
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + (4 << 30), hard))
    try:
        r = cli("passes", f, "--pipeline", "verify")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert "do not cover experts" in out


# ---------------------------------------------------------------- CLI arguments, checked before any work


@pytest.fixture(scope="module")
def lowered(minis, tmp_path_factory, cli) -> Path:
    out = tmp_path_factory.mktemp("lowered") / "llama.vxir"
    assert cli("lower", minis["hf_llama"], "-o", out).exit_code == 0
    return out


EXEC_BAD = {
    "max-new-tokens -1": (["--max-new-tokens", "-1"], "--max-new-tokens"),
    "max-context -5": (["--max-context", "-5"], "--max-context"),
    "max-context 10**12": (["--max-context", str(10**12)], "--max-context"),
    "temperature nan": (["--temperature", "nan"], "--temperature"),
    "temperature -1": (["--temperature", "-1"], "--temperature"),
    "top-k -5": (["--top-k", "-5"], "--top-k"),
    "top-p 2": (["--top-p", "2"], "--top-p"),
    "seed 2**70": (["--seed", str(2**70)], "--seed"),
}


@pytest.mark.parametrize("case", list(EXEC_BAD))
def test_exec_refuses_out_of_range_options(lowered, cli, case):
    args, names = EXEC_BAD[case]
    r = cli("exec", lowered, "--tokens", "1,2", *args)
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert names in out, out


@pytest.mark.parametrize("context", ["-5", str(10**12)])
def test_describe_refuses_a_context_out_of_range(lowered, cli, context):
    r = cli("describe", lowered, "--context", context)
    assert r.exit_code != 0 and "--context" in r.stdout + r.stderr


def test_output_paths_are_checked_before_the_work(lowered, tmp_path, cli):
    a_file = tmp_path / "plain"
    a_file.write_text(PRECIOUS)
    cases = [
        ("describe", lowered, "--dot", a_file / "g.dot"),
        ("exec", lowered, "--tokens", "1,2", "--max-new-tokens", "2", "--logits-out", a_file / "l.safetensors"),
        ("exec", lowered, "--tokens", "1,2", "--max-new-tokens", "2", "--save-state", tmp_path),
        ("lower", lowered.parent, "-o", a_file / "x.vxir"),
    ]
    for args in cases:
        r = cli(*args)
        out = r.stdout + r.stderr
        assert r.exit_code != 0 and "Traceback" not in out, args
        assert "is not a directory" in out or "is a directory" in out, (args, out)
        assert r.stdout.strip() == "" or "error" in r.stdout, args  # no generated text came before the refusal
    assert a_file.read_text() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_a_lone_surrogate_escape_is_a_located_error(tmp_path, cli):
    text = _golden_text()
    lines = text.splitlines(keepends=True)
    assert lines[1].startswith('module "')
    f = tmp_path / "surrogate.vxir"
    f.write_text(lines[0] + 'module "x\\ud800y" {\n' + "".join(lines[2:]))
    r = cli("passes", f)
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert f"{f}:2:8: error: invalid string literal: a \\u escape names a lone surrogate" in out, out


@pytest.mark.parametrize("edit", [("groups=1 ", "groups=0 "), ("chunk_size=256", "chunk_size=0"),
                                  ("heads=48 ", "heads=-3 "), ("norm_eps=1e-05", "norm_eps=nan")])
def test_attributes_outside_their_declared_range_are_refused_by_verify(tmp_path, cli, edit):
    """Declarations state each attribute's valid range (ints positive unless declared min=0, floats not NaN):
    verify refuses, by name, what a kernel could not run (chunk_size=0 used to pass every pass and then fail at
    run time with "range() arg 3 must not be zero")."""
    old, new = edit
    text = _golden_text()
    assert old in text, old
    f = tmp_path / "bad.vxir"
    f.write_text(text.replace(old, new, 1))
    r = cli("passes", f, "--pipeline", "verify")
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    name = old.split("=")[0]
    assert f"attribute {name}=" in out and "[bad-attribute]" in out, out


# ---------------------------------------------------------------- found by the IR fuzzer (tests/fuzzing.py)


def _touch_model_files(text: str, ir_dir: Path) -> None:
    """Empty files where the IR's source model_dir and file lines put them (verify only checks they exist)."""
    model_dir = ir_dir / re.search(r' model_dir "([^"]+)"', text).group(1)
    model_dir.mkdir(parents=True, exist_ok=True)
    for path in re.findall(r'^\s*file @\S+ "([^"]+)"', text, re.M):
        (model_dir / path).touch()


@pytest.mark.parametrize("name", ["x[/x]", "[bold]x", "x" * 100_000])
def test_describe_prints_any_module_name(tmp_path, cli, name):
    """The module name is shown as text: a name holding rich markup ("[/x]") raised MarkupError in the table
    view, and a 100 kB name spent seconds in rich's highlighter."""
    text = _golden_text()
    lines = text.splitlines(keepends=True)
    assert lines[1].startswith('module "')
    f = tmp_path / "named.vxir"
    f.write_text(lines[0] + f'module "{name}" {{\n' + "".join(lines[2:]))
    _touch_model_files(text, tmp_path)
    t0 = time.perf_counter()
    r = cli("describe", f)
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - t0 < 5
    assert name[:50] in r.stdout.replace("\n", "")



@pytest.mark.parametrize("value", [str(2**31), "9" * 400])
def test_int_attributes_past_2_31_are_refused_by_verify(tmp_path, cli, value):
    """An int attribute is at most 2**31-1 (as the frontends bound config ints): an mla qk_nope_head_dim of 10**12
    passed verify and then overflowed float arithmetic in the softmax-scale rule (OverflowError)."""
    text = (GOLDEN / "test_deepseek_v3" / "test_witness_golden_ir.vxir").read_text()
    assert " qk_nope_head_dim=128 " in text
    f = tmp_path / "big.vxir"
    f.write_text(text.replace(" qk_nope_head_dim=128 ", f" qk_nope_head_dim={value} ", 1))
    _touch_model_files(text, tmp_path)
    r = cli("passes", f, "--pipeline", "verify")
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert "refused: 1 finding" in out and "is not an int in 0..2147483647  [bad-attribute]" in out, out
    assert len(out) < 4000  # a 400-digit value is shown shortened


def test_mla_query_head_of_no_dims_is_refused(tmp_path, cli):
    """qk_nope_head_dim and qk_rope_head_dim may each be 0, not both: the scale rule raised ZeroDivisionError
    (0.0 cannot be raised to a negative power)."""
    text = (GOLDEN / "test_deepseek_v3" / "test_witness_golden_ir.vxir").read_text()
    old = " qk_nope_head_dim=128 qk_rope_head_dim=64 "
    assert old in text
    f = tmp_path / "zero.vxir"
    f.write_text(text.replace(old, " qk_nope_head_dim=0 qk_rope_head_dim=0 ", 1))
    _touch_model_files(text, tmp_path)
    r = cli("passes", f, "--pipeline", "verify")
    out = r.stdout + r.stderr
    assert r.exit_code != 0 and "Traceback" not in out
    assert "a query head must have a dim" in out and "[inconsistent-attributes]" in out, out

def test_human_byte_sizes():
    """Exact decimal arithmetic: the table view divided with floats, and a byte count past 1.8e308 (reached with
    10**400-sized attributes, before verify bounded them) raised OverflowError in `vxc describe`."""
    from vxc.describe_view import _bytes

    assert [_bytes(n) for n in (0, 1023, 1024, 1536, 3 << 30, 5000 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "3.0 GiB", "5000.0 TiB"]
    assert _bytes(10**400).endswith(" TiB") and len(_bytes(10**400)) > 380


def test_refusal_json_is_strict_json(tmp_path, cli):
    """A NaN attribute's finding carries the value: `vxc passes --json` wrote it as NaN, which is not JSON."""
    import json

    text = _golden_text()
    f = tmp_path / "nan.vxir"
    f.write_text(text.replace("norm_eps=1e-05", "norm_eps=nan", 1))
    r = cli("passes", f, "--pipeline", "verify", "--json")
    assert r.exit_code != 0

    def strict(x):
        raise ValueError(f"not JSON: {x}")

    d = json.loads(r.stdout, parse_constant=strict)
    assert any(x.get("actual") == "nan" for x in d["findings"]), d


def test_describe_dot_quotes_the_module_name(tmp_path, cli):
    """The Graphviz file named the graph with the module name written bare inside quotes: a name holding a quote,
    a backslash or a line break ended the string early and broke the file."""
    import json

    text = _golden_text()
    lines = text.splitlines(keepends=True)
    name = 'a"b\\c\nd'
    f = tmp_path / "named.vxir"
    f.write_text(lines[0] + f"module {json.dumps(name)} {{\n" + "".join(lines[2:]))
    _touch_model_files(text, tmp_path)
    dot = tmp_path / "g.dot"
    r = cli("describe", f, "--dot", dot, "--json")
    assert r.exit_code == 0, r.output
    assert dot.read_text().split("\n")[0] == 'digraph "a\\"b\\\\c\\nd" {'
