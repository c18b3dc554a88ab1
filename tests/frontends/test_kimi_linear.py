"""kimi_linear lowering: KDA + NoPE MLA stacks as operators, attributes and regions, both config dialects,
named refusals at lowering, and the Kimi-Linear-48B witness at full geometry (header-only) with its golden
IR and describe JSON. Parity against transformers 5.24 is in tests/families/test_kimi_linear.py.

Every expected number is written here from the published geometry, never read from vxc's declarations.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import builders as B
from tests.families import latent_support as S
from tests.families.kimi_linear_support import KDA_LAYERS, MLA_LAYERS, N_LAYERS, VOCAB
from tests.families.kimi_linear_support import mini  # noqa: F401  (fixture)


def to_hub(src, dst, first_k_dense: int):
    """The hub checkpoint's spelling of the same weights: ``linear_attn_config`` with 1-based layer lists,
    ``first_k_dense_replace``, the dense FFN as ``mlp.*``."""
    cfg = S.read_config(src)
    for k in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        cfg.pop(k)
    cfg["linear_attn_config"] = {"full_attn_layers": [i + 1 for i in MLA_LAYERS], "kda_layers": [i + 1 for i in KDA_LAYERS],
                                 "head_dim": 12, "num_heads": 2, "short_conv_kernel_size": 3}
    cfg.update(first_k_dense_replace=first_k_dense, mla_use_nope=True, moe_router_activation_func="sigmoid", use_grouped_topk=True)
    rename = {f"model.layers.{i}.block_sparse_moe.{n}_proj": f"model.layers.{i}.mlp.{n}_proj"
              for i in range(first_k_dense) for n in ("gate", "up", "down")}
    S.copy_weights(src, dst, rename)
    S.write_config(dst, cfg)
    return dst


# ---------------------------------------------------------------- lowering


def test_lowered_structure(mini):
    from vxc.driver import lower_to_file

    ctx = lower_to_file(mini["moe"], mini["moe"] / "m.vxir")
    m = ctx.module
    kinds = [layer.mixer.kind for layer in m.layers]
    assert kinds == ["kda", "mla", "kda", "kda", "mla"]
    assert [layer.ffn.kind for layer in m.layers] == ["swiglu"] + ["moe"] * 4
    assert m.source.dialect == "kimi_linear/transformers-5"
    facts = {f.name: f.value for f in m.facts}
    assert facts["layer_map_read_from"] == "layer_types (0-based)" and facts["mla_layers"] == MLA_LAYERS
    assert facts["dense_ffn_spelling"] == "block_sparse_moe.{gate,up,down}_proj"
    mla = m.layers[1].mixer.attrs
    assert (mla["rotary_dim"], mla["rotary_layout"], mla["q_lora"]) == (0, "none", False)
    assert mla["scale"] == pytest.approx(16 ** -0.5)
    kda = m.layers[0].mixer.attrs
    assert (kda["heads"], kda["head_dim"], kda["conv_kernel"], kda["out_gate_act"]) == (2, 12, 3, "sigmoid")
    regions = {layer.index: [(r.name, r.kind, list(r.shape), r.precision, r.growth) for r in layer.regions] for layer in m.layers}
    assert regions[0] == [("delta", "recurrent", [2, 12, 12], "f32", "fixed"), ("conv_q", "conv_history", [24, 3], "compute", "fixed"),
                          ("conv_k", "conv_history", [24, 3], "compute", "fixed"), ("conv_v", "conv_history", [24, 3], "compute", "fixed")]
    assert regions[1] == [("latent", "latent_rows", [26], "compute", "per_token")]
    moe = m.layers[1].ffn.attrs
    assert (moe["router"], moe["experts"], moe["top_k"], moe["selection_bias"], moe["shared_intermediate"]) == ("sigmoid_grouped", 6, 2, True, 24)
    text = (mini["moe"] / "m.vxir").read_text()
    assert 'bank "model.layers.2.block_sparse_moe.experts.{e}.w1.weight" experts 6' in text


def test_hub_dialect_same_program(mini, tmp_path):
    """The hub spelling lowers to the same operators, attributes and regions, and executes bit-identically."""
    from vxc.frontends import lower
    from vxc.passes import PassManager
    from vxc.passes.context import Context

    hub = to_hub(mini["moe"], tmp_path / "hub", 1)
    a = PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(lower(mini["moe"]), model_dir=mini["moe"])).module
    b = PassManager(["verify", "bind", "closure", "state"], emit=lambda s: None).run(Context(lower(hub), model_dir=hub)).module
    assert b.source.dialect == "kimi_linear/hub"
    facts = {f.name: f.value for f in b.facts}
    assert facts["layer_map_read_from"] == "linear_attn_config (1-based)"
    assert facts["mla_layers"] == MLA_LAYERS  # 1-based [2, 5] in the config
    assert facts["dense_ffn_spelling"] == "mlp.{gate,up,down}_proj"
    for la, lb in zip(a.layers, b.layers):
        assert (la.mixer.kind, la.mixer.attrs, la.ffn.kind, la.ffn.attrs) == (lb.mixer.kind, lb.mixer.attrs, lb.ffn.kind, lb.ffn.attrs)
        assert la.regions == lb.regions
    ids = S.prompt(VOCAB, 20)
    from vxc.runtime.session import Session

    la, lb = Session(S.engine(mini["moe"])).prefill(ids), Session(S.engine(hub)).prefill(ids)
    assert torch.equal(la, lb)


def test_no_layer_map_is_refused(mini, tmp_path):
    from vxc.frontends import FrontendError, lower

    d = tmp_path / "nomap"
    S.copy_weights(mini["dense"], d)
    cfg = S.read_config(mini["dense"])
    cfg.pop("layer_types")
    S.write_config(d, cfg)
    with pytest.raises(FrontendError, match="neither layer_types nor linear_attn_config"):
        lower(d)


def test_one_based_list_checked_against_tensors(mini, tmp_path):
    """A layer list read as 0-based by mistake would put MLA on layers 2 and 5; the tensors say 1 and 4."""
    from vxc.frontends import FrontendError, lower

    d = to_hub(mini["dense"], tmp_path / "hub", N_LAYERS)
    cfg = S.read_config(d)
    cfg["linear_attn_config"]["full_attn_layers"] = [1, 4]  # these lists are 1-based: MLA on 0 and 3
    cfg["linear_attn_config"]["kda_layers"] = [2, 3, 5]
    S.write_config(d, cfg)
    with pytest.raises(FrontendError, match=r"puts MLA on layers \[0, 3\].*kv_a_proj_with_mqa on layers \[1, 4\]"):
        lower(d)


# ---------------------------------------------------------------- refusals


def test_stripped_f_b_proj_is_a_named_finding(mini, tmp_path):
    from safetensors.torch import load_file, save_file

    from vxc.driver import lower_to_file
    from vxc.passes.findings import Refusal

    d = tmp_path / "stripped"
    S.copy_weights(mini["dense"], d)
    S.write_config(d, S.read_config(mini["dense"]))
    f = d / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.2.self_attn.f_b_proj.weight"]
    save_file(t, str(f))
    out = tmp_path / "x.vxir"
    with pytest.raises(Refusal) as e:
        lower_to_file(d, out)
    lines = [x.line() for x in e.value.findings]
    assert lines == ["layer 2 kda: required role KdaFBProj is not bound  [missing-operand]"]
    assert not out.exists()


# ---------------------------------------------------------------- the 48B witness (header-only, full geometry)

W = "kimi-linear-48b-a3b"
W_MLA = [3, 7, 11, 15, 19, 23, 26]  # 1-based 4, 8, 12, 16, 20, 24, 27
W_KDA = [i for i in range(27) if i not in W_MLA]
W_LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim
W_KDA_FIXED_EL = 32 * 128 * 128 + 3 * (32 * 128) * 4  # delta matrix + three conv histories (k = 4)
W_KDA_FIXED_B = 32 * 128 * 128 * 4 + 3 * (32 * 128) * 4 * 2  # matrix fp32, histories bf16


@pytest.fixture(scope="module")
def witness(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_witness")
    return B.witness_header_only(W, root / W)


def test_witness_describe(witness, describe_json):
    d = describe_json(witness)
    assert d["layers"] == 27 and d["compute"] == "bf16"
    assert d["operators"]["kda"] == {"count": 20, "layers": W_KDA}
    assert d["operators"]["mla"] == {"count": 7, "layers": W_MLA}
    assert d["operators"]["swiglu"] == {"count": 1, "layers": [0]}
    assert d["operators"]["moe"] == {"count": 26, "layers": list(range(1, 27))}
    assert d["surfaces"] == {"attention": 7, "ffn": 27, "moe": 26}
    s = d["state"]
    assert s["recurrent_layers"] == 20 and s["growing_layers"] == 7
    assert s["per_token_elements"] == 7 * W_LATENT and s["per_token_bytes"] == 7 * W_LATENT * 2
    assert s["fixed_elements"] == 20 * W_KDA_FIXED_EL and s["fixed_bytes"] == 20 * W_KDA_FIXED_B
    growing = [r for r in s["regions"] if r["growth"] == "per_token"]
    assert [r["layer"] for r in growing] == W_MLA
    assert all(r["kind"] == "latent_rows" and r["shape"] == [W_LATENT] and r["operator"] == "mla" for r in growing)
    for i in W_KDA:
        rs = [r for r in s["regions"] if r["layer"] == i]
        assert [(r["kind"], r["shape"], r["dtype"], r["growth"]) for r in rs] == [
            ("recurrent", [32, 128, 128], "f32", "fixed")] + [("conv_history", [4096, 4], "bf16", "fixed")] * 3


def test_witness_describe_human(witness, cli):
    r = cli("describe", witness)
    assert r.exit_code == 0, r.output
    out = r.stdout
    print(out)
    assert "27 layers" in out and "20 recurrent layers" in out and "7 growing layers" in out
    assert "per token: 4,032 elements" in out
    assert "latent_rows" in out and "576" in out and "3, 7, 11, 15, 19, 23, 26" in out
    assert "constant-size" not in out


def test_witness_golden_ir(witness, snapshot):
    from tests.families.moe_support import lowered_text

    text = lowered_text(witness)  # lowered, verify,bind,closure,state, model_dir relative to its parent
    assert f'model_dir "{W}"' in text and 'dialect "kimi_linear/hub"' in text
    assert len(text.splitlines()) < 3000
    assert text == snapshot


def test_witness_golden_describe(witness, describe_json, snapshot_json):
    assert json.dumps(describe_json(witness), indent=1, sort_keys=True) + "\n" == snapshot_json
