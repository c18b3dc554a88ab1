"""The Llama-shaped skeleton every transformers decoder frontend shares: ``model.embed_tokens``,
``model.layers.{i}.{input_layernorm, post_attention_layernorm, mlp.*}``, ``model.norm``, ``lm_head``.

Each family states how its layers differ (mixer, FFN, whether its RMSNorms are zero-centred); the
tensor spellings and the embedding / final norm / head operators are written here once.
"""

from __future__ import annotations

from pathlib import Path

from ..ir.module import Layer, Module, Op
from ..ir.roles import Placement, Role
from .common import Attrs, Builder, FrontendError, compute_dtype, op

EMBEDDING = "model.embed_tokens.weight"


def sizes(A: Attrs) -> tuple[int, int, int, int]:
    """hidden_size (>= 1), num_hidden_layers, num_attention_heads (>= 1), vocab_size: required integers."""
    return (A.need("hidden_size", kind=int, min=1), A.layers("num_hidden_layers"),
            A.need("num_attention_heads", kind=int, min=1), A.need("vocab_size", kind=int))


def rmsnorm(dim: int, eps: float, eps_default: bool, role: Role, zero_centred: bool = False) -> Op:
    """An RMSNorm whose centring is the family's convention (recorded as filled in)."""
    return op("rmsnorm", {"dim": dim, "eps": eps, "zero_centred": zero_centred},
              ({"eps"} if eps_default else set()) | {"zero_centred"}, role=role)


def bind_norms(b: Builder, i: int) -> None:
    """The two norms of a two-norm layer: before the mixer and before the FFN."""
    p = f"model.layers.{i}."
    b.bind(p + "input_layernorm.weight", Role.PreAttentionNorm, i)
    b.bind(p + "post_attention_layernorm.weight", Role.PreFfnNorm, i)  # the pre-FFN norm of a two-norm layer


def bind_swiglu(b: Builder, p: str, i: int) -> None:
    """A dense SwiGLU FFN under ``p`` (e.g. ``model.layers.{i}.mlp.``)."""
    for name, role in (("gate_proj", Role.FfnGate), ("up_proj", Role.FfnUp), ("down_proj", Role.FfnDown)):
        b.bind(p + f"{name}.weight", role, i)


def finish(b: Builder, A: Attrs, model_dir: Path, d: int, vocab: int, layers: list[Layer], final_norm: Op) -> Module:
    """Bind the embedding, final norm and head; the module (``tie_word_embeddings`` absent: untied, a default)."""
    tied, tied_default = A.get("tie_word_embeddings", default=False, kind=bool)
    b.bind(EMBEDDING, Role.Embedding)
    b.bind("model.norm.weight", Role.FinalNorm)
    b.bind("lm_head.weight", Role.LmHead)
    emb = op("embedding", {"vocab": vocab, "padded_vocab": vocab, "dim": d})
    head = op("head", {"tied": bool(tied), "padded_vocab": vocab, "dim": d}, {"tied"} if tied_default else set())
    return b.module(model_dir.resolve().name, compute_dtype(A, b, EMBEDDING), emb, layers, final_norm, head)


def check_silu(A: Attrs) -> None:
    """``hidden_act`` must be SiLU: absent it is (or the family default, recorded), anything else is refused."""
    act = A.take("hidden_act") if "hidden_act" in A.defaults else A.raw("hidden_act") if "hidden_act" in A else "silu"
    if act != "silu":
        raise FrontendError(f"{A.where}: hidden_act={act!r} is not supported (silu only)")


def swiglu_op(d: int, intermediate: int, defaults: set[str] | None = None) -> Op:
    return op("swiglu", {"d_model": d, "intermediate": intermediate, "act": "silu"}, defaults)


def two_norm_layer(i: int, d: int, eps: tuple[float, bool], mixer: Op, ffn: Op, zero_centred: bool = False) -> Layer:
    """A pre-norm layer: RMSNorm → mixer, RMSNorm → FFN (``eps`` = (value, filled_by_default))."""
    norms = [rmsnorm(d, eps[0], eps[1], role, zero_centred) for role in (Role.PreAttentionNorm, Role.PreFfnNorm)]
    return Layer(i, "compute", Placement.PreOnly, norms, mixer, ffn)
