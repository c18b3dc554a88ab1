"""The state provider: static buffers for exactly the declared regions, at the
declared precision policy, with describe's byte figures equal to what is
allocated, and a rows-only provider refusing, by name, the layers it cannot
hold."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.runtime import parity_table as P
from vxc.passes.findings import Refusal
from vxc.passes.surfaces import describe
from vxc.runtime.state import ROWS_ONLY, StateProvider

CTX = 64
COMPUTE = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _engine(lab, name, dtype=torch.float32, **kw):
    return P.engine_for(lab.built(name)[1], dtype=dtype, max_context=CTX, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mamba2attn-native", "oute-base1", "mamba2-native", "qwen3", "llama"])
def test_describe_bytes_equal_allocation(lab, name, dtype):
    e = _engine(lab, name, dtype)
    d = describe(e.plan, context=CTX, compute=COMPUTE[dtype])["state"]
    allocated = e.state.nbytes()
    assert d["at_context"] == {"tokens": CTX, "sequences": 1, "bytes_per_sequence": allocated, "bytes": allocated}
    assert d["fixed_bytes"] + d["per_token_bytes"] * CTX == allocated
    # and byte by byte: the provider's buffers are exactly the declared regions
    assert len(e.state.buffers) == len(d["regions"])


# mamba2attn-native (MINI_NATIVE_MAMBA2ATTN): Mamba2 on layers 0 and 2 (13 heads x 8, state 14,
# conv_dim 104 + 2*14 = 132, conv 4), conv-QKV on layer 1 (qkv rows (6 + 2*2)*10 = 100, conv 3,
# 2 kv heads x 10).
SSM = (13, 8, 14)
M2_CONV = (132, 4)
ATTN_CONV = (100, 3)
KV = (2, CTX, 2, 10)


@pytest.mark.parametrize("dtype,total", [(torch.float32, 27312), (torch.bfloat16, 19480)], ids=["fp32", "bf16"])
def test_state_figures_by_hand(lab, dtype, total):
    """Independent figures: 2 * 1456 ssm elements always in fp32; 2 * 528 + 300 conv-history and
    40 * 64 KV-row elements at the compute dtype."""
    e = _engine(lab, "mamba2attn-native", dtype)
    bpe = torch.finfo(dtype).bits // 8
    assert total == 2 * math.prod(SSM) * 4 + (2 * math.prod(M2_CONV) + math.prod(ATTN_CONV) + math.prod(KV)) * bpe
    assert e.state.nbytes() == total
    shapes = sorted((tuple(b.shape), b.dtype) for b in e.state.buffers.values())
    want = sorted([(SSM, torch.float32)] * 2 + [(M2_CONV, dtype)] * 2 + [(ATTN_CONV, dtype), (KV, dtype)])
    assert shapes == want


@pytest.mark.parametrize("dtype,total", [(torch.float32, 27312), (torch.bfloat16, 19480)], ids=["fp32", "bf16"])
def test_sequence_slots_by_hand(lab, vxc_inproc, dtype, total):
    """S = 3 sequence slots hold three independent copies of the figures above: what describe --sequences
    reports (in process and on the command line) is what the provider allocates, fp32 regions fp32 in every
    slot, and a slot's buffers are views of the slot tensors (writes land in that slot only)."""
    e = _engine(lab, "mamba2attn-native", dtype, sequences=3)
    assert e.state.nbytes() == 3 * total
    d = describe(e.plan, context=CTX, compute=COMPUTE[dtype], sequences=3)["state"]["at_context"]
    assert d == {"tokens": CTX, "sequences": 3, "bytes_per_sequence": total, "bytes": 3 * total}
    shapes = sorted((tuple(b.shape), b.dtype) for b in e.state.slots.values())
    want = sorted([((3, *SSM), torch.float32)] * 2 + [((3, *M2_CONV), dtype)] * 2 + [((3, *ATTN_CONV), dtype), ((3, *KV), dtype)])
    assert shapes == want
    s1 = e.state.slot(1)
    for rid, b in s1.items():
        b.fill_(1)
    assert all(int(e.state.slots[rid][1].count_nonzero()) == b.numel() for rid, b in s1.items())
    assert all(int(e.state.slots[rid][i].count_nonzero()) == 0 for rid in s1 for i in (0, 2))
    e.state.zero_(1)
    assert all(int(b.count_nonzero()) == 0 for b in e.state.slots.values())
    if dtype == torch.float32:
        r = vxc_inproc("describe", lab.built("mamba2attn-native")[1], "--json", "--context", CTX, "--sequences", 3)
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["state"]["at_context"]["bytes"] == 3 * total
        r = vxc_inproc("describe", lab.built("mamba2attn-native")[1], "--sequences", 3)
        assert r.exit_code != 0 and "--sequences needs --context" in r.output


def test_precision_policy_under_bf16(lab):
    """Recurrent (fp32-declared) regions stay float32 under --dtype bf16; compute regions follow it."""
    e = _engine(lab, "oute-base0", torch.bfloat16)
    kinds = {}
    for rid, b in e.state.buffers.items():
        kinds.setdefault(e.state.layout[rid], set()).add(b.dtype)
    # MINI_OUTE: 5 layers, attention on 2 and 4 -> 3 Mamba2 ssm regions
    assert sum(1 for k in e.state.layout.values() if k == "recurrent") == 3
    assert kinds == {"recurrent": {torch.float32}, "conv_history": {torch.bfloat16}, "kv_rows": {torch.bfloat16}}
    # the bf16 engine runs, and stays near the fp32 reference
    from vxc.runtime.session import Session

    ids = P.prompt_ids(lab.family("oute-base0"))
    s = Session(e)
    logits = s.prefill(ids)
    ref = lab.ref("oute-base0").full(ids)
    assert torch.isfinite(logits).all()
    assert P.maxabs(logits, ref) < 0.05 * float(ref.abs().max())
    step = s.step(ids[0])
    # logits come back in the compute dtype, as the bf16 references return them
    assert logits.dtype == step.dtype == torch.bfloat16 and torch.isfinite(step).all()
    assert all(b.dtype == torch.float32 for rid, b in e.state.buffers.items() if e.state.layout[rid] == "recurrent")


def _refusal_layers(r: Refusal) -> dict[int, str]:
    assert r.findings and all(f.code == "unsupported-region" for f in r.findings)
    return {f.layer: f.operator for f in r.findings}


def test_rows_only_refuses_conv_qkv(lab):
    with pytest.raises(Refusal) as exc:
        _engine(lab, "mamba2attn-native", provider=ROWS_ONLY)
    r = exc.value
    layers = _refusal_layers(r)
    assert layers == {0: "mamba2", 1: "conv_qkv", 2: "mamba2"}
    (attn,) = [f for f in r.findings if f.layer == 1]
    line = attn.line()
    assert line.startswith("layer 1 conv_qkv:") and "[unsupported-region]" in line
    assert "kv (kv_rows)" in line and "conv (conv_history)" in line  # it names both halves, allocates neither
    assert "refused: 3 findings" in r.text()


def test_rows_only_refuses_before_allocating(lab):
    """allocate() itself refuses: it returns no partial buffers for the layers it can hold."""
    e = lab.engine("oute-base1")
    with pytest.raises(Refusal) as exc:
        ROWS_ONLY.allocate(e.plan, torch.float32, CTX)
    # MINI_OUTE with index_base 1: attention on physical layers 1 and 3, Mamba2 on 0, 2, 4
    assert _refusal_layers(exc.value) == {0: "mamba2", 1: "conv_qkv", 2: "mamba2", 3: "conv_qkv", 4: "mamba2"}


def test_rows_only_refuses_mamba2(lab):
    with pytest.raises(Refusal) as exc:
        _engine(lab, "mamba2-native", provider=ROWS_ONLY)
    assert _refusal_layers(exc.value) == {0: "mamba2", 1: "mamba2", 2: "mamba2"}  # n_layer 3
    assert all("ssm (recurrent)" in f.message and "conv (conv_history)" in f.message for f in exc.value.findings)


def test_rows_only_holds_softmax_rows(lab):
    """The same provider holds a pure softmax model, and executes it bit-identically."""
    from vxc.runtime.session import Session

    e = _engine(lab, "qwen3", provider=ROWS_ONLY)
    assert set(e.state.layout.values()) == {"kv_rows"}
    # MINI_HF qwen3: 3 layers, 2 kv heads x 14 -> [2, CTX, 2, 14] each
    assert sorted(tuple(b.shape) for b in e.state.buffers.values()) == [(2, CTX, 2, 14)] * 3
    ids = P.prompt_ids(lab.family("qwen3"))
    a = Session(e).prefill(ids)
    b = Session(_engine(lab, "qwen3", provider=StateProvider())).prefill(ids)
    assert torch.equal(a, b)


def test_state_is_constant_in_length_for_pure_ssm(lab):
    """mamba2: no growing region, so the allocation is the same at any --max-context."""
    small = P.engine_for(lab.built("mamba2-native")[1], max_context=8).state.nbytes()
    big = P.engine_for(lab.built("mamba2-native")[1], max_context=4096).state.nbytes()
    # MINI_NATIVE_MAMBA2: 3 layers x (ssm 12*8*10 + conv (96+40)*4) fp32
    assert small == big == 3 * (12 * 8 * 10 + 136 * 4) * 4
