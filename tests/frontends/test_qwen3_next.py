"""Qwen3-Next (``qwen3_next``) lowering: gated-delta linear attention + output-gated softmax attention + MoE.

- The miniature's program (mixers, FFNs, norms, states, banks) and its fused groups.
- The two config dialects (transformers 5.24 ``save_pretrained``: ``layer_types`` + ``rope_parameters``;
  hub: ``full_attention_interval`` + ``rope_theta``/``partial_rotary_factor``) lower to the same program, and
  the IR says which was read; absent keys are recorded defaults.
- The fused projections reach plain roles through gather views that reproduce the reference's own split.
- A missing projection is a named refusal.
- The Qwen3-Next-80B-A3B witness lowered header-only at full geometry: golden IR and describe JSON, and
  constants computed here from the published geometry.

Parity against transformers 5.24 (and the dialects executing bit-identically) is in
tests/families/test_qwen3_next.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests import builders as B
from tests import references as R
from tests.families import qwen3_next_support as Q
from tests.families.qwen3_next_support import dialects, moe_dir, root  # noqa: F401  (fixtures)
from vxc.frontends import lower
from vxc.ir import parse, print_module
from vxc.passes import PassManager
from vxc.passes.context import Context
from vxc.passes.findings import Refusal


LOWER = ["verify", "bind", "closure", "state"]


def _text(model_dir: Path) -> str:
    m = lower(model_dir, relative_to=Path(model_dir).parent)
    ctx = PassManager(LOWER, emit=lambda s: None).run(Context(m, model_dir=Path(model_dir)))
    return print_module(ctx.module)


# ---------------------------------------------------------------- the miniature


def test_miniature_program(moe_dir):
    text = _text(moe_dir)
    lines = [ln.strip() for ln in text.splitlines()]
    mixers = [ln for ln in lines if ln.startswith("mixer ")]
    assert [ln.split()[1] for ln in mixers] == ["gated_delta", "softmax", "gated_delta", "gated_delta", "softmax"]
    assert [ln.split()[1] for ln in lines if ln.startswith("ffn ")] == ["moe", "moe", "swiglu", "moe", "moe"]
    # per key head: q 12 | k 12 | v 3·10 | z 3·10 (group of 84) — gathered into plain roles
    assert "| gather 0 groups 2 [0:12, 12:24, 24:54] layer 0 role LinearAttnInProjQkv" in text
    assert "| gather 0 groups 2 [54:84] layer 0 role LinearAttnInProjZ" in text
    assert "| gather 0 groups 2 [0:3] layer 0 role LinearAttnInProjB" in text
    assert "| gather 0 groups 2 [3:6] layer 0 role LinearAttnInProjA" in text
    # q_proj per head: query 24 | gate 24
    assert "| gather 0 groups 3 [0:24] layer 1 role AttnQ" in text
    assert "| gather 0 groups 3 [24:48] layer 1 role AttnOutputGate" in text
    norms = [ln for ln in lines if ln.startswith(("norm ", "final_norm "))]
    assert len(norms) == 11 and all("zero_centred=true" in ln for ln in norms)
    att = next(ln for ln in mixers if ln.split()[1] == "softmax")
    for fact in ("output_gate=true", "qk_norm_zero_centred=true", "rotary_dim=6 ", "rotary_layout=half", "rotary_base=5000.0"):
        assert fact in att, fact
    delta = mixers[0]
    for fact in ("k_heads=2", "v_heads=6", "k_head_dim=12", "v_head_dim=10", "conv_kernel=4", "chunk_size=64",
                 f"scale={1 / math.sqrt(12)!r}", "norm_order=norm_then_gate", "norm_act=silu"):
        assert fact in delta, fact
    assert "state delta recurrent [6,12,10] f32 fixed" in text
    assert "state conv conv_history [108,4] compute fixed" in text  # 2·2·12 + 6·10 raw q|k|v channels
    assert "state kv kv_rows [2,1,24] compute per_token" in text
    assert "experts 7" in text and ".experts.3." not in text  # banks, not per-expert lines
    assert print_module(parse(text)) == text


def test_fused_groups(moe_dir):
    from vxc.passes.manager import parse_pipeline

    ctx = PassManager(parse_pipeline(",".join(LOWER + ["plan", "fuse"])), emit=lambda s: None).run(Context(lower(moe_dir), model_dir=moe_dir))
    pre, dec = (ctx.artefacts["fuse"][v] for v in ("prefill", "decode"))
    kinds = [c.kernel for c in pre.groups()]
    assert kinds.count("gated_delta_prefill") == 3 and kinds.count("sigmoid_gate_mul") == 2
    dkinds = [c.kernel for c in dec.groups()]
    assert dkinds.count("gated_delta_step") == 3 and dkinds.count("conv1d_step") == 3
    assert "gated_delta_prefill" not in dkinds


def test_gather_views_reproduce_the_reference_split(moe_dir):
    """The operands the IR declares, applied to the stored tensors, are exactly the weight rows transformers' own
    fix_query_key_value_ordering and q_proj chunking pick: the reference's split is applied to the weight
    matrices themselves (``W.T`` in place of the activations: each output channel of the projection is one
    column), so the check is bit-exact and involves no GEMM (whose rounding differs between CPUs and shapes)."""
    import transformers

    from vxc.runtime.views import apply_view

    m = lower(moe_dir)
    stored = R.load_checkpoint(moe_dir)
    tensors = m.tensor_table()
    ops = {(o.layer, str(o.role)): o for o in m.operands}

    def view(layer, role):
        o = ops[(layer, role)]
        return apply_view(stored[tensors[o.sources[0]].key], o.transforms)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    d = model.config.hidden_size
    la = model.model.layers[0].linear_attn
    with torch.no_grad():
        cols = lambda w: w.T.unsqueeze(0)  # noqa: E731  ([1, d, out]: "d tokens", one per input channel)
        q, k, v, z, b, a = la.fix_query_key_value_ordering(cols(la.in_proj_qkvz.weight), cols(la.in_proj_ba.weight))
        qkv = torch.cat([t.reshape(1, d, -1) for t in (q, k, v)], -1)
        for role, want in (("LinearAttnInProjQkv", qkv), ("LinearAttnInProjZ", z), ("LinearAttnInProjB", b),
                           ("LinearAttnInProjA", a)):
            got = view(0, role)
            assert torch.equal(got.T, want.reshape(d, -1)), role
            assert got.shape[0] < la.in_proj_qkvz.weight.shape[0] + la.in_proj_ba.weight.shape[0]
        sa = model.model.layers[1].self_attn
        query, gate = torch.chunk(cols(sa.q_proj.weight).view(1, d, -1, 48), 2, dim=-1)
        assert torch.equal(view(1, "AttnQ").T, query.reshape(d, -1))
        assert torch.equal(view(1, "AttnOutputGate").T, gate.reshape(d, -1))
        # not vacuous: the reference's order is not the stored order (a plain slice would not reproduce it)
        stored_q = la.in_proj_qkvz.weight[: view(0, "LinearAttnInProjQkv").shape[0]]
        assert not torch.equal(view(0, "LinearAttnInProjQkv"), stored_q)


def test_missing_projection_is_a_named_refusal(moe_dir, root):
    from safetensors.torch import save_file

    bad = root / "missing_ba"
    bad.mkdir()
    (bad / "config.json").write_text((moe_dir / "config.json").read_text())
    tensors = R.load_checkpoint(moe_dir)
    del tensors["model.layers.2.linear_attn.in_proj_ba.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(Refusal) as e:
        PassManager(LOWER, emit=lambda s: None).run(Context(lower(bad), model_dir=bad))
    msg = e.value.text()
    assert "refused: 2 findings (closure)" in msg, msg
    assert "layer 2 gated_delta: required role LinearAttnInProjB is not bound  [missing-operand]" in msg
    assert "layer 2 gated_delta: required role LinearAttnInProjA is not bound  [missing-operand]" in msg


# ---------------------------------------------------------------- config dialects


def _program(text: str) -> list[str]:
    """The program lines of an IR text, without provenance and without the default markers."""
    keep = ("tensor ", "operand ", "embedding ", "layer ", "norm ", "mixer ", "ffn ", "state ", "final_norm ", "head ",
            "residual ", "placement ", "file ")
    return [ln.strip().replace(" (default)", "") for ln in text.splitlines() if ln.strip().startswith(keep)]


def test_both_dialects_lower_to_one_program(dialects):
    new, hub = dialects
    tn, th = _text(new), _text(hub)
    assert _program(tn) == _program(th)
    assert 'dialect "qwen3_next (transformers 5.24 save_pretrained)"' in tn
    assert 'dialect "qwen3_next (hub)"' in th
    assert "fact layer_map_read_from layer_types " in tn and "fact rope_read_from rope_parameters " in tn
    assert "fact layer_map_read_from full_attention_interval " in th
    assert 'fact rope_read_from "rope_theta/rope_scaling" ' in th
    mixers = [ln.split()[1] for ln in _program(th) if ln.startswith("mixer ")]
    assert mixers == ["gated_delta", "softmax", "gated_delta", "softmax"]


def test_absent_keys_are_recorded_defaults(tmp_path):
    """A hub config without full_attention_interval or partial_rotary_factor: Qwen3NextConfig's defaults
    (interval 4, factor 0.25) are filled in and marked."""
    cfg = {**{k: v for k, v in Q.HUB4.items() if k not in ("layer_types", "rope_parameters")},
           "model_type": "qwen3_next", "rope_theta": 5000.0}
    on_disk = {k: v for k, v in cfg.items() if k != "linear_conv_kernel_dim"}
    d = B.hf_header_only(tmp_path / "defaults", cfg, "F32", config_json=on_disk)
    text = _text(d)
    mixers = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("mixer ")]
    assert [m.split()[1] for m in mixers] == ["gated_delta"] * 3 + ["softmax"]
    assert "default 4" in next(ln for ln in text.splitlines() if "fact layer_map_read_from" in ln)
    assert "rotary_dim=6 (default)" in mixers[3]  # 0.25 of head_dim 24, filled in
    assert "conv_kernel=4 (default)" in mixers[0]


# ---------------------------------------------------------------- the Qwen3-Next-80B-A3B witness

WITNESS = "qwen3-next-80b-a3b"
# published geometry (witness config): 48 layers, full_attention_interval 4 → softmax on 3, 7, …, 47;
# softmax 16 q heads, 2 kv heads × 256, partial rotary 0.25 → 64 dims, theta 1e7;
# gated delta: 16 key heads × 128, 32 value heads × 128, conv 4 → conv channels 2·16·128 + 32·128 = 8192;
# MoE on every layer: 512 experts, top-10, experts 512 wide, a shared expert 512 wide; bf16 weights.
W_LAYERS = 48
W_SOFTMAX = list(range(3, 48, 4))
W_DELTA = [i for i in range(48) if i not in W_SOFTMAX]
W_KV = (2, 2, 256)
W_DELTA_STATE = (32, 128, 128)
W_CONV = (2 * 16 * 128 + 32 * 128, 4)
W_FIXED_EL = 36 * (32 * 128 * 128 + 8192 * 4)
W_FIXED_B = 36 * (32 * 128 * 128 * 4 + 8192 * 4 * 2)
W_TOKEN_EL = 12 * 2 * 2 * 256


@pytest.fixture(scope="module")
def witness(tmp_path_factory) -> Path:
    return B.witness_header_only(WITNESS, tmp_path_factory.mktemp("witness") / WITNESS)


@pytest.fixture(scope="module")
def witness_text(witness) -> str:
    return _text(witness)


@pytest.fixture(scope="module")
def witness_describe(witness, cli) -> dict:
    r = cli("describe", witness, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_witness_describe(witness_describe):
    d = witness_describe
    assert d["layers"] == W_LAYERS and d["compute"] == "bf16"
    assert d["vocab"] == {"logical": 151936, "padded": 151936}
    assert d["operators"]["gated_delta"] == {"count": 36, "layers": W_DELTA}
    assert d["operators"]["softmax"] == {"count": 12, "layers": W_SOFTMAX}
    assert d["operators"]["moe"] == {"count": 48, "layers": list(range(48))}
    assert set(d["operators"]) == {"gated_delta", "softmax", "moe"}
    assert d["surfaces"] == {"attention": 12, "ffn": 48, "moe": 48}
    s = d["state"]
    assert s["recurrent_layers"] == 36 and s["growing_layers"] == 12
    assert s["fixed_elements"] == W_FIXED_EL and s["fixed_bytes"] == W_FIXED_B
    assert s["per_token_elements"] == W_TOKEN_EL and s["per_token_bytes"] == 2 * W_TOKEN_EL
    by_layer: dict[int, list] = {}
    for r in s["regions"]:
        by_layer.setdefault(r["layer"], []).append(r)
    for i in W_SOFTMAX:
        (kv,) = by_layer[i]
        assert (kv["kind"], kv["shape"], kv["dtype"], kv["growth"]) == ("kv_rows", list(W_KV), "bf16", "per_token")
        assert math.prod(kv["shape"]) == 2 * 2 * 256  # K and V of 2 kv heads × 256 per token
    for i in W_DELTA:
        rec, conv = sorted(by_layer[i], key=lambda r: r["kind"] != "recurrent")
        assert (rec["kind"], rec["shape"], rec["dtype"], rec["growth"]) == ("recurrent", list(W_DELTA_STATE), "f32", "fixed")
        assert (conv["kind"], conv["shape"], conv["dtype"], conv["growth"]) == ("conv_history", list(W_CONV), "bf16", "fixed")


def test_witness_ir(witness_text):
    text = witness_text
    lines = text.splitlines()
    assert len(lines) < 4000  # banks: one line per expert role and layer, not 73,728 per-expert tensors
    assert not re.search(r"\.experts\.\d+\.", text)
    assert len([ln for ln in lines if " bank " in ln]) == 48 * 3
    assert 'bank "model.layers.7.mlp.experts.{e}.gate_proj.weight" experts 512' in text
    assert 'dialect "qwen3_next (hub)"' in text
    assert "fact layer_map_read_from full_attention_interval " in text
    assert 'fact rope_read_from "rope_theta/rope_scaling" ' in text
    att = next(ln.strip() for ln in lines if ln.strip().startswith("mixer softmax"))
    for fact in ("heads=16", "kv_heads=2", "head_dim=256", "output_gate=true", "rotary_dim=64 ", "rotary_base=10000000.0",
                 "qk_norm_zero_centred=true"):
        assert fact in att, fact
    ffn = next(ln.strip() for ln in lines if ln.strip().startswith("ffn moe"))
    for fact in ("experts=512", "top_k=10", "intermediate=512", "router=softmax_topk", "norm_topk_prob=true",
                 "shared_experts=true", "shared_intermediate=512", "shared_gate=true"):
        assert fact in ffn, fact
    assert "| gather 0 groups 16 [0:128, 128:256, 256:512] layer 0 role LinearAttnInProjQkv" in text
    assert "| gather 0 groups 16 [0:256] layer 3 role AttnQ" in text


def test_witness_golden_ir(witness_text, snapshot):
    assert print_module(parse(witness_text)) == witness_text
    assert witness_text == snapshot


def test_witness_golden_describe(witness_describe, snapshot_json):
    assert json.dumps(witness_describe, indent=1, sort_keys=True) + "\n" == snapshot_json
