"""Dialect resolution: the OuteAI layer-index base settled by tensor evidence
(0, 1, and evidence that cannot decide), and unknown families refused with the
supported list. Nothing is fuzzy and nothing falls back to a generic model."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import builders
from vxc.frontends import FrontendError, lower


def _facts(m) -> dict:
    return {f.name: f for f in m.facts}


def test_oute_base0(minis):
    m = lower(minis["oute_base0"])
    f = _facts(m)["layer_index_base"]
    assert f.value == 0
    # MINI_OUTE: attention in_proj rows (6 + 2*3) * 9 = 108, Mamba2 rows 2*112 + 2*2*12 + 14 = 286
    assert "108" in f.evidence and "286" in f.evidence and "2,4" in f.evidence
    assert [layer.index for layer in m.layers if layer.mixer.kind == "conv_qkv"] == [2, 4]


def test_oute_base1(minis):
    m = lower(minis["oute_base1"])
    f = _facts(m)["layer_index_base"]
    assert f.value == 1
    assert "108" in f.evidence and "1,3" in f.evidence
    assert [layer.index for layer in m.layers if layer.mixer.kind == "conv_qkv"] == [1, 3]


def test_oute_base_recorded_in_text(minis, cli, tmp_path):
    out = tmp_path / "b1.vxir"
    r = cli("lower", minis["oute_base1"], "-o", out)
    assert r.exit_code == 0, r.output
    lines = [ln.strip() for ln in out.read_text().splitlines() if ln.strip().startswith("fact layer_index_base")]
    assert len(lines) == 1 and lines[0].startswith("fact layer_index_base 1 evidence ")


# An OuteAI geometry where the attention in_proj has exactly as many rows as the
# Mamba2 in_proj: (Hq + 2*Hkv) * Dh = (18 + 2*2) * 13 = 286 = 2*112 + 2*2*12 + 14.
AMBIGUOUS = {**builders.MINI_OUTE, "num_attention_heads": 18, "num_key_value_heads": 2, "attention_head_dim": 13}
assert (18 + 2 * 2) * 13 == 2 * 112 + 2 * 2 * 12 + 14


def test_oute_ambiguous_evidence_refused(tmp_path, cli):
    d = builders.build_oute(tmp_path / "amb", AMBIGUOUS, index_base=0, header_only=True)
    with pytest.raises(FrontendError) as e:
        lower(d)
    msg = str(e.value)
    assert "0- or 1-based" in msg and "cannot decide" in msg and "286" in msg
    out = tmp_path / "amb.vxir"
    r = cli("lower", d, "-o", out)
    assert r.exit_code != 0
    assert "cannot decide" in r.stderr
    assert not out.exists()


def test_oute_evidence_fitting_neither_refused(tmp_path):
    d = builders.build_oute(tmp_path / "neither", builders.MINI_OUTE, index_base=0, header_only=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_layers_idx"] = [3, 4]  # the tensors put attention on 2 and 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FrontendError, match="fits neither"):
        lower(d)


def _dir_with_config(tmp_path, cfg: dict, like):
    d = tmp_path / "m"
    d.mkdir(parents=True)
    for f in like.glob("*.safetensors"):
        shutil.copyfile(f, d / f.name)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


SUPPORTED = ("llama", "mamba2", "mamba2attn", "qwen2", "qwen3", "mamba_ssm-native")


def test_unknown_model_type_lists_supported(tmp_path, minis, cli):
    cfg = json.loads((minis["hf_llama"] / "config.json").read_text())
    cfg["model_type"] = "llama_but_not_quite"
    d = _dir_with_config(tmp_path, cfg, minis["hf_llama"])
    with pytest.raises(FrontendError) as e:
        lower(d)
    msg = str(e.value)
    assert "unknown model_type 'llama_but_not_quite'" in msg
    assert all(s in msg for s in SUPPORTED), msg
    r = cli("lower", d, "-o", tmp_path / "x.vxir")
    assert r.exit_code != 0 and "unknown model_type" in r.stderr


def test_near_miss_model_type_is_not_fuzzy(tmp_path, minis):
    for i, near in enumerate(("Llama", "qwen-3", "mamba2attn ", "LlamaForCausalLM")):
        cfg = json.loads((minis["hf_llama"] / "config.json").read_text())
        cfg["model_type"] = near
        d = _dir_with_config(tmp_path / str(i), cfg, minis["hf_llama"])
        with pytest.raises(FrontendError, match="unknown model_type"):
            lower(d)


@pytest.mark.parametrize("cfg", [
    {"d_model": 48, "n_layer": 3, "vocab_size": 101},  # native-looking but no ssm_cfg
    {**builders.MINI_NATIVE_MAMBA2, "ssm_cfg": {"layer": "Mamba1"}},  # a dialect vxc does not lower
    {"hidden_size": 40},
], ids=["no-ssm_cfg", "mamba1", "bare"])
def test_no_model_type_and_no_dialect(cfg, tmp_path, minis):
    d = _dir_with_config(tmp_path, cfg, minis["native_mamba2"])
    with pytest.raises(FrontendError) as e:
        lower(d)
    msg = str(e.value)
    assert "no model_type" in msg and "matches no known dialect" in msg
    assert all(s in msg for s in SUPPORTED), msg
