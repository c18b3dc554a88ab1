"""A config problem is a named refusal that names the key; a bug in a frontend is not dressed up as one."""

from __future__ import annotations

import json
import shutil

import pytest

from vxc.frontends import FrontendError, lower
from vxc.frontends.common import Attrs, ConfigError


def _with_config(tmp_path, src, **edits):
    d = tmp_path / "m"
    d.mkdir()
    for f in src.glob("*.safetensors"):
        shutil.copyfile(f, d / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("mini, key, value, says", [
    ("hf_llama", "num_hidden_layers", "2", "num_hidden_layers='2' is not an integer"),
    ("hf_qwen3", "rms_norm_eps", "tiny", "rms_norm_eps='tiny' is not a number"),
    ("hf_llama", "tie_word_embeddings", "yes", "tie_word_embeddings='yes' is not true or false"),
    ("native_mamba2", "n_layer", 2.5, "n_layer=2.5 is not an integer"),
    ("oute_base0", "attention_layers_idx", [2, "4"], "attention_layers_idx[1]='4' is not an integer"),
    ("hf_qwen3", "rope_parameters", {"rope_type": "linear", "factor": "x"}, "rope_parameters.factor='x' is not a number"),
])
def test_wrong_type_is_a_named_config_refusal(tmp_path, minis, mini, key, value, says):
    d = _with_config(tmp_path, minis[mini], **{key: value})
    with pytest.raises(FrontendError) as e:
        lower(d)
    assert isinstance(e.value, ConfigError)
    assert "cannot read this config" in str(e.value) and says in str(e.value), str(e.value)


def test_missing_key_names_it(tmp_path, minis):
    d = tmp_path / "m"
    shutil.copytree(minis["hf_qwen2"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lacks required key 'vocab_size'"):
        lower(d)


def test_a_frontend_bug_is_not_reported_as_a_config_error(minis, monkeypatch):
    """A KeyError from a code bug inside a frontend propagates as itself (a traceback), not as a refusal."""
    from vxc.frontends import softmax_decoder

    def broken(b, p, i):
        raise KeyError("a bug, not the config")

    monkeypatch.setattr(softmax_decoder, "bind_attention", broken)
    with pytest.raises(KeyError, match="a bug, not the config"):
        lower(minis["hf_llama"])


def test_attrs_reads():
    A = Attrs({"a": 3, "flag": 1, "nested": {"k": 2.0}, "n": None, "xs": [1, 2]}, "cfg", defaults={"d": 7})
    assert A.need("a", kind=int) == 3 and A.need("missing", "a") == 3  # alternative spellings: the first set
    assert A.get("flag", default=False, kind=bool) == (True, False)  # a flag written 0/1
    assert A.opt("nested.k", kind=float) == 2.0 and A.opt("nested.absent") is None
    assert A.take("d") == 7
    assert "d" in A.filled and "n" in A and A.raw("n") is None
    assert A.need("xs", kind=list[int]) == [1, 2]
    with pytest.raises(ConfigError, match=r"cfg: cannot read this config: a=3 must be >= 4"):
        A.need("a", kind=int, min=4)
    with pytest.raises(ConfigError, match="lacks required key 'n' / 'm'"):
        A.need("n", "m")
