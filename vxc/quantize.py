"""``vxc quantize MODEL -o OUT.vxir --scheme q8_0|q4_0|q4_1|q4_k_m|q5_k_m|q3_k_m|q2_k|tq1_0|tq2_0|iq4_nl|iq4_xs [--keep ROLE ...]``: data
preparation, not execution.

Every operand whose role the operator declarations mark ``quantise=True`` (a projection, the embedding / head
table: ``vxc.ir.operators.decl.RoleSpec``) is encoded in a ggml block format, unless ``--keep`` names its role:

- ``q8_0`` / ``q4_0`` / ``q4_1``: that format, bit-exact with ``gguf.quants.quantize``.
- ``q4_k_m``: the Q4_K_M mix ggml's quantize tool writes without an importance matrix, chosen by the roles'
  declared ``more_bits`` class instead of tensor names: q4_k for most matrices; q6_k for the ``head``
  class (the output table, and the embedding table when the head is tied to it) and, on the layers its
  ``use_more_bits`` rule picks (``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``), for the ``down`` class (FFN
  output projections; ``i`` the layer, ``n`` the layers) and the ``value`` class (attention value projections,
  fused QKV ones included; ``i`` the operand's place among the operands of ``value`` roles, ``n`` their
  count). Encoded with ggml's reference encoders (``vxc.runtime.ggml_blocks``: the bytes
  ``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref`` write).
- ``q5_k_m``: the Q5_K_M mix, the same rule with q5_k where q4_k_m has q4_k (``quantize_row_q5_K_ref``).
- ``q3_k_m``: the Q3_K_M mix: q3_k for most matrices; q6_k for ``head``; for ``down`` q5_k on the layers
  ``i < n/16``, q4_k on the others; for ``value`` q5_k on the first two (``i < 2``), q4_k on the others; q4_k
  for the ``attn_out`` class (attention output projections).
- ``q2_k``: the Q2_K mix: q2_k for most matrices; q6_k for ``head``; q3_k for ``down`` and ``attn_out``; for
  ``value`` q4_k when ``n_head / n_head_kv >= 4`` (llama.cpp's ``n_gqa()``, here the first layer's mixer
  attributes ``heads // kv_heads``; 0 where it declares no ``kv_heads``), q3_k otherwise.
- ``iq4_nl`` / ``iq4_xs``: llama.cpp's IQ4_NL / IQ4_XS files as its quantize tool writes them without an importance
  matrix: the format for most matrices (ggml's ``quantize_iq4_nl`` / ``quantize_iq4_xs`` scale search, byte for
  byte); q6_k for ``head``; q5_k for ``value`` where ``n_head / n_head_kv >= 4`` and for ``down`` on the layers
  ``i < n/8``; iq4_xs falls back to iq4_nl where rows are not whole 256-value blocks.
- ``tq1_0`` / ``tq2_0``: the ternary formats (values -d, 0, d per 256; for models trained ternary, as BitNet
  b1.58 / TriLM are: any other model loses most of its quality), as the quantize tool's TQ1_0 / TQ2_0: q6_k for
  ``head``, q4_k for ``embed`` (an untied token-embedding table; a tied one is ``head``), the ternary format
  for the rest (gguf-py's encoders, bytes as ``gguf.quants.quantize``).

Not reproduced, the tool's choices keyed on model facts other than the roles (and that ratio): 8-expert models
(q8_0 for K and V; q5_k for the attention output in q2_k / q3_k_m / q4_k_m); 70B-class models (q5_k for V where
q3_k / q4_k would be); Falcon (q8_0 for the head; q3_k_m: q3_k for down off the ``use_more_bits`` layers, no
upgrade of the attention output; q4_k_m: q6_k / q5_k for down); q2_k's value rule on MLA files (their GGUF
``head_count_kv`` depends on the converter; vxc's MLA declares no ``kv_heads``, so q3_k). Where vxc lowers a
family from GGUF, a role's class follows llama.cpp's tensor categories: ``attn_out`` is declared on the softmax,
MLA and KDA attentions' output projections (GGUF ``attn_output``) and on the conv-QKV attention's; a gated-delta
or Mamba2 layer's output projection (GGUF ``ssm_out``) has none.

A matrix whose rows are not whole blocks of its format falls back as the tool falls back (q2_k, q3_k, tq1_0, tq2_0 -> q4_0,
q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0; reported); one whose rows are not whole 32-value blocks either is kept
as stored (reported; the tool writes f16 there). Every other operand keeps its stored dtype. Expert banks are not
declared quantisable (the runtime has no kernels reading encoded banks): they are copied as stored, one
``[experts, ...]`` tensor each.

The output is self-contained: one safetensors file beside OUT.vxir (``OUT.safetensors``) holding each operand's
logical tensor (views applied; encoded ones as uint8 ``[rows, row_bytes]`` blocks), the IR declaring them
(``operand %l0.AttnQ f32[576,576] = q8_0(blocks $t3) ...``) with the scheme recorded as a fact, and the model's
tokenizer.json (the GGUF metadata's tokenizer for a GGUF input) unless the directory holds it already. The new
module runs verify, bind, closure and state before anything is written; the files are written atomically and a
failure leaves none behind.

Already encoded operands (a GGUF file's blocks, MXFP4 expert banks) of roles not being quantised are copied as
stored, views and all; one of a role to quantise is refused by name (no re-encoding; ``--keep`` its role).
Family-agnostic: roles and declarations only. Also refused: an unknown scheme or role.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .ir.diagnostics import VxcError
from .ir.ggml import encoding
from .ir.module import Fact, FileEntry, Module, Operand, Tensor
from .ir.operators import OPERATORS


MORE_BITS_RULE = "i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2"
ALWAYS = "always"
GQA4 = "n_head/n_head_kv >= 4"
# a mixed scheme's rules: which operands of a ``more_bits`` class they pick, from ``(i, n, gqa)``: for "down" the
# operand's layer and the layers, for "value" its place among the value operands and their count (None, None for
# the other classes; a rule on ``i`` then never holds), and the model's n_head / n_head_kv
RULES = {
    ALWAYS: lambda i, n, gqa: True,
    MORE_BITS_RULE: lambda i, n, gqa: i is not None and use_more_bits(i, n),
    "i < n/16": lambda i, n, gqa: i is not None and i < n // 16,
    "i < 2": lambda i, n, gqa: i is not None and i < 2,
    "i < n/8": lambda i, n, gqa: i is not None and i < n // 8,
    GQA4: lambda i, n, gqa: gqa >= 4,
}


@dataclass(frozen=True)
class Scheme:
    name: str
    base: str  # the ggml format of every quantised operand ...
    # ... but those a (more_bits class, rule, format) picks: of an operand's class, the first whose rule holds
    more: tuple[tuple[str, str, str], ...] = ()
    reference: str = "gguf.quants.quantize"


def _k_m(name: str, base: str) -> Scheme:
    rule = MORE_BITS_RULE
    return Scheme(name, base, (("head", ALWAYS, "q6_k"), ("down", rule, "q6_k"), ("value", rule, "q6_k")),
                  f"ggml's quantize_row_{base[:2]}_K_ref / quantize_row_q6_K_ref")


def _ternary(name: str) -> Scheme:
    return Scheme(name, name, (("head", ALWAYS, "q6_k"), ("embed", ALWAYS, "q4_k")),
                  f"gguf.quants.quantize ({name}) / ggml's quantize_row_q4_K_ref / quantize_row_q6_K_ref")


def _iq4(name: str) -> Scheme:
    return Scheme(name, name, (("head", ALWAYS, "q6_k"), ("value", GQA4, "q5_k"), ("down", "i < n/8", "q5_k")),
                  f"ggml's quantize_{name} without an importance matrix / quantize_row_q5_K_ref / quantize_row_q6_K_ref")


SCHEMES = {s.name: s for s in (
    Scheme("q8_0", "q8_0"), Scheme("q4_0", "q4_0"), Scheme("q4_1", "q4_1"),
    _k_m("q4_k_m", "q4_k"), _k_m("q5_k_m", "q5_k"),
    Scheme("q3_k_m", "q3_k", (("head", ALWAYS, "q6_k"), ("down", "i < n/16", "q5_k"), ("down", ALWAYS, "q4_k"),
                              ("value", "i < 2", "q5_k"), ("value", ALWAYS, "q4_k"), ("attn_out", ALWAYS, "q4_k")),
           "ggml's quantize_row_q3_K_ref / q4_K_ref / q5_K_ref / q6_K_ref"),
    Scheme("q2_k", "q2_k", (("head", ALWAYS, "q6_k"), ("down", ALWAYS, "q3_k"), ("value", GQA4, "q4_k"),
                            ("value", ALWAYS, "q3_k"), ("attn_out", ALWAYS, "q3_k")),
           "ggml's quantize_row_q2_K_ref / q3_K_ref / q4_K_ref / q6_K_ref"),
    _ternary("tq1_0"), _ternary("tq2_0"), _iq4("iq4_nl"), _iq4("iq4_xs"),
)}
assert all(r in RULES for s in SCHEMES.values() for _, r, _ in s.more)
# a format whose block does not divide a row: the 32-value format the quantize tool falls back to
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "tq1_0": "q4_0", "tq2_0": "q4_0",
            "iq4_xs": "iq4_nl"}


class QuantizeError(VxcError):
    pass


def quantisable_roles() -> set[str]:
    """The roles an operator declaration marks ``quantise=True``."""
    return {spec.name for decl in OPERATORS.values() for spec in decl.roles if spec.name and spec.quantise}


def more_bits_classes() -> dict[str, str]:
    """role -> its declared ``more_bits`` class, for the roles that declare one."""
    out: dict[str, str] = {}
    for decl in OPERATORS.values():
        for spec in decl.roles:
            if spec.name and spec.more_bits:
                assert out.setdefault(spec.name, spec.more_bits) == spec.more_bits, spec.name
    return out


def use_more_bits(i: int, n: int) -> bool:
    """The quantize tool's ``use_more_bits``, in C's integer arithmetic (``i >= n/8`` wherever the modulo is
    reached, so it is never taken of a negative number)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class Report:
    scheme: str
    encoded: dict[str, str] = field(default_factory=dict)  # operand sym -> ggml format
    kept: list[tuple[str, str]] = field(default_factory=list)  # (operand sym, why)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (operand sym, why)
    notes: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.encoded.values():
            out[f] = out.get(f, 0) + 1
        return out


def _check(m: Module, scheme: str, keep: list[str]) -> set[str]:
    from .ir.roles import Role

    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    names = {str(r) for r in Role}
    bad = [k for k in keep if k not in names]
    if bad:
        raise QuantizeError(f"--keep {', '.join(bad)}: not a role; roles: {', '.join(sorted(names))}")
    roles = quantisable_roles() - set(keep)
    problems = [f"operand %{o.sym} ({o.role}) is already encoded ({o.encoding})" for o in m.operands
                if o.encoding is not None and str(o.role) in roles]
    if problems:
        raise QuantizeError(f"vxc quantize does not re-encode {len(problems)} already encoded operand(s) "
                            "(--keep ROLE copies them as stored):\n" + "\n".join(f"  - {p}" for p in problems))
    return roles


def _classes(m: Module) -> dict[str, str]:
    """operand sym -> its ``more_bits`` class. A tied head reads the embedding operator's table: that table
    takes the head's class."""
    cls = more_bits_classes()
    out = {o.sym: cls[str(o.role)] for o in m.operands if str(o.role) in cls}
    head = {cls[s.name] for s in OPERATORS[m.head.kind].roles if s.name in cls}
    if m.head.attrs.get("tied") and len(head) == 1:
        table = {s.name for s in OPERATORS[m.embedding.kind].roles if s.quantise}
        out.update({o.sym: next(iter(head)) for o in m.operands if o.layer is None and str(o.role) in table})
    return out


def n_gqa(m: Module) -> int:
    """llama.cpp's ``n_gqa()``: the first layer's ``heads // kv_heads`` as its mixer declares them; 0 where it
    declares no (or zero) ``kv_heads`` (a layer without KV heads, as llama.cpp takes it)."""
    mixer = m.layers[0].mixer if m.layers else None
    attrs = mixer.attrs if mixer is not None else {}
    heads, kv = attrs.get("heads"), attrs.get("kv_heads")
    return heads // kv if isinstance(heads, int) and isinstance(kv, int) and kv > 0 else 0


def choose_formats(m: Module, scheme: str, roles: set[str]) -> tuple[dict[str, str], list[tuple[str, str]], list[tuple[str, str]]]:
    """The format of every operand to encode (sym -> format), the quantisable operands kept as stored and the
    fallbacks taken, each with why."""
    tensors = m.tensor_table()
    s = SCHEMES[scheme]
    classes = _classes(m)
    place = {layer.index: i for i, layer in enumerate(m.layers)}  # the layer's place, whatever the index base
    values = sorted((o for o in m.operands if classes.get(o.sym) == "value"), key=lambda o: place.get(o.layer, 0))
    value_at = {o.sym: i for i, o in enumerate(values)}
    gqa = n_gqa(m)

    def chosen(o: Operand) -> str:
        c = classes.get(o.sym)
        i, n = {"down": (place.get(o.layer), len(m.layers)), "value": (value_at.get(o.sym), len(values))}.get(c, (None, None))
        return next((f for cls, rule, f in s.more if cls == c and RULES[rule](i, n, gqa)), s.base)

    formats: dict[str, str] = {}
    kept: list[tuple[str, str]] = []
    fallbacks: list[tuple[str, str]] = []
    for o in m.operands:
        if str(o.role) not in roles:
            continue
        if any(tensors[t].is_bank for t in o.sources):
            kept.append((o.sym, "an expert bank (kept as stored: no encoded-bank kernels)"))
            continue
        if len(o.shape) != 2:
            kept.append((o.sym, f"not a matrix ({list(o.shape)})"))
            continue
        fmt = chosen(o)
        cols, block = o.shape[-1], encoding(fmt).block_size
        if cols % block and fmt in FALLBACK and cols % encoding(FALLBACK[fmt]).block_size == 0:
            fallbacks.append((o.sym, f"rows of {cols} values are not whole {block}-value blocks: {FALLBACK[fmt]}, "
                                     f"not {fmt}"))
            fmt = FALLBACK[fmt]
        elif cols % block:
            also = f" (nor {encoding(FALLBACK[fmt]).block_size}-value ones for {FALLBACK[fmt]})" if fmt in FALLBACK else ""
            kept.append((o.sym, f"rows of {cols} values are not whole {block}-value blocks{also}"))
            continue
        formats[o.sym] = fmt
    return formats, kept, fallbacks


def quantize_module(m: Module, model_dir: Path, out_ir: Path, scheme: str, keep: list[str]) -> tuple[Module, dict, Report]:
    """The quantised module (not yet written), its tensors by key, and what was done."""
    from .runtime.ggml_blocks import quantize
    from .runtime.weights import TORCH_DTYPES, Weights

    roles = _check(m, scheme, keep)
    formats, kept, fallbacks = choose_formats(m, scheme, roles)
    weights = Weights(m, Path(model_dir))
    rep = Report(scheme, kept=kept, fallbacks=fallbacks)
    out_tensors: dict[str, torch.Tensor] = {}
    tensors: list[Tensor] = []
    operands: list[Operand] = []
    stored = m.tensor_table()
    for o in m.operands:
        tsym, key = f"t{len(tensors)}", o.sym
        fmt = formats.get(o.sym)
        if fmt is not None:
            w = weights.operand(o, torch.float32, "cpu")
            b = quantize(fmt, w.contiguous()).contiguous()
            out_tensors[key] = b
            tensors.append(Tensor(tsym, "u8", tuple(b.shape), key, file="w0"))
            operands.append(Operand(o.sym, "f32", o.shape, [tsym], o.role, layer=o.layer, encoding=fmt,
                                    part_names=["blocks"]))
            rep.encoded[o.sym] = fmt
            rep.bytes_before += w.numel() * TORCH_DTYPES[o.dtype].itemsize
            rep.bytes_after += b.numel()
            del w
        elif o.encoding is not None:  # encoded, and not a role to quantise: its stored parts copied as they are
            syms = []
            for part, src in zip(o.part_names, o.sources):
                t = weights.stored(src, copy=True).contiguous()
                syms.append(f"t{len(tensors)}")
                out_tensors[f"{key}.{part}"] = t
                tensors.append(Tensor(syms[-1], stored[src].dtype, tuple(t.shape), f"{key}.{part}", file="w0"))
                rep.bytes_before += t.numel() * t.element_size()
                rep.bytes_after += t.numel() * t.element_size()
            operands.append(Operand(o.sym, o.dtype, o.shape, syms, o.role, layer=o.layer, encoding=o.encoding,
                                    part_names=list(o.part_names), transforms=copy.deepcopy(o.transforms),
                                    activations=o.activations))
        else:
            t = weights.operand(o, TORCH_DTYPES[o.dtype], "cpu").contiguous()
            out_tensors[key] = t
            tensors.append(Tensor(tsym, o.dtype, tuple(t.shape), key, file="w0"))
            operands.append(Operand(o.sym, o.dtype, o.shape, [tsym], o.role, layer=o.layer))
            rep.bytes_before += t.numel() * t.element_size()
            rep.bytes_after += t.numel() * t.element_size()
    q = copy.deepcopy(m)
    q.tensors, q.operands, q.index = tensors, operands, None
    q.source.model_dir = "."
    q.facts.append(Fact("quantized", scheme, _evidence(SCHEMES[scheme], rep, keep)))
    q.files = [FileEntry("w0", out_ir.with_suffix(".safetensors").name, 0, "")]
    return q, out_tensors, rep


def _evidence(s: Scheme, rep: Report, keep: list[str]) -> str:
    counts = rep.counts()
    mix = ", ".join(f"{counts[f]} {f}" for f in sorted(counts))
    text = (f"vxc quantize --scheme {s.name}: {len(rep.encoded)} operands of roles declared quantise=True encoded "
            f"({mix}; bytes of {s.reference})")
    for cls in dict.fromkeys(c for c, _, _ in s.more):
        alts = [(r, f) for c, r, f in s.more if c == cls]
        text += f"; more_bits class {cls}: " + ", else ".join(f if r == ALWAYS else f"{f} where {r}" for r, f in alts)
        if alts[-1][0] != ALWAYS:
            text += f", else {s.base}"
    if rep.fallbacks:
        text += f"; {len(rep.fallbacks)} fell back to a 32-value format (rows not whole blocks)"
    if rep.kept:
        text += f"; {len(rep.kept)} kept as stored"
    if keep:
        text += f"; kept by --keep: {', '.join(keep)}"
    return text


def quantize_to_file(src: Path, out_ir: Path, scheme: str, keep: list[str], activations: str | None = None) -> Report:
    """Quantise the model at ``src`` (a .vxir, a model directory or a GGUF file) into ``out_ir`` and the
    safetensors file beside it. Both are written to temporary files and renamed into place only once the new
    module has passed verify, bind, closure and state: on any failure nothing is left behind and files already
    at those paths are untouched."""
    import os

    from .driver import declare_activations, load, run, save_safetensors_atomic, write_atomic
    from .frontends.common import _read_header
    from .ir.printer import print_module
    from .passes.context import Context

    out_ir = Path(out_ir)
    st = out_ir.with_suffix(".safetensors")
    if st.resolve() == Path(src).resolve() or out_ir.resolve() == Path(src).resolve():
        raise QuantizeError(f"{out_ir}: the output would overwrite the input")
    ctx = run(load(src), "verify,bind,closure", emit=lambda s: None)
    notes: list[str] = []
    tok = _tokenizer(ctx.module, Path(ctx.model_dir), out_ir.parent / "tokenizer.json", notes)
    q, tensors, rep = quantize_module(ctx.module, ctx.model_dir, out_ir, scheme, keep)
    if activations is not None:
        rep.notes.append(f"{declare_activations(q, activations)} encoded operands declare activations {activations}")
    rep.notes += notes
    tmp_st, tmp_ir = st.with_name(f".{st.name}.part"), out_ir.with_name(f".{out_ir.name}.part")
    tmp_tok = out_ir.with_name(".tokenizer.json.part")
    try:
        if tok is not None:
            write_atomic(tmp_tok, tok)
        save_safetensors_atomic(tmp_st, tensors, {"vxc_quantized": scheme})
        _, size, digest = _read_header(tmp_st, st.name)
        # checked against the temporary file, then declared under its final name (same bytes, size, digest)
        q.files = [FileEntry("w0", tmp_st.name, size, digest)]
        checked = run(Context(q, model_dir=out_ir.resolve().parent), "verify,bind,closure,state", emit=lambda s: None)
        checked.module.files[0].path = st.name
        write_atomic(tmp_ir, print_module(checked.module))
        if tok is not None:
            os.replace(tmp_tok, tmp_tok.with_name("tokenizer.json"))
        os.replace(tmp_st, st)
        os.replace(tmp_ir, out_ir)
    finally:
        for t in (tmp_st, tmp_ir, tmp_tok):
            t.unlink(missing_ok=True)
    return rep


def _tokenizer(m: Module, model_dir: Path, dest: Path, notes: list[str]) -> str | None:
    """The tokenizer.json to write beside the output (the model directory's, or the one a GGUF file's metadata
    describes), so that ``vxc exec --prompt`` runs on it; None when there is none or ``dest`` already holds it.
    A different tokenizer at ``dest`` is refused (the output directory belongs to another model)."""
    from .runtime.tokenizer import load_tokenizer

    path = model_dir / "tokenizer.json"
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    else:
        try:
            tok = load_tokenizer(model_dir, m)
        except VxcError as e:  # as ``vxc exec`` takes it: no tokenizer, token ids in and out
            notes.append(f"no tokenizer.json written: {e}")
            return None
        if tok is None:
            return None
        text = tok.to_str()
    if dest.is_file():
        if dest.read_text(encoding="utf-8") != text:
            raise QuantizeError(f"{dest}: holds a different tokenizer; write the output into another directory")
        return None
    return text
