"""``vxc lower`` as a user meets it: the one-line summary, the atomic write,
and bad input — each a single clear message, a non-zero exit, no traceback and
no output file."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from tests import builders
from tests.conftest import GOLDEN


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A header-only native miniature to break in copies."""
    d = tmp_path_factory.mktemp("good") / "mini"
    return builders.build_native_mamba(d, builders.MINI_NATIVE_MAMBA2, header_only=True)


@pytest.fixture(scope="module")
def good_sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("good") / "sharded"
    return builders.build_native_mamba(d, builders.MINI_NATIVE_MAMBA2, header_only=True, shards=2)


def test_lower_summary_and_file(witnesses, witness_root, cli):
    out = witness_root / "780m-lowered.vxir"
    r = cli("lower", witnesses["mamba2-780m"], "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.count("\n") == 1
    assert r.stdout.startswith("lowered mamba2-780m ") and "48 layers (48 mamba2)" in r.stdout and "434 tensors" in r.stdout
    # written next to the witness dir, the IR is exactly the golden IR after ``state``
    golden = (GOLDEN / "test_witnesses" / "test_golden_ir[mamba2-780m-state].vxir").read_text()
    assert out.read_text() == golden


def test_lower_json(witnesses, tmp_path, cli):
    out = tmp_path / "sub" / "dir" / "250m.vxir"  # missing parents are created
    r = cli("lower", witnesses["mamba2attn-250m.oute-dialect"], "-o", out, "--json")
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    assert j["ok"] is True and j["output"] == str(out) and j["layers"] == 32
    assert j["mixers"] == {"mamba2": 28, "conv_qkv": 4}
    # 32 block norms + 28 x 8 Mamba2 tensors (no projection biases) + 4 x 4 conv-QKV tensors
    # (in_proj, conv1d weight+bias, out_proj) + embedding + final norm (tied: no head)
    assert j["tensors"] == 32 + 28 * 8 + 4 * 4 + 2
    assert out.is_file()


def test_lower_replaces_existing_output(good, tmp_path, cli):
    out = tmp_path / "x.vxir"
    out.write_text("old\n")
    assert cli("lower", good, "-o", out).exit_code == 0
    assert out.read_text().startswith("vindex3 schema 6\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.vxir"]


def test_crash_while_writing_leaves_the_old_output_and_no_temporary(good, tmp_path, cli, monkeypatch):
    import vxc.driver

    def boom(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(vxc.driver.os, "replace", boom)
    out = tmp_path / "x.vxir"
    out.write_text("stale\n")
    r = cli("lower", good, "-o", out)
    assert r.exit_code != 0 and "No space left on device" in r.stderr
    assert list(tmp_path.iterdir()) == [out] and out.read_text() == "stale\n"  # untouched, no temporary left


# ---------------------------------------------------------------- bad input


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _truncate(path, n):
    with open(path, "r+b") as f:
        f.truncate(n)


def _missing_dir(tmp, good, sharded):
    return tmp / "does-not-exist"


def _no_config(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "config.json").unlink()
    return d


def _invalid_json(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "config.json").write_text('{"d_model": 48, "n_layer": ')
    return d


def _config_not_object(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "config.json").write_text("[48, 3]")
    return d


def _wrong_type(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_layer"] = "3"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _no_weights(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "model.safetensors").unlink()
    return d


def _data_cut_short(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    p = d / "model.safetensors"
    _truncate(p, p.stat().st_size - 100)
    return d


def _header_longer_than_file(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    p = d / "model.safetensors"
    (n,) = struct.unpack("<Q", p.read_bytes()[:8])
    _truncate(p, 8 + n // 2)
    return d


def _absurd_header_length(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    return d


def _three_bytes(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "model.safetensors").write_bytes(b"abc")
    return d


def _header_not_json(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json")
    return d


def _index_missing_shard(tmp, good, sharded):
    d = _copy(sharded, tmp / "m")
    next(d.glob("model-00002-*.safetensors")).unlink()
    return d


def _index_outside(tmp, good, sharded):
    d = _copy(sharded, tmp / "m")
    shard = next(d.glob("model-00002-*.safetensors"))
    shutil.copyfile(shard, tmp / "x.safetensors")  # a real file, so only the containment check can refuse
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["weight_map"] = {k: ("../x.safetensors" if v == shard.name else v) for k, v in j["weight_map"].items()}
    idx.write_text(json.dumps(j))
    shard.unlink()
    return d


def _index_not_json(tmp, good, sharded):
    d = _copy(sharded, tmp / "m")
    (d / "model.safetensors.index.json").write_text("{")
    return d


def _index_names_absent_tensor(tmp, good, sharded):
    d = _copy(sharded, tmp / "m")
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["weight_map"]["backbone.layers.9.mixer.D"] = next(iter(j["weight_map"].values()))
    idx.write_text(json.dumps(j))
    return d


def _unknown_family(tmp, good, sharded):
    d = _copy(good, tmp / "m")
    (d / "config.json").write_text(json.dumps({"model_type": "rwkv7", "hidden_size": 48}))
    return d


def _model_dir_is_a_file(tmp, good, sharded):
    p = tmp / "config.json"
    shutil.copyfile(good / "config.json", p)
    return p


def _not_gguf_either(tmp, good, sharded):
    p = tmp / "model.gguf"  # named like one, but a zip archive's bytes
    p.write_bytes(b"PK\x03\x04" + bytes(60))
    return p


BAD = {
    "missing-dir": (_missing_dir, "does not exist"),
    "no-config": (_no_config, "no config.json"),
    "invalid-json": (_invalid_json, "not valid JSON"),
    "config-not-object": (_config_not_object, "expected a JSON object"),
    "wrong-type": (_wrong_type, "cannot read this config"),
    "no-weights": (_no_weights, "no *.safetensors"),
    "data-cut-short": (_data_cut_short, "truncated file"),
    "header-longer-than-file": (_header_longer_than_file, "truncated or corrupt safetensors header"),
    "absurd-header-length": (_absurd_header_length, "truncated or corrupt safetensors header"),
    "three-bytes": (_three_bytes, "truncated safetensors file"),
    "header-not-json": (_header_not_json, "header is not valid JSON"),
    "index-missing-shard": (_index_missing_shard, "which does not exist"),
    "index-outside": (_index_outside, "'../x.safetensors', a path outside the model directory"),
    "index-not-json": (_index_not_json, "not a valid index"),
    "index-absent-tensor": (_index_names_absent_tensor, "no shard holds"),
    "unknown-family": (_unknown_family, "unknown model_type 'rwkv7'; supported: "),
    "dir-is-a-file": (_model_dir_is_a_file, "is not a directory"),
    # a file that is not GGUF either (a GGUF file is lowered as a whole model): both inputs named, and its first bytes
    "not-gguf-either": (_not_gguf_either, "nor a GGUF file (one starts with the bytes b'GGUF'; this file starts b'PK\\x03\\x04')"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case, tmp_path, good, good_sharded, cli):
    make, message = BAD[case]
    src = make(tmp_path, good, good_sharded)
    out = tmp_path / "out" / "m.vxir"
    out.parent.mkdir()
    out.write_text("stale\n")
    r = cli("lower", src, "-o", out)  # in-process: an uncaught exception fails the test here
    assert r.exit_code != 0
    assert r.stdout == ""
    err = r.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert message in err[0], err[0]
    assert list(out.parent.iterdir()) == [out] and out.read_text() == "stale\n"  # untouched, no temporary
    j = cli("lower", src, "-o", out, "--json")
    assert j.exit_code != 0 and message in json.loads(j.stdout)["error"]


@pytest.mark.parametrize("case", ["missing-dir", "header-longer-than-file", "index-outside", "wrong-type"])
def test_bad_input_as_a_user_sees_it(case, tmp_path, good, good_sharded, vxc_sub):
    make, message = BAD[case]
    src = make(tmp_path, good, good_sharded)
    out = tmp_path / "o.vxir"
    r = vxc_sub("lower", src, "-o", out)
    assert r.exit_code == 1
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.count("\n") == 1 and message in r.stderr
    assert not out.exists()


def test_bad_input_to_describe_and_passes(tmp_path, good, good_sharded, cli):
    src = _header_longer_than_file(tmp_path, good, good_sharded)
    for cmd in ("describe", "passes"):
        r = cli(cmd, src)
        assert r.exit_code != 0 and "truncated or corrupt safetensors header" in r.stderr


def test_shapes_contradicting_config_refused(good, tmp_path, cli):
    d = _copy(good, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["d_model"] = 56  # the tensors were written for 48 (d_inner 96, 12 heads); 56 -> 112, 14 heads
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.vxir"
    r = cli("lower", d, "-o", out)
    assert r.exit_code != 0 and not out.exists()
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused: ") and all(ln.endswith("[shape-mismatch]") for ln in lines[1:])
    assert any("Mamba2OutProj" in ln and "[48,96]" in ln and "[56,112]" in ln for ln in lines)
    assert any("Mamba2D " in ln and "[12]" in ln and "[14]" in ln for ln in lines)


def test_geometry_contradicting_itself_refused(good, tmp_path, cli):
    d = _copy(good, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["d_model"] = 50  # d_inner 100 is no multiple of headdim 8
    (d / "config.json").write_text(json.dumps(cfg))
    r = cli("lower", d, "-o", tmp_path / "o.vxir")
    assert r.exit_code != 0 and not (tmp_path / "o.vxir").exists()
    assert r.stdout.splitlines()[0].startswith("refused: ")
