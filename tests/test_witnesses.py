"""The three seed witnesses at full geometry (header-only safetensors): surfaces,
state regions and golden snapshots of the IR after ``closure`` and ``state`` and
of the describe JSON.

Every expected number below is computed here from the witness configs'
published geometry (VINDEX3.md, OPERATORS.md), never read from vxc's operator
declarations.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import GOLDEN, WITNESS_NAMES
from vxc.frontends import lower
from vxc.ir import parse, print_module
from vxc.passes import PassManager
from vxc.passes.context import Context

HEADER = "// -----// IR Dump After {} //----- //"

# ---------------------------------------------------------------- independent geometry

# mamba2-780m: d_model 1536, expand 2 -> d_inner 3072, headdim 64 -> 48 heads,
# d_state 128, ngroups 1, d_conv 4; 48 layers; vocab 50277 padded to 16 -> 50288; f32.
M780_SSM = (48, 64, 128)
M780_CONV = (3072 + 2 * 1 * 128, 4)  # 3328 channels x k=4 (what the references allocate)
M780_FIXED = 48 * 48 * 64 * 128 + 48 * 3328 * 4

# mamba2attn-250m (OuteAI): d_model 1024, mamba2 32 heads x 64 = 2048, state 128,
# groups 1, conv 4 -> conv_dim 2304; conv-QKV 16 q heads, 16 kv heads, head_dim 128,
# conv 4 -> fused qkv rows (16+2*16)*128 = 6144; attention on 4,12,20,28 (0-based);
# weights bf16 (compute bf16): conv histories and KV rows 2 bytes, SSM state f32.
A250_ATTN = [4, 12, 20, 28]
A250_MAMBA = [i for i in range(32) if i not in A250_ATTN]
A250_SSM = (32, 64, 128)
A250_MCONV = (2048 + 2 * 1 * 128, 4)
A250_QKV_CONV = ((16 + 2 * 16) * 128, 4)
A250_KV = (2, 16, 128)
A250_FIXED_EL = 28 * (32 * 64 * 128 + 2304 * 4) + 4 * 6144 * 4
A250_FIXED_B = 28 * (32 * 64 * 128 * 4 + 2304 * 4 * 2) + 4 * 6144 * 4 * 2
A250_TOKEN_EL = 4 * 2 * 16 * 128
A250_TOKEN_B = A250_TOKEN_EL * 2

# mamba2attn-2.7b (native): d_model 2560, d_inner 5120, 80 heads x 64, state 128,
# groups 1 -> conv_dim 5376; attention 30 heads, kv heads default = 30, head_dim 128,
# conv 4 -> qkv rows 90*128 = 11520; attention on 9,18,27,36,45,56; f32.
A27_ATTN = [9, 18, 27, 36, 45, 56]
A27_MAMBA = [i for i in range(64) if i not in A27_ATTN]
A27_SSM = (80, 64, 128)
A27_MCONV = (5120 + 256, 4)
A27_QKV_CONV = (90 * 128, 4)
A27_KV = (2, 30, 128)
A27_FIXED_EL = 58 * (80 * 64 * 128 + 5376 * 4) + 6 * 11520 * 4
A27_TOKEN_EL = 6 * 2 * 30 * 128

EXPECTED = {
    "mamba2-780m": dict(
        layers=48, vocab=(50277, 50288), operators={"mamba2": list(range(48))},
        surfaces={"attention": 0, "ffn": 0, "moe": 0},
        recurrent=48, growing=0, fixed_el=M780_FIXED, fixed_b=4 * M780_FIXED, token_el=0, token_b=0,
        compute="f32", mamba_regions=(M780_SSM, M780_CONV), attn_regions=None,
    ),
    "mamba2attn-250m.oute-dialect": dict(
        layers=32, vocab=(32768, 32768), operators={"mamba2": A250_MAMBA, "conv_qkv": A250_ATTN},
        surfaces={"attention": 4, "ffn": 0, "moe": 0},
        recurrent=28, growing=4, fixed_el=A250_FIXED_EL, fixed_b=A250_FIXED_B, token_el=A250_TOKEN_EL,
        token_b=A250_TOKEN_B, compute="bf16", mamba_regions=(A250_SSM, A250_MCONV), attn_regions=(A250_KV, A250_QKV_CONV),
    ),
    "mamba2attn-2.7b": dict(
        layers=64, vocab=(50277, 50288), operators={"mamba2": A27_MAMBA, "conv_qkv": A27_ATTN},
        surfaces={"attention": 6, "ffn": 0, "moe": 0},
        recurrent=58, growing=6, fixed_el=A27_FIXED_EL, fixed_b=4 * A27_FIXED_EL, token_el=A27_TOKEN_EL,
        token_b=4 * A27_TOKEN_EL, compute="f32", mamba_regions=(A27_SSM, A27_MCONV), attn_regions=(A27_KV, A27_QKV_CONV),
    ),
}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------- describe: surfaces and state


@pytest.mark.parametrize("name", WITNESS_NAMES)
def test_describe_surfaces(name, witnesses, describe_json):
    e = EXPECTED[name]
    d = describe_json(witnesses[name])
    assert d["schema"] == 6
    assert d["layers"] == e["layers"]
    assert d["vocab"] == {"logical": e["vocab"][0], "padded": e["vocab"][1]}
    assert set(d["operators"]) == set(e["operators"])  # no softmax, no FFN kind anywhere
    for kind, layers in e["operators"].items():
        assert d["operators"][kind] == {"count": len(layers), "layers": layers}
    assert d["surfaces"] == e["surfaces"]
    s = d["state"]
    assert set(s) == {"recurrent_layers", "growing_layers", "fixed_elements", "fixed_bytes",
                      "per_token_elements", "per_token_bytes", "regions"}
    assert s["recurrent_layers"] == e["recurrent"]
    assert s["growing_layers"] == e["growing"]
    assert s["fixed_elements"] == e["fixed_el"]
    assert s["fixed_bytes"] == e["fixed_b"]
    assert s["per_token_elements"] == e["token_el"]
    assert s["per_token_bytes"] == e["token_b"]
    for k in ("fixed_elements", "fixed_bytes", "per_token_elements", "per_token_bytes", "recurrent_layers", "growing_layers"):
        assert type(s[k]) is int, k


@pytest.mark.parametrize("name", WITNESS_NAMES)
def test_state_regions_per_layer(name, witnesses, describe_json):
    e = EXPECTED[name]
    regions = describe_json(witnesses[name])["state"]["regions"]
    for r in regions:
        assert set(r) == {"layer", "operator", "name", "kind", "shape", "dtype", "growth"}
    by_layer: dict[int, list] = {}
    for r in regions:
        by_layer.setdefault(r["layer"], []).append(r)
    assert sorted(by_layer) == list(range(e["layers"]))  # no model-level state
    ssm, conv = e["mamba_regions"]
    for i in e["operators"]["mamba2"]:
        rs = by_layer[i]
        assert len(rs) == 2, rs
        rec = [r for r in rs if r["kind"] == "recurrent"]
        hist = [r for r in rs if r["kind"] == "conv_history"]
        assert len(rec) == 1 and len(hist) == 1
        assert rec[0]["shape"] == list(ssm) and rec[0]["dtype"] == "f32" and rec[0]["growth"] == "fixed"
        assert hist[0]["shape"] == list(conv) and hist[0]["dtype"] == e["compute"] and hist[0]["growth"] == "fixed"
        assert all(r["operator"] == "mamba2" for r in rs)
    if e["attn_regions"] is None:
        assert all(r["growth"] == "fixed" for r in regions)
        assert not any(r["kind"] == "kv_rows" for r in regions)
        return
    kv, qconv = e["attn_regions"]
    for i in e["operators"]["conv_qkv"]:
        rs = by_layer[i]
        assert len(rs) == 2, rs
        rows = [r for r in rs if r["growth"] == "per_token"]
        fixed = [r for r in rs if r["growth"] == "fixed"]
        assert len(rows) == 1 and len(fixed) == 1
        assert rows[0]["kind"] == "kv_rows" and _prod(rows[0]["shape"]) == _prod(kv)
        assert rows[0]["shape"] == list(kv)
        assert fixed[0]["kind"] == "conv_history" and fixed[0]["shape"] == list(qconv)
        assert rows[0]["dtype"] == fixed[0]["dtype"] == e["compute"]
        assert all(r["operator"] == "conv_qkv" for r in rs)


def test_780m_continuation_is_constant_in_length(witnesses, describe_json):
    a = describe_json(witnesses["mamba2-780m"], 1)["state"]["at_context"]
    b = describe_json(witnesses["mamba2-780m"], 100_000)["state"]["at_context"]
    one = 4 * 19_513_344
    assert a == {"tokens": 1, "sequences": 1, "bytes_per_sequence": one, "bytes": one}
    assert b == {"tokens": 100_000, "sequences": 1, "bytes_per_sequence": one, "bytes": one}


@pytest.mark.parametrize("tokens", [0, 1, 8192])
def test_250m_bytes_at_context(tokens, witnesses, describe_json):
    d = describe_json(witnesses["mamba2attn-250m.oute-dialect"], tokens)
    # fixed: 28 x (SSM 262144 f32 + conv 2304x4 bf16) + 4 x conv 6144x4 bf16 = 30,072,832 bytes
    # per token: 4 layers x K,V 16x128 bf16 = 32,768 bytes
    per = 30_072_832 + tokens * 32_768
    assert d["state"]["at_context"] == {"tokens": tokens, "sequences": 1, "bytes_per_sequence": per, "bytes": per}


def test_250m_index_base_recorded(witnesses):
    text = _dump(witnesses["mamba2attn-250m.oute-dialect"], "closure").split("\n", 1)[1]
    facts = [line.strip() for line in text.splitlines() if line.strip().startswith("fact layer_index_base")]
    assert len(facts) == 1
    assert facts[0].startswith("fact layer_index_base 0 evidence ")
    assert "6144" in facts[0] and "4,12,20,28" in facts[0]


def test_describe_human(witnesses, cli):
    r = cli("describe", witnesses["mamba2-780m"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    print(out)
    assert "48 layers" in out and "vocab 50277 (padded 50288)" in out
    assert "surfaces: attention 0 · ffn 0 · moe 0" in out
    assert "19,513,344 elements" in out
    assert "per token: 0 elements" in out
    assert "48×64×128" in out and "3328×4" in out
    r = cli("describe", witnesses["mamba2attn-250m.oute-dialect"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    print(out)
    assert "surfaces: attention 4 · ffn 0 · moe 0" in out
    assert "28 recurrent layers" in out and "4 growing layers" in out
    assert "2×16×128" in out and "6144×4" in out
    assert "softmax" not in out


# ---------------------------------------------------------------- golden snapshots


def _dump(model_dir, stage: str) -> str:
    """The ``--print-after STAGE`` dump of a model directory, lowered with its
    model_dir written relative to its parent (so the text names only the
    directory and is the same on every machine)."""
    pipeline = {"closure": ["verify", "bind", "closure"], "state": ["verify", "bind", "closure", "state"]}[stage]
    m = lower(model_dir, relative_to=model_dir.parent)
    dumps: list[str] = []
    ctx = PassManager(pipeline, print_after={stage}, emit=dumps.append).run(Context(m, model_dir=model_dir))
    assert len(dumps) == 1
    body = dumps[0].split("\n", 1)[1]
    assert body == print_module(ctx.module)
    assert dumps[0].startswith(HEADER.format(stage) + "\n")
    return dumps[0]


@pytest.mark.parametrize("stage", ["closure", "state"])
@pytest.mark.parametrize("name", WITNESS_NAMES)
def test_golden_ir(name, stage, witnesses, snapshot):
    text = _dump(witnesses[name], stage).split("\n", 1)[1]
    assert f'model_dir "{name}"' in text
    has_state = any(line.strip().startswith("state ") for line in text.splitlines())
    assert has_state == (stage == "state")
    assert text == snapshot


@pytest.mark.parametrize("name", WITNESS_NAMES)
def test_golden_describe(name, witnesses, describe_json, snapshot_json):
    assert json.dumps(describe_json(witnesses[name]), indent=1, sort_keys=True) + "\n" == snapshot_json


def test_golden_fuse_listing(witnesses, snapshot_text):
    """The ``--print-after fuse`` listing of the hybrid witness (Mamba2 + conv-QKV attention, OuteAI dialect):
    every fused kernel group of prefill and decode, in order, with its plan op and what it fuses."""
    from vxc.passes.manager import parse_pipeline

    d = witnesses["mamba2attn-250m.oute-dialect"]
    dumps: list[str] = []
    PassManager(parse_pipeline("verify,bind,closure,state,plan,fuse"), print_after={"fuse"},
                emit=dumps.append).run(Context(lower(d, relative_to=d.parent), model_dir=d))
    (text,) = dumps
    assert text.startswith(HEADER.format("fuse") + "\n")
    lines = text.splitlines()
    assert sum(line.startswith(("fuse prefill:", "fuse decode:")) for line in lines) == 2
    for kernel in ("vxc.ssd_prefill", "vxc.ssd_step", "vxc.conv1d_prefill", "vxc.conv1d_step", "vxc.attention"):
        assert any(kernel + " " in line for line in lines), kernel
    assert text == snapshot_text


def test_golden_round_trip():
    """``print(parse(text)) == text`` for every golden IR (runs last in this module)."""
    files = sorted(GOLDEN.rglob("*.vxir"))
    assert len(files) >= 2 * len(WITNESS_NAMES), files
    for f in files:
        text = f.read_text()
        assert print_module(parse(text, str(f))) == text, f
