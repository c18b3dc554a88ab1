"""mamba_ssm checkpoints: the native ``MambaLMHeadModel`` config dialect
(``ssm_cfg.layer == "Mamba2"``, optional conv-QKV ``MHA`` layers declared by
``attn_layer_idx`` + ``attn_cfg``) and OuteAI's ``mamba2attn`` dialect.

Both spell tensors ``backbone.layers.{i}.norm.weight`` /
``backbone.layers.{i}.mixer.*``; the embedding is ``backbone.embedding.weight``
(native) or ``backbone.embeddings.weight`` (OuteAI). Defaults the configs
leave out are mamba_ssm's class defaults, recorded as such.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..ir.module import Layer, Module
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, ConfigError, FrontendError, compute_dtype, op, pad_to
from .registry import by_dialect, by_model_type

NATIVE = "mamba_ssm-native"
OUTE = "mamba2attn-oute"

# mamba_ssm Mamba2 class defaults
MAMBA2_DEFAULTS = {
    "d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
    "bias": False, "conv_bias": True, "dt_limit": [0.0, math.inf], "rmsnorm": True, "norm_before_gate": False,
}
# mamba_ssm MHA class defaults
MHA_DEFAULTS = {
    "num_heads_kv": None, "head_dim": None, "mlp_dim": 0, "qkv_proj_bias": True, "out_proj_bias": True,
    "softmax_scale": None, "causal": False, "d_conv": 0, "rotary_emb_dim": 0, "rotary_emb_base": 10000.0,
    "rotary_emb_interleaved": False,
}
MAMBA2_KINDS = {"d_state": int, "d_conv": int, "expand": int, "headdim": int, "ngroups": int, "chunk_size": int,
                "bias": bool, "conv_bias": bool, "rmsnorm": bool, "norm_before_gate": bool}
MHA_KINDS = {"num_heads_kv": int, "head_dim": int, "mlp_dim": int, "qkv_proj_bias": bool, "out_proj_bias": bool,
             "softmax_scale": float, "causal": bool, "d_conv": int, "rotary_emb_dim": int, "rotary_emb_base": float,
             "rotary_emb_interleaved": bool}
NORM_EPS = 1e-5  # mamba_ssm norm_epsilon and RMSNormGated eps defaults

MIXER = "backbone.layers.{i}.mixer."
BLOCK_NORM = "backbone.layers.{i}.norm.weight"


def dt_limit(A: Attrs, key: str, value) -> list[float]:
    """A (min, max) pair of numbers."""
    pair = A.check(key, value, list[float])
    if len(pair) != 2:
        raise ConfigError(f"{A.where}: cannot read this config: {A.prefix}{key}={value!r} is not a (min, max) pair")
    return pair


def _op(kind: str, rows: tuple[tuple[str, object, bool], ...]):
    """An operator from (attribute, value, filled_by_default) rows."""
    return op(kind, {name: value for name, value, _ in rows}, {name for name, _, default in rows if default})


def mamba2_op(d_model: int, g: dict, filled: set[str], eps: float, eps_default: bool):
    """The mamba2 operator from geometry ``g`` (mamba_ssm names); ``filled``: keys taken from defaults."""
    d_inner = g["expand"] * d_model if g.get("d_inner") is None else g["d_inner"]
    lo, hi = g["dt_limit"]
    return _op("mamba2", (
        ("d_model", d_model, False),
        ("d_inner", d_inner, "expand" in filled and g.get("d_inner") is None),
        ("heads", d_inner // g["headdim"], False),
        ("head_dim", g["headdim"], "headdim" in filled),
        ("state_size", g["d_state"], "d_state" in filled),
        ("groups", g["ngroups"], "ngroups" in filled),
        ("conv_kernel", g["d_conv"], "d_conv" in filled),
        ("conv_bias", bool(g["conv_bias"]), "conv_bias" in filled),
        ("proj_bias", bool(g["bias"]), "bias" in filled),
        ("chunk_size", g["chunk_size"], "chunk_size" in filled),
        ("dt_min", float(lo), "dt_limit" in filled),
        ("dt_max", float(hi), "dt_limit" in filled),
        ("norm_eps", eps, eps_default),
        ("norm_order", "norm_then_gate" if g["norm_before_gate"] else "gate_then_norm", "norm_before_gate" in filled),
        ("norm_act", "silu", True),
        ("norm_group", d_inner // g["ngroups"], True),
    ))


def conv_qkv_op(d_model: int, m: dict, filled: set[str]):
    heads = m["num_heads"]
    kv = m["num_heads_kv"] if m["num_heads_kv"] is not None else heads
    hd = m["head_dim"] if m["head_dim"] is not None else d_model // heads
    scale = m["softmax_scale"]
    return _op("conv_qkv", (
        ("d_model", d_model, False),
        ("heads", heads, False),
        ("kv_heads", kv, "num_heads_kv" in filled or m["num_heads_kv"] is None),
        ("head_dim", hd, "head_dim" in filled or m["head_dim"] is None),
        ("conv_kernel", m["d_conv"], "d_conv" in filled),
        ("conv_bias", True, True),  # nn.Conv1d's default; MHA does not switch it off
        ("qkv_bias", bool(m["qkv_proj_bias"]), "qkv_proj_bias" in filled),
        ("out_bias", bool(m["out_proj_bias"]), "out_proj_bias" in filled),
        ("causal", bool(m["causal"]), "causal" in filled),
        ("scale", float(scale) if scale is not None else 1.0 / math.sqrt(hd), scale is None),
        ("rotary_dim", m["rotary_emb_dim"], "rotary_emb_dim" in filled),
        ("rotary_base", float(m["rotary_emb_base"]), "rotary_emb_base" in filled),
        ("rotary_layout", "interleaved" if m["rotary_emb_interleaved"] else "half", "rotary_emb_interleaved" in filled),
        ("rope_type", "default", True),
    ))


# checkpoint spelling under mixer. → role, per operator kind
_MAMBA2_ONLY = {
    "dt_bias": Role.Mamba2DtBias, "A_log": Role.Mamba2ALog, "D": Role.Mamba2D, "norm.weight": Role.Mamba2GatedNorm,
}
_SHARED = {
    "mamba2": {
        "in_proj.weight": Role.Mamba2InProj, "in_proj.bias": Role.Mamba2InProjBias,
        "conv1d.weight": Role.Mamba2Conv1d, "conv1d.bias": Role.Mamba2Conv1dBias,
        "out_proj.weight": Role.Mamba2OutProj, "out_proj.bias": Role.Mamba2OutProjBias,
    },
    "conv_qkv": {
        "in_proj.weight": Role.ConvQkvInProj, "in_proj.bias": Role.ConvQkvInProjBias,
        "conv1d.weight": Role.ConvQkvConv1d, "conv1d.bias": Role.ConvQkvConv1dBias,
        "out_proj.weight": Role.ConvQkvOutProj, "out_proj.bias": Role.ConvQkvOutProjBias,
    },
}


def bind_mixer(b: Builder, i: int, kind: str) -> None:
    prefix = MIXER.format(i=i)
    table = {**_SHARED[kind], **_MAMBA2_ONLY}
    for suffix, role in table.items():
        key = prefix + suffix
        shape = b.shape(key)
        if shape is None:
            continue
        if suffix == "conv1d.weight" and len(shape) == 3 and shape[1] == 1:
            b.bind_reshaped(key, role, i, (shape[0], shape[2]))
        elif suffix == "A_log" or suffix == "D" or suffix == "dt_bias":
            b.bind_reshaped(key, role, i, (math.prod(shape),))
        else:
            b.bind(key, role, i)
    b.bind(BLOCK_NORM.format(i=i), Role.Mamba2PreMixerNorm, i)


def _layers(b: Builder, n_layer: int, attn: set[int], d_model: int, mamba, attn_op, residual: str, eps: float, eps_default: bool) -> list[Layer]:
    layers = []
    for i in range(n_layer):
        kind = "conv_qkv" if i in attn else "mamba2"
        mixer = attn_op if i in attn else mamba
        bind_mixer(b, i, kind)
        norm = op("rmsnorm", {"dim": d_model, "eps": eps, "zero_centred": False},
                  ({"eps"} if eps_default else set()) | {"zero_centred"}, role=Role.Mamba2PreMixerNorm)
        layers.append(Layer(i, residual, Placement.PreMixer, [norm], _copy(mixer)))
    return layers


def _copy(o):
    return op(o.kind, dict(o.attrs), set(o.defaults), o.role)


def _model_ops(b: Builder, emb_key: str, vocab: int, padded: int, d_model: int, tied: bool, eps: float, eps_default: bool):
    b.bind(emb_key, Role.Embedding)
    b.bind("backbone.norm_f.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    embedding = op("embedding", {"vocab": vocab, "padded_vocab": padded, "dim": d_model})
    final = op("rmsnorm", {"dim": d_model, "eps": eps, "zero_centred": False},
               ({"eps"} if eps_default else set()) | {"zero_centred"}, role=Role.FinalNorm)
    head = op("head", {"tied": tied, "padded_vocab": padded, "dim": d_model})
    return embedding, final, head


def _is_native(cfg: dict) -> bool:
    s = cfg.get("ssm_cfg")
    return isinstance(s, dict) and s.get("layer") == "Mamba2"


def _read_mamba2(R: Attrs, spell: dict[str, str], defaults: dict | None = None) -> tuple[dict, set[str]]:
    """Mamba2 geometry (mamba_ssm names) read through ``spell`` (mamba_ssm name → config key); the names filled
    from the defaults (``defaults``, keyed by config key; else mamba_ssm's class defaults)."""
    g, filled = {}, set()
    for k, ck in spell.items():
        default = defaults[ck] if defaults is not None else MAMBA2_DEFAULTS[k]
        if k == "dt_limit":
            v, d = R.get(ck, default=default)
            v = dt_limit(R, ck, v)
        else:
            v, d = R.get(ck, default=default, kind=MAMBA2_KINDS[k], min=1 if k in ("headdim", "ngroups") else None)
        g[k] = v
        if d:
            filled.add(k)
    return g, filled


def _read_mha(M: Attrs, spell: dict[str, str], given: dict) -> tuple[dict, set[str]]:
    """MHA geometry (mamba_ssm names) read through ``spell``; ``given``: values the dialect fixes."""
    m, filled = dict(given), set()
    for k, ck in spell.items():
        m[k], d = M.get(ck, default=MHA_DEFAULTS[k], kind=MHA_KINDS[k], min=1 if k == "head_dim" else None)
        if d:
            filled.add(k)
    return m, filled


@by_dialect(NATIVE, _is_native)
def lower_native(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json ({NATIVE})")
    where = A.where
    d_model, n_layer, vocab = A.need("d_model", kind=int), A.layers("n_layer"), A.need("vocab_size", kind=int)
    if A.raw("d_intermediate"):
        raise FrontendError(f"{where}: d_intermediate={A.raw('d_intermediate')} (a gated MLP per block) is not supported yet")
    if (A.raw("rms_norm") if "rms_norm" in A else True) is not True:
        raise FrontendError(f"{where}: rms_norm=false (LayerNorm blocks) is not supported")
    b = Builder(model_dir, "mamba_ssm", NATIVE, sha, relative_to)
    ssm = dict(A.raw("ssm_cfg"))
    ssm.pop("layer")
    unknown = sorted(set(ssm) - set(MAMBA2_DEFAULTS) - {"d_ssm", "dt_min", "dt_max", "dt_init_floor", "A_init_range", "D_has_hdim"})
    if unknown:
        raise FrontendError(f"{where}: ssm_cfg keys not understood: {', '.join(unknown)}")
    if ssm.get("D_has_hdim"):
        raise FrontendError(f"{where}: ssm_cfg.D_has_hdim=true is not supported")
    S = Attrs(ssm, where, prefix="ssm_cfg.")
    g, filled = _read_mamba2(S, {k: k for k in MAMBA2_DEFAULTS})
    if g["rmsnorm"] is not True:
        raise FrontendError(f"{where}: ssm_cfg.rmsnorm=false (ungated output) is not supported")
    g["d_inner"] = S.opt("d_ssm", kind=int)
    if g["d_inner"] not in (None, g["expand"] * d_model):
        raise FrontendError(f"{where}: d_ssm != expand*d_model is not supported")
    mamba = mamba2_op(d_model, g, filled, NORM_EPS, True)
    attn_idx = A.opt("attn_layer_idx", kind=list[int]) or []
    attn_op = None
    if attn_idx:
        M = Attrs(A.opt("attn_cfg", kind=dict) or {}, where, prefix="attn_cfg.")
        m, mfilled = _read_mha(M, {k: k for k in MHA_DEFAULTS}, {"num_heads": M.need("num_heads", kind=int, min=1)})
        if m["mlp_dim"]:
            raise FrontendError(f"{where}: attn_cfg.mlp_dim={m['mlp_dim']} (MLP fused into MHA) is not supported")
        if not m["d_conv"]:
            raise FrontendError(f"{where}: attn_cfg.d_conv=0 (MHA without the QKV conv) is not supported yet")
        attn_op = conv_qkv_op(d_model, m, mfilled)
        bad = [i for i in attn_idx if not (0 <= i < n_layer)]
        if bad:
            raise FrontendError(f"{where}: attn_layer_idx {bad} outside 0..{n_layer - 1}")
        b.fact("layer_index_base", 0, "mamba_ssm MixerModel tests `i in attn_layer_idx` for i in range(n_layer)")
    residual = "fp32" if A.get("residual_in_fp32", default=False, kind=bool)[0] else "compute"
    layers = _layers(b, n_layer, set(attn_idx), d_model, mamba, attn_op, residual, NORM_EPS, True)
    padded = pad_to(vocab, A.get("pad_vocab_size_multiple", default=8, kind=int)[0])
    tied = A.get("tie_embeddings", default=True, kind=bool)[0]
    emb, final, head = _model_ops(b, "backbone.embedding.weight", vocab, padded, d_model, tied, NORM_EPS, True)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, "backbone.embedding.weight"), emb, layers, final, head)


@by_model_type("mamba2attn")
def lower_oute(model_dir: Path, cfg: dict, sha: str, relative_to: Path | None) -> Module:
    A = Attrs(cfg, f"{model_dir}/config.json ({OUTE})")
    where = A.where
    d_model, n_layer, vocab = A.need("hidden_size", kind=int), A.layers("num_hidden_layers"), A.need("vocab_size", kind=int)
    A.need("state_size", kind=int)
    d_inner = A.need("mamba2_num_heads", kind=int) * A.need("mamba2_head_dim", kind=int, min=1)
    if A.raw("mlp_intermediate_size"):
        raise FrontendError(f"{where}: mlp_intermediate_size={A.raw('mlp_intermediate_size')} is not supported yet")
    b = Builder(model_dir, "mamba_ssm", OUTE, sha, relative_to)
    expand = A.opt("expand", kind=int)
    if expand is not None and expand * d_model != d_inner:
        raise FrontendError(f"{where}: expand*hidden_size={expand * d_model} but mamba2_num_heads*mamba2_head_dim={d_inner}")
    g, filled = _read_mamba2(A, {"d_state": "state_size", "d_conv": "mamba2_conv_kernel", "headdim": "mamba2_head_dim",
                                 "ngroups": "n_groups", "chunk_size": "chunk_size", "bias": "use_mamba2_bias",
                                 "conv_bias": "use_conv_bias", "dt_limit": "time_step_limit"})
    g.update({"d_inner": d_inner, "expand": d_inner // d_model, "norm_before_gate": False, "rmsnorm": True})
    filled.add("norm_before_gate")
    eps, eps_default = A.get("layer_norm_epsilon", default=NORM_EPS, kind=float)
    mamba = mamba2_op(d_model, g, filled, eps, eps_default)
    idx = A.opt("attention_layers_idx", kind=list[int]) or []
    attn_op = None
    attn: set[int] = set()
    if idx:
        if A.raw("num_attention_heads") is None:
            raise FrontendError(f"{where}: attention_layers_idx given but num_attention_heads missing")
        if A.raw("rope_scaling"):
            raise FrontendError(f"{where}: rope_scaling={A.raw('rope_scaling')!r} is not supported")
        m, mfilled = _read_mha(A, {"num_heads_kv": "num_key_value_heads", "head_dim": "attention_head_dim",
                                   "d_conv": "attention_conv_kernel", "rotary_emb_dim": "rope_emb_dim",
                                   "rotary_emb_base": "rope_theta", "qkv_proj_bias": "use_attention_qkv_bias",
                                   "out_proj_bias": "use_attention_out_bias"},
                               {"num_heads": A.need("num_attention_heads", kind=int, min=1), "softmax_scale": None, "causal": True,
                                "mlp_dim": 0, "rotary_emb_interleaved": MHA_DEFAULTS["rotary_emb_interleaved"]})
        # the dialect has no causal or interleave key: a decoder's MHA is causal, a filled-in fact
        mfilled |= {"causal", "rotary_emb_interleaved"}
        if not m["d_conv"]:
            raise FrontendError(f"{where}: attention_conv_kernel=0 is not supported yet")
        attn_op = conv_qkv_op(d_model, m, mfilled)
        attn = _settle_index_base(b, where, idx, n_layer, attn_op.attrs, mamba.attrs)
    residual = "fp32" if (A.raw("residual_in_fp32") if "residual_in_fp32" in A else True) else "compute"
    layers = _layers(b, n_layer, attn, d_model, mamba, attn_op, residual, eps, eps_default)
    emb_key = "backbone.embeddings.weight"
    rows = (b.shape(emb_key) or (vocab,))[0]
    padded = rows if rows >= vocab else vocab  # padding is read from the table; fewer rows is a contract finding
    if padded != vocab:
        b.fact("padded_vocab", padded, f"{emb_key} has {rows} rows for vocab_size {vocab}")
    tied = A.get("tie_embedding_weights", default=True, kind=bool)[0]
    emb, final, head = _model_ops(b, emb_key, vocab, padded, d_model, tied, eps, eps_default)
    return b.module(model_dir.resolve().name, compute_dtype(A, b, emb_key), emb, layers, final, head)


def _settle_index_base(b: Builder, where: str, idx: list[int], n_layer: int, attn: dict, mamba: dict) -> set[int]:
    """0- or 1-based ``attention_layers_idx``: decided by in_proj rows, never assumed."""
    attn_rows = (attn["heads"] + 2 * attn["kv_heads"]) * attn["head_dim"]
    mamba_rows = 2 * mamba["d_inner"] + 2 * mamba["groups"] * mamba["state_size"] + mamba["heads"]
    rows = {}
    for i in range(n_layer):
        s = b.shape(MIXER.format(i=i) + "in_proj.weight")
        rows[i] = s[0] if s else None

    def fits(base: int) -> bool:
        phys = {i - base for i in idx}
        if any(not (0 <= p < n_layer) for p in phys):
            return False
        return all(rows[i] == (attn_rows if i in phys else mamba_rows) for i in range(n_layer))

    ok = [base for base in (0, 1) if fits(base)]
    listing = ", ".join(str(i) for i in idx)
    if len(ok) == 2:
        raise FrontendError(
            f"{where}: attention_layers_idx [{listing}] could be 0- or 1-based: attention and Mamba2 layers both have "
            f"in_proj rows {attn_rows}, so the tensors cannot decide; refusing to guess"
        )
    if not ok:
        seen = ", ".join(f"{i}:{rows[i]}" for i in range(n_layer) if rows[i] != mamba_rows)
        raise FrontendError(
            f"{where}: attention_layers_idx [{listing}] fits neither a 0- nor a 1-based reading: attention layers need "
            f"in_proj rows {attn_rows}, Mamba2 layers {mamba_rows}; layers with other rows: {seen or 'none'}"
        )
    base = ok[0]
    phys = sorted(i - base for i in idx)
    b.fact("layer_index_base", base,
           f"in_proj rows {attn_rows} on layers {','.join(map(str, phys))}, {mamba_rows} on the other {n_layer - len(phys)}")
    return set(phys)
