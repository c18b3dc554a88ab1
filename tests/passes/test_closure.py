"""Closure and bind refusals through ``vxc lower``: named, itemised, counted,
machine-readable with ``--json``, and never an IR file behind them."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import builders

MISSING_D = "layer {} mamba2: required role Mamba2D is not bound  [missing-operand]"


def native_header_only(d, cfg, *, drop=(), add=None, change=None, config_src=None):
    """A header-only native-dialect checkpoint with keys dropped, added or reshaped."""
    d.mkdir(parents=True, exist_ok=True)
    specs = builders.native_mamba_specs(cfg, "F32")
    for k in drop:
        del specs[k]
    specs.update(add or {})
    for k, shape in (change or {}).items():
        specs[k] = (specs[k][0], shape)
    if config_src is not None:
        shutil.copyfile(config_src, d / "config.json")
    else:
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    builders.write_header_only(d / "model.safetensors", specs)
    return d


MINI = builders.MINI_NATIVE_MAMBA2  # 3 layers, 12 heads


def _lower(cli, d, out, *extra):
    before = out.read_bytes() if out.exists() else None
    r = cli("lower", d, "-o", out, *extra)
    assert r.exit_code != 0, r.output
    # a refusal writes nothing: an earlier file at OUT is left as it was, and no temporary is left behind
    assert (out.read_bytes() if out.exists() else None) == before
    assert not list(out.parent.glob(f".{out.name}.*"))
    return r


def test_one_missing_operand(tmp_path, cli):
    d = native_header_only(tmp_path / "m", MINI, drop=["backbone.layers.1.mixer.D"])
    r = _lower(cli, d, tmp_path / "out.vxir")
    assert r.stdout.splitlines() == ["refused: 1 finding (closure)", "  " + MISSING_D.format(1)]


@pytest.fixture(scope="module")
def stripped_780m(tmp_path_factory):
    cfg = builders.witness_config("mamba2-780m")
    d = tmp_path_factory.mktemp("stripped") / "mamba2-780m-noD"
    return native_header_only(d, cfg, drop=[f"backbone.layers.{i}.mixer.D" for i in range(48)],
                              config_src=builders.WITNESS_DIR / "mamba2-780m.config.json")


def test_780m_without_D_refused_with_48_findings(stripped_780m, tmp_path, cli):
    out = tmp_path / "780m.vxir"
    out.write_text("stale IR from an earlier run\n")
    r = _lower(cli, stripped_780m, out)
    lines = r.stdout.splitlines()
    assert lines[0] == "refused: 48 findings (closure)"
    assert lines[1:] == ["  " + MISSING_D.format(i) for i in range(48)]
    print("\n" + r.stdout)


def test_780m_without_D_json(stripped_780m, tmp_path, cli):
    r = _lower(cli, stripped_780m, tmp_path / "780m.vxir", "--json")
    j = json.loads(r.stdout)
    assert j["refused"] is True and j["pass"] == "closure" and j["count"] == 48
    assert [(f["code"], f["layer"], f["operator"], f["role"]) for f in j["findings"]] == [
        ("missing-operand", i, "mamba2", "Mamba2D") for i in range(48)]
    assert all(f["message"] == "required role Mamba2D is not bound" for f in j["findings"])


def test_780m_without_D_subprocess(stripped_780m, tmp_path, vxc_sub):
    out = tmp_path / "780m.vxir"
    out.write_text("stale\n")
    r = vxc_sub("lower", stripped_780m, "-o", out)
    assert r.exit_code != 0
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines()[0] == "refused: 48 findings (closure)"
    assert len(r.stdout.splitlines()) == 49
    assert out.read_text() == "stale\n"  # a refusal leaves an existing output untouched


def test_unclassified_tensor(tmp_path, cli):
    extra = "backbone.layers.2.mixer.foo_proj.weight"
    d = native_header_only(tmp_path / "m", MINI, add={extra: ("F32", (8, 48))})
    r = _lower(cli, d, tmp_path / "out.vxir")
    lines = r.stdout.splitlines()
    assert lines[0] == "refused: 1 finding (closure)"
    assert extra in lines[1] and "[8,48]" in lines[1] and "claimed by no role" in lines[1]
    assert lines[1].endswith("[unclassified]")
    j = json.loads(_lower(cli, d, tmp_path / "out.vxir", "--json").stdout)
    assert [(f["code"], f["tensor"]) for f in j["findings"]] == [("unclassified", extra)]


def test_wrong_shape(tmp_path, cli):
    # A_log of layer 0 with one row too few: 11 instead of MINI's 12 heads
    d = native_header_only(tmp_path / "m", MINI, change={"backbone.layers.0.mixer.A_log": (11,)})
    r = _lower(cli, d, tmp_path / "out.vxir")
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("refused: 1 finding (")
    f = lines[1]
    assert f.startswith("  layer 0 mamba2: ") and f.endswith("[shape-mismatch]")
    assert "Mamba2ALog" in f and "backbone.layers.0.mixer.A_log" in f and "[11]" in f and "[12]" in f
    j = json.loads(_lower(cli, d, tmp_path / "out.vxir", "--json").stdout)
    (g,) = j["findings"]
    assert (g["code"], g["layer"], g["operator"], g["role"]) == ("shape-mismatch", 0, "mamba2", "Mamba2ALog")
    assert g["expected"] == [12] and g["actual"] == [11]


def test_shapes_contradicting_the_config(tmp_path, cli):
    """A config whose d_state disagrees with every tensor: each broken contract is itemised."""
    d = native_header_only(tmp_path / "m", MINI)
    cfg = json.loads((d / "config.json").read_text())
    cfg["ssm_cfg"]["d_state"] = 11  # the tensors were written for 10
    (d / "config.json").write_text(json.dumps(cfg))
    r = _lower(cli, d, tmp_path / "out.vxir", "--json")
    j = json.loads(r.stdout)
    assert j["refused"] is True and j["count"] >= 3
    got = {(f["layer"], f["role"]) for f in j["findings"] if f["code"] == "shape-mismatch"}
    # in_proj rows and the conv channels depend on d_state on every layer
    for i in range(3):
        assert (i, "Mamba2InProj") in got and (i, "Mamba2Conv1d") in got
    inproj = next(f for f in j["findings"] if f["role"] == "Mamba2InProj" and f["layer"] == 0)
    # rows 2*96 + 2*2*d_state + 12: 244 stored, 248 declared
    assert inproj["expected"] == [248, 48] and inproj["actual"] == [244, 48]


def test_text_and_json_agree(tmp_path, cli):
    d = native_header_only(tmp_path / "m", MINI, drop=["backbone.layers.0.mixer.D", "backbone.layers.2.mixer.dt_bias"],
                           add={"backbone.layers.1.mixer.bar": ("F32", (3,))})
    text = _lower(cli, d, tmp_path / "o.vxir").stdout.splitlines()
    j = json.loads(_lower(cli, d, tmp_path / "o.vxir", "--json").stdout)
    assert text[0] == f"refused: {j['count']} findings ({j['pass']})" and j["count"] == 3
    assert len(text) == 1 + j["count"]
    for line, f in zip(text[1:], j["findings"]):
        assert line.endswith(f"  [{f['code']}]") and f["message"] in line
        if f["layer"] is not None:
            assert line.startswith(f"  layer {f['layer']} {f['operator']}: ")
    assert sorted(f["code"] for f in j["findings"]) == ["missing-operand", "missing-operand", "unclassified"]
