"""GGUF files (llama.cpp's container): ``vxc lower model.gguf -o m.vxir``.

The container is read by :mod:`vxc.ir.gguf_container` (the ``gguf`` package; mmap, no full read). What is
family knowledge lives here: ``general.architecture`` picks the family, the metadata keys
(``{arch}.block_count``, ``{arch}.attention.head_count`` …) are its config, and llama.cpp's tensor names
(``token_embd``, ``blk.{i}.attn_q`` …) map to roles. Every tensor keeps its stored encoding: a
block-quantised tensor becomes an encoded operand (``q4_1(blocks $t)``), decoded by the runtime.

Families: ``llama`` (llama.cpp's converter permutes the rows of Q and K so that its rotary rotates adjacent
pairs: the attention is declared ``rotary_layout=interleaved`` over the weights as stored — no permutation is
undone), ``qwen2`` (q/k/v biases; rotary on halves, unpermuted), ``qwen3`` (q/k RMSNorms; halves).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..ir.gguf_container import Container, GGUFError, read
from ..ir.module import FileEntry, Module
from ..ir.roles import Role
from .common import Attrs, Builder, Checkpoint, FrontendError, Stored, op
from .decoder import rmsnorm, swiglu_op, two_norm_layer

FAMILIES = {
    # arch: (q/k/v biases, q/k norms, rotary layout of the stored Q/K rows)
    "llama": (False, False, "interleaved"),
    "qwen2": (True, False, "half"),
    "qwen3": (False, True, "half"),
}


def _nest(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """``{arch}.a.b`` keys as nested objects ``{"a": {"b": …}}``, so :class:`Attrs` reads them by dotted key."""
    out: dict[str, Any] = {}
    for k, v in metadata.items():
        if not k.startswith(arch + "."):
            continue
        node = out
        *path, last = k[len(arch) + 1:].split(".")
        for part in path:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            if not isinstance(node.get(last), dict):
                node[last] = v
    return out


def lower_gguf(path: Path, relative_to: Path | None = None) -> Module:
    try:
        c = read(path, path.name)
    except GGUFError as e:
        raise FrontendError(str(e)) from None
    arch = c.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise FrontendError(f"{path.name}: no general.architecture in the GGUF metadata")
    if arch not in FAMILIES:
        raise FrontendError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    return _lower_decoder(path, c, arch, relative_to)


def _builder(path: Path, c: Container, arch: str, relative_to: Path | None) -> Builder:
    files = [FileEntry("w0", path.name, c.size, c.header_sha256, format="gguf")]
    tensors = {e.name: Stored("w0", e.dtype, e.shape) for e in c.entries.values()}
    b = Builder(path.parent, "gguf", arch, c.header_sha256, relative_to, ckpt=Checkpoint(files, tensors))
    return b


def _lower_decoder(path: Path, c: Container, arch: str, relative_to: Path | None) -> Module:
    qkv_bias, qk_norm, layout = FAMILIES[arch]
    A = Attrs(_nest(c.metadata, arch), f"{path.name} (GGUF {arch} metadata)", prefix=arch + ".")
    d = A.need("embedding_length", kind=int, min=1)
    n_layer = A.layers("block_count")
    heads = A.need("attention.head_count", kind=int, min=1)
    kv = A.opt("attention.head_count_kv", kind=int)
    inter = A.need("feed_forward_length", kind=int, min=1)
    eps = A.need("attention.layer_norm_rms_epsilon", kind=float, min=0.0)
    hd = A.opt("attention.key_length", kind=int, min=1)
    vd = A.opt("attention.value_length", kind=int, min=1)
    b = _builder(path, c, arch, relative_to)
    defaults: set[str] = set()
    if kv is None:
        kv = heads
        defaults.add("kv_heads")
    if hd is None:
        hd = d // heads
        defaults.add("head_dim")
    if vd is not None and vd != hd:
        raise FrontendError(f"{A.where}: attention.value_length={vd} differs from key_length={hd} (not supported)")
    rdim = A.opt("rope.dimension_count", kind=int, min=0)
    base = A.opt("rope.freq_base", kind=float, min=0.0)
    scaling = A.raw("rope.scaling.type")
    if scaling not in (None, "none"):
        raise FrontendError(f"{A.where}: rope.scaling.type={scaling!r} is not supported for GGUF yet")
    rope = {"rotary_dim": hd if rdim is None else rdim, "rotary_base": 10000.0 if base is None else base,
            "rotary_layout": layout, "rope_type": "default"}
    rope_defaults = {"rope_type"} | ({"rotary_dim"} if rdim is None else set()) | ({"rotary_base"} if base is None else set())
    b.fact("rotary_layout_of_stored_rows", layout,
           "llama.cpp's converter permutes Q/K rows of llama for its adjacent-pair rotary" if layout == "interleaved"
           else f"llama.cpp's converter stores {arch} Q/K rows unpermuted (rotary on halves)")
    b.fact("vocab_from", "token_embd rows", "the embedding table's row count")
    emb_shape = _logical_shape(c, "token_embd.weight")
    if emb_shape is None:
        raise FrontendError(f"{path.name}: no token_embd.weight tensor")
    vocab = emb_shape[0]
    declared = A.opt("vocab_size", kind=int, min=1)
    if declared is not None and declared != vocab:
        raise FrontendError(f"{A.where}: vocab_size={declared} but token_embd.weight has {vocab} rows")

    def bind(key: str, role: Role, layer: int | None = None) -> None:
        e = c.entries.get(key)
        if e is None:
            return
        if e.encoding is None:
            b.bind(key, role, layer)
        else:
            b.bind_encoded(e.encoding, {"blocks": key}, role, layer, dtype="f32")

    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, role in (("attn_q.weight", Role.AttnQ), ("attn_k.weight", Role.AttnK), ("attn_v.weight", Role.AttnV),
                           ("attn_output.weight", Role.AttnO), ("attn_q.bias", Role.AttnQBias),
                           ("attn_k.bias", Role.AttnKBias), ("attn_v.bias", Role.AttnVBias),
                           ("attn_q_norm.weight", Role.AttnQNorm), ("attn_k_norm.weight", Role.AttnKNorm),
                           ("attn_norm.weight", Role.PreAttentionNorm), ("ffn_norm.weight", Role.PreFfnNorm),
                           ("ffn_gate.weight", Role.FfnGate), ("ffn_up.weight", Role.FfnUp), ("ffn_down.weight", Role.FfnDown)):
            bind(p + name, role, i)
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": qkv_bias, "k_bias": qkv_bias,
                 "v_bias": qkv_bias, "o_bias": False, "qk_norm": qk_norm}
        ad = set(defaults) | {"o_bias"}
        if qk_norm:
            attrs["qk_norm_eps"], attrs["qk_norm_zero_centred"] = eps, False
            ad |= {"qk_norm_zero_centred"}
        attrs.update({"sinks": False, "output_gate": False, "window": 0, "scale": 1.0 / math.sqrt(hd)})
        ad |= {"sinks", "output_gate", "window", "scale"}
        attrs.update(rope)
        ad |= rope_defaults
        layers.append(two_norm_layer(i, d, (eps, False), op("softmax", attrs, ad), swiglu_op(d, inter, {"act"})))
    bind("token_embd.weight", Role.Embedding)
    bind("output_norm.weight", Role.FinalNorm)
    tied = "output.weight" not in c.entries
    bind("output.weight", Role.LmHead)
    b.fact("head_tied", tied, "no output.weight: the head reads token_embd" if tied else "output.weight is stored")
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    head = op("head", {"tied": tied, "padded_vocab": vocab, "dim": d})
    name = path.stem
    return b.module(name, "f32", emb, layers, rmsnorm(d, eps, False, Role.FinalNorm), head)


def _logical_shape(c: Container, key: str) -> tuple[int, ...] | None:
    e = c.entries.get(key)
    if e is None:
        return None
    if e.encoding is None:
        return e.shape
    from ..ir.ggml import logical_cols

    return e.shape[:-1] + (logical_cols(e.encoding, e.shape[-1]),)
