"""deepseek_v3 lowering: MLA with q-LoRA (or a direct q), YaRN with mscale, the interleaved rotary layout,
dense and grouped-routing MoE FFNs as attributes; both rotary spellings; YaRN tables against the reference's;
a named refusal at lowering; the DeepSeek-V3 witness at full geometry (header-only) with its golden IR and
describe JSON. Parity against transformers 5.24 is in tests/families/test_deepseek_v3.py.

Every expected number is written here from the published geometry, never read from vxc's declarations.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests import builders as B
from tests.families import latent_support as S
from tests.families.deepseek_v3_support import VOCAB
from tests.families.deepseek_v3_support import mini  # noqa: F401  (fixture)


def mscale(f, m):
    return 0.1 * m * math.log(f) + 1.0


YARN_SCALE = 18 ** -0.5 * mscale(4.0, 0.6) ** 2
YARN_ATTENTION_FACTOR = mscale(4.0, 0.8) / mscale(4.0, 0.6)


def to_hub(src, dst):
    """The hub spelling of the rotary parameters: ``rope_theta`` + ``rope_scaling`` with ``type``."""
    cfg = S.read_config(src)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp.pop("rope_type", None)
    cfg["rope_scaling"] = {**rp, "type": "yarn"}
    cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
    S.copy_weights(src, dst)
    S.write_config(dst, cfg)
    return dst


def _lowered(d):
    from vxc.frontends import lower
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    return PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(lower(d), model_dir=d)).module


# ---------------------------------------------------------------- lowering


def test_lowered_attributes(mini):
    m = _lowered(mini["moe"])
    assert m.source.dialect == "deepseek_v3/transformers-5"
    assert [layer.mixer.kind for layer in m.layers] == ["mla"] * 3
    assert [layer.ffn.kind for layer in m.layers] == ["swiglu", "moe", "moe"]
    a = m.layers[0].mixer.attrs
    assert (a["q_lora"], a["q_lora_rank"], a["kv_lora_rank"], a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]) == (True, 26, 18, 10, 8, 14)
    assert (a["rotary_dim"], a["rotary_layout"], a["rotary_output"], a["rope_type"]) == (8, "interleaved", "split", "yarn")
    assert (a["rope_factor"], a["rope_original_max_position"], a["rope_beta_fast"], a["rope_beta_slow"]) == (4.0, 32, 32.0, 1.0)
    assert (a["rope_mscale"], a["rope_mscale_all_dim"], a["rope_truncate"]) == (0.8, 0.6, True)
    assert a["scale"] == pytest.approx(YARN_SCALE, rel=1e-12)
    assert a["rope_attention_factor"] == pytest.approx(YARN_ATTENTION_FACTOR, rel=1e-12)
    assert a["norm_eps"] == 1e-6 and "norm_eps" in m.layers[0].mixer.defaults
    assert [(r.name, r.kind, list(r.shape), r.precision, r.growth) for r in m.layers[0].regions] == [
        ("latent", "latent_rows", [26], "compute", "per_token")]
    moe = m.layers[1].ffn.attrs
    assert (moe["router"], moe["n_group"], moe["topk_group"], moe["top_k"], moe["routed_scaling"]) == ("sigmoid_grouped", 4, 2, 2, 2.5)
    d = _lowered(mini["direct"]).layers[0].mixer.attrs
    assert (d["q_lora"], d["q_lora_rank"], d["rotary_layout"], d["rotary_output"], d["rope_type"]) == (False, 0, "half", "in_place", "default")
    assert d["scale"] == pytest.approx(18 ** -0.5, rel=1e-12)


def test_hub_rotary_spelling_same_program(mini, tmp_path):
    hub = to_hub(mini["moe"], tmp_path / "hub")
    a, b = _lowered(mini["moe"]), _lowered(hub)
    assert b.source.dialect == "deepseek_v3/hub"
    assert {f.name: f.value for f in b.facts}["rope_read_from"] == "rope_theta/rope_scaling"
    for la, lb in zip(a.layers, b.layers):
        assert (la.mixer.attrs, la.ffn.attrs, la.regions) == (lb.mixer.attrs, lb.ffn.attrs, lb.regions)
    from vxc.runtime.session import Session

    ids = S.prompt(VOCAB, 20)
    assert torch.equal(Session(S.engine(mini["moe"])).prefill(ids), Session(S.engine(hub)).prefill(ids))


def test_yarn_tables_match_reference(mini):
    """vxc's YaRN inverse frequencies and attention factor equal transformers' for the declared attributes."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vxc.runtime.rope import inv_freq

    cfg = transformers.AutoConfig.from_pretrained(str(mini["dense"]))
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    a = _lowered(mini["dense"]).layers[0].mixer.attrs
    inv, factor = inv_freq(a)
    assert torch.equal(inv, ref_inv.float()) and factor == pytest.approx(ref_factor, rel=1e-12)


# ---------------------------------------------------------------- refusals


def test_missing_q_a_layernorm_is_a_named_finding(mini, tmp_path):
    from safetensors.torch import load_file, save_file

    from vxc.driver import lower_to_file
    from vxc.passes.findings import Refusal

    d = tmp_path / "stripped"
    S.copy_weights(mini["dense"], d)
    S.write_config(d, S.read_config(mini["dense"]))
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.q_a_layernorm.weight"]
    save_file(t, str(d / "model.safetensors"))
    out = tmp_path / "x.vxir"
    with pytest.raises(Refusal) as e:
        lower_to_file(d, out)
    assert [x.line() for x in e.value.findings] == ["layer 1 mla: required role MlaQANorm is not bound  [missing-operand]"]
    assert not out.exists()


# ---------------------------------------------------------------- the DeepSeek-V3 witness (header-only, full geometry)

W = "deepseek-v3"
W_LATENT = 512 + 64


@pytest.fixture(scope="module")
def witness(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3_witness")
    return B.witness_header_only(W, root / W)


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == 61 and d["compute"] == "bf16"
    assert d["operators"]["mla"] == {"count": 61, "layers": list(range(61))}
    assert d["operators"]["swiglu"] == {"count": 3, "layers": [0, 1, 2]}
    assert d["operators"]["moe"] == {"count": 58, "layers": list(range(3, 61))}
    assert d["surfaces"] == {"attention": 61, "ffn": 61, "moe": 58}
    s = d["state"]
    assert (s["recurrent_layers"], s["growing_layers"], s["fixed_elements"]) == (0, 61, 0)
    assert s["per_token_elements"] == 61 * W_LATENT and s["per_token_bytes"] == 61 * W_LATENT * 2
    assert all(r["kind"] == "latent_rows" and r["shape"] == [W_LATENT] and r["growth"] == "per_token" for r in s["regions"])
    # versus expanded K/V rows: 128 heads × (192 + 128) per token per layer
    assert 128 * (192 + 128) == 40_960 and W_LATENT == 576


def test_witness_attributes(witness):
    m = _lowered(witness)
    a = m.layers[0].mixer.attrs
    assert (a["q_lora"], a["q_lora_rank"], a["heads"], a["rope_type"], a["rope_factor"]) == (True, 1536, 128, "yarn", 40.0)
    assert (a["rotary_layout"], a["rotary_output"], a["rope_original_max_position"]) == ("interleaved", "split", 4096)
    assert a["scale"] == pytest.approx(192 ** -0.5 * mscale(40.0, 1.0) ** 2, rel=1e-12)
    assert a["rope_attention_factor"] == 1.0
    moe = m.layers[3].ffn.attrs
    assert (moe["experts"], moe["top_k"], moe["n_group"], moe["topk_group"], moe["routed_scaling"]) == (256, 8, 8, 4, 2.5)


def test_witness_golden_ir(witness, snapshot):
    from tests.families.moe_support import lowered_text

    text = lowered_text(witness)  # lowered, verify,bind,closure,state, model_dir relative to its parent
    assert f'model_dir "{W}"' in text and 'dialect "deepseek_v3/hub"' in text
    assert len(text.splitlines()) < 5000
    assert text == snapshot


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json
