"""Numerical references for vxc tests, independent of vxc (nothing here imports it).

- ``native_to_hf_mamba2(model_dir)``: a native mamba_ssm pure-Mamba2 checkpoint
  loaded (strictly) into transformers' ``Mamba2ForCausalLM``.
- ``Mamba2AttnOracle(model_dir, dtype, index_base=...)``: plain-torch oracle for
  Mamba2 + conv-QKV attention stacks (native and OuteAI dialects), written from
  shared/design/OPERATORS.md and the upstream MHA semantics.  Its full-sequence
  path and its incremental path use different algorithms (quadratic SSD dual
  form / softmax over a mask vs. recurrence / KV rows), so their agreement is
  evidence, not a tautology.
- ``hf_logits`` / ``hf_prefill_then_step``: full vs. cached runs of any
  transformers causal LM.
- ``floor_and_tolerance`` / ``argmax_agreement``: VINDEX3.md "Numerical floor".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

# ---------------------------------------------------------------------------
# checkpoint reading
# ---------------------------------------------------------------------------


def read_config(model_dir) -> dict:
    """config.json; Python's json accepts the bare ``Infinity`` of the OuteAI
    dialect, and transformers' ``{"__float__": "Infinity"}`` is decoded too."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return _decode_special_floats(cfg)


def _decode_special_floats(obj):
    table = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in table:
            return table[obj["__float__"]]
        return {k: _decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_special_floats(v) for v in obj]
    return obj


def load_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards named by
    model.safetensors.index.json."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for k in f.keys():
                if k in out:
                    raise ValueError(f"tensor {k} appears in two shards")
                out[k] = f.get_tensor(k)
    return out


def _padded_vocab(vocab: int, multiple) -> int:
    multiple = int(multiple or 1)
    return vocab + (-vocab % multiple)


# ---------------------------------------------------------------------------
# transformers reference for native pure-Mamba2 checkpoints
# ---------------------------------------------------------------------------


def native_mamba2_hf_config(cfg: dict):
    """transformers ``Mamba2Config`` equivalent to a native MambaLMHeadModel config."""
    import transformers
    ssm = dict(cfg.get("ssm_cfg") or {})
    if ssm.get("layer", "Mamba1") != "Mamba2":
        raise ValueError("native_to_hf_mamba2: ssm_cfg layer is not Mamba2")
    if cfg.get("attn_layer_idx"):
        raise ValueError("native_to_hf_mamba2: checkpoint has attention layers "
                         "(transformers has no conv-QKV attention); use Mamba2AttnOracle")
    if int(cfg.get("d_intermediate", 0) or 0):
        raise ValueError("native_to_hf_mamba2: d_intermediate > 0 is not supported")
    if not ssm.get("rmsnorm", True) or ssm.get("norm_before_gate", False):
        raise ValueError("native_to_hf_mamba2: transformers implements only "
                         "rmsnorm=True, norm_before_gate=False")
    if ssm.get("D_has_hdim", False) or ssm.get("d_ssm") is not None:
        raise ValueError("native_to_hf_mamba2: D_has_hdim / d_ssm are not supported")
    d = int(cfg["d_model"])
    expand = ssm.get("expand", 2)
    headdim = int(ssm.get("headdim", 64))
    d_inner = int(expand * d)
    dt_limit = ssm.get("dt_limit", (0.0, math.inf))
    return transformers.Mamba2Config(
        hidden_size=d,
        num_hidden_layers=int(cfg["n_layer"]),
        num_heads=d_inner // headdim,
        head_dim=headdim,
        state_size=int(ssm.get("d_state", 128)),
        n_groups=int(ssm.get("ngroups", 1)),
        conv_kernel=int(ssm.get("d_conv", 4)),
        expand=expand,
        use_bias=bool(ssm.get("bias", False)),
        use_conv_bias=bool(ssm.get("conv_bias", True)),
        vocab_size=_padded_vocab(int(cfg["vocab_size"]), cfg.get("pad_vocab_size_multiple", 8)),
        tie_word_embeddings=bool(cfg.get("tie_embeddings", True)),
        residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
        layer_norm_epsilon=1e-5,
        chunk_size=int(ssm.get("chunk_size", 256)),
        time_step_limit=tuple(float(x) for x in dt_limit),
        rms_norm=True,
        norm_before_gate=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )


def native_to_hf_mamba2(model_dir, dtype: torch.dtype = torch.float32):
    """Load a native-dialect pure-Mamba2 checkpoint into ``Mamba2ForCausalLM``.

    Renames ``backbone.embedding.`` -> ``backbone.embeddings.`` (every other
    name is spelled the same in transformers 5.24) and loads with strict key
    checking; a tied head is checked to alias the embedding.
    """
    import transformers
    cfg = read_config(model_dir)
    hf_cfg = native_mamba2_hf_config(cfg)
    sd = {}
    for k, v in load_checkpoint(model_dir).items():
        if k.startswith("backbone.embedding."):
            k = "backbone.embeddings." + k[len("backbone.embedding."):]
        sd[k] = v.to(torch.float32)
    tied = hf_cfg.tie_word_embeddings
    if tied:
        if "lm_head.weight" in sd:
            raise ValueError("tied checkpoint also stores lm_head.weight")
        sd["lm_head.weight"] = sd["backbone.embeddings.weight"]
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(hf_cfg)
    model.load_state_dict(sd, strict=True)  # raises on missing / unexpected keys
    if tied:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.backbone.embeddings.weight.data_ptr()
    return model.to(dtype).eval()


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    """Full-sequence logits [T, V] of a transformers causal LM (no cache)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    return model(ids, use_cache=False).logits[0]


@torch.no_grad()
def hf_prefill_then_step(model, ids, n_prefill: int) -> torch.Tensor:
    """Logits [T, V]: prefill ``ids[:n_prefill]`` then feed the rest one token
    at a time through transformers' cache (``cache=`` / ``.cache``)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    out = model(ids[:, :n_prefill], use_cache=True)
    rows = [out.logits[0]]
    cache = out.cache
    for t in range(n_prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0])
    return torch.cat(rows, 0)


# ---------------------------------------------------------------------------
# Plain-torch oracle: Mamba2 + conv-QKV attention
# ---------------------------------------------------------------------------


def _rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal_conv(x, w, b):
    """x [T, C] raw, w [C, k]; out[t] = sum_j w[:, j] * x[t - (k-1) + j] (+ b)."""
    T, C = x.shape
    k = w.shape[1]
    xp = torch.cat([x.new_zeros(k - 1, C), x], 0)
    out = sum(w[:, j] * xp[j:j + T] for j in range(k))
    return out + b if b is not None else out


def _history(x, k):
    """The last k-1 raw inputs [k-1, C], zero padded on the left."""
    T, C = x.shape
    if k <= 1:
        return x.new_zeros(0, C)
    xp = torch.cat([x.new_zeros(k - 1, C), x], 0)
    return xp[-(k - 1):].clone()


def rotary(x, pos, rotary_dim: int, base: float, interleaved: bool = False):
    """Rotate the first ``rotary_dim`` dims of each head of x [T, H, D] at
    absolute positions ``pos`` [T]; dims beyond rotary_dim pass unchanged.
    Half-split (NeoX) pairs (i, i + rd/2) unless ``interleaved`` (2i, 2i+1)."""
    if rotary_dim == 0:
        return x
    rd = rotary_dim
    inv_freq = base ** (-torch.arange(0, rd, 2, dtype=x.dtype) / rd)
    ang = pos.to(x.dtype)[:, None] * inv_freq[None, :]           # [T, rd/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        out = torch.stack([o1, o2], -1).flatten(-2)
    else:
        out = torch.cat([o1, o2], -1)
    return torch.cat([out, rest], -1)


class Mamba2AttnOracle(torch.nn.Module):
    """Reference for mamba_ssm-style Mamba2 stacks with optional conv-QKV attention.

    ``Mamba2AttnOracle(model_dir, dtype=torch.float64, index_base=None)``

    Reads config.json in the native dialect (``d_model``/``ssm_cfg``/
    ``attn_layer_idx``/``attn_cfg``; 0-based layer list) or the OuteAI dialect
    (``model_type == "mamba2attn"``; then ``index_base`` 0 or 1 is required:
    physical layer = listed index - index_base).  All math runs in ``dtype``.

    - ``forward(ids [T]) -> logits [T, padded_vocab]`` (stateless)
    - ``prefill(ids) -> logits [T, V]`` (resets and fills the state)
    - ``step(token) -> logits [V]``
    - ``greedy(ids, n_new) -> list[int]``
    - ``cache``: per layer a dict; Mamba2: ``conv`` [d_conv-1, conv_dim] raw
      pre-conv xBC, ``ssm`` [H, P, N]; attention: ``conv`` [d_conv-1, qkv_rows]
      raw pre-conv qkv, ``k`` [T, Hkv, Dh] post-conv post-rotary, ``v`` [T, Hkv, Dh]
    """

    def __init__(self, model_dir, dtype: torch.dtype = torch.float64, *,
                 index_base: int | None = None):
        super().__init__()
        if dtype not in (torch.float32, torch.float64):
            raise ValueError("Mamba2AttnOracle computes in float32 or float64")
        self.dtype = dtype
        self.config = cfg = read_config(model_dir)
        w = {k: v.to(dtype) for k, v in load_checkpoint(model_dir).items()}
        if cfg.get("model_type") == "mamba2attn":
            self._init_oute(cfg, w, index_base)
        elif "d_model" in cfg and "ssm_cfg" in cfg:
            if index_base not in (None, 0):
                raise ValueError("the native dialect's attn_layer_idx is 0-based")
            self._init_native(cfg, w)
        else:
            raise ValueError("Mamba2AttnOracle: config is neither the native mamba_ssm "
                             "dialect nor OuteAI mamba2attn")
        self.layer_kinds = ["attn" if i in self.attn_layers else "mamba2"
                            for i in range(self.n_layer)]
        self._bind(w)
        self.reset()

    # -- configuration -----------------------------------------------------

    def _init_native(self, cfg, w):
        self.dialect = "native"
        ssm = dict(cfg.get("ssm_cfg") or {})
        if ssm.get("layer", "Mamba1") != "Mamba2":
            raise ValueError("only Mamba2 layers are supported")
        if int(cfg.get("d_intermediate", 0) or 0):
            raise ValueError("d_intermediate > 0 (MLP blocks) is not supported")
        if not ssm.get("rmsnorm", True) or ssm.get("D_has_hdim") or ssm.get("d_ssm") is not None:
            raise ValueError("rmsnorm=False / D_has_hdim / d_ssm are not supported")
        d = self.d_model = int(cfg["d_model"])
        self.n_layer = int(cfg["n_layer"])
        self.vocab = _padded_vocab(int(cfg["vocab_size"]), cfg.get("pad_vocab_size_multiple", 8))
        self.tied = bool(cfg.get("tie_embeddings", True))
        self.eps = 1e-5
        self.emb_key = "backbone.embedding.weight"
        self.d_inner = int(ssm.get("expand", 2) * d)
        self.headdim = int(ssm.get("headdim", 64))
        self.n_heads = self.d_inner // self.headdim
        self.d_state = int(ssm.get("d_state", 128))
        self.ngroups = int(ssm.get("ngroups", 1))
        self.d_conv = int(ssm.get("d_conv", 4))
        self.norm_before_gate = bool(ssm.get("norm_before_gate", False))
        self.dt_limit = tuple(float(x) for x in ssm.get("dt_limit", (0.0, math.inf)))
        self.attn_layers = sorted({int(i) for i in cfg.get("attn_layer_idx") or []})
        a = dict(cfg.get("attn_cfg") or {})
        if self.attn_layers:
            if int(a.get("mlp_dim", 0) or 0):
                raise ValueError("attn_cfg mlp_dim > 0 is not supported")
            # upstream MHA defaults causal=False; released configs set it True
            if not a.get("causal", False):
                raise ValueError("attn_cfg without causal=True: upstream MHA would attend "
                                 "non-causally; the oracle implements causal attention only")
            nh = int(a["num_heads"])
            self.attn = {
                "Hq": nh,
                "Hkv": int(a.get("num_heads_kv") or nh),
                "Dh": int(a.get("head_dim") or d // nh),
                "d_conv": int(a.get("d_conv", 0)),
                "rotary_dim": int(a.get("rotary_emb_dim", 0)),
                "base": float(a.get("rotary_emb_base", 10000.0)),
                "interleaved": bool(a.get("rotary_emb_interleaved", False)),
                "scale": a.get("softmax_scale"),
            }

    def _init_oute(self, cfg, w, index_base):
        self.dialect = "oute"
        if index_base not in (0, 1):
            raise ValueError("OuteAI dialect: pass index_base=0 or 1 (the config does not say)")
        if int(cfg.get("mlp_intermediate_size", 0) or 0):
            raise ValueError("mlp_intermediate_size > 0 is not supported")
        d = self.d_model = int(cfg["hidden_size"])
        self.n_layer = int(cfg["num_hidden_layers"])
        self.vocab = int(cfg["vocab_size"])
        self.tied = bool(cfg.get("tie_embedding_weights", True))
        self.eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        self.emb_key = "backbone.embeddings.weight"
        self.n_heads = int(cfg["mamba2_num_heads"])
        self.headdim = int(cfg["mamba2_head_dim"])
        self.d_inner = self.n_heads * self.headdim
        self.d_state = int(cfg["state_size"])
        self.ngroups = int(cfg.get("n_groups", 1))
        self.d_conv = int(cfg["mamba2_conv_kernel"])
        self.norm_before_gate = False
        self.dt_limit = tuple(float(x) for x in cfg.get("time_step_limit", (0.0, math.inf)))
        self.attn_layers = sorted({int(i) - index_base for i in cfg.get("attention_layers_idx") or []})
        nh = int(cfg["num_attention_heads"])
        self.attn = {
            "Hq": nh,
            "Hkv": int(cfg.get("num_key_value_heads") or nh),
            "Dh": int(cfg["attention_head_dim"]),
            "d_conv": int(cfg["attention_conv_kernel"]),
            "rotary_dim": int(cfg.get("rope_emb_dim", 0)),
            "base": float(cfg.get("rope_theta", 10000.0)),
            "interleaved": False,
            "scale": None,
        }
        if cfg.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported")

    def _bind(self, w):
        for i in self.attn_layers:
            if not 0 <= i < self.n_layer:
                raise ValueError(f"attention layer {i} outside 0..{self.n_layer - 1}")
        used = set()

        def take(key, shape=None, optional=False):
            if key not in w:
                if optional:
                    return None
                raise KeyError(f"checkpoint lacks {key}")
            used.add(key)
            t = w[key]
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: shape {tuple(t.shape)} != expected {tuple(shape)}")
            return t

        d = self.d_model
        self.embedding = take(self.emb_key, (self.vocab, d))
        self.norm_f = take("backbone.norm_f.weight", (d,))
        self.lm_head = self.embedding if self.tied else take("lm_head.weight", (self.vocab, d))
        if self.tied and "lm_head.weight" in w:
            used.add("lm_head.weight")  # an aliased copy; the embedding is what is used
        self.layers = []
        H, P, N, G = self.n_heads, self.headdim, self.d_state, self.ngroups
        conv_dim = self.d_inner + 2 * G * N
        rows = 2 * self.d_inner + 2 * G * N + H
        for i in range(self.n_layer):
            p = f"backbone.layers.{i}."
            L = {"norm": take(p + "norm.weight", (d,))}
            m = p + "mixer."
            if i in self.attn_layers:
                a = self.attn
                qkv = (a["Hq"] + 2 * a["Hkv"]) * a["Dh"]
                L["in_w"] = take(m + "in_proj.weight", (qkv, d))
                L["in_b"] = take(m + "in_proj.bias", (qkv,), optional=True)
                if a["d_conv"] > 0:
                    L["conv_w"] = take(m + "conv1d.weight", (qkv, 1, a["d_conv"]))[:, 0]
                    L["conv_b"] = take(m + "conv1d.bias", (qkv,), optional=True)
                L["out_w"] = take(m + "out_proj.weight", (d, a["Hq"] * a["Dh"]))
                L["out_b"] = take(m + "out_proj.bias", (d,), optional=True)
            else:
                L["in_w"] = take(m + "in_proj.weight", (rows, d))
                L["in_b"] = take(m + "in_proj.bias", (rows,), optional=True)
                L["conv_w"] = take(m + "conv1d.weight", (conv_dim, 1, self.d_conv))[:, 0]
                L["conv_b"] = take(m + "conv1d.bias", (conv_dim,), optional=True)
                L["dt_bias"] = take(m + "dt_bias", (H,))
                L["A"] = -torch.exp(take(m + "A_log", (H,)))
                L["D"] = take(m + "D", (H,))
                L["gnorm"] = take(m + "norm.weight", (self.d_inner,))
                L["out_w"] = take(m + "out_proj.weight", (d, self.d_inner))
                L["out_b"] = take(m + "out_proj.bias", (d,), optional=True)
            self.layers.append(L)
        unused = sorted(set(w) - used)
        if unused:
            raise ValueError(f"checkpoint tensors the oracle does not use: {unused[:8]}")

    # -- Mamba2 mixer --------------------------------------------------------

    def _mamba2_pre(self, L, u):
        """in_proj and split: z [T, d_inner], xBC raw [T, conv_dim], dt raw [T, H]."""
        zxbcdt = u @ L["in_w"].T
        if L["in_b"] is not None:
            zxbcdt = zxbcdt + L["in_b"]
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        return zxbcdt.split([self.d_inner, conv_dim, self.n_heads], -1)

    def _mamba2_post_conv(self, L, xbc, dt):
        H, P, N, G = self.n_heads, self.headdim, self.d_state, self.ngroups
        T = xbc.shape[0]
        x, B, C = xbc.split([self.d_inner, G * N, G * N], -1)
        x = x.reshape(T, H, P)
        group = torch.arange(H) // (H // G)
        B = B.reshape(T, G, N)[:, group]           # [T, H, N]
        C = C.reshape(T, G, N)[:, group]
        dt = F.softplus(dt + L["dt_bias"])          # [T, H]
        lo, hi = self.dt_limit
        if (lo, hi) != (0.0, math.inf):
            dt = dt.clamp(lo, hi)
        return x, B, C, dt

    def _mamba2_out(self, L, y, z):
        T = y.shape[0]
        G = self.ngroups
        if self.norm_before_gate:
            g = _rmsnorm(y.reshape(T, G, -1), 1.0, self.eps).reshape(T, -1) * L["gnorm"]
            g = g * F.silu(z)
        else:
            g = (y * F.silu(z)).reshape(T, G, -1)
            g = _rmsnorm(g, 1.0, self.eps).reshape(T, -1) * L["gnorm"]
        out = g @ L["out_w"].T
        return out + L["out_b"] if L["out_b"] is not None else out

    def _mamba2_full(self, L, u):
        """Whole sequence, quadratic SSD dual form; returns (out, state)."""
        z, xbc_raw, dt = self._mamba2_pre(L, u)
        xbc = F.silu(_causal_conv(xbc_raw, L["conv_w"], L["conv_b"]))
        x, B, C, dt = self._mamba2_post_conv(L, xbc, dt)
        T = u.shape[0]
        a = dt * L["A"]                              # [T, H], log decay per step
        cum = a.cumsum(0)
        seg = cum[:, None, :] - cum[None, :, :]      # [t, s, H] = sum_{r=s+1..t} a_r
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[:, :, None]
        decay = torch.exp(seg.masked_fill(~causal, -math.inf))
        cb = torch.einsum("thn,shn->tsh", C, B)
        y = torch.einsum("tsh,sh,shp->thp", cb * decay, dt, x) + L["D"][:, None] * x
        # state after the last token: sum_s exp(cum_T - cum_s) dt_s x_s B_s^T
        w_last = torch.exp(cum[-1][None, :] - cum) * dt   # [T, H]
        state = torch.einsum("sh,shp,shn->hpn", w_last, x, B)
        out = self._mamba2_out(L, y.reshape(T, -1), z)
        return out, {"conv": _history(xbc_raw, self.d_conv), "ssm": state}

    def _mamba2_step(self, L, u, st):
        """One token u [1, d] by the recurrence; updates ``st`` in place."""
        z, xbc_raw, dt = self._mamba2_pre(L, u)
        window = torch.cat([st["conv"], xbc_raw], 0)         # [k, conv_dim]
        xbc = (window * L["conv_w"].T).sum(0, keepdim=True)
        if L["conv_b"] is not None:
            xbc = xbc + L["conv_b"]
        st["conv"] = window[1:]
        x, B, C, dt = self._mamba2_post_conv(L, F.silu(xbc), dt)
        x, B, C, dt = x[0], B[0], C[0], dt[0]                # [H,P], [H,N], [H,N], [H]
        dA = torch.exp(dt * L["A"])
        st["ssm"] = st["ssm"] * dA[:, None, None] + (dt[:, None] * x)[:, :, None] * B[:, None, :]
        y = torch.einsum("hpn,hn->hp", st["ssm"], C) + L["D"][:, None] * x
        return self._mamba2_out(L, y.reshape(1, -1), z)

    # -- conv-QKV attention --------------------------------------------------

    def _attn_qkv(self, L, qkv, pos):
        a = self.attn
        T = qkv.shape[0]
        q, k, v = qkv.split([a["Hq"] * a["Dh"], a["Hkv"] * a["Dh"], a["Hkv"] * a["Dh"]], -1)
        q = rotary(q.reshape(T, a["Hq"], a["Dh"]), pos, a["rotary_dim"], a["base"], a["interleaved"])
        k = rotary(k.reshape(T, a["Hkv"], a["Dh"]), pos, a["rotary_dim"], a["base"], a["interleaved"])
        return q, k, v.reshape(T, a["Hkv"], a["Dh"])

    def _attend(self, L, q, k, v, q_pos, k_pos):
        a = self.attn
        rep = torch.arange(a["Hq"]) // (a["Hq"] // a["Hkv"])   # q head -> kv head
        k, v = k[:, rep], v[:, rep]
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(a["Dh"])
        s = torch.einsum("thd,shd->hts", q, k) * scale
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(q.shape[0], -1)
        out = o @ L["out_w"].T
        return out + L["out_b"] if L["out_b"] is not None else out

    def _attn_in(self, L, u):
        qkv = u @ L["in_w"].T
        return qkv + L["in_b"] if L["in_b"] is not None else qkv

    def _attn_full(self, L, u, pos0=0):
        raw = self._attn_in(L, u)
        kc = self.attn["d_conv"]
        qkv = _causal_conv(raw, L["conv_w"], L["conv_b"]) if kc > 0 else raw   # no activation
        T = u.shape[0]
        pos = torch.arange(pos0, pos0 + T)
        q, k, v = self._attn_qkv(L, qkv, pos)
        out = self._attend(L, q, k, v, pos, pos)
        st = {"conv": _history(raw, kc) if kc > 0 else None, "k": k, "v": v}
        return out, st

    def _attn_step(self, L, u, st, pos):
        raw = self._attn_in(L, u)
        if self.attn["d_conv"] > 0:
            window = torch.cat([st["conv"], raw], 0)
            qkv = (window * L["conv_w"].T).sum(0, keepdim=True)
            if L["conv_b"] is not None:
                qkv = qkv + L["conv_b"]
            st["conv"] = window[1:]
        else:
            qkv = raw
        p = torch.tensor([pos])
        q, k, v = self._attn_qkv(L, qkv, p)
        st["k"] = torch.cat([st["k"], k], 0)
        st["v"] = torch.cat([st["v"], v], 0)
        return self._attend(L, q, st["k"], st["v"], p, torch.arange(pos + 1))

    # -- whole model ---------------------------------------------------------

    def _ids(self, ids):
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError("ids must be a 1-D token sequence")
        return ids

    def _run_full(self, ids):
        h = self.embedding[ids]
        residual = torch.zeros_like(h)
        states = []
        for i, L in enumerate(self.layers):
            residual = h + residual
            x = _rmsnorm(residual, L["norm"], self.eps)
            if self.layer_kinds[i] == "attn":
                h, st = self._attn_full(L, x)
            else:
                h, st = self._mamba2_full(L, x)
            states.append(st)
        hf = _rmsnorm(h + residual, self.norm_f, self.eps)
        return hf @ self.lm_head.T, states

    @torch.no_grad()
    def forward(self, ids) -> torch.Tensor:
        """logits [T, padded_vocab] for a 1-D token sequence (stateless)."""
        return self._run_full(self._ids(ids))[0]

    def reset(self):
        self.cache = None
        self.position = 0

    @torch.no_grad()
    def prefill(self, ids) -> torch.Tensor:
        ids = self._ids(ids)
        logits, self.cache = self._run_full(ids)
        self.position = ids.shape[0]
        return logits

    @torch.no_grad()
    def step(self, token) -> torch.Tensor:
        """Feed one token after ``prefill``; logits [V]."""
        if self.cache is None:
            raise RuntimeError("step() before prefill()")
        tok = torch.as_tensor(token, dtype=torch.long).reshape(1)
        h = self.embedding[tok]
        residual = torch.zeros_like(h)
        for i, L in enumerate(self.layers):
            residual = h + residual
            x = _rmsnorm(residual, L["norm"], self.eps)
            if self.layer_kinds[i] == "attn":
                h = self._attn_step(L, x, self.cache[i], self.position)
            else:
                h = self._mamba2_step(L, x, self.cache[i])
        self.position += 1
        hf = _rmsnorm(h + residual, self.norm_f, self.eps)
        return (hf @ self.lm_head.T)[0]

    @torch.no_grad()
    def prefill_then_step(self, ids, n_prefill: int) -> torch.Tensor:
        """logits [T, V]: prefill ids[:n_prefill], then step through the rest."""
        ids = self._ids(ids)
        rows = [self.prefill(ids[:n_prefill])]
        for t in ids[n_prefill:].tolist():
            rows.append(self.step(t)[None])
        return torch.cat(rows, 0)

    @torch.no_grad()
    def greedy(self, ids, n_new: int) -> list[int]:
        """Greedy continuation of ``ids`` by ``n_new`` tokens (argmax over the padded vocab)."""
        logits = self.prefill(ids)[-1]
        out = []
        for _ in range(n_new):
            t = int(logits.argmax())
            out.append(t)
            logits = self.step(t)
        return out


# ---------------------------------------------------------------------------
# Numerical floor (VINDEX3.md)
# ---------------------------------------------------------------------------


def _maxabs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def floor_and_tolerance(ref_logits_fp32, ref_logits_fp64, ref_stepwise_fp32) -> dict:
    """floor = max(maxabs(fp32 - fp64), maxabs(full - stepwise));
    tol = max(2*floor, 1e-5 * max|logit|).  Also returns the two parts."""
    a = _maxabs(ref_logits_fp32, ref_logits_fp64)
    b = _maxabs(ref_logits_fp32, ref_stepwise_fp32)
    floor = max(a, b)
    max_logit = float(ref_logits_fp64.double().abs().max())
    return {"floor": floor, "tol": max(2.0 * floor, 1e-5 * max_logit),
            "fp32_vs_fp64": a, "full_vs_step": b, "max_abs_logit": max_logit}


def kernel_floor_and_tolerance(twin_fp32, exact_fp64) -> dict:
    """The numerical floor of one kernel's output: its fp32 twin vs an fp64 evaluation of the same math;
    tol = max(2*floor, 1e-5 * max|exact|) (VINDEX3.md "Numerical floor", at the kernel's output)."""
    floor = _maxabs(twin_fp32, exact_fp64)
    return {"floor": floor, "tol": max(2.0 * floor, 1e-5 * float(exact_fp64.double().abs().max()))}


def assert_kernel_at_floor(got, twin_fp32, exact_fp64, what: str = "") -> None:
    """``got`` (another implementation of a kernel: Triton, native) is within the floor tolerance of both the
    fp32 twin and the fp64 evaluation. For comparisons across backends or GEMM shapes, whose roundings differ
    between CPUs (oneDNN's AMX and AVX-512 paths, the interpreter's numpy dots): never bit-equality there."""
    assert got.shape == exact_fp64.shape, (what, got.shape, exact_fp64.shape)
    fl = kernel_floor_and_tolerance(twin_fp32, exact_fp64)
    err32, err64 = _maxabs(got, twin_fp32), _maxabs(got, exact_fp64)
    assert err32 <= fl["tol"] and err64 <= fl["tol"], (
        f"{what}: vs twin {err32:.3e}, vs fp64 {err64:.3e} > tol {fl['tol']:.3e} (floor {fl['floor']:.3e})")


def argmax_agreement(ref, test, tol: float) -> tuple[float, int]:
    """Argmax agreement over positions whose reference top-2 margin > 10*tol.

    ref, test: [T, V] (or [V]).  Returns (fraction agreeing among the included
    positions, number of excluded positions); the fraction is NaN when every
    position is excluded (so a vacuous check cannot pass as 1.0).
    """
    ref = ref.double().reshape(-1, ref.shape[-1])
    test = test.double().reshape(-1, test.shape[-1])
    top2 = ref.topk(2, dim=-1).values
    keep = (top2[:, 0] - top2[:, 1]) > 10.0 * tol
    excluded = int((~keep).sum())
    if not bool(keep.any()):
        return float("nan"), excluded
    agree = (ref.argmax(-1) == test.argmax(-1))[keep].double().mean()
    return float(agree), excluded


# ------------------------------------------------------------------ kernel oracles (fp64, from OPERATORS.md)


def experts_fp64(x, w, idx, w_in, w_up, w_down, b_in, b_down, layout, act, alpha, limit):
    """OPERATORS.md's routed experts, token by token and slot by slot, in fp64 (the floor's exact side)."""
    x, w_in, w_down, w = x.double(), w_in.double(), w_down.double(), w.double()
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t].tolist()):
            if layout == "separate":
                g, u = w_in[e] @ x[t], w_up[e].double() @ x[t]
            else:
                gu = w_in[e] @ x[t] + (0.0 if b_in is None else b_in[e].double())
                g, u = gu[0::2], gu[1::2]
            if act == "silu":
                h = g * torch.sigmoid(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = (u + 1.0) * g * torch.sigmoid(alpha * g)
            y = w_down[e] @ h + (0.0 if b_down is None else b_down[e].double())
            out[t] += w[t, j] * y
    return out


def shared_fp64(x, routed, w_gate, w_up, w_down, branch_gate):
    x = x.double()
    g, u = x @ w_gate.double().T, x @ w_up.double().T
    y = (g * torch.sigmoid(g) * u) @ w_down.double().T
    if branch_gate is not None:
        y = torch.sigmoid(x @ branch_gate.double().T) * y
    return routed.double() + y
