"""GGUF files (llama.cpp's container): ``vxc lower model.gguf -o m.vxir``.

The container is read by :mod:`vxc.ir.gguf_container` (the ``gguf`` package; mmap, no full read). What is
family knowledge lives here: ``general.architecture`` picks the family, the metadata keys
(``{arch}.block_count``, ``{arch}.attention.head_count`` …) are its config, and llama.cpp's tensor names
(``token_embd``, ``blk.{i}.attn_q`` …) map to roles. Every tensor keeps its stored encoding: a
block-quantised tensor becomes an encoded operand (``q4_1(blocks $t)``), decoded by the runtime.

Families: ``llama`` (llama.cpp's converter permutes the rows of Q and K so that its rotary rotates adjacent
pairs: the attention is declared ``rotary_layout=interleaved`` over the weights as stored — no permutation is
undone), ``qwen2`` (q/k/v biases; rotary on halves, unpermuted), ``qwen3`` (q/k RMSNorms; halves),
``qwen3moe`` (qwen3's attention; every FFN routed experts, softmax top-k renormalised as llama.cpp's graph
does, the three expert banks ``ffn_{gate,up,down}_exps`` [E, rows, cols] bound encoded), ``mamba2``
(pure Mamba2 stack, :func:`_lower_mamba2`: the converter's ``Mamba2Model`` stores ``ssm_a = -exp(A_log)`` —
read back through the ``log_neg`` view — and reshapes D, A to ``[heads, 1]``, the gated norm to
``[groups, d_inner / groups]`` and squeezes the conv to ``[conv_dim, kernel]``; reshape views undo those).

``gemma3`` (:func:`_lower_gemma3`: sandwich norms stored as ``1 + w``, the scaled embedding, GeGLU, 5:1
sliding-window layers with llama.cpp's settings the file does not store, declared and marked).

``qwen3next`` (:func:`_lower_qwen3next`: gated-delta layers with the converter's split ``attn_qkv`` / ``attn_gate``
— or a legacy file's grouped ``ssm_in`` — output-gated softmax layers, an MoE with a sigmoid-gated shared expert on
every layer; the zero-centred norms stored as ``1 + w``).

``kimi-linear`` (:func:`_lower_kimi_linear`: KDA layers and NoPE MLA layers by ``attention.head_count_kv`` per layer,
the converter's split ``attn_k_b`` (transposed) / ``attn_v_b`` bound as the fused up-projection through a ``concat``
view; a leading dense FFN, then the grouped sigmoid MoE with its selection bias and shared experts).

Every tensor of the file is either bound to a role here or left unbound, and closure names each unbound one
(``tensor blk.0.ssm_x.weight … is claimed by no role``): nothing in a file is skipped silently.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..ir.gguf_container import Container, GGUFError, read
from ..ir.module import FileEntry, Layer, Module, Transform
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, Checkpoint, FrontendError, Stored, op
from .decoder import rmsnorm, swiglu_op, two_norm_layer
from .mamba_ssm import mamba2_op

FAMILIES = {
    # arch: (q/k/v biases, q/k norms, rotary layout of the stored Q/K rows)
    "llama": (False, False, "interleaved"),
    "qwen2": (True, False, "half"),
    "qwen3": (False, True, "half"),
    "qwen3moe": (False, True, "half"),  # qwen3's attention; every layer's FFN an MoE (_moe_ffn)
}
SSM_FAMILIES = ("mamba2",)
OTHER_FAMILIES = ("gemma3", "qwen3next", "kimi-linear")


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
    if arch == "mamba2":
        return _lower_mamba2(path, c, relative_to)
    if arch == "gemma3":
        return _lower_gemma3(path, c, relative_to)
    if arch == "qwen3next":
        return _lower_qwen3next(path, c, relative_to)
    if arch == "kimi-linear":
        return _lower_kimi_linear(path, c, relative_to)
    if arch not in FAMILIES:
        raise FrontendError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
                            f"{', '.join([*FAMILIES, *OTHER_FAMILIES, *SSM_FAMILIES])}")
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

    bind = _binder(b, c)
    moe = _moe_ffn(A, b, d) if arch == "qwen3moe" else None

    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, role in (("attn_q.weight", Role.AttnQ), ("attn_k.weight", Role.AttnK), ("attn_v.weight", Role.AttnV),
                           ("attn_output.weight", Role.AttnO), ("attn_q.bias", Role.AttnQBias),
                           ("attn_k.bias", Role.AttnKBias), ("attn_v.bias", Role.AttnVBias),
                           ("attn_q_norm.weight", Role.AttnQNorm), ("attn_k_norm.weight", Role.AttnKNorm),
                           ("attn_norm.weight", Role.PreAttentionNorm), ("ffn_norm.weight", Role.PreFfnNorm),
                           ("ffn_gate.weight", Role.FfnGate), ("ffn_up.weight", Role.FfnUp), ("ffn_down.weight", Role.FfnDown),
                           # qwen3moe: the router and the expert banks (ggml's [E, rows, cols] tensors, each encoded)
                           ("ffn_gate_inp.weight", Role.MoeRouterWeight), ("ffn_gate_exps.weight", Role.PerExpertGate),
                           ("ffn_up_exps.weight", Role.PerExpertUp), ("ffn_down_exps.weight", Role.PerExpertDown)):
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
        ffn = op("moe", dict(moe.attrs), set(moe.defaults)) if moe is not None else swiglu_op(d, inter, {"act"})
        layers.append(two_norm_layer(i, d, (eps, False), op("softmax", attrs, ad), ffn))
    return _finish(b, c, bind, path.stem, vocab, d, eps, layers)


def _moe_ffn(A: Attrs, b: Builder, d: int, arch: str = "qwen3moe"):
    """qwen3moe's FFN (llama.cpp src/models/qwen3moe.cpp: build_moe_ffn with LLM_FFN_SILU, norm_w = true, softmax
    gating): softmax over all experts -> top-k -> renormalised; SwiGLU experts of expert_feed_forward_length; no
    shared expert. Every layer is MoE (the architecture has no dense layers)."""
    E = A.need("expert_count", kind=int, min=1)
    k = A.need("expert_used_count", kind=int, min=1)
    inter = A.need("expert_feed_forward_length", kind=int, min=1)
    if k > E:
        raise FrontendError(f"{A.where}: expert_used_count={k} exceeds expert_count={E}")
    b.fact("moe_renormalise", True, f"llama.cpp's {arch} graph renormalises the top-k weights (build_moe_ffn "
                                    "norm_w = true); the file does not store it")
    attrs = {"d_model": d, "experts": E, "top_k": k, "intermediate": inter, "router": "softmax_topk",
             "norm_topk_prob": True, "routed_scaling": 1.0, "n_group": 1, "topk_group": 1, "router_bias": False,
             "selection_bias": False, "expert_layout": "separate", "expert_bias": False, "act": "silu",
             "shared_experts": False, "shared_intermediate": 0, "shared_gate": False}
    defaults = {"router", "norm_topk_prob", "routed_scaling", "n_group", "topk_group", "router_bias", "selection_bias",
                "expert_layout", "expert_bias", "act", "shared_experts", "shared_intermediate", "shared_gate"}
    return op("moe", attrs, defaults)


def _finish(b: Builder, c: Container, bind, name: str, vocab: int, d: int, eps: float, layers: list,
            embedding_scale: float | None = None) -> Module:
    """The embedding, final norm and head (tied when the file stores no ``output.weight``) around ``layers``."""
    bind("token_embd.weight", Role.Embedding)
    bind("output_norm.weight", Role.FinalNorm)
    tied = "output.weight" not in c.entries
    bind("output.weight", Role.LmHead)
    b.fact("head_tied", tied, "no output.weight: the head reads token_embd" if tied else "output.weight is stored")
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d,
                           **({} if embedding_scale is None else {"scale": embedding_scale})})
    head = op("head", {"tied": tied, "padded_vocab": vocab, "dim": d})
    return b.module(name, "f32", emb, layers, rmsnorm(d, eps, False, Role.FinalNorm), head)


def _attention_geometry(path: Path, c: Container, arch: str) -> tuple[Attrs, int, int, int, int, float, int]:
    """The metadata reader and the sizes every attention family stores: (A, embedding_length, block_count,
    head_count, head_count_kv, rms eps, key_length), value_length refused where it differs from key_length."""
    A = Attrs(_nest(c.metadata, arch), f"{path.name} (GGUF {arch} metadata)", prefix=arch + ".")
    d = A.need("embedding_length", kind=int, min=1)
    n_layer = A.layers("block_count")
    heads = A.need("attention.head_count", kind=int, min=1)
    kv = A.need("attention.head_count_kv", kind=int, min=1)
    eps = A.need("attention.layer_norm_rms_epsilon", kind=float, min=0.0)
    hd = A.need("attention.key_length", kind=int, min=1)
    vd = A.opt("attention.value_length", kind=int, min=1)
    if vd is not None and vd != hd:
        raise FrontendError(f"{A.where}: attention.value_length={vd} differs from key_length={hd} (not supported)")
    return A, d, n_layer, heads, kv, eps, hd


# llama.cpp's gemma3 tensor names -> roles (a sandwich layer: four norms)
_GEMMA3_TENSORS = {
    "attn_q.weight": Role.AttnQ, "attn_k.weight": Role.AttnK, "attn_v.weight": Role.AttnV,
    "attn_output.weight": Role.AttnO, "attn_q_norm.weight": Role.AttnQNorm, "attn_k_norm.weight": Role.AttnKNorm,
    "attn_norm.weight": Role.PreAttentionNorm, "post_attention_norm.weight": Role.PostAttentionNorm,
    "ffn_norm.weight": Role.PreFfnNorm, "post_ffw_norm.weight": Role.PostFfnNorm,
    "ffn_gate.weight": Role.FfnGate, "ffn_up.weight": Role.FfnUp, "ffn_down.weight": Role.FfnDown,
}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp llama-model.cpp LLM_ARCH_GEMMA3: hparams.set_swa_pattern(6)
_GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3 (not stored in the file)
_GEMMA3_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B: the one size whose attention scale is (n_embd / n_head)^-1/2


def _lower_gemma3(path: Path, c: Container, relative_to: Path | None) -> Module:
    """``general.architecture = gemma3``, as llama.cpp's converter writes it and llama.cpp runs it.

    Declared from llama.cpp's gemma3 graph: the converter stores every norm weight as ``1 + w`` (so the norms,
    q/k norms included, are plain RMSNorms over the stored weight); the embedding rows are scaled by
    √embedding_length; sandwich layers (attn_norm → attention → post_attention_norm, ffn_norm → GeGLU →
    post_ffw_norm); GELU with the tanh approximation; rotary on halves (NEOX) of the whole head; every sixth
    layer full attention, the others a window of ``attention.sliding_window`` keys with rotary base 10000, the full
    layers ``rope.freq_base``; attention scale ``key_length^-½`` (``(embedding_length / head_count)^-½`` for the
    62-layer 27B). The file stores none of the pattern, the local base or the scale: they are filled in, marked."""
    arch = "gemma3"
    A, d, n_layer, heads, kv, eps, hd = _attention_geometry(path, c, arch)
    inter = A.need("feed_forward_length", kind=int, min=1)
    window = A.need("attention.sliding_window", kind=int, min=1)
    base = A.need("rope.freq_base", kind=float, min=0.0)
    scaling = A.raw("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise FrontendError(f"{A.where}: rope.scaling.type={scaling!r} is not supported (none, linear)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if A.raw(key) is not None:
            raise FrontendError(f"{A.where}: {key}={A.raw(key)!r} is not supported (no operator declares soft-capping)")
    b = _builder(path, c, arch, relative_to)
    emb_shape = _logical_shape(c, "token_embd.weight")
    if emb_shape is None:
        raise FrontendError(f"{path.name}: no token_embd.weight tensor")
    vocab = emb_shape[0]
    b.fact("vocab_from", "token_embd rows", "the embedding table's row count")
    b.fact("norm_weights_stored_as", "1 + w", "convert_hf_to_gguf Gemma3Model adds 1 to every norm weight: plain RMSNorms")
    b.fact("layer_map", f"every {_GEMMA3_SWA_PATTERN}th layer full",
           "llama.cpp LLM_ARCH_GEMMA3 set_swa_pattern(6); the file does not store it")
    b.fact("rotary_base_sliding", _GEMMA3_LOCAL_THETA, "llama.cpp's gemma3 local rope base; the file does not store it")
    qpas = d / heads if n_layer == _GEMMA3_27B_LAYERS else hd
    full_rope = {"rotary_dim": hd, "rotary_base": base, "rotary_layout": "half", "rope_type": "default"}
    if scaling == "linear":
        full_rope.update(rope_type="linear", rope_factor=A.need("rope.scaling.factor", kind=float, min=0.0))
    local_rope = {"rotary_dim": hd, "rotary_base": _GEMMA3_LOCAL_THETA, "rotary_layout": "half", "rope_type": "default"}
    bind = _binder(b, c)
    layers = []
    for i in range(n_layer):
        for name, role in _GEMMA3_TENSORS.items():
            bind(f"blk.{i}.{name}", role, i)
        sliding = (i + 1) % _GEMMA3_SWA_PATTERN != 0
        attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": False, "k_bias": False,
                 "v_bias": False, "o_bias": False, "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": False,
                 "sinks": False, "output_gate": False, "window": window if sliding else 0,
                 "scale": 1.0 / math.sqrt(qpas), **(local_rope if sliding else full_rope)}
        ad = {"q_bias", "k_bias", "v_bias", "o_bias", "qk_norm_zero_centred", "sinks", "output_gate", "window", "scale",
              "rotary_dim", "rotary_layout", "rope_type"} | ({"rotary_base"} if sliding else set())
        ffn = swiglu_op(d, inter, {"act"})
        ffn.attrs["act"] = "gelu_tanh"
        norms = [rmsnorm(d, eps, False, role)
                 for role in (Role.PreAttentionNorm, Role.PostAttentionNorm, Role.PreFfnNorm, Role.PostFfnNorm)]
        layers.append(Layer(i, "compute", Placement.PrePost, norms, op("softmax", attrs, ad), ffn))
    return _finish(b, c, bind, path.stem, vocab, d, eps, layers, embedding_scale=math.sqrt(d))


# llama.cpp's qwen3next tensor names (gguf-py MODEL_ARCH.QWEN3NEXT, as convert_hf_to_gguf's Qwen3NextModel writes
# them) -> roles, by layer kind; the FFN's are every layer's
_Q3N_ATTN = {
    "attn_k.weight": Role.AttnK, "attn_v.weight": Role.AttnV, "attn_output.weight": Role.AttnO,
    "attn_q_norm.weight": Role.AttnQNorm, "attn_k_norm.weight": Role.AttnKNorm,
}
_Q3N_DELTA = {
    "ssm_dt.bias": Role.LinearAttnDtBias, "ssm_norm.weight": Role.LinearAttnNorm, "ssm_out.weight": Role.LinearAttnOutProj,
}
_Q3N_FFN = {
    "attn_norm.weight": Role.PreAttentionNorm, "post_attention_norm.weight": Role.PreFfnNorm,
    "ffn_gate_inp.weight": Role.MoeRouterWeight, "ffn_gate_exps.weight": Role.PerExpertGate,
    "ffn_up_exps.weight": Role.PerExpertUp, "ffn_down_exps.weight": Role.PerExpertDown,
    "ffn_gate_shexp.weight": Role.SharedExpertGate, "ffn_up_shexp.weight": Role.SharedExpertUp,
    "ffn_down_shexp.weight": Role.SharedExpertDown, "ffn_gate_inp_shexp.weight": Role.SharedExpertBranchGate,
}
_Q3N_DELTA_CHUNK = 64  # how the gated-delta prefill is blocked (the transformers reference's chunk), not what it computes
_Q3N_L2_EPS = 1e-6  # the reference's l2norm eps on q and k (llama.cpp: the file's rms eps, max(|x|, eps) form)
_Q3N_INTERVAL = 4  # llama.cpp's default full_attention_interval when the file stores neither it nor recurrent_layers


def _lower_qwen3next(path: Path, c: Container, relative_to: Path | None) -> Module:
    """``general.architecture = qwen3next`` (Qwen3-Next), as llama.cpp's converter writes it and llama.cpp's
    ``qwen3next`` graph runs it.

    - Layer map: ``attention.recurrent_layers`` (one bool per layer) when stored, else softmax on the layers i with
      (i+1) % ``full_attention_interval`` == 0 (4 when absent), as llama.cpp reads them.
    - Gated delta (``ssm.*``: state_size = key head dim, group_count = key heads, time_step_rank = value heads,
      inner_size = value heads x value head dim): the converter splits the checkpoint's per-key-head grouped
      ``in_proj_qkvz`` into ``attn_qkv`` (q of all heads | k | v) and ``attn_gate`` (z), bound as they are; a
      legacy file's grouped ``ssm_in`` is bound through gather views instead. ``ssm_ba`` keeps the grouping
      (``b r | a r`` per key head, r = value heads / key heads): gather views. ``ssm_a = -exp(A_log)`` (read back
      through ``log_neg``), the conv squeezed to ``[channels, kernel]``, ``ssm_norm`` one head's weight (as
      stored: the converter adds 1 to no gated-norm weight). Conv SiLU, q/k l2-normalised, q scaled by Dk^-½,
      normalise-then-gate with silu(z).
    - Softmax: ``attn_q`` emits query and gate per head (``[H, 2·Dh]``): gather views bind AttnQ and
      AttnOutputGate; per-head q/k RMSNorms; partial rotary (``rope.dimension_count``) on halves;
      ``attn · σ(gate)`` before ``attn_output``.
    - Every RMSNorm but the gated one is zero-centred in the checkpoint; the converter stores ``1 + w``, so they
      are plain RMSNorms over the stored weight.
    - FFN on every layer: softmax over all experts → top-k → renormalised (llama.cpp always renormalises); SwiGLU
      expert banks ``[E, rows, cols]``; a shared SwiGLU expert of ``expert_shared_feed_forward_length`` scaled by
      σ(x·``ffn_gate_inp_shexp``)."""
    arch = "qwen3next"
    A, d, n_layer, heads, kv, eps, hd = _attention_geometry(path, c, arch)
    K = A.need("ssm.conv_kernel", kind=int, min=1)
    Dk = A.need("ssm.state_size", kind=int, min=1)
    Hk = A.need("ssm.group_count", kind=int, min=1)
    Hv = A.need("ssm.time_step_rank", kind=int, min=1)
    inner = A.need("ssm.inner_size", kind=int, min=1)
    if Hv % Hk:
        raise FrontendError(f"{A.where}: ssm.time_step_rank={Hv} (value heads) is not a multiple of "
                            f"ssm.group_count={Hk} (key heads)")
    if inner % Hv:
        raise FrontendError(f"{A.where}: ssm.inner_size={inner} is not a multiple of ssm.time_step_rank={Hv} "
                            f"(the value heads)")
    Dv, r = inner // Hv, Hv // Hk
    mtp = A.opt("nextn_predict_layers", kind=int, min=0)
    if mtp:
        raise FrontendError(f"{A.where}: nextn_predict_layers={mtp}: the file holds multi-token-prediction layers, "
                            f"which no operator declares (convert with convert_hf_to_gguf.py --no-mtp)")
    if A.raw("rope.scaling.type") not in (None, "none"):
        raise FrontendError(f"{A.where}: rope.scaling.type={A.raw('rope.scaling.type')!r} is not supported for GGUF yet")
    base = A.need("rope.freq_base", kind=float, min=0.0)
    rdim = A.need("rope.dimension_count", kind=int, min=0)
    if rdim > hd or rdim % 2:
        raise FrontendError(f"{A.where}: rope.dimension_count={rdim} must be even and at most key_length={hd}")
    b = _builder(path, c, arch, relative_to)
    recurrent = A.raw("attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < n_layer or not all(isinstance(x, bool) for x in recurrent):
            raise FrontendError(f"{A.where}: attention.recurrent_layers must hold a bool for each of the {n_layer} "
                                f"layers, got {recurrent!r:.80}")
        kinds = ["delta" if recurrent[i] else "softmax" for i in range(n_layer)]
        b.fact("layer_map_read_from", "attention.recurrent_layers", "one bool per layer, as llama.cpp reads it first")
    else:
        interval = A.opt("full_attention_interval", kind=int, min=1)
        b.fact("layer_map_read_from", "full_attention_interval",
               f"{'no recurrent_layers and no full_attention_interval: llama.cpp' + chr(39) + 's default ' if interval is None else ''}"
               f"{interval or _Q3N_INTERVAL}; softmax on layers i with (i+1) % interval == 0")
        kinds = ["delta" if (i + 1) % (interval or _Q3N_INTERVAL) else "softmax" for i in range(n_layer)]
    emb_shape = _logical_shape(c, "token_embd.weight")
    if emb_shape is None:
        raise FrontendError(f"{path.name}: no token_embd.weight tensor")
    vocab = emb_shape[0]
    b.fact("vocab_from", "token_embd rows", "the embedding table's row count")
    b.fact("norm_weights_stored_as", "1 + w", "convert_hf_to_gguf Qwen3NextModel adds 1 to every norm weight but "
           "the gated norm's: plain RMSNorms")
    b.fact("ssm_a_stored_as", "-exp(A_log)", "convert_hf_to_gguf Qwen3NextModel: A_log --> -exp(A_log); the operand "
           "reads it back through log_neg")
    delta_attrs = {"d_model": d, "k_heads": Hk, "v_heads": Hv, "k_head_dim": Dk, "v_head_dim": Dv, "conv_kernel": K,
                   "conv_act": "silu", "chunk_size": _Q3N_DELTA_CHUNK, "scale": 1.0 / math.sqrt(Dk),
                   "l2_eps": _Q3N_L2_EPS, "norm_eps": eps, "norm_order": "norm_then_gate", "norm_act": "silu"}
    delta_defaults = {"conv_act", "chunk_size", "scale", "l2_eps", "norm_order", "norm_act"}
    attn_attrs = {"d_model": d, "heads": heads, "kv_heads": kv, "head_dim": hd, "q_bias": False, "k_bias": False,
                  "v_bias": False, "o_bias": False, "qk_norm": True, "qk_norm_eps": eps, "qk_norm_zero_centred": False,
                  "sinks": False, "output_gate": True, "window": 0, "scale": 1.0 / math.sqrt(hd),
                  "rotary_dim": rdim, "rotary_base": base, "rotary_layout": "half", "rope_type": "default"}
    attn_defaults = {"q_bias", "k_bias", "v_bias", "o_bias", "qk_norm_zero_centred", "sinks", "window", "scale",
                     "rotary_layout", "rope_type"}
    moe = _moe_ffn(A, b, d, arch)
    shared = A.need("expert_shared_feed_forward_length", kind=int, min=1)
    moe.attrs.update(shared_experts=True, shared_intermediate=shared, shared_gate=True)
    moe.defaults -= {"shared_experts", "shared_intermediate"}
    bind = _binder(b, c)

    def grouped(*takes: tuple[int, int]) -> list[Transform]:
        return [Transform("gather", dim=0, groups=Hk, takes=list(takes))]

    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, role in _Q3N_FFN.items():
            bind(p + name, role, i)
        if kinds[i] == "delta":
            for name, role in _Q3N_DELTA.items():
                bind(p + name, role, i)
            if p + "ssm_in.weight" in c.entries:  # legacy: the checkpoint's grouped in_proj_qkvz as stored
                qkvz = p + "ssm_in.weight"
                group = 2 * Dk + 2 * r * Dv
                bind(qkvz, Role.LinearAttnInProjQkv, i, grouped((0, Dk), (Dk, 2 * Dk), (2 * Dk, 2 * Dk + r * Dv)))
                bind(qkvz, Role.LinearAttnInProjZ, i, grouped((2 * Dk + r * Dv, group)))
            else:
                bind(p + "attn_qkv.weight", Role.LinearAttnInProjQkv, i)
                bind(p + "attn_gate.weight", Role.LinearAttnInProjZ, i)
            bind(p + "ssm_ba.weight", Role.LinearAttnInProjB, i, grouped((0, r)))
            bind(p + "ssm_ba.weight", Role.LinearAttnInProjA, i, grouped((r, 2 * r)))
            bind(p + "ssm_conv1d.weight", Role.LinearAttnConv1d, i,
                 _reshape_to(c, p + "ssm_conv1d.weight", (2 * Hk * Dk + Hv * Dv, K)))
            bind(p + "ssm_a", Role.LinearAttnALog, i, [*_reshape_to(c, p + "ssm_a", (Hv,)), Transform("log_neg")])
            mixer = op("gated_delta", dict(delta_attrs), set(delta_defaults))
        else:
            for name, role in _Q3N_ATTN.items():
                bind(p + name, role, i)
            q = p + "attn_q.weight"
            bind(q, Role.AttnQ, i, [Transform("gather", dim=0, groups=heads, takes=[(0, hd)])])
            bind(q, Role.AttnOutputGate, i, [Transform("gather", dim=0, groups=heads, takes=[(hd, 2 * hd)])])
            mixer = op("softmax", dict(attn_attrs), set(attn_defaults))
        ffn = op("moe", dict(moe.attrs), set(moe.defaults))
        layers.append(two_norm_layer(i, d, (eps, False), mixer, ffn))
    return _finish(b, c, bind, path.stem, vocab, d, eps, layers)


# llama.cpp's kimi-linear tensor names (gguf-py MODEL_ARCH.KIMI_LINEAR, as convert_hf_to_gguf's KimiLinearModel writes
# them) -> roles, by layer kind
_KIMI_KDA = {
    "attn_q.weight": Role.KdaQProj, "attn_k.weight": Role.KdaKProj, "attn_v.weight": Role.KdaVProj,
    "ssm_f_a.weight": Role.KdaFAProj, "ssm_f_b.weight": Role.KdaFBProj, "ssm_beta.weight": Role.KdaBProj,
    "ssm_g_a.weight": Role.KdaGAProj, "ssm_g_b.weight": Role.KdaGBProj, "ssm_norm.weight": Role.KdaONorm,
    "attn_output.weight": Role.KdaOutProj, "ssm_dt.bias": Role.KdaDtBias,
}
_KIMI_MLA = {
    "attn_q.weight": Role.MlaQProj, "attn_q_a.weight": Role.MlaQAProj, "attn_q_a_norm.weight": Role.MlaQANorm,
    "attn_q_b.weight": Role.MlaQBProj, "attn_kv_a_mqa.weight": Role.MlaKvAProj, "attn_kv_a_norm.weight": Role.MlaKvANorm,
    "attn_kv_b.weight": Role.MlaKvBProj, "attn_output.weight": Role.MlaOutProj,
}
_KIMI_FFN = {
    "attn_norm.weight": Role.PreAttentionNorm, "ffn_norm.weight": Role.PreFfnNorm,
    "ffn_gate.weight": Role.FfnGate, "ffn_up.weight": Role.FfnUp, "ffn_down.weight": Role.FfnDown,
    "ffn_gate_inp.weight": Role.MoeRouterWeight, "exp_probs_b.bias": Role.MoeRouterSelectionBias,
    "ffn_gate_exps.weight": Role.PerExpertGate, "ffn_up_exps.weight": Role.PerExpertUp,
    "ffn_down_exps.weight": Role.PerExpertDown, "ffn_gate_shexp.weight": Role.SharedExpertGate,
    "ffn_up_shexp.weight": Role.SharedExpertUp, "ffn_down_shexp.weight": Role.SharedExpertDown,
}
_KIMI_KDA_CHUNK = 64  # how the KDA prefill is blocked (the transformers reference's chunk), not what it computes
_KIMI_L2_EPS = 1e-6  # the reference's q/k l2norm eps (llama.cpp: the file's rms eps)
_KIMI_MLA_NORM_EPS = 1e-6  # the reference's kv_a RMSNorm eps (the norm class default; llama.cpp: the file's rms eps)
_GATING_SIGMOID = 2  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (gguf-py ExpertGatingFuncType.SIGMOID)


def _lower_kimi_linear(path: Path, c: Container, relative_to: Path | None) -> Module:
    """``general.architecture = kimi-linear`` (Kimi-Linear), as llama.cpp's converter (``KimiLinearModel``) writes
    it and llama.cpp's ``kimi-linear`` graph runs it.

    - Layer map: ``attention.head_count_kv`` per layer — 0 on a KDA (recurrent) layer, >0 on an MLA layer — as
      llama.cpp reads it.
    - KDA (``kda.head_dim`` wide heads, ``attention.head_count`` of them, as llama.cpp sizes them): q / k / v with
      short convs (``ssm_conv1d_{q,k,v}`` stored ``[1, C, 1, kernel]``, reshaped), SiLU; the decay ``ssm_f_a`` /
      ``ssm_f_b`` + ``ssm_dt.bias``, ``ssm_a = -exp(A_log)`` read back through ``log_neg``; β = σ(``ssm_beta``);
      output RMSNorm ``ssm_norm`` gated by σ(``ssm_g_b``(``ssm_g_a``(x))). q / k l2-normalised with the reference's
      eps 1e-6 (llama.cpp uses the file's rms eps there).
    - MLA without rotary (llama.cpp's kimi-linear graph applies none, as the reference with ``mla_use_nope``):
      ``attn_q`` (or ``attn_q_a`` / ``attn_q_b`` with a q-LoRA), ``attn_kv_a_mqa`` → ``[c | k_pe]``, the latent's
      RMSNorm (the reference's eps 1e-6), softmax scale ``key_length_mla^-½``. The converter splits the
      checkpoint's ``kv_b_proj`` per head into ``attn_k_b`` (the key rows, transposed: ``[H, R, N]``) and
      ``attn_v_b`` (``[H, V, R]``); they are bound as the fused ``[H·(N+V), R]`` through ``concat 1 ($k_b |
      transpose 1 2, $v_b) | reshape``. A legacy file's unsplit ``attn_kv_b`` is bound as stored.
    - FFN: SwiGLU on the first ``leading_dense_block_count`` layers; then the MoE as llama.cpp's ``build_moe_ffn``
      runs it here: σ(router) (``expert_gating_func`` must be sigmoid), the selection bias ``exp_probs_b`` for the
      choice only, groups when ``expert_group_count`` > 1, top-k renormalised (llama.cpp always renormalises),
      scaled by ``expert_weights_scale``; ``expert_shared_count`` shared experts of ``expert_feed_forward_length``
      each."""
    arch = "kimi-linear"
    A = Attrs(_nest(c.metadata, arch), f"{path.name} (GGUF {arch} metadata)", prefix=arch + ".")
    d = A.need("embedding_length", kind=int, min=1)
    n_layer = A.layers("block_count")
    heads = A.need("attention.head_count", kind=int, min=1)
    eps = A.need("attention.layer_norm_rms_epsilon", kind=float, min=0.0)
    kv = A.raw("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) < n_layer or not all(isinstance(x, int) and x >= 0 for x in kv):
        raise FrontendError(f"{A.where}: attention.head_count_kv must list one count per layer (0: a KDA layer), "
                            f"got {kv!r:.80}")
    kinds = ["kda" if kv[i] == 0 else "mla" for i in range(n_layer)]
    D = A.need("kda.head_dim", kind=int, min=1)
    K = A.need("ssm.conv_kernel", kind=int, min=1)
    R = A.need("attention.kv_lora_rank", kind=int, min=1)
    q_rank = A.opt("attention.q_lora_rank", kind=int, min=1)
    rope = A.need("rope.dimension_count", kind=int, min=0)
    qk = A.need("attention.key_length_mla", kind=int, min=1)
    V = A.need("attention.value_length_mla", kind=int, min=1)
    if qk <= rope:
        raise FrontendError(f"{A.where}: attention.key_length_mla={qk} must exceed rope.dimension_count={rope} "
                            f"(the key's no-rotary part)")
    N = qk - rope
    dense_n, dense_filled = A.get("leading_dense_block_count", default=0, kind=int, min=0)
    b = _builder(path, c, arch, relative_to)
    b.fact("layer_map_read_from", "attention.head_count_kv", "0 on a KDA layer, > 0 on an MLA layer, as llama.cpp reads it")
    b.fact("mla_rotary", "none", "llama.cpp's kimi-linear graph applies no rotary to MLA (the reference's mla_use_nope)")
    b.fact("ssm_a_stored_as", "-exp(A_log)", "convert_hf_to_gguf KimiLinearModel: A_log --> -exp(A_log); the operand "
           "reads it back through log_neg")
    emb_shape = _logical_shape(c, "token_embd.weight")
    if emb_shape is None:
        raise FrontendError(f"{path.name}: no token_embd.weight tensor")
    vocab = emb_shape[0]
    b.fact("vocab_from", "token_embd rows", "the embedding table's row count")
    kda_attrs = {"d_model": d, "heads": heads, "head_dim": D, "conv_kernel": K, "conv_act": "silu", "norm_eps": eps,
                 "l2_eps": _KIMI_L2_EPS, "scale": D ** -0.5, "out_gate_act": "sigmoid", "chunk_size": _KIMI_KDA_CHUNK}
    kda_defaults = {"conv_act", "l2_eps", "scale", "out_gate_act", "chunk_size"}
    mla_attrs = {"d_model": d, "heads": heads, "q_lora": q_rank is not None, "q_lora_rank": int(q_rank or 0),
                 "kv_lora_rank": R, "qk_nope_head_dim": N, "qk_rope_head_dim": rope, "v_head_dim": V,
                 "norm_eps": _KIMI_MLA_NORM_EPS, "scale": qk ** -0.5, "rotary_dim": 0, "rotary_base": 10000.0,
                 "rotary_layout": "none", "rope_type": "default", "rotary_output": "in_place"}
    mla_defaults = {"norm_eps", "scale", "rotary_dim", "rotary_base", "rotary_layout", "rope_type", "rotary_output"}
    moe = None
    if dense_n < n_layer:
        E = A.need("expert_count", kind=int, min=1)
        k = A.need("expert_used_count", kind=int, min=1)
        if k > E:
            raise FrontendError(f"{A.where}: expert_used_count={k} exceeds expert_count={E}")
        gating = A.need("expert_gating_func", kind=int)
        if gating != _GATING_SIGMOID:
            raise FrontendError(f"{A.where}: expert_gating_func={gating} is not supported (the kimi-linear router is "
                                f"sigmoid, {_GATING_SIGMOID})")
        inter = A.need("expert_feed_forward_length", kind=int, min=1)
        shared = A.need("expert_shared_count", kind=int, min=0)
        scale, scale_filled = A.get("expert_weights_scale", default=1.0, kind=float, min=0.0)
        groups, groups_filled = A.get("expert_group_count", default=1, kind=int, min=1)
        used_groups, used_filled = A.get("expert_group_used_count", default=groups, kind=int, min=1)
        if E % groups or used_groups > groups:
            raise FrontendError(f"{A.where}: expert_count={E} in expert_group_count={groups} groups, "
                                f"expert_group_used_count={used_groups}: not a grouping")
        b.fact("moe_renormalise", True, "llama.cpp's kimi-linear graph renormalises the top-k weights (build_moe_ffn "
                                        "norm_w = true); the file does not store it")
        moe = op("moe", {"d_model": d, "experts": E, "top_k": k, "intermediate": inter, "router": "sigmoid_grouped",
                         "norm_topk_prob": True, "routed_scaling": float(scale or 1.0), "n_group": groups,
                         "topk_group": used_groups, "router_bias": False, "selection_bias": True,
                         "expert_layout": "separate", "expert_bias": False, "act": "silu", "shared_experts": shared > 0,
                         "shared_intermediate": inter * shared, "shared_gate": False},
                 {"norm_topk_prob", "router_bias", "expert_layout", "expert_bias", "act", "shared_gate"}
                 | {n for n, f in (("routed_scaling", scale_filled), ("n_group", groups_filled),
                                   ("topk_group", used_filled)) if f})
    dense_inter = A.need("feed_forward_length", kind=int, min=1) if dense_n else 0
    b.fact("dense_layers", dense_n, "leading_dense_block_count" + (" (absent: none)" if dense_filled else ""))
    bind = _binder(b, c)

    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, role in _KIMI_FFN.items():
            bind(p + name, role, i)
        if kinds[i] == "kda":
            for name, role in _KIMI_KDA.items():
                bind(p + name, role, i)
            for x, role in (("q", Role.KdaQConv1d), ("k", Role.KdaKConv1d), ("v", Role.KdaVConv1d)):
                key = p + f"ssm_conv1d_{x}.weight"  # stored [1, C, 1, kernel]
                bind(key, role, i, _reshape_to(c, key, (heads * D, K)))
            bind(p + "ssm_a", Role.KdaALog, i, [*_reshape_to(c, p + "ssm_a", (heads,)), Transform("log_neg")])
            mixer = op("kda", dict(kda_attrs), set(kda_defaults))
        else:
            for name, role in _KIMI_MLA.items():
                bind(p + name, role, i)
            kb, vb = p + "attn_k_b.weight", p + "attn_v_b.weight"
            if kb in c.entries or vb in c.entries:
                b.bind_concat([(kb, _entry_encoding(c, kb), [Transform("transpose", dim=1, dim2=2)]),
                               (vb, _entry_encoding(c, vb), [])], 1, Role.MlaKvBProj, i,
                              [Transform("reshape", shape=(heads * (N + V), R))])
            mixer = op("mla", dict(mla_attrs), set(mla_defaults))
        if i < dense_n:
            ffn = swiglu_op(d, dense_inter, {"act"})
        else:
            ffn = op("moe", dict(moe.attrs), set(moe.defaults))
        layers.append(two_norm_layer(i, d, (eps, False), mixer, ffn))
    return _finish(b, c, bind, path.stem, vocab, d, eps, layers)


def _entry_encoding(c: Container, key: str) -> str | None:
    e = c.entries.get(key)
    return None if e is None else e.encoding


def _binder(b: Builder, c: Container):
    """``bind(key, role, layer, transforms)``: a stored tensor to a role, through its ggml encoding when it has one
    (the operand decodes to f32); an absent key binds nothing (closure names the role it leaves unbound)."""

    def bind(key: str, role: Role, layer: int | None = None, transforms: list[Transform] | None = None) -> None:
        e = c.entries.get(key)
        if e is None:
            return
        if e.encoding is None:
            b.bind(key, role, layer, transforms)
        else:
            b.bind_encoded(e.encoding, {"blocks": key}, role, layer, transforms, dtype="f32")

    return bind


def _reshape_to(c: Container, key: str, shape: tuple[int, ...]) -> list[Transform]:
    """A reshape view to ``shape`` when the stored (logical) shape differs but holds as many elements; none
    otherwise (the bind pass then reports the stored shape against the role's contract)."""
    have = _logical_shape(c, key)
    if have is None or have == shape or math.prod(have) != math.prod(shape):
        return []
    return [Transform("reshape", shape=shape)]


# llama.cpp's mamba2 tensor names (gguf-py MODEL_TENSOR.SSM_*, as convert_hf_to_gguf's Mamba2Model writes them)
_MAMBA2_TENSORS = {
    "attn_norm.weight": Role.Mamba2PreMixerNorm,
    "ssm_in.weight": Role.Mamba2InProj, "ssm_in.bias": Role.Mamba2InProjBias,
    "ssm_conv1d.weight": Role.Mamba2Conv1d, "ssm_conv1d.bias": Role.Mamba2Conv1dBias,
    "ssm_dt.bias": Role.Mamba2DtBias, "ssm_a": Role.Mamba2ALog, "ssm_d": Role.Mamba2D,
    "ssm_norm.weight": Role.Mamba2GatedNorm,
    "ssm_out.weight": Role.Mamba2OutProj, "ssm_out.bias": Role.Mamba2OutProjBias,
}


def _lower_mamba2(path: Path, c: Container, relative_to: Path | None) -> Module:
    """``general.architecture = mamba2``: llama.cpp's ``mamba2.ssm.*`` metadata and ``blk.{i}.ssm_*`` tensors.

    What llama.cpp's graph (``build_mamba2_layer``) computes, declared: conv over ``xBC`` with its bias, then
    SiLU; ``dt = softplus(dt + ssm_dt.bias)`` with no limit (``dt_min=0, dt_max=inf``); ``y + D * x``, gated by
    ``silu(z)`` *before* the grouped RMSNorm (groups of ``d_inner / group_count``, eps the file's
    ``layer_norm_rms_epsilon``); residual added in f32."""
    arch = "mamba2"
    A = Attrs(_nest(c.metadata, arch), f"{path.name} (GGUF {arch} metadata)", prefix=arch + ".")
    d = A.need("embedding_length", kind=int, min=1)
    n_layer = A.layers("block_count")
    d_conv = A.need("ssm.conv_kernel", kind=int, min=1)
    d_inner = A.need("ssm.inner_size", kind=int, min=1)
    d_state = A.need("ssm.state_size", kind=int, min=1)
    heads = A.need("ssm.time_step_rank", kind=int, min=1)
    groups = A.need("ssm.group_count", kind=int, min=1)
    eps = A.need("attention.layer_norm_rms_epsilon", kind=float, min=0.0)
    if A.raw("ssm.dt_b_c_rms"):
        raise FrontendError(f"{A.where}: ssm.dt_b_c_rms=true (RMS norms on dt, B, C) is not supported")
    if d_inner % heads:
        raise FrontendError(f"{A.where}: ssm.inner_size={d_inner} is not a multiple of ssm.time_step_rank={heads} "
                            f"(the head count)")
    if d_inner % groups:
        raise FrontendError(f"{A.where}: ssm.inner_size={d_inner} is not a multiple of ssm.group_count={groups}")
    b = _builder(path, c, arch, relative_to)
    emb_shape = _logical_shape(c, "token_embd.weight")
    if emb_shape is None:
        raise FrontendError(f"{path.name}: no token_embd.weight tensor")
    vocab = emb_shape[0]
    b.fact("vocab_from", "token_embd rows", "the embedding table's row count (llama.cpp's converter pads the token "
           "list of a mamba2 vocabulary to a multiple of 16, not the table)")
    conv_bias = "blk.0.ssm_conv1d.bias" in c.entries
    proj_bias = "blk.0.ssm_in.bias" in c.entries
    b.fact("ssm_a_stored_as", "-exp(A_log)", "convert_hf_to_gguf Mamba2Model.modify_tensors: A_log --> A = "
           "-exp(A_log); the operand reads it back through log_neg")
    b.fact("dt_limit", "none", "llama.cpp's ssm_scan takes softplus(dt + dt_bias) unclamped")
    b.fact("norm_order", "gate_then_norm", "llama.cpp build_mamba2_layer: y * silu(z), then the grouped RMS norm")
    g = {"d_inner": d_inner, "expand": d_inner // d, "headdim": d_inner // heads, "d_state": d_state,
         "ngroups": groups, "d_conv": d_conv, "conv_bias": conv_bias, "bias": proj_bias, "chunk_size": 256,
         "dt_limit": [0.0, math.inf], "norm_before_gate": False}
    # chunk_size (how the scan is blocked, not what it computes) is mamba_ssm's class default; the dt limit and the
    # norm order are what llama.cpp computes (facts above), filled in since the file states neither
    mamba = mamba2_op(d, g, {"chunk_size", "dt_limit", "norm_before_gate"}, eps, False)
    conv_dim = d_inner + 2 * groups * d_state
    shapes = {"ssm_conv1d.weight": (conv_dim, d_conv), "ssm_a": (heads,), "ssm_d": (heads,),
              "ssm_norm.weight": (d_inner,), "ssm_dt.bias": (heads,), "ssm_conv1d.bias": (conv_dim,)}
    bind = _binder(b, c)
    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for name, role in _MAMBA2_TENSORS.items():
            key = p + name
            xs = _reshape_to(c, key, shapes[name]) if name in shapes else []
            if name == "ssm_a":
                xs.append(Transform("log_neg"))
            bind(key, role, i, xs)
        norm = rmsnorm(d, eps, False, Role.Mamba2PreMixerNorm)
        layers.append(Layer(i, "fp32", Placement.PreMixer, [norm], op(mamba.kind, dict(mamba.attrs), set(mamba.defaults))))
    return _finish(b, c, bind, path.stem, vocab, d, eps, layers)


def _logical_shape(c: Container, key: str) -> tuple[int, ...] | None:
    e = c.entries.get(key)
    if e is None:
        return None
    if e.encoding is None:
        return e.shape
    from ..ir.ggml import logical_cols

    return e.shape[:-1] + (logical_cols(e.encoding, e.shape[-1]),)
