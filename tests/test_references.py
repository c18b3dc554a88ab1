"""The fixtures judge vxc, so they are proved here, independently of vxc."""

from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from safetensors import safe_open

from tests import builders as B
from tests import references as R


def _ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _maxabs(a, b):
    return float((a.double() - b.double()).abs().max())


@pytest.fixture(scope="module")
def pure_dir(tmp_path_factory):
    return B.build_native_mamba(tmp_path_factory.mktemp("pure"), B.MINI_NATIVE_MAMBA2, seed=3)


@pytest.fixture(scope="module")
def attn_dir(tmp_path_factory):
    return B.build_native_mamba(tmp_path_factory.mktemp("attn"), B.MINI_NATIVE_MAMBA2ATTN, seed=1)


@pytest.fixture(scope="module")
def oute_dir(tmp_path_factory):
    return B.build_oute(tmp_path_factory.mktemp("oute"), B.MINI_OUTE, index_base=1, seed=2)


# ---------------------------------------------------------------------------
# (1)-(3) oracle vs transformers on a pure-Mamba2 native miniature
# ---------------------------------------------------------------------------

def test_oracle_matches_transformers_mamba2(pure_dir):
    hf = R.native_to_hf_mamba2(pure_dir)
    ids = _ids(40, B.MINI_NATIVE_MAMBA2["vocab_size"])   # > 2 chunks of 16
    ref = R.hf_logits(hf, ids)
    ora = R.Mamba2AttnOracle(pure_dir, torch.float32)(ids)
    assert ref.shape == ora.shape == (40, 112)            # padded vocab
    assert ref.abs().max() > 3.0                          # logits spread over units
    assert _maxabs(ref, ora) < 1e-4
    # and transformers' own cached decode agrees with the oracle's recurrence
    hf_step = R.hf_prefill_then_step(hf, ids, 13)
    ora_step = R.Mamba2AttnOracle(pure_dir, torch.float32).prefill_then_step(ids, 13)
    assert _maxabs(hf_step, ora_step) < 1e-4


def test_native_to_hf_is_strict(tmp_path):
    cfg = B.MINI_NATIVE_MAMBA2
    tensors = R.load_checkpoint(B.build_native_mamba(tmp_path / "a", cfg))
    tensors["backbone.layers.0.mixer.extra.weight"] = torch.zeros(3)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    B.write_safetensors(tmp_path / "b" / "model.safetensors", tensors)
    with pytest.raises(RuntimeError, match="Unexpected"):
        R.native_to_hf_mamba2(tmp_path / "b")
    with pytest.raises(ValueError, match="attention"):
        R.native_to_hf_mamba2(B.build_native_mamba(tmp_path / "c", B.MINI_NATIVE_MAMBA2ATTN))


@pytest.mark.parametrize("which", ["pure", "attn", "oute"])
def test_oracle_prefill_then_step_equals_forward(which, pure_dir, attn_dir, oute_dir):
    d, kw = {"pure": (pure_dir, {}), "attn": (attn_dir, {}),
             "oute": (oute_dir, {"index_base": 1})}[which]
    ids = _ids(30, 97, seed=5)
    for dtype, lim in ((torch.float64, 1e-11), (torch.float32, 1e-4)):
        o = R.Mamba2AttnOracle(d, dtype, **kw)
        full = o(ids)
        for n in (1, 2, 11):   # shorter than, equal to and longer than the conv history
            assert _maxabs(full, o.prefill_then_step(ids, n)) < lim
    # greedy continuation == argmax of a full forward over the extended sequence
    o = R.Mamba2AttnOracle(d, torch.float64, **kw)
    cont = o.greedy(ids[:9], 6)
    full = o(torch.cat([ids[:9], torch.tensor(cont)]))
    assert full[8:-1].argmax(-1).tolist() == cont


@pytest.mark.parametrize("which", ["pure", "attn", "oute"])
def test_oracle_fp32_close_to_fp64(which, pure_dir, attn_dir, oute_dir):
    d, kw = {"pure": (pure_dir, {}), "attn": (attn_dir, {}),
             "oute": (oute_dir, {"index_base": 1})}[which]
    ids = _ids(30, 97, seed=6)
    a = R.Mamba2AttnOracle(d, torch.float32, **kw)(ids)
    b = R.Mamba2AttnOracle(d, torch.float64, **kw)(ids)
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    assert b.abs().max() > 3.0
    assert _maxabs(a, b) < 1e-4
    f = R.floor_and_tolerance(a, b, R.Mamba2AttnOracle(d, torch.float32, **kw).prefill_then_step(ids, 7))
    frac, excluded = R.argmax_agreement(b, a, f["tol"])
    assert frac == 1.0 and excluded <= 2


# ---------------------------------------------------------------------------
# (4) conv-QKV attention pieces, by hand
# ---------------------------------------------------------------------------

def test_rotary_by_hand():
    torch.manual_seed(0)
    T, H, D, rd, base = 5, 3, 10, 6, 10000.0
    x = torch.randn(T, H, D, dtype=torch.float64)
    pos = torch.arange(7, 7 + T)
    y = R.rotary(x, pos, rd, base)
    assert torch.equal(y[..., rd:], x[..., rd:])           # dims beyond rotary_dim untouched
    for t in range(T):
        for i in range(rd // 2):                           # half-split pairs (i, i + rd/2)
            ang = (7 + t) * base ** (-2 * i / rd)
            c, s = math.cos(ang), math.sin(ang)
            x1, x2 = x[t, :, i], x[t, :, i + rd // 2]
            assert torch.allclose(y[t, :, i], x1 * c - x2 * s, atol=1e-12)
            assert torch.allclose(y[t, :, i + rd // 2], x2 * c + x1 * s, atol=1e-12)
    # relative-position property of the rotated part
    q, k = torch.randn(1, 1, D, dtype=torch.float64), torch.randn(1, 1, D, dtype=torch.float64)
    d1 = (R.rotary(q, torch.tensor([9]), rd, base) * R.rotary(k, torch.tensor([4]), rd, base)).sum()
    d2 = (R.rotary(q, torch.tensor([25]), rd, base) * R.rotary(k, torch.tensor([20]), rd, base)).sum()
    assert abs(float(d1 - d2)) < 1e-12
    assert torch.equal(R.rotary(x, pos, 0, base), x)


def _hand_conv_qkv_layer(w, prefix, x, *, Hq, Hkv, Dh, rd, base, k):
    """Naive loops over the stored tensors: in_proj(+b) -> causal conv(+b), no
    activation -> split q|k|v -> partial half-split rotary -> GQA causal softmax
    -> out_proj(+b)."""
    T = x.shape[0]
    qkv = x @ w[prefix + "in_proj.weight"].T
    if prefix + "in_proj.bias" in w:
        qkv = qkv + w[prefix + "in_proj.bias"]
    cw, cb = w[prefix + "conv1d.weight"][:, 0, :], w[prefix + "conv1d.bias"]
    conv = torch.zeros_like(qkv)
    for t in range(T):
        for j in range(k):                  # tap j multiplies input t - (k-1) + j
            src = t - (k - 1) + j
            if src >= 0:
                conv[t] += cw[:, j] * qkv[src]
        conv[t] += cb
    q = conv[:, :Hq * Dh].reshape(T, Hq, Dh).clone()
    kk = conv[:, Hq * Dh:(Hq + Hkv) * Dh].reshape(T, Hkv, Dh).clone()
    v = conv[:, (Hq + Hkv) * Dh:].reshape(T, Hkv, Dh)

    def rot(vec, p):
        out = vec.clone()
        for i in range(rd // 2):
            a = p * base ** (-2 * i / rd)
            out[i] = vec[i] * math.cos(a) - vec[i + rd // 2] * math.sin(a)
            out[i + rd // 2] = vec[i + rd // 2] * math.cos(a) + vec[i] * math.sin(a)
        return out

    for t in range(T):
        for h in range(Hq):
            q[t, h] = rot(q[t, h], t)
        for h in range(Hkv):
            kk[t, h] = rot(kk[t, h], t)
    ctx = torch.zeros(T, Hq, Dh, dtype=x.dtype)
    group = Hq // Hkv
    for t in range(T):
        for h in range(Hq):
            g = h // group                   # GQA: query head h reads kv head h // (Hq/Hkv)
            scores = torch.stack([q[t, h] @ kk[s, g] for s in range(t + 1)]) / math.sqrt(Dh)
            p = torch.softmax(scores, 0)
            ctx[t, h] = sum(p[s] * v[s, g] for s in range(t + 1))
    out = ctx.reshape(T, -1) @ w[prefix + "out_proj.weight"].T
    if prefix + "out_proj.bias" in w:
        out = out + w[prefix + "out_proj.bias"]
    return out


@pytest.mark.parametrize("which", ["attn", "oute"])
def test_conv_qkv_layer_by_hand(which, attn_dir, oute_dir):
    if which == "attn":
        d, kw, layer = attn_dir, {}, 1
        a = B.MINI_NATIVE_MAMBA2ATTN["attn_cfg"]
        geo = dict(Hq=a["num_heads"], Hkv=a["num_heads_kv"], Dh=a["head_dim"],
                   rd=a["rotary_emb_dim"], base=10000.0, k=a["d_conv"])
        d_model = B.MINI_NATIVE_MAMBA2ATTN["d_model"]
    else:
        d, kw, layer = oute_dir, {"index_base": 1}, 1       # listed 2, base 1
        c = B.MINI_OUTE
        geo = dict(Hq=c["num_attention_heads"], Hkv=c["num_key_value_heads"],
                   Dh=c["attention_head_dim"], rd=c["rope_emb_dim"], base=c["rope_theta"],
                   k=c["attention_conv_kernel"])
        d_model = c["hidden_size"]
    o = R.Mamba2AttnOracle(d, torch.float64, **kw)
    assert o.layer_kinds[layer] == "attn"
    w = {k: v.double() for k, v in R.load_checkpoint(d).items()}
    x = torch.randn(9, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = _hand_conv_qkv_layer(w, f"backbone.layers.{layer}.mixer.", x, **geo)
    got, _ = o._attn_full(o.layers[layer], x)
    assert _maxabs(want, got) < 1e-10
    # a wrong GQA map (kv head h % Hkv) would be detectably different
    assert geo["Hq"] // geo["Hkv"] > 1


def test_attention_state_and_layer_placement(attn_dir, oute_dir):
    ids = _ids(12, 97, seed=8)
    o = R.Mamba2AttnOracle(attn_dir, torch.float64)
    assert o.layer_kinds == ["mamba2", "attn", "mamba2"]
    o.prefill(ids)
    a = B.MINI_NATIVE_MAMBA2ATTN["attn_cfg"]
    st = o.cache[1]
    assert st["k"].shape == st["v"].shape == (12, a["num_heads_kv"], a["head_dim"])
    assert st["conv"].shape == (a["d_conv"] - 1, (a["num_heads"] + 2 * a["num_heads_kv"]) * a["head_dim"])
    s = B.MINI_NATIVE_MAMBA2ATTN["ssm_cfg"]
    assert o.cache[0]["ssm"].shape == (104 // s["headdim"], s["headdim"], s["d_state"])
    assert o.cache[0]["conv"].shape == (s["d_conv"] - 1, 104 + 2 * s["ngroups"] * s["d_state"])
    ssm_shape = o.cache[0]["ssm"].shape
    o.step(3)
    assert o.cache[1]["k"].shape[0] == 13                      # KV rows grow
    assert o.cache[0]["ssm"].shape == ssm_shape                 # recurrent state does not
    # OuteAI index base: the builder put attention on listed - 1; the oracle with the
    # wrong base finds Mamba2-shaped tensors there and refuses.
    assert R.Mamba2AttnOracle(oute_dir, torch.float32, index_base=1).layer_kinds == \
        ["mamba2", "attn", "mamba2", "attn", "mamba2"]
    with pytest.raises((ValueError, KeyError)):
        R.Mamba2AttnOracle(oute_dir, torch.float32, index_base=0)
    with pytest.raises(ValueError, match="index_base"):
        R.Mamba2AttnOracle(oute_dir, torch.float32)


# ---------------------------------------------------------------------------
# (5) builders
# ---------------------------------------------------------------------------

def _read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def test_header_only_file(tmp_path):
    specs = {"b": ("BF16", (3, 5)), "a": ("F32", (7,)), "c": ("U8", (2, 2, 2)),
             "d": ("I64", (4,)), "e": ("F16", (0, 3))}
    p = B.write_header_only(tmp_path / "x.safetensors", specs)
    n, header = _read_header(p)
    assert header["__metadata__"] == {"format": "pt"}
    keys = [k for k in header if k != "__metadata__"]
    assert keys == sorted(specs)
    data = 3 * 5 * 2 + 7 * 4 + 8 + 4 * 8 + 0
    assert os.path.getsize(p) == 8 + n + data
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") == data
    with safe_open(str(p), "pt") as f:
        assert sorted(f.keys()) == sorted(specs)
        for k, (dt, shape) in specs.items():
            assert tuple(f.get_slice(k).get_shape()) == shape
            assert f.get_slice(k).get_dtype() == dt
        t = f.get_tensor("b")
        assert t.dtype == torch.bfloat16 and not t.any()  # the sparse data reads as zeros


def test_mini_specs_match_builder_files(tmp_path):
    for cfg, build, specs in (
        (B.MINI_NATIVE_MAMBA2, lambda d, c, **k: B.build_native_mamba(d, c, **k),
         B.native_mamba_specs(B.MINI_NATIVE_MAMBA2)),
        (B.MINI_NATIVE_MAMBA2ATTN, lambda d, c, **k: B.build_native_mamba(d, c, **k),
         B.native_mamba_specs(B.MINI_NATIVE_MAMBA2ATTN)),
        (B.MINI_OUTE, lambda d, c, **k: B.build_oute(d, c, index_base=0, **k),
         B.oute_specs(B.MINI_OUTE, 0, "F32")),
    ):
        for header_only in (False, True):
            d = build(tmp_path / f"{id(cfg)}{header_only}", cfg, header_only=header_only)
            assert json.loads((d / "config.json").read_text()) == json.loads(json.dumps(cfg))
            with safe_open(str(d / "model.safetensors"), "pt") as f:
                got = {k: ("F32", tuple(f.get_slice(k).get_shape())) for k in f.keys()}
            assert got == specs
    # the OuteAI config keeps the bare Infinity
    d = B.build_oute(tmp_path / "inf", B.MINI_OUTE, index_base=1)
    assert "Infinity" in (d / "config.json").read_text()
    # the native miniature's widths are all distinct
    s = B.MINI_NATIVE_MAMBA2["ssm_cfg"]
    dm = B.MINI_NATIVE_MAMBA2["d_model"]
    di = s["expand"] * dm
    widths = [dm, di, di // s["headdim"], s["headdim"], s["d_state"], s["ngroups"], s["d_conv"],
              di + 2 * s["ngroups"] * s["d_state"], 2 * di + 2 * s["ngroups"] * s["d_state"] + di // s["headdim"], 112]
    assert len(set(widths)) == len(widths)


def test_sharded_native_checkpoint(tmp_path):
    one = B.build_native_mamba(tmp_path / "one", B.MINI_NATIVE_MAMBA2ATTN, seed=7)
    three = B.build_native_mamba(tmp_path / "three", B.MINI_NATIVE_MAMBA2ATTN, seed=7, shards=3)
    index = json.loads((three / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (three / "model.safetensors").exists()
    a, b = R.load_checkpoint(one), R.load_checkpoint(three)
    assert sorted(a) == sorted(b) == sorted(index["weight_map"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    ids = _ids(10, 97)
    assert torch.equal(R.Mamba2AttnOracle(one, torch.float32)(ids),
                       R.Mamba2AttnOracle(three, torch.float32)(ids))


def _witness_shapes(d):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def test_witness_mamba2_780m(tmp_path):
    d = B.witness_header_only("mamba2-780m", tmp_path / "w")
    assert (d / "config.json").read_bytes() == (B.WITNESS_DIR / "mamba2-780m.config.json").read_bytes()
    s = _witness_shapes(d)
    # embedding + norm_f + 48 x (block norm, in_proj, conv1d.weight, conv1d.bias,
    # dt_bias, A_log, D, gated norm, out_proj) = 2 + 48*9; tied: no lm_head
    assert len(s) == 2 + 48 * 9 == 434
    assert "lm_head.weight" not in s
    assert s["backbone.embedding.weight"] == ("F32", (50288, 1536))
    m = "backbone.layers.47.mixer."
    assert s[m + "in_proj.weight"] == ("F32", (6448, 1536))
    assert s[m + "conv1d.weight"] == ("F32", (3328, 1, 4))
    assert s[m + "conv1d.bias"] == ("F32", (3328,))
    assert s[m + "A_log"] == s[m + "D"] == s[m + "dt_bias"] == ("F32", (48,))
    assert s[m + "norm.weight"] == ("F32", (3072,))
    assert s[m + "out_proj.weight"] == ("F32", (1536, 3072))
    n, _ = _read_header(d / "model.safetensors")
    data = sum(4 * math.prod(shape) for _, shape in s.values())
    assert os.path.getsize(d / "model.safetensors") == 8 + n + data
    assert os.stat(d / "model.safetensors").st_blocks * 512 < 10 ** 7    # sparse


def test_witness_mamba2attn_native_and_oute(tmp_path):
    d = B.witness_header_only("mamba2attn-2.7b", tmp_path / "n")
    s = _witness_shapes(d)
    attn = [9, 18, 27, 36, 45, 56]
    for i in range(64):
        rows = s[f"backbone.layers.{i}.mixer.in_proj.weight"][1][0]
        assert rows == (30 * 128 * 3 if i in attn else 2 * 5120 + 2 * 128 + 80)
    assert s["backbone.layers.9.mixer.out_proj.weight"] == ("F32", (2560, 3840))
    assert "backbone.layers.9.mixer.in_proj.bias" not in s      # qkv_proj_bias false
    assert len(s) == 2 + 58 * 9 + 6 * 5

    d = B.witness_header_only("mamba2attn-250m.oute-dialect.config.json", tmp_path / "o")
    assert (d / "config.json").read_bytes() == \
        (B.WITNESS_DIR / "mamba2attn-250m.oute-dialect.config.json").read_bytes()
    s = _witness_shapes(d)
    assert s["backbone.embeddings.weight"] == ("BF16", (32768, 1024))
    for i in range(32):
        rows = s[f"backbone.layers.{i}.mixer.in_proj.weight"][1][0]
        assert rows == ((16 + 32) * 128 if i in (4, 12, 20, 28) else 2 * 2048 + 2 * 128 + 32)
    assert len(s) == 2 + 28 * 9 + 4 * 5


@pytest.mark.parametrize("model_type", sorted(B.MINI_HF))
def test_hf_builders(model_type, tmp_path):
    import transformers
    d = B.build_hf(tmp_path / "real", model_type, B.MINI_HF[model_type], seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == model_type
    logits = R.hf_logits(model, _ids(16, B.MINI_HF[model_type]["vocab_size"]))
    assert logits.abs().max() > 3.0
    # cached decode of the same model agrees (floor part b)
    assert _maxabs(logits, R.hf_prefill_then_step(model, _ids(16, B.MINI_HF[model_type]["vocab_size"]), 5)) < 1e-4
    # header-only twin written from the meta device: same names and shapes on disk
    h = B.hf_header_only(tmp_path / "hdr", cfg, dtype="F32")
    real, hdr = _witness_shapes(d), _witness_shapes(h)
    assert real == hdr
    assert json.loads((h / "config.json").read_text())["model_type"] == model_type


def test_floor_and_argmax_helpers():
    ref64 = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.999, 0.0], [0.0, 3.0, -1.0]], dtype=torch.float64)
    ref32 = (ref64 + 1e-6).float()
    step = (ref64 - 3e-6).float()
    f = R.floor_and_tolerance(ref32, ref64, step)
    assert f["floor"] == pytest.approx(4e-6, rel=0.15)
    assert f["tol"] == pytest.approx(max(2 * f["floor"], 5e-5))
    test = ref64.clone()
    test[1] = torch.tensor([0.0, 2.0, 0.0])       # flips argmax only where the margin is tiny
    frac, excluded = R.argmax_agreement(ref64, test, 1e-3)
    assert (frac, excluded) == (1.0, 1)
    test[2] = torch.tensor([9.0, 0.0, 0.0])
    assert R.argmax_agreement(ref64, test, 1e-3) == (0.5, 1)
    frac, excluded = R.argmax_agreement(ref64, test, 10.0)
    assert math.isnan(frac) and excluded == 3


def test_kernel_floor_helper():
    exact = torch.tensor([[40.0, -3.0], [0.5, 7.0]], dtype=torch.float64)
    twin = (exact + torch.tensor([[2e-3, 0.0], [0.0, -1e-3]], dtype=torch.float64)).float()
    fl = R.kernel_floor_and_tolerance(twin, exact)
    assert fl["floor"] == pytest.approx(2e-3, abs=1e-5) and fl["tol"] == pytest.approx(4e-3, abs=2e-5)
    R.assert_kernel_at_floor(exact.float() + 1.5e-3, twin, exact)  # within 2 × floor of both
    with pytest.raises(AssertionError, match="tol"):
        R.assert_kernel_at_floor(exact.float() - 3.5e-3, twin, exact)  # within reach of fp64, not of the twin
    tight = R.kernel_floor_and_tolerance(exact.float(), exact)  # an exact twin: the 1e-5·max|out| term
    assert tight["floor"] == 0.0 and tight["tol"] == pytest.approx(4e-4)
    with pytest.raises(AssertionError):
        R.assert_kernel_at_floor(exact.float() + 1e-3, exact.float(), exact)
