"""Every wave-1 miniature (random weights, awkward widths) lowers, passes the
whole pipeline, round-trips as text, and lowers to the operator kinds its math
is: the same math → the same kinds, whatever the family's spelling."""

from __future__ import annotations

import pytest

from tests.conftest import MINI_NAMES
from vxc.frontends import lower
from vxc.ir import parse, print_module
from vxc.ir.roles import Placement
from vxc.passes import PassManager
from vxc.passes.context import Context
from vxc.passes.plan import plan_ops

FULL = ["verify", "bind", "closure", "state", "plan"]


def _run(model_dir, pipeline=FULL):
    m = lower(model_dir, relative_to=model_dir.parent)
    return PassManager(list(pipeline), emit=lambda s: None).run(Context(m, model_dir=model_dir))


@pytest.fixture(scope="module")
def planned(minis):
    return {name: _run(path) for name, path in minis.items()}


@pytest.mark.parametrize("name", MINI_NAMES)
def test_full_pipeline_via_cli(name, minis, cli):
    r = cli("passes", minis[name])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "ok: verify,bind,closure,state,plan"


@pytest.mark.parametrize("name", MINI_NAMES)
def test_text_round_trip(name, minis):
    """lower → print → parse → print is the identity on the text, before and after ``state``."""
    for pipeline in (["verify", "bind", "closure"], ["verify", "bind", "closure", "state"]):
        text = print_module(_run(minis[name], pipeline).module)
        again = print_module(parse(text, f"{name}.vxir"))
        assert again == text
        # the parsed module passes the same pipeline again
        ctx = PassManager(pipeline, emit=lambda s: None).run(Context(parse(text), model_dir=minis[name]))
        assert print_module(ctx.module) == text


# Expected mixer kind per layer, from each miniature's builder geometry (tests/builders.py).
MIXERS = {
    "native_mamba2": ["mamba2"] * 3,
    "native_mamba2attn": ["mamba2", "conv_qkv", "mamba2"],
    "oute_base0": ["mamba2", "mamba2", "conv_qkv", "mamba2", "conv_qkv"],
    "oute_base1": ["mamba2", "conv_qkv", "mamba2", "conv_qkv", "mamba2"],
    "hf_llama": ["softmax"] * 2,
    "hf_qwen2": ["softmax"] * 2,
    "hf_qwen3": ["softmax"] * 3,
    "hf_mamba2": ["mamba2"] * 2,
}


@pytest.mark.parametrize("name", MINI_NAMES)
def test_operator_kinds(name, planned):
    m = planned[name].module
    assert [layer.mixer.kind for layer in m.layers] == MIXERS[name]
    softmaxy = name.startswith("hf_") and name != "hf_mamba2"
    for layer in m.layers:
        if softmaxy:
            assert layer.placement == Placement.PreOnly
            assert layer.ffn is not None and layer.ffn.kind == "swiglu"
        else:
            assert layer.placement == Placement.PreMixer
            assert layer.ffn is None


def _layer_shape(ctx):
    """Per layer: the ordered (slot, kind) program, and model-level ops' kinds."""
    ops = plan_ops(ctx.plan)
    layers: dict = {}
    for p in ops:
        layers.setdefault(p.layer, []).append((p.slot, p.kind))
    return layers


def _layer_roles(ctx, layer):
    return {str(r) for p in plan_ops(ctx.plan) if p.layer == layer for r in p.operands}


def test_llama_qwen2_qwen3_same_kinds(planned):
    shapes = {n: _layer_shape(planned[n]) for n in ("hf_llama", "hf_qwen2", "hf_qwen3")}
    want = [("norm", "add_rmsnorm"), ("mixer", "softmax"), ("norm", "add_rmsnorm"), ("ffn", "swiglu")]
    for n, s in shapes.items():
        for layer, program in s.items():
            if layer is not None:
                assert program == want, (n, layer)
        assert [k for _, k in s[None]] == [k for _, k in shapes["hf_llama"][None]]


def test_llama_qwen2_qwen3_differ_only_in_roles_and_attributes(planned):
    llama = _layer_roles(planned["hf_llama"], 0)
    assert llama == {"PreAttentionNorm", "AttnQ", "AttnK", "AttnV", "AttnO", "PreFfnNorm", "FfnGate", "FfnUp", "FfnDown"}
    assert _layer_roles(planned["hf_qwen2"], 0) == llama | {"AttnQBias", "AttnKBias", "AttnVBias"}
    assert _layer_roles(planned["hf_qwen3"], 0) == llama | {"AttnQNorm", "AttnKNorm"}
    mixers = {n: planned[n].module.layers[0].mixer.attrs for n in ("hf_llama", "hf_qwen2", "hf_qwen3")}
    # the attribute *names* are the operator's; only values differ
    assert set(mixers["hf_llama"]) | {"qk_norm_eps", "qk_norm_zero_centred"} == set(mixers["hf_qwen3"])
    assert set(mixers["hf_llama"]) == set(mixers["hf_qwen2"])
    assert (mixers["hf_qwen2"]["q_bias"], mixers["hf_qwen2"]["k_bias"], mixers["hf_qwen2"]["v_bias"], mixers["hf_qwen2"]["o_bias"]) == (True, True, True, False)
    assert mixers["hf_qwen3"]["qk_norm"] is True and mixers["hf_llama"]["qk_norm"] is False
    # geometry straight from the builder's MINI_HF
    assert (mixers["hf_llama"]["heads"], mixers["hf_llama"]["kv_heads"], mixers["hf_llama"]["head_dim"]) == (4, 2, 12)
    assert (mixers["hf_qwen2"]["heads"], mixers["hf_qwen2"]["kv_heads"], mixers["hf_qwen2"]["head_dim"]) == (6, 2, 10)
    assert (mixers["hf_qwen3"]["heads"], mixers["hf_qwen3"]["kv_heads"], mixers["hf_qwen3"]["head_dim"]) == (4, 2, 14)


def test_mamba2_native_and_transformers_same_kinds(planned):
    native, hf = _layer_shape(planned["native_mamba2"]), _layer_shape(planned["hf_mamba2"])
    want = [("norm", "add_rmsnorm"), ("mixer", "mamba2")]
    assert all(p == want for k, p in native.items() if k is not None)
    assert all(p == want for k, p in hf.items() if k is not None)
    assert [k for _, k in native[None]] == [k for _, k in hf[None]]
    # same roles on a layer (conv bias on, projection biases off in both)
    assert _layer_roles(planned["native_mamba2"], 0) == _layer_roles(planned["hf_mamba2"], 0) == {
        "Mamba2PreMixerNorm", "Mamba2InProj", "Mamba2Conv1d", "Mamba2Conv1dBias", "Mamba2DtBias", "Mamba2ALog",
        "Mamba2D", "Mamba2GatedNorm", "Mamba2OutProj"}
    # the native miniature is tied (no LmHead operand), the transformers one is not
    assert planned["native_mamba2"].module.head.attrs["tied"] is True
    assert planned["hf_mamba2"].module.head.attrs["tied"] is False


def test_mamba2_geometry_from_config(planned):
    a = planned["native_mamba2"].module.layers[0].mixer.attrs
    # MINI_NATIVE_MAMBA2: d_model 48, d_inner 96, 12 heads x 8, d_state 10, ngroups 2, conv 4
    assert (a["d_model"], a["d_inner"], a["heads"], a["head_dim"], a["state_size"], a["groups"], a["conv_kernel"]) == (48, 96, 12, 8, 10, 2, 4)
    regions = {r.name: r for r in planned["native_mamba2"].module.layers[0].regions}
    assert regions["ssm"].shape == (12, 8, 10)
    assert regions["conv"].shape == (96 + 2 * 2 * 10, 4)


def test_conv_qkv_miniature_geometry(planned):
    m = planned["native_mamba2attn"].module
    a = m.layers[1].mixer.attrs
    # MINI_NATIVE_MAMBA2ATTN attention: 6 q heads, 2 kv heads, head_dim 10, conv 3, rotary 6, biases on
    assert (a["heads"], a["kv_heads"], a["head_dim"], a["conv_kernel"], a["rotary_dim"]) == (6, 2, 10, 3, 6)
    assert (a["qkv_bias"], a["out_bias"]) == (True, True)
    regions = {r.name: r for r in m.layers[1].regions}
    assert regions["kv"].growth == "per_token" and regions["kv"].elements() == 2 * 2 * 10
    assert regions["conv"].growth == "fixed" and regions["conv"].shape == ((6 + 2 * 2) * 10, 3)
