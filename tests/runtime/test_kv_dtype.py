"""``--kv-dtype``: the growing row caches (KV rows, MLA latent rows) at f16 / bf16 under fp32 compute.

Numerics: a cache of unit roundoff u (f16 2^-11, bf16 2^-8) changes each cached K / V value by at most u relative;
the stated tolerance for logits is 16 u · max|logit| against the family's fp64 reference (prefill of the prompt's
first part, then the decode steps that read the narrow cache), with the argmax equal wherever the reference's
top-two margin exceeds twice that. Measured on these miniatures: f16 0.03-1.3e-3, bf16 0.3-18e-3 relative. Within
one cache type the rest holds as for fp32 caches: decode steps equal the full prefill within one rounding of the
cache (u · max|logit|: prefill and step may compute a value one fp32 ulp apart and round it apart), batched decode equals single-sequence decode, a prefix-cache hit equals the cold run
(test_prefix_cache). The fixed regions (recurrent matrices, conv histories) keep their declared precision.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.families import deepseek_v3_support as DS
from tests.families import latent_support as LS
from tests.runtime import batch_check as BC
from tests.runtime import parity_table as P
from vxc.passes.surfaces import describe
from vxc.runtime.session import Session, SessionError

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # unit roundoff of the cache type
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
CTX = 64
DEEPSEEK = P.Family("deepseek_v3-dense", lambda d: LS.build(d, "deepseek_v3", DS.DENSE, seed=5), "hf", DS.VOCAB, DS.VOCAB)


def _built(lab, name):
    if name == DEEPSEEK.name:  # MLA latent rows
        if name not in lab._built:
            lab._built[name] = P.build(DEEPSEEK, lab.root)
        return DEEPSEEK, lab._built[name]
    return P.FAMILIES[name], lab.built(name)


def _ref(lab, f, mdir):
    if f is DEEPSEEK:
        if f.name not in lab._refs:
            lab._refs[f.name] = P.Reference(f, mdir)
        return lab._refs[f.name]
    return lab.ref(f.name)


@torch.no_grad()
def _prefill_then_steps(ir, ids, split, kv):
    s = Session(P.engine_for(ir, max_context=CTX, kv_dtype=kv))
    rows = [s.prefill(ids[:split])]
    rows += [s.step(t)[None] for t in ids[split:]]
    return torch.cat(rows)


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "mamba2attn-native", "oute-base1", DEEPSEEK.name])
def test_logits_within_the_stated_tolerance_of_the_reference(lab, name, kv):
    f, (mdir, ir) = _built(lab, name)
    ids = P.prompt_ids(f)[:40]
    split = 24
    ref = _ref(lab, f, mdir).full(ids, fp64=True)[:, : f.vocab].double()
    got = _prefill_then_steps(ir, ids, split, kv)[:, : f.vocab].double()
    big = ref.abs().max().item()
    bound = 16 * U[kv] * big
    err = (got - ref).abs().max().item()
    assert big > 0.5 and err <= bound, (err, bound, err / big)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    # the narrow cache did change something (the tolerance is not vacuous): not the fp32 cache's logits
    fp32 = _prefill_then_steps(ir, ids, split, None)[:, : f.vocab].double()
    assert not torch.equal(fp32, got)
    print(f"\n{name} {kv}: {err / big:.2e} of max|logit| (bound {16 * U[kv]:.2e}), {int(clear.sum())}/{len(ids)} clear")


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native", "llama"])
def test_decode_steps_equal_the_full_prefill_on_an_f16_cache(lab, name):
    """Both read rounded rows; a K / V value that the prefill's GEMM and the step's GEMV compute one fp32 ulp apart
    can round to neighbouring f16 values, so the bound is one f16 rounding: u · max|logit| (measured up to 0.14 u on
    llama; identical rows would be 1e-5 max|logit|). Not the fp32 floor, and not 16 u either."""
    f, (_, ir) = _built(lab, name)
    ids = P.prompt_ids(f)[:40]
    full = Session(P.engine_for(ir, max_context=CTX, kv_dtype=torch.float16)).prefill(ids).float()
    steps = _prefill_then_steps(ir, ids, 17, torch.float16).float()
    big = full.abs().max().item()
    assert big > 0.5 and (full - steps).abs().max().item() <= U[torch.float16] * big


@pytest.mark.parametrize("name", ["qwen3", "mamba2attn-native"])
def test_batched_decode_equals_single_on_an_f16_cache(lab, name):
    _, ir = lab.built(name)
    BC.assert_batched(ir, P.FAMILIES[name].vocab, kv_dtype=torch.float16)


def test_state_figures_by_hand(lab, vxc_inproc):
    """mamba2attn-native (see test_state): 2 x 1456 SSM elements fp32 (declared), 2 x 528 + 300 conv-history
    elements at the compute dtype fp32, and 2560 KV-row elements (64 positions) at f16: 11648 + 5424 + 5120 bytes,
    in the provider, in describe and on the command line."""
    total = 2 * 1456 * 4 + (2 * 528 + 300) * 4 + 2560 * 2
    assert total == 22192
    e = P.engine_for(lab.built("mamba2attn-native")[1], max_context=CTX, kv_dtype=torch.float16, sequences=2)
    assert e.state.nbytes() == 2 * total
    kinds = {(e.state.layout[rid], b.dtype) for rid, b in e.state.slots.items()}
    assert kinds == {("recurrent", torch.float32), ("conv_history", torch.float32), ("kv_rows", torch.float16)}
    d = describe(e.plan, context=CTX, sequences=2, kv="f16")
    assert d["kv_dtype"] == "f16" and d["state"]["at_context"]["bytes"] == 2 * total
    r = vxc_inproc("describe", lab.built("mamba2attn-native")[1], "--json", "--context", CTX, "--kv-dtype", "fp16")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["state"]["at_context"]["bytes"] == total
    assert {(x["kind"], x["dtype"]) for x in out["state"]["regions"]} == {("recurrent", "f32"), ("conv_history", "f32"),
                                                                         ("kv_rows", "f16")}
    r = vxc_inproc("describe", lab.built("mamba2attn-native")[1], "--kv-dtype", "fp16")  # the text view
    assert r.exit_code == 0 and "KV / latent rows f16" in " ".join(r.stdout.split()), r.output
    r = vxc_inproc("describe", lab.built("mamba2attn-native")[1], "--kv-dtype", "fp8")
    assert r.exit_code != 0 and "--kv-dtype fp8" in r.output


def test_saved_state_keeps_its_cache_type(lab, tmp_path):
    """A state saved from an f16 cache resumes on an f16 cache (the same next logits) and is refused, naming the
    region's types, by an engine whose cache is fp32."""
    _, ir = lab.built("qwen3")
    ids = P.prompt_ids(P.FAMILIES["qwen3"])[:12]
    a = Session(P.engine_for(ir, max_context=CTX, kv_dtype=torch.float16))
    a.prefill(ids)
    a.save_state(tmp_path / "s.safetensors")
    want = a.step(5)
    b = Session(P.engine_for(ir, max_context=CTX, kv_dtype=torch.float16))
    b.load_state(tmp_path / "s.safetensors")
    assert torch.equal(b.step(5), want)
    c = Session(P.engine_for(ir, max_context=CTX))
    with pytest.raises(SessionError, match="float16.*float32"):
        c.load_state(tmp_path / "s.safetensors")


def test_exec_reports_and_checks_the_cache_type(lab, vxc_inproc):
    ir = lab.built("qwen3")[1]
    r = vxc_inproc("exec", ir, "--tokens", "3,4,5", "--max-new-tokens", 3, "--max-context", CTX, "--kv-dtype", "fp16", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["kv_dtype"] == "fp16"
    r = vxc_inproc("exec", ir, "--tokens", "3,4,5", "--kv-dtype", "f8")
    assert r.exit_code != 0 and "--kv-dtype f8" in r.output and "fp16" in r.output


def test_memory_check_counts_the_cache_type(lab):
    """The per-position bytes the context budget uses are the narrow cache's: half the KV bytes at f16."""
    from vxc.runtime.state import StateProvider

    e = P.engine_for(lab.built("qwen3")[1], max_context=CTX)
    prov = StateProvider()
    per32 = prov.nbytes(e.plan, torch.float32, 1) - prov.nbytes(e.plan, torch.float32, 0)
    per16 = prov.nbytes(e.plan, torch.float32, 1, kv_dtype=torch.float16) - prov.nbytes(e.plan, torch.float32, 0,
                                                                                         kv_dtype=torch.float16)
    assert per32 == 2 * per16 > 0
    assert not math.isnan(per16)
