"""Miniature GGUF files with random weights, written with the ``gguf`` package's own writer and quantisers, in
llama.cpp's layout (for ``llama``: the Q/K rows permuted as llama.cpp's converter permutes them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# per-tensor encodings of a mixed file (the kinds a Q4_K_M file mixes, plus the 32-blocks)
MIXED = {
    "token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q4_1",
    "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q6_K",
}

MINI_LLAMA = {"vocab": 300, "d": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
              "eps": 1e-5, "theta": 10000.0, "context": 512}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation of Q/K rows: within each head, (half, index) -> (index, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the grid formats: the largest |w| / |d| their codes reach (grid value times the largest sub-block scale factor)
GRID_REACH = {"iq2_xxs": 43 * 15.5 * 0.25, "iq2_xs": 43 * 15.5 * 0.25, "iq2_s": 43 * 15.5 * 0.25,
              "iq3_xxs": 62 * 15.5 * 0.5, "iq3_s": 15 * 31, "iq1_s": 1.125 * 15, "iq1_m": 1.125 * 15}


def put_f16_scales(name: str, blocks: np.ndarray, draw, pick: np.ndarray | None = None) -> None:
    """Set the f16 scale fields of ``blocks`` (u8 ``[N, type_size]`` of encoding ``name``, in place) of the blocks
    ``pick`` selects (a bool mask; all by default) to ``draw(n)`` (n float16 values per field) — iq1_m's ``d``,
    spread over the top nibbles of its four u16 scale words, included."""
    from vxc.ir.ggml import ENCODINGS

    sel = np.arange(blocks.shape[0]) if pick is None else np.flatnonzero(pick)
    at = 0
    for field, width in ENCODINGS[name].fields:
        if field.endswith(":f16"):
            blocks[sel, at:at + 2] = np.asarray(draw(len(sel)), dtype=np.float16).reshape(-1, 1).view(np.uint8)
        at += width
    if name == "iq1_m":
        bits = np.asarray(draw(len(sel)), dtype=np.float16).view(np.uint16)
        words = blocks[sel, 48:56].copy().view(np.uint16)  # [n, 4]
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 15) << 12)
        blocks[sel, 48:56] = words.view(np.uint8)


def _quantized(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    import gguf

    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype)
    except NotImplementedError:
        # the package has no quantiser for this type: random blocks with sane f16 scales decode to the weights
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = w.shape
        raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
        # scales giving weights of trained magnitude (|w| up to ~0.1: sub-scales x codes reach ~1000 x d)
        scales = (rng.standard_normal((rows, cols // block, 1)) * 4e-4).astype(np.float16).view(np.uint8)
        if qtype.name == "Q6_K":  # d is the last 2 bytes; 16 int8 scales before it
            raw[..., -2:] = scales
            raw[..., -18:-2] = rng.integers(-20, 20, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        elif qtype.name == "Q3_K":  # d is the last 2 bytes (16 6-bit scales, less 32, before it)
            raw[..., -2:] = (scales.view(np.float16) * 3).view(np.uint8)
        elif qtype.name == "Q2_K":  # d, dmin the last 4 bytes (16 4-bit scale / min pairs first)
            raw[..., -4:-2] = (scales.view(np.float16) * 8).view(np.uint8)
            raw[..., -2:] = (rng.standard_normal((rows, cols // block, 1)) * 2e-4).astype(np.float16).view(np.uint8)
        elif qtype.name.lower() in GRID_REACH:  # d (iq1_m: spread over its scale words) for |w| up to ~0.1
            flat = raw.reshape(-1, type_size)
            put_f16_scales(qtype.name.lower(), flat, lambda n: rng.standard_normal(n) * (0.05 / GRID_REACH[qtype.name.lower()]))
        elif qtype.name in ("IQ4_NL", "IQ4_XS"):  # d first (codes reach +-127, iq4_xs's scales +-32 on top)
            raw[..., 0:2] = (scales.view(np.float16) / (4 if qtype.name == "IQ4_NL" else 64)).view(np.uint8)
        else:  # Q4_K / Q5_K: d, dmin first
            raw[..., 0:2] = scales
            raw[..., 2:4] = (rng.standard_normal((rows, cols // block, 1)) * 2e-4).astype(np.float16).view(np.uint8)
        return raw.reshape(rows, cols // block * type_size)


def write_llama_gguf(path: Path, cfg: dict = MINI_LLAMA, *, encodings: dict[str, str] | None = None, seed: int = 0,
                     arch: str = "llama", tied: bool = False, scale: float = 0.08) -> Path:
    import gguf

    enc = enc0 = dict(MIXED if encodings is None else encodings)
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    d, f, H, Hk, hd, V = cfg["d"], cfg["ffn"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["vocab"]
    w.add_name(path.stem)
    w.add_context_length(cfg["context"])
    w.add_embedding_length(d)
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(f)
    w.add_head_count(H)
    w.add_head_count_kv(Hk)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    moe = arch == "qwen3moe"
    if moe:  # what convert_hf_to_gguf's Qwen3MoeModel writes
        w.add_expert_count(cfg["experts"])
        w.add_expert_used_count(cfg["top_k"])
        w.add_expert_feed_forward_length(cfg["moe_ffn"])

    def add(name: str, arr: np.ndarray, kind: str | None) -> None:
        arr = arr.astype(np.float32)
        if kind is None or kind == "F32" or arr.ndim == 1:
            w.add_tensor(name, arr)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        q = _quantized(arr.reshape(-1, arr.shape[-1]), qtype, rng)  # an expert bank: its rows, expert after expert
        q = q.reshape(*arr.shape[:-1], q.shape[-1])
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * scale

    add("token_embd.weight", rng.standard_normal((V, d)) * 0.5, enc.get("token_embd"))
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        enc = {**enc0, **{k[len(p):]: v for k, v in enc0.items() if k.startswith(p)}}  # "blk.1.attn_output": that layer's
        add(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(d), None)
        q, k = mat(H * hd, d), mat(Hk * hd, d)
        if arch == "llama":
            q, k = _permute(q, H), _permute(k, Hk)
        add(p + "attn_q.weight", q, enc.get("attn_q"))
        add(p + "attn_k.weight", k, enc.get("attn_k"))
        add(p + "attn_v.weight", mat(Hk * hd, d), enc.get("attn_v"))
        if arch == "qwen2":  # q/k/v biases
            for n, rows in (("attn_q", H * hd), ("attn_k", Hk * hd), ("attn_v", Hk * hd)):
                add(p + n + ".bias", 0.1 * rng.standard_normal(rows), None)
        if arch in ("qwen3", "qwen3moe"):  # per-head q/k RMSNorms
            add(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(hd), None)
            add(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(hd), None)
        add(p + "attn_output.weight", mat(d, H * hd), enc.get("attn_output"))
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(d), None)
        if moe:  # the router (f32, as the converter keeps it) and the three expert banks [E, rows, cols]
            E, I = cfg["experts"], cfg["moe_ffn"]
            add(p + "ffn_gate_inp.weight", mat(E, d) * 4, None)
            add(p + "ffn_gate_exps.weight", rng.standard_normal((E, I, d)) * scale, enc.get("ffn_gate_exps"))
            add(p + "ffn_up_exps.weight", rng.standard_normal((E, I, d)) * scale, enc.get("ffn_up_exps"))
            add(p + "ffn_down_exps.weight", rng.standard_normal((E, d, I)) * scale, enc.get("ffn_down_exps"))
            continue
        add(p + "ffn_gate.weight", mat(f, d), enc.get("ffn_gate"))
        add(p + "ffn_up.weight", mat(f, d), enc.get("ffn_up"))
        add(p + "ffn_down.weight", mat(d, f), enc.get("ffn_down"))
    enc = enc0
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(d), None)
    if not tied:
        add("output.weight", mat(V, d), enc.get("output"))
    # a byte-level BPE vocabulary (transformers needs a tokenizer section to read the file's config)
    tokens = [f"<t{i}>" for i in range(V)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * V)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------- mamba2
#
# A transformers Mamba2ForCausalLM miniature written as llama.cpp's convert_hf_to_gguf.py (class Mamba2Model)
# writes it: the same metadata keys and values, the same tensor names, shapes and per-tensor types, the same
# tokenizer section (tests/gguf_convert_check.py compares the two files key by key and byte by byte).

# every width distinct and row lengths multiples of 32 (q8_0 / q4_0 blocks; the converter falls back to f16 for
# a row that is not): d_model 64, d_inner 128 = 16 heads x 8, state 12, 2 groups, conv 4 -> conv_dim 176,
# in_proj rows 320; vocab 301 (the token list padded to 304, the table not)
MINI_MAMBA2 = {
    "vocab_size": 301, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 16, "head_dim": 8, "expand": 2,
    "state_size": 12, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "use_bias": False, "use_conv_bias": True,
    "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 0, "initializer_range": 0.25,
}
MINI_MAMBA2_TOKENS = 290  # trained BPE vocabulary (<= the table's 301 rows)


def mamba2_hf_model(cfg: dict = MINI_MAMBA2, seed: int = 0):
    """A random Mamba2ForCausalLM (norms, A_log and dt_bias moved off their initial values: tests/hf_random)."""
    from tests.builders import hf_config
    from tests.hf_random import random_hf_model

    return random_hf_model(hf_config("mamba2", cfg), seed, norm_std=0.1, dt_bias="set")


def write_mamba2_hf_dir(out_dir: Path, cfg: dict = MINI_MAMBA2, seed: int = 0, tokens: int = MINI_MAMBA2_TOKENS):
    """The model (save_pretrained) and a trained byte-level BPE tokenizer in ``out_dir``; returns the model."""
    from tests.gguf_convert import write_bpe_tokenizer

    model = mamba2_hf_model(cfg, seed)
    model.save_pretrained(str(out_dir))
    write_bpe_tokenizer(out_dir, tokens)
    return model


# HF name (under backbone.layers.{i}.) -> the converter's GGUF name (under blk.{i}.)
_MAMBA2_NAMES = {
    "norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight", "mixer.in_proj.bias": "ssm_in.bias",
    "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d", "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight", "mixer.out_proj.bias": "ssm_out.bias",
}
_MAMBA2_TOP = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def mamba2_gguf_name(hf_name: str) -> str:
    if hf_name in _MAMBA2_TOP:
        return _MAMBA2_TOP[hf_name]
    parts = hf_name.split(".")
    assert parts[:2] == ["backbone", "layers"], hf_name
    return f"blk.{parts[2]}." + _MAMBA2_NAMES[".".join(parts[3:])]


def mamba2_gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array, transformed as Mamba2Model.modify_tensors does (torch f32 arithmetic): conv
    squeezed to [C, k], A_log -> A = -exp(A_log) and D as [H, 1], the gated norm as [groups, d_inner / groups]."""
    import torch

    cfg = model.config
    d_inner = cfg.expand * cfg.hidden_size
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g = mamba2_gguf_name(name)
        t = t.detach().to(torch.float32)
        if g.endswith("ssm_conv1d.weight"):
            t = t.squeeze()
        elif g.endswith(("ssm_a", "ssm_d")):
            t = t.reshape((*t.shape, 1))
        elif g.endswith("ssm_norm.weight"):
            t = t.reshape((cfg.n_groups, d_inner // cfg.n_groups))
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        out[g] = t.numpy()
    return out


def converter_qtype(name: str, shape: tuple[int, ...], outtype: str, override: dict[str, str] | None = None):
    """The ggml type convert_hf_to_gguf.py gives tensor ``name`` at ``--outtype`` (prepare_tensors): 1-D tensors,
    norms, the conv and every tensor whose name does not end in ``.weight`` stay F32; the others take the outtype,
    and a Q8_0 whose row is not whole blocks falls back to F16. ``override`` (short name -> type, e.g.
    ``{"ssm_in": "Q4_0"}``) replaces the outtype for the tensors that are quantised, as llama-quantize would."""
    import gguf

    T = gguf.GGMLQuantizationType
    short = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if len(shape) <= 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name or not name.endswith(".weight"):
        return T.F32
    kind = (override or {}).get(short) or {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[outtype]
    qt = T[kind]
    if qt not in (T.F32, T.F16, T.BF16):
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if shape[-1] % block:
            return T.F16  # gguf.QuantError -> "falling back to F16"
    return qt


def _gpt2_vocab(tokenizer_dir: Path, vocab_size: int):
    """The tokenizer section _set_vocab_gpt2 writes: tokens of the padded vocabulary ([PAD{i}] UNUSED where the
    tokenizer has no id), CONTROL for special added tokens, the merges, the special ids SpecialVocab finds."""
    import json as _json

    import gguf

    tj = _json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        vocab[a["content"]] = i
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if i in added and added[i].get("special") else
                         gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges


def write_mamba2_gguf(path: Path, model, tokenizer_dir: Path, outtype: str = "f32", *,
                      override: dict[str, str] | None = None, name: str = "Mamba2",
                      drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> Path:
    """``model`` (a Mamba2ForCausalLM) as ``convert_hf_to_gguf.py DIR --outtype OUTTYPE`` writes it (``override``:
    see :func:`converter_qtype`), the tokenizer from ``tokenizer_dir``'s tokenizer.json (pre-tokenizer ``gpt-2``,
    as tests/gguf_convert.py's wrapper maps an unknown hash). For refusal tests: ``drop`` leaves tensors out,
    ``extra`` adds f32 tensors."""
    import gguf

    cfg = model.config
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    d_inner = cfg.expand * cfg.hidden_size
    padded = -(cfg.vocab_size // -16) * 16  # set_vocab: pad_vocab_size_multiple (absent: 16)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    w = gguf.GGUFWriter(str(path), "mamba2")
    w.add_type("model")
    w.add_name(name)
    w.add_context_length(2**20)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(cfg.state_size)
    w.add_ssm_time_step_rank(d_inner // cfg.head_dim)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = _gpt2_vocab(Path(tokenizer_dir), padded)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, fn in (("eos_token_id", w.add_eos_token_id), ("bos_token_id", w.add_bos_token_id),
                    ("pad_token_id", w.add_pad_token_id)):
        v = getattr(cfg, key, None)
        if v is not None:
            fn(int(v))
    tensors = {k: v for k, v in mamba2_gguf_tensors(model).items() if k not in drop}
    tensors.update(extra or {})
    for gname, arr in tensors.items():
        qt = converter_qtype(gname, arr.shape, outtype, override)
        data = gguf.quants.quantize(arr, qt)
        w.add_tensor(gname, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------- references


def _gguf_arrays(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (ggml type name, the tensor decoded to f32 by gguf.quants.dequantize, in torch order)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = (t.tensor_type.name, np.ascontiguousarray(a).reshape(shape))
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's Q/K row permutation (:func:`_permute`)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_DECODER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_DECODER_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def hf_name_of(gguf_name: str, arch: str) -> str:
    """The transformers parameter a GGUF tensor of llama.cpp's converter came from (llama, qwen2, qwen3, mamba2)."""
    if arch == "mamba2":
        top = {v: k for k, v in _MAMBA2_TOP.items()}
        if gguf_name in top:
            return top[gguf_name]
        _, i, rest = gguf_name.split(".", 2)
        return f"backbone.layers.{i}." + {v: k for k, v in _MAMBA2_NAMES.items()}[rest]
    if gguf_name in _DECODER_TOP:
        return _DECODER_TOP[gguf_name]
    _, i, rest = gguf_name.split(".", 2)
    return f"model.layers.{i}." + _DECODER_NAMES[rest]


def reference_on_gguf_weights(model, gguf_path: Path, arch: str):
    """``model`` (the transformers checkpoint the file was converted from) with every parameter replaced by the
    file's decoded tensor, the converter's transforms undone (llama's Q/K permutation, mamba2's squeeze and
    reshapes) — the reference "on the dequantised weights". Checked on the way: every parameter comes from the
    file (a tied head from the embedding), and every F32 tensor is bit-equal to the converter-transformed original
    (mamba2's ``ssm_a`` is checked as ``-exp(A_log)`` and the original ``A_log`` kept). Returns (model copy,
    {ggml type: count})."""
    import copy

    import torch

    ref = copy.deepcopy(model).float()
    cfg = ref.config
    params = dict(ref.state_dict())
    arrays = _gguf_arrays(gguf_path)
    types: dict[str, int] = {}
    seen = set()
    for gname, (tname, a) in arrays.items():
        hname = hf_name_of(gname, arch)
        types[tname] = types.get(tname, 0) + 1
        orig = params[hname]
        t = torch.from_numpy(a)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            t = torch.from_numpy(_unpermute(a, heads))
        if gname.endswith(".ssm_a"):
            want = -torch.exp(orig.float())
            assert tname == "F32" and torch.equal(t.reshape(want.shape), want), f"{gname}: not -exp(A_log)"
            seen.add(hname)
            continue
        t = t.reshape(orig.shape)
        if tname == "F32":
            assert torch.equal(t, orig.float()), f"{gname} (F32) differs from {hname}"
        with torch.no_grad():
            params[hname].copy_(t)
        seen.add(hname)
    tied = getattr(cfg, "tie_word_embeddings", False)
    missing = sorted(set(params) - seen - ({"lm_head.weight"} if tied else set()))
    assert not missing, f"parameters the file does not hold: {missing}"
    if tied:
        ref.tie_weights()
    return ref.eval(), types


# ---------------------------------------------------------------------------------------------------- qwen3next

# Miniature Qwen3-Next for GGUF files: every quantised matrix's row whole 32-blocks (d 64, expert widths 32 / 64,
# value dim 4 x 32), Hv = 2 Hk, layers linear / full / linear / linear / full, MoE with a shared expert everywhere
# (llama.cpp's qwen3next loads no dense FFN)
MINI_Q3N = {
    "vocab_size": 301, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
MINI_Q3N_TOKENS = 290


def write_qwen3next_hf_dir(out_dir: Path, cfg: dict = MINI_Q3N, seed: int = 0, tokens: int = MINI_Q3N_TOKENS):
    """A random Qwen3NextForCausalLM (norms off their initial values, decay rates as tests/families/
    qwen3_next_support builds them) saved with a trained byte-level BPE tokenizer in ``out_dir``; returns it."""
    from tests.builders import HF_INITIALIZER_RANGE, hf_config
    from tests.gguf_convert import write_bpe_tokenizer
    from tests.hf_random import random_hf_model

    model = random_hf_model(hf_config("qwen3_next", {"initializer_range": HF_INITIALIZER_RANGE, **cfg}), seed,
                            norm_std=0.15, dt_bias="add")
    model.save_pretrained(str(out_dir))
    write_bpe_tokenizer(out_dir, tokens)
    return model


_Q3N_NAMES = {  # HF name under model.layers.{i}. -> GGUF name under blk.{i}. (in_proj_qkvz and the experts apart)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_Q3N_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}


def _qkvz_split(w, cfg):
    """Qwen3NextModel.modify_tensors' split of the per-key-head grouped in_proj_qkvz: (attn_qkv, attn_gate)."""
    import torch

    Dk, Dv, Hk, Hv, d = (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads,
                         cfg.linear_num_value_heads, cfg.hidden_size)
    sizes = [Dk, Dk, Hv // Hk * Dv, Hv // Hk * Dv]
    t = w.permute(1, 0).contiguous().view(-1, Hk, sum(sizes))
    q, k, v, z = torch.split(t, sizes, dim=-1)
    q, k, v, z = (x.contiguous().view(d, -1) for x in (q, k, v, z))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def _qkvz_join(qkv, z, cfg):
    """The inverse of :func:`_qkvz_split`: the grouped in_proj_qkvz from attn_qkv and attn_gate."""
    import torch

    Dk, Dv, Hk, Hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = Hv // Hk
    q, k, v = torch.split(qkv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=0)
    parts = [q.reshape(Hk, Dk, -1), k.reshape(Hk, Dk, -1), v.reshape(Hk, r * Dv, -1), z.reshape(Hk, r * Dv, -1)]
    return torch.cat(parts, dim=1).reshape(-1, qkv.shape[1])


def qwen3next_gguf_tensors(model, legacy: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> f32 array, as Qwen3NextModel.modify_tensors (and Qwen2MoeModel's expert split) make them
    (torch f32 arithmetic): A_log -> -exp(A_log), dt_bias -> ssm_dt.bias, the conv squeezed, every norm weight but
    the gated norm's + 1, in_proj_qkvz split into attn_qkv / attn_gate (``legacy``: kept grouped as ``ssm_in``),
    the fused gate_up bank split in two."""
    import torch

    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in _Q3N_TOP:
            g = _Q3N_TOP[name]
        else:
            parts = name.split(".")
            assert parts[:2] == ["model", "layers"], name
            i, rest = parts[2], ".".join(parts[3:])
            pre = f"blk.{i}."
            if rest == "linear_attn.in_proj_qkvz.weight":
                if legacy:
                    out[pre + "ssm_in.weight"] = t.numpy()
                else:
                    qkv, z = _qkvz_split(t, cfg)
                    out[pre + "attn_qkv.weight"], out[pre + "attn_gate.weight"] = qkv.numpy(), z.numpy()
                continue
            if rest == "mlp.experts.gate_up_proj":
                n = t.shape[-2] // 2
                out[pre + "ffn_gate_exps.weight"] = t[..., :n, :].contiguous().numpy()
                out[pre + "ffn_up_exps.weight"] = t[..., n:, :].contiguous().numpy()
                continue
            g = pre + _Q3N_NAMES[rest]
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        out[g] = t.numpy()
    return out


_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # the converter's FFN_GATE_INP(_SHEXP): F32


def write_qwen3next_gguf(path: Path, model, tokenizer_dir: Path, outtype: str = "f32", *,
                         override: dict[str, str] | None = None, legacy: bool = False, name: str = "Hf",
                         drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> Path:
    """``model`` (a Qwen3NextForCausalLM without MTP layers) as ``convert_hf_to_gguf.py DIR --outtype OUTTYPE
    --no-mtp`` writes it (``override``: see :func:`converter_qtype`; ``legacy``: the grouped ``ssm_in`` of older
    converters), the tokenizer from ``tokenizer_dir`` (pre-tokenizer ``gpt-2``). ``drop`` / ``extra``: for
    refusal tests."""
    import gguf

    cfg = model.config
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    w = gguf.GGUFWriter(str(path), "qwen3next")
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rp = cfg.rope_parameters
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(ftype)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    # (GGUFWriter.add_recurrent_layers of newer gguf-py: the key and its bool array, written by hand here)
    w.add_array("qwen3next.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types])
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", None) or 4)
    w.add_rope_dimension_count(int(cfg.head_dim * rp.get("partial_rotary_factor", 0.25)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types, merges = _gpt2_vocab(Path(tokenizer_dir), cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # SpecialVocab's order: a special token named in tokenizer_config.json (its id in the token list), else config.json
    import json as _json

    tc = _json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    for key, fn in (("eos", w.add_eos_token_id), ("bos", w.add_bos_token_id), ("pad", w.add_pad_token_id)):
        named = tc.get(f"{key}_token")
        v = tokens.index(named) if isinstance(named, str) and named in tokens else getattr(cfg, f"{key}_token_id", None)
        if v is not None:
            fn(int(v))
    tensors = {k: v for k, v in qwen3next_gguf_tensors(model, legacy).items() if k not in drop}
    tensors.update(extra or {})
    T = gguf.GGMLQuantizationType
    for gname, arr in tensors.items():
        qt = T.F32 if gname.endswith(_F32_ALWAYS) else converter_qtype(gname, arr.shape, outtype, override)
        w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def qwen3next_reference_on_gguf_weights(model, gguf_path: Path):
    """``model`` with every parameter replaced by the file's decoded tensor, the converter's transforms undone
    (attn_qkv / attn_gate joined back into the grouped in_proj_qkvz, the two expert banks joined). Checked on the
    way: every parameter comes from the file; every F32 tensor is bit-equal to the checkpoint's, through the
    converter's transform (a shifted norm's ``1 + w``: the value transformers' zero-centred norm computes in f32,
    so the checkpoint's ``w`` stays; ``ssm_a`` as ``-exp(A_log)``). Returns (model copy, {ggml type: count})."""
    import copy

    import torch

    ref = copy.deepcopy(model).float()
    cfg = ref.config
    params = dict(ref.state_dict())
    arrays = {k: (tn, torch.from_numpy(a)) for k, (tn, a) in _gguf_arrays(gguf_path).items()}
    types: dict[str, int] = {}
    for tn, _ in arrays.values():
        types[tn] = types.get(tn, 0) + 1
    inv_top = {v: k for k, v in _Q3N_TOP.items()}
    inv = {v: k for k, v in _Q3N_NAMES.items()}
    seen = set()

    def put(hname: str, t, exact: bool) -> None:
        orig = params[hname]
        t = t.reshape(orig.shape)
        if exact:
            assert torch.equal(t, orig.float()), f"{hname}: the file's F32 tensor differs from the checkpoint"
        with torch.no_grad():
            orig.copy_(t)
        seen.add(hname)

    for gname, (tn, t) in arrays.items():
        if gname in inv_top:
            hname = inv_top[gname]
        else:
            _, i, rest = gname.split(".", 2)
            pre = f"model.layers.{i}."
            if rest == "attn_qkv.weight":
                z_tn, z = arrays[f"blk.{i}.attn_gate.weight"]
                put(pre + "linear_attn.in_proj_qkvz.weight", _qkvz_join(t, z, cfg), tn == z_tn == "F32")
                continue
            if rest == "attn_gate.weight":
                continue
            if rest == "ssm_in.weight":
                put(pre + "linear_attn.in_proj_qkvz.weight", t, tn == "F32")
                continue
            if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                if rest == "ffn_gate_exps.weight":
                    u_tn, u = arrays[f"blk.{i}.ffn_up_exps.weight"]
                    put(pre + "mlp.experts.gate_up_proj", torch.cat([t, u], dim=-2), tn == u_tn == "F32")
                continue
            hname = pre + inv[rest]
        if gname.endswith(".ssm_a"):
            want = -torch.exp(params[hname].float())
            assert tn == "F32" and torch.equal(t.reshape(want.shape), want), f"{gname}: not -exp(A_log)"
            seen.add(hname)
            continue
        if hname.endswith("norm.weight") and not hname.endswith("linear_attn.norm.weight"):
            want = params[hname].float() + 1  # what the reference's (1 + w) is in f32, and what the file stores
            assert tn == "F32" and torch.equal(t.reshape(want.shape), want), f"{gname}: not 1 + w"
            seen.add(hname)
            continue
        put(hname, t, tn == "F32")
    missing = sorted(set(params) - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    assert not missing, f"parameters the file does not hold: {missing}"
    return ref.eval(), types
