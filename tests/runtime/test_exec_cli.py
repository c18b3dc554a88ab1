"""``vxc exec`` and ``vxc demo`` from the command line: the JSON report, the
teacher-forced logits file, tokenizer handling, weight-file checks and the
--model-dir override."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.runtime import parity_table as P
from tests.runtime.conftest import read_json_line


def _toks(ids) -> str:
    return ",".join(map(str, ids))


@pytest.mark.parametrize("name", ["mamba2attn-native", "qwen3"])
def test_exec_json_and_logits_out(lab, vxc_inproc, tmp_path, name):
    f = lab.family(name)
    ir = lab.built(name)[1]
    ids = P.prompt_ids(f)
    out = tmp_path / "logits.safetensors"
    r = vxc_inproc("exec", ir, "--tokens", _toks(ids), "--max-new-tokens", 8, "--json", "--logits-out", out)
    assert r.exit_code == 0, r.output
    res = read_json_line(r.stdout)
    gen = res["generated_ids"]
    assert isinstance(gen, list) and len(gen) == 8 and all(type(t) is int and 0 <= t < f.vocab for t in gen)
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        assert isinstance(res[k], float) and res[k] > 0, (k, res[k])
    p = lab.parity(name)
    assert gen == p.greedy_ref[:8]  # the reference's own greedy continuation
    data = load_file(str(out))
    assert set(data) == {"logits"}
    logits = data["logits"]
    assert logits.dtype == torch.float32 and tuple(logits.shape) == (f.prompt_len, f.padded_vocab)
    ref = lab.ref(name).full(ids)
    assert P.maxabs(logits, ref) <= p.tol
    assert not out.with_name(out.name + ".tmp").exists()


def test_exec_streams_ids_without_tokenizer(lab, vxc_inproc):
    ir = lab.built("mamba2attn-native")[1]
    r = vxc_inproc("exec", ir, "--tokens", "3,1,4,1,5,9,2,6", "--max-new-tokens", 5)
    assert r.exit_code == 0, r.output
    streamed = [int(t) for t in r.stdout.split()]
    assert len(streamed) == 5
    assert "no tokenizer.json" in r.stderr and "token ids only" in r.stderr
    assert "prefill 8 tokens" in r.stderr and "tok/s" in r.stderr


def test_prompt_without_tokenizer_is_a_clear_error(lab, vxc_proc):
    ir = lab.built("mamba2attn-native")[1]
    r = vxc_proc("exec", ir, "--prompt", "hello", "--max-new-tokens", 2)
    assert r.exit_code != 0
    assert "tokenizer.json" in r.stderr and "--tokens" in r.stderr
    assert "Traceback" not in r.output


def test_token_ids_outside_the_vocabulary(lab, vxc_inproc):
    ir = lab.built("qwen3")[1]  # vocab 109
    r = vxc_inproc("exec", ir, "--tokens", "1,2,109", "--max-new-tokens", 1)
    assert r.exit_code == 1 and "outside the vocabulary" in r.output


@pytest.fixture(scope="module")
def demo(tmp_path_factory, vxc_proc):
    root = tmp_path_factory.mktemp("demo")
    r = vxc_proc("demo", "--dir", root, "--max-new-tokens", 12)
    return root, r


def test_demo_end_to_end(demo):
    root, r = demo
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert (root / "mini-mamba2attn.vxir").is_file() and (root / "mini-mamba2attn" / "tokenizer.json").is_file()
    assert "== lowered" in r.stdout
    # the streamed text: the prompt, then 12 generated characters, then the throughput line on stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("The state of "))
    assert len(line) > len("The state of ")
    assert "tok/s" in r.stderr
    # the demo runs exec --profile: both tables, the decode one naming the replay's kernels
    assert "prefill profile: " in r.stderr and "decode profile: " in r.stderr
    assert " / vxc_gemv / fp32" in r.stderr


def test_prompt_with_tokenizer_streams_text(demo, vxc_inproc):
    root, r = demo
    assert r.exit_code == 0, r.output
    ir = root / "mini-mamba2attn.vxir"
    args = ("exec", ir, "--prompt", "Hello, state", "--max-new-tokens", 10)
    j = vxc_inproc(*args, "--json")
    assert j.exit_code == 0, j.output
    res = read_json_line(j.stdout)
    assert isinstance(res["generated_text"], str) and len(res["generated_ids"]) == 10
    assert res["prompt_tokens"] == len("Hello, state")  # the demo tokenizer is character-level
    s = vxc_inproc(*args)
    assert s.exit_code == 0, s.output
    assert s.stdout == "Hello, state" + res["generated_text"] + "\n"


def _copy_lowered(lab, name, dst):
    """The .vxir and its model directory, copied with the same relative layout."""
    mdir, ir = lab.built(name)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(mdir, dst / mdir.name)
    shutil.copy(ir, dst / ir.name)
    return dst / mdir.name, dst / ir.name


def test_header_byte_changed_is_refused(lab, vxc_inproc, tmp_path):
    mdir, ir = _copy_lowered(lab, "mamba2attn-native", tmp_path)
    st = mdir / "model.safetensors"
    raw = bytearray(st.read_bytes())
    at = raw.index(b'"F32"', 8)  # a dtype string inside the JSON header
    raw[at + 2] = ord("1")  # F32 -> F12: the same length, a different header
    st.write_bytes(bytes(raw))
    r = vxc_inproc("exec", ir, "--tokens", "1,2,3", "--max-new-tokens", 1)
    assert r.exit_code == 1
    assert "header sha256 differs" in r.stderr and "refusing" in r.stderr


def test_appended_bytes_are_refused(lab, vxc_inproc, tmp_path):
    mdir, ir = _copy_lowered(lab, "qwen3", tmp_path)
    st = mdir / "model.safetensors"
    size = st.stat().st_size
    with open(st, "ab") as fh:
        fh.write(b"\0" * 16)
    r = vxc_inproc("exec", ir, "--tokens", "1,2,3", "--max-new-tokens", 1)
    assert r.exit_code == 1
    assert f"size {size + 16} bytes, the IR recorded {size}" in r.stderr


def test_model_dir_override_after_moving_the_checkpoint(lab, vxc_inproc, tmp_path):
    name = "oute-base1"
    mdir, ir = _copy_lowered(lab, name, tmp_path / "a")
    moved = tmp_path / "elsewhere" / "checkpoint"
    moved.parent.mkdir()
    shutil.move(str(mdir), moved)
    toks = _toks(P.prompt_ids(lab.family(name)))
    r = vxc_inproc("exec", ir, "--tokens", toks, "--max-new-tokens", 6, "--json")
    assert r.exit_code == 2  # a named refusal (verify: the recorded file is missing), as JSON under --json
    res = read_json_line(r.stdout.replace("\n", " "))
    assert res["refused"] and [f["code"] for f in res["findings"]] == ["missing-file"]
    assert "does not exist" in res["findings"][0]["message"] and str(mdir) in res["findings"][0]["message"]
    r = vxc_inproc("exec", ir, "--tokens", toks, "--max-new-tokens", 6, "--json", "--model-dir", moved)
    assert r.exit_code == 0, r.output
    assert read_json_line(r.stdout)["generated_ids"] == lab.parity(name).greedy_ref[:6]
