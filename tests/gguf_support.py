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
        else:  # Q4_K / Q5_K / Q2_K-style: d, dmin first
            raw[..., 0:2] = scales
            raw[..., 2:4] = (rng.standard_normal((rows, cols // block, 1)) * 2e-4).astype(np.float16).view(np.uint8)
        return raw.reshape(rows, cols // block * type_size)


def write_llama_gguf(path: Path, cfg: dict = MINI_LLAMA, *, encodings: dict[str, str] | None = None, seed: int = 0,
                     arch: str = "llama", tied: bool = False, scale: float = 0.08) -> Path:
    import gguf

    enc = dict(MIXED if encodings is None else encodings)
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

    def add(name: str, arr: np.ndarray, kind: str | None) -> None:
        arr = arr.astype(np.float32)
        if kind is None or kind == "F32" or arr.ndim == 1:
            w.add_tensor(name, arr)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        q = _quantized(arr, qtype, rng)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * scale

    add("token_embd.weight", rng.standard_normal((V, d)) * 0.5, enc.get("token_embd"))
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
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
        if arch == "qwen3":  # per-head q/k RMSNorms
            add(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(hd), None)
            add(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(hd), None)
        add(p + "attn_output.weight", mat(d, H * hd), enc.get("attn_output"))
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(d), None)
        add(p + "ffn_gate.weight", mat(f, d), enc.get("ffn_gate"))
        add(p + "ffn_up.weight", mat(f, d), enc.get("ffn_up"))
        add(p + "ffn_down.weight", mat(d, f), enc.get("ffn_down"))
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
