"""Seeded mutation fuzzing of VINDEX3 text (issue 11: bad input never crashes).

A *case* is one seed: it picks a corpus text and applies one to three mutations
(:func:`make_case`), all drawn from ``random.Random(seed)``, so a seed is the whole
reproduction. :func:`classify` feeds the mutated bytes through what ``vxc passes``
and ``vxc describe`` do with an IR file, without weights (no model directory,
so verify does not look for the files): parse the bytes, print → parse → print
(a fixed point), the default pipeline with every pass dumped, then the plan's
surfaces (``describe`` at three contexts, JSON, Graphviz, the rich table). The
outcome is one of

- ``accepted``: every step ran and the printed text is a fixed point;
- ``syntax``: an :class:`IRSyntaxError` whose message is ``file:line:col: error: …``
  with the offending line and a caret, the line and column inside the text;
- ``refusal``: a :class:`Refusal` with at least one finding (code, message),
  its text and JSON renderable;
- ``crash``: anything else — another exception, a syntax error pointing
  outside the text, a printer that does not round-trip, more than
  :data:`CASE_SECONDS`, or memory past the cap (:func:`memory_cap`).

The corpus is every golden IR under ``golden/`` cut down to a few layers
(:func:`shrink`: the first layer of each mixer/FFN combination, then layers with
other attributes, renumbered; unclaimed tensors and files dropped), which
keeps every operator kind and costs milliseconds to parse; the gpt-oss one again
with its experts stored as MXFP4 (:func:`mxfp4_experts`); and three GGUF
miniatures lowered in memory (``file … format gguf``, every ggml block encoding).
"""

from __future__ import annotations

import copy
import io
import json
import random
import re
import resource
import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "golden"

ACCEPTED, SYNTAX, REFUSAL, CRASH = "accepted", "syntax", "refusal", "crash"
OUTCOMES = (ACCEPTED, SYNTAX, REFUSAL, CRASH)
CASE_SECONDS = 5.0
FILENAME = "fuzz.vxir"


# ---------------------------------------------------------------- corpus


def _op_sig(op) -> tuple:
    return (op.kind, tuple(sorted((k, repr(v)) for k, v in op.attrs.items()))) if op is not None else None


def shrink(m, limit: int = 4):
    """A copy of module ``m`` with at most ``limit`` layers: the first of each (mixers, FFN, placement) kind
    combination (both mixers of a Parallel layer), then layers whose operators' attributes differ from those
    kept; renumbered from 0, with the operands of dropped layers, the tensors no operand names and the files no
    tensor names dropped."""
    kinds, sigs, keep = set(), set(), []
    for layer in m.layers:
        k = (tuple(mx.kind for mx in layer.mixers()), layer.ffn.kind if layer.ffn else None, layer.placement)
        if k not in kinds:
            kinds.add(k)
            sigs.add((*map(_op_sig, layer.mixers()), _op_sig(layer.ffn)))
            keep.append(layer.index)
    for layer in m.layers:
        s = (*map(_op_sig, layer.mixers()), _op_sig(layer.ffn))
        if len(keep) >= max(limit, len(kinds)):
            break
        if s not in sigs:
            sigs.add(s)
            keep.append(layer.index)
    keep.sort()
    new = {old: i for i, old in enumerate(keep)}
    out = copy.deepcopy(m)
    out.layers = []
    for layer in m.layers:
        if layer.index in new:
            c = copy.deepcopy(layer)
            c.index = new[layer.index]
            out.layers.append(c)
    out.operands = []
    for o in m.operands:
        if o.layer is None or o.layer in new:
            c = copy.deepcopy(o)
            c.layer = None if o.layer is None else new[o.layer]
            out.operands.append(c)
    claimed = {s for o in out.operands for s in o.sources}
    out.tensors = [copy.deepcopy(t) for t in m.tensors if t.sym in claimed]
    used = {p.file for t in out.tensors for p in t.parts} | {t.file for t in out.tensors if not t.is_bank}
    out.files = [copy.deepcopy(f) for f in m.files if f.sym in used]
    return out


# GGUF miniatures lowered in memory (tests/gguf_support.py): the file format and the ggml block encodings
GGUF_MINIS = {
    "gguf/llama-mixed": dict(arch="llama"),
    "gguf/qwen3-other-blocks": dict(arch="qwen3", tied=True, encodings={
        "token_embd": "Q5_0", "attn_q": "Q5_1", "attn_k": "Q2_K", "attn_v": "Q3_K", "attn_output": "Q5_K",
        "ffn_gate": "F16", "ffn_up": "IQ4_NL", "ffn_down": "IQ4_XS"}),
    "gguf/qwen2-f32": dict(arch="qwen2", encodings={}),
    "gguf/llama-grid": dict(arch="llama", encodings={
        "token_embd": "IQ3_S", "attn_q": "IQ2_XXS", "attn_k": "IQ2_XS", "attn_v": "IQ3_XXS", "attn_output": "IQ2_S",
        "ffn_gate": "IQ1_S", "ffn_up": "IQ1_M", "ffn_down": "TQ1_0", "output": "TQ2_0"}),
}


def mxfp4_experts(m):
    """A copy of module ``m`` whose expert matrices (stored [E, in, out], read through ``| transpose 1 2``) are
    stored as gpt-oss's MXFP4 pairs instead: u8 blocks [E, out, in/32, 16] and scales [E, out, in/32]."""
    out = copy.deepcopy(m)
    tensors = out.tensor_table()
    for o in out.operands:
        if str(o.role) not in ("ExpertGateUp", "ExpertDown") or o.encoding is not None:
            continue
        t = tensors[o.sources[0]]
        e, n_out, n_in = o.shape
        blocks = type(t)(t.sym + "b", "u8", (e, n_out, n_in // 32, 16), t.key + "_blocks", file=t.file)
        scales = type(t)(t.sym + "s", "u8", (e, n_out, n_in // 32), t.key + "_scales", file=t.file)
        out.tensors[out.tensors.index(t)] = blocks
        out.tensors.append(scales)
        o.encoding, o.part_names, o.sources, o.transforms = "mxfp4", ["blocks", "scales"], [blocks.sym, scales.sym], []
    return out


def _gguf_texts() -> list[tuple[str, str]]:
    import tempfile

    from tests.gguf_support import write_llama_gguf
    from vxc.frontends import lower
    from vxc.ir.printer import print_module

    out = []
    with tempfile.TemporaryDirectory() as d:
        for name, kw in GGUF_MINIS.items():
            path = write_llama_gguf(Path(d) / "model.gguf", seed=0, **kw)
            out.append((name, print_module(lower(path, relative_to=Path(d)))))
    return out


@lru_cache(maxsize=1)
def corpus() -> tuple[tuple[str, str], ...]:
    """(name, text) of every golden IR, shrunk (see :func:`shrink`), and of the GGUF miniatures."""
    from vxc.ir.parser import parse
    from vxc.ir.printer import print_module

    out = []
    for p in sorted(GOLDEN.rglob("*.vxir")):
        m = shrink(parse(p.read_text(), str(p)))
        out.append((f"{p.parent.name}/{p.name}", print_module(m)))
        if p.parent.name == "test_gpt_oss":
            out.append((f"{p.parent.name}/{p.name} (experts as mxfp4)", print_module(mxfp4_experts(m))))
    if not out:
        raise AssertionError(f"no golden IR under {GOLDEN}")
    return tuple(out + _gguf_texts())


# ---------------------------------------------------------------- mutations

_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|[$@%][A-Za-z0-9_.\-]*|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|[A-Za-z_]\w*|\.\.|\S')
_NUMBER = re.compile(r"(?<![\w$@%])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SYMREF = re.compile(r"[$@%][A-Za-z0-9_.\-]+")
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')
_ATTR = re.compile(r"\b([A-Za-z_]\w*)=")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_SPAN = re.compile(r"\[(-?\d+):(-?\d+)\]|(?<=[\[,] )(-?\d+):(-?\d+)")
_SHAPE = re.compile(r"\[(-?\d+(?:,-?\d+)*)?\]")
_OPLINE = re.compile(r"^(\s*(?:mixer|ffn|embedding|head|norm \w+|final_norm \w+) )(\w+)", re.M)
_WORD = re.compile(r"(?<![\w$@%\"=.-])[A-Za-z_]\w*(?![\w=])")

NUMBERS = ("0", "-1", "1", "-0", str(10**12), str(10**30), "9" * 400, "9" * 5000, "-" + "9" * 5000, "nan", "-nan", "1e999",
           "-1e999", "1e-999", "inf", "-inf", "0x", "0x10", "1.5", "2147483648", str(2**63), str(2**64), "1_000", "")
UNICODE = ("\x00", "\u0301", "\u202e", "\u200f", "\u2028", "\u2029", "\x85", "\r", "\r\n", "\x0b", "\x0c", "\t",
           "\ufeff", "\U0001F600", "é", "\u4e2d", "\uffff", "\x7f", "\x1b[31m", "\x1c", "e\u0301\u0301\u0301")
ESCAPES = ("\\ud800", "\\udfff", "\\ud83d\\ude00", "\\udc00\\ud800", "\\u0000", "\\x41", "\\", "\\u12", "\\n",
           "\\u2028", '\\"', "{e}", "\\u0085", "\\t", "\\/", "[/]", "[red]", "\\u001b[31m")
BAD_UTF8 = (b"\xff", b"\xfe", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82")
ATTR_NAMES = ("state", "layer", "role", "mixer", "true", "nan", "inf", "x", "_", "experts", "bank", "evidence",
              "default", "window", "compute", "A" * 300)
WORDS = ("true", "false", "nan", "inf", "fp32", "compute", "bf16", "f32", "f16", "i64", "bool", "u8", "PreOnly",
         "PrePost", "PreMixer", "PreFfn", "fixed", "per_token", "recurrent", "kv_rows", "latent_rows", "conv_history",
         "silu", "gelu", "mxfp4", "layer", "state", "role", "bank", "experts", "slice", "gather", "none", "x",
         "q4_0", "q4_1", "q5_0", "q8_0", "q2_k", "q4_k", "q6_k", "iq4_xs", "iq2_xxs", "iq3_s", "iq1_m", "tq1_0", "tq2_0", "blocks", "scales", "format", "gguf",
         "safetensors")


def _short(s, n: int = 40) -> str:
    r = repr(s)
    return r if len(r) <= n else r[: n - 5] + "…" + r[-4:]


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _replace(rng, text: str, pattern: re.Pattern, what: str, make):
    """Replace one random match of ``pattern`` by ``make(match)``."""
    ms = list(pattern.finditer(text))
    if not ms:
        return text, f"{what}: none"
    m = rng.choice(ms)
    new = make(m)
    return text[: m.start()] + new + text[m.end():], f"{what} L{_line_of(text, m.start())} {_short(m.group(0))} -> {_short(new)}"


def _lines(text: str) -> list[str]:
    return text.split("\n")


def m_delete_lines(rng, text):
    ls = _lines(text)
    i = rng.randrange(len(ls))
    n = rng.choice((1, 1, 1, 2, 5))
    del ls[i: i + n]
    return "\n".join(ls), f"delete {n} line(s) at L{i + 1}"


def m_duplicate_line(rng, text):
    ls = _lines(text)
    i, j = rng.randrange(len(ls)), rng.randrange(len(ls) + 1)
    ls.insert(j, ls[i])
    return "\n".join(ls), f"copy L{i + 1} to before L{j + 1}"


def m_swap_lines(rng, text):
    ls = _lines(text)
    i, j = rng.randrange(len(ls)), rng.randrange(len(ls))
    ls[i], ls[j] = ls[j], ls[i]
    return "\n".join(ls), f"swap L{i + 1} and L{j + 1}"


def _tokens_of_line(rng, text):
    ls = _lines(text)
    for _ in range(20):
        i = rng.randrange(len(ls))
        toks = list(_TOKEN.finditer(ls[i]))
        if toks:
            return ls, i, toks
    return ls, 0, list(_TOKEN.finditer(ls[0]))


def m_token(rng, text):
    ls, i, toks = _tokens_of_line(rng, text)
    line = ls[i]
    a = rng.choice(toks)
    op = rng.choice(("delete", "duplicate", "swap"))
    if op == "delete":
        ls[i] = line[: a.start()] + line[a.end():]
        d = f"delete token {_short(a.group(0))}"
    elif op == "duplicate":
        ls[i] = line[: a.end()] + " " + a.group(0) + line[a.end():]
        d = f"duplicate token {_short(a.group(0))}"
    else:
        b = rng.choice(toks)
        x, y = sorted((a, b), key=lambda t: t.start())
        if x.start() == y.start():
            return "\n".join(ls), "swap a token with itself"
        ls[i] = line[: x.start()] + y.group(0) + line[x.end(): y.start()] + x.group(0) + line[y.end():]
        d = f"swap tokens {_short(x.group(0))} and {_short(y.group(0))}"
    return "\n".join(ls), f"{d} in L{i + 1}"


def m_number(rng, text):
    def make(m):
        choice = rng.choice(NUMBERS + ("neg",) * 4)
        if choice == "neg":
            v = m.group(0)
            return v[1:] if v.startswith("-") else "-" + v
        return choice

    return _replace(rng, text, _NUMBER, "number", make)


def m_number_everywhere(rng, text):
    """Every occurrence of one number changed alike: the geometry stays consistent (attributes, tensor shapes,
    contracts and regions agree), so the changed value reaches the later passes and describe."""
    nums = sorted(set(m.group(0) for m in _NUMBER.finditer(text)))
    if not nums:
        return text, "number everywhere: none"
    n = rng.choice(nums)
    new = rng.choice(("0", "-1", "1", "2", "3", "neg", str(10**6), str(2**31 - 1), str(2**31), str(10**12), str(10**30),
                      "9" * 400, "1.5", "nan"))
    if new == "neg":
        new = n[1:] if n.startswith("-") else "-" + n
    pat = re.compile(r"(?<![\w$@%.])" + re.escape(n) + r"(?![\w.])")
    return pat.sub(lambda m: new, text), f"number {_short(n)} -> {_short(new)} everywhere"


def m_unicode(rng, text):
    ch = rng.choice(UNICODE)
    strings = list(_STRING.finditer(text))
    if strings and rng.random() < 0.5:
        s = rng.choice(strings)
        pos = rng.randint(s.start() + 1, s.end() - 1)
        where = "in a string"
    else:
        pos = rng.randrange(len(text) + 1)
        where = "at"
    return text[:pos] + ch + text[pos:], f"insert {_short(ch)} {where} L{_line_of(text, pos)}"


def m_escape(rng, text):
    esc = rng.choice(ESCAPES)
    strings = list(_STRING.finditer(text))
    s = rng.choice(strings)
    pos = rng.randint(s.start() + 1, s.end() - 1)
    return text[:pos] + esc + text[pos:], f"insert escape {_short(esc)} in string L{_line_of(text, pos)}"


def m_string(rng, text):
    def make(m):
        body = m.group(0)
        return rng.choice(('""', '"{e}"', '"{e}{e}"', body.replace("{e}", ""), '"' + "x" * 100_000 + '"',
                           '"\\u0000"', '"../../etc/passwd"', '"/"', body[:-1] + '\\"', '"' + body,
                           body[:-1] + '[/x]"', '"[bold]' + body[1:], '"%s %d {0} {e"'))

    return _replace(rng, text, _STRING, "string", make)


def m_symbol_ref(rng, text):
    syms = _SYMREF.findall(text)

    def make(m):
        s = m.group(0)
        same = [x for x in syms if x[0] == s[0]]
        return rng.choice((s + "x", s[0], s[0] + "nope", rng.choice(same), rng.choice("$@%") + s[1:],
                           s[0] + "a" * 500, s[0] + "-1", s[0] + "..", s[0] + "é"))

    return _replace(rng, text, _SYMREF, "symbol", make)


def m_duplicate_definition(rng, text):
    ls = _lines(text)
    defs = [i for i, line in enumerate(ls) if re.match(r"\s*(tensor|operand|file|layer \d+ \{|state )", line)]
    if not defs:
        return text, "duplicate definition: none"
    i = rng.choice(defs)
    if rng.random() < 0.5 or not ls[i].lstrip().startswith(("tensor", "operand", "file")):
        j = rng.randrange(len(ls) + 1)
        ls.insert(j, ls[i])
        return "\n".join(ls), f"copy definition L{i + 1} to before L{j + 1}"
    sym = _SYMREF.search(ls[i]).group(0)
    same = [k for k in defs if k != i and (m := _SYMREF.search(ls[k])) and m.group(0)[0] == sym[0]]
    if not same:
        return text, "duplicate definition: no other"
    k = rng.choice(same)
    ls[k] = _SYMREF.sub(sym, ls[k], count=1)
    return "\n".join(ls), f"define {sym} (L{i + 1}) again at L{k + 1}"


def m_attr_name(rng, text):
    names = sorted(set(_ATTR.findall(text)))

    def make(m):
        if rng.random() < 0.2:  # the attribute given twice
            rest = text[m.end():]
            value = re.match(r"\S*", rest).group(0)
            return f"{m.group(1)}={value} {m.group(1)}="
        return rng.choice(names + list(ATTR_NAMES)) + "="

    return _replace(rng, text, _ATTR, "attribute name", make)


_ATTR_VALUE = re.compile(r'\b([A-Za-z_]\w*)=("(?:\\.|[^"\\\n])*"|\[[^\]\n]*\]|[^\s\[]+)( \(default\))?')
INT_EDGES = ("0", "1", "2", "3", "-1", str(2**31 - 1), str(2**31), str(10**12), "9" * 400)
FLOAT_EDGES = ("0.0", "-0.0", "nan", "inf", "-inf", "1e-300", "1e300", "-1.0", "1.0", "0.5")
OTHER_VALUES = ("1", "1.0", "true", "false", "x", '"s"', "[1, 2]", "[]", "none")


def _edge(rng, value: str) -> str:
    if rng.random() < 0.15:
        return rng.choice(OTHER_VALUES)
    if re.fullmatch(r"-?\d+", value):
        return rng.choice(INT_EDGES)
    if re.fullmatch(r"-?(\d+\.\d+([eE][-+]?\d+)?|\d+[eE][-+]?\d+|inf|nan)", value):
        return rng.choice(FLOAT_EDGES)
    if value in ("true", "false"):
        return {"true": "false", "false": "true"}[value]
    return rng.choice(OTHER_VALUES + ("silu", "gelu", "interleaved", "half", "yarn", "default", "sigmoid", "softmax",
                                      "topk_softmax", "gate_then_norm", "norm_then_gate", "split", "fused"))


def _op_line_attrs(rng, text):
    ls = _lines(text)
    ops = [i for i, line in enumerate(ls) if _OPLINE.match(line) and _ATTR_VALUE.search(line)]
    if not ops:
        return ls, None, []
    i = rng.choice(ops)
    return ls, i, list(_ATTR_VALUE.finditer(ls[i]))


def m_attr_values(rng, text):
    """Attributes of one operator set to edge values (0, 1, -1, 2**31, NaN, inf, another type): one, a few, or
    all of them at once, so the consistency rules and derived geometry meet values verify lets through."""
    ls, i, attrs = _op_line_attrs(rng, text)
    if i is None:
        return text, "attribute values: none"
    k = rng.choice((1, 1, 2, 3, len(attrs)))
    chosen = sorted(rng.sample(attrs, min(k, len(attrs))), key=lambda m: m.start(), reverse=True)
    line, done = ls[i], []
    for m in chosen:
        new = _edge(rng, m.group(2))
        line = line[: m.start(2)] + new + line[m.end(2):]
        done.append(f"{m.group(1)}={_short(new, 16)}")
    ls[i] = line
    return "\n".join(ls), f"attributes L{i + 1} {' '.join(reversed(done))}"


def m_attr_delete(rng, text):
    ls, i, attrs = _op_line_attrs(rng, text)
    if i is None:
        return text, "delete attributes: none"
    chosen = sorted(rng.sample(attrs, min(rng.choice((1, 1, 2, 3)), len(attrs))), key=lambda m: m.start(), reverse=True)
    line = ls[i]
    for m in chosen:
        line = line[: m.start()] + line[m.end():]
    ls[i] = line
    return "\n".join(ls), f"delete attributes L{i + 1} {' '.join(m.group(1) for m in chosen)}"


def m_operator_kind(rng, text):
    from vxc.ir.operators import OPERATORS

    return _replace(rng, text, _OPLINE, "operator kind",
                    lambda m: m.group(1) + rng.choice(list(OPERATORS) + ["nope", "Mixer", "state"]))


def m_word(rng, text):
    vocab = sorted(set(_WORD.findall(text)))
    return _replace(rng, text, _WORD, "word", lambda m: rng.choice(vocab + list(WORDS)))


def m_range(rng, text):
    def make(m):
        a, b = m.group(1), m.group(2)
        return rng.choice((f"{b}..{a}", f"0..{10**12}", "0..-1", f"{a}..{a}", f"{a}..{int(b) + 1}", f"{10**30}..{10**30}",
                           f"-5..{b}", f"{a}..{'9' * 400}"))

    return _replace(rng, text, _RANGE, "range", make)


def m_span(rng, text):
    def make(m):
        s = m.group(0)
        bracket = s.startswith("[")
        a, b = (m.group(1), m.group(2)) if bracket else (m.group(3), m.group(4))
        new = rng.choice((f"{b}:{a}", f"0:{10**12}", f"{a}:{a}", "0:-1", f"-1:{b}", f"{a}:{int(b) + 1}", f"{10**30}:{10**30 + 1}"))
        return f"[{new}]" if bracket else new

    return _replace(rng, text, _SPAN, "slice/take", make)


def m_shape(rng, text):
    def make(m):
        dims = [d for d in (m.group(1) or "").split(",") if d]
        op = rng.choice(("drop", "add", "empty", "zero", "huge", "many"))
        if op == "drop" and dims:
            del dims[rng.randrange(len(dims))]
        elif op == "add":
            dims.insert(rng.randrange(len(dims) + 1), rng.choice(("1", "2", "0", str(10**12))))
        elif op == "empty":
            dims = []
        elif op == "zero" and dims:
            dims[rng.randrange(len(dims))] = "0"
        elif op == "huge" and dims:
            dims[rng.randrange(len(dims))] = rng.choice((str(10**12), str(2**63), str(10**30)))
        elif op == "many":
            dims = dims + ["1"] * rng.choice((8, 64, 1000))
        return "[" + ",".join(dims) + "]"

    return _replace(rng, text, _SHAPE, "shape", make)


def m_layer_block(rng, text):
    ls = _lines(text)
    starts = [i for i, line in enumerate(ls) if re.match(r"\s*layer \d+ \{", line)]
    if not starts:
        return text, "layer block: none"
    i = rng.choice(starts)
    j = next((k for k in range(i + 1, len(ls)) if ls[k].strip() == "}"), len(ls) - 1)
    block = ls[i: j + 1]
    op = rng.choice(("delete", "duplicate", "renumber", "move"))
    if op == "delete":
        del ls[i: j + 1]
    elif op == "duplicate":
        ls[j + 1: j + 1] = block
    elif op == "renumber":
        ls[i] = re.sub(r"layer \d+", f"layer {rng.choice((0, 1, 7, -1, 10**12))}", ls[i], count=1)
    else:
        del ls[i: j + 1]
        k = rng.choice(starts + [0, len(ls)])
        k = min(k, len(ls))
        ls[k:k] = block
    return "\n".join(ls), f"{op} layer block at L{i + 1}"


TEXT_MUTATORS = (
    (m_delete_lines, 3), (m_duplicate_line, 2), (m_swap_lines, 2), (m_token, 4), (m_number, 6), (m_number_everywhere, 5), (m_unicode, 2),
    (m_escape, 2), (m_string, 2), (m_symbol_ref, 4), (m_duplicate_definition, 2), (m_attr_name, 3), (m_attr_values, 8), (m_attr_delete, 3),
    (m_operator_kind, 3), (m_word, 4), (m_range, 2), (m_span, 2), (m_shape, 4), (m_layer_block, 2),
)


def b_truncate(rng, data: bytes):
    n = rng.randrange(len(data) + 1)
    return data[:n], f"truncate at byte {n} of {len(data)}"


def b_bad_utf8(rng, data: bytes):
    bad = rng.choice(BAD_UTF8)
    n = rng.randrange(len(data) + 1)
    return data[:n] + bad + data[n:], f"insert bytes {bad!r} at byte {n}"


def b_nul(rng, data: bytes):
    n = rng.randrange(len(data) + 1)
    return data[:n] + b"\x00" + data[n:], f"insert NUL at byte {n}"


BYTE_MUTATORS = ((b_truncate, 2), (b_bad_utf8, 2), (b_nul, 1))


def _pick(rng, weighted):
    fns, weights = zip(*weighted)
    return rng.choices(fns, weights)[0]


@dataclass
class Case:
    seed: int
    source: str  # the corpus entry
    mutations: list[str]
    data: bytes

    def title(self) -> str:
        return f"seed {self.seed} ({self.source}): {'; '.join(self.mutations)}"


def make_case(seed: int) -> Case:
    rng = random.Random(seed)
    name, text = rng.choice(corpus())
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        text, d = _pick(rng, TEXT_MUTATORS)(rng, text)
        done.append(d)
    data = text.encode("utf-8", errors="surrogatepass")
    if rng.random() < 0.15:
        data, d = _pick(rng, BYTE_MUTATORS)(rng, data)
        done.append(d)
    return Case(seed, name, done, data)


# ---------------------------------------------------------------- classification


@dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    detail: str = ""  # crash: what went wrong (exception type, message, where)
    seconds: float = 0.0
    where: str = ""  # crash: the innermost vxc frame, "file:line" (groups crashes by root cause)
    extra: dict = field(default_factory=dict)


class CaseTimeout(BaseException):
    """Raised by the interval timer in a case past CASE_SECONDS (a BaseException: no ``except Exception`` eats it)."""


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@contextmanager
def memory_cap(extra: int = 4 << 30):
    """Cap the address space at ``extra`` bytes above its current size (a regression that allocates without
    bound is a MemoryError — a crash outcome — instead of taking the machine down); restored on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = _address_space() + extra
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _vxc_frame(tb) -> str:
    frames = [f for f in traceback.extract_tb(tb) if "/vxc/" in f.filename or "/lark/" in f.filename]
    if not frames:
        frames = traceback.extract_tb(tb)
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename.split("/vxc/", 1)[-1] if "/vxc/" in f.filename else f.filename.rsplit("/", 1)[-1]
    return f"{path}:{f.lineno}"


def _crash(e: BaseException, step: str) -> Outcome:
    msg = str(e)
    if len(msg) > 300:
        msg = msg[:300] + f"… ({len(msg)} chars)"
    return Outcome(CRASH, f"{step}: {type(e).__name__}: {msg}", where=_vxc_frame(e.__traceback__))


def _syntax_problem(e, data: bytes, filename: str) -> str | None:
    """Why ``e`` is not a well-located syntax error for ``data``, or None."""
    from vxc.ir.parser import _OTHER_LINE_BREAKS

    lines = _OTHER_LINE_BREAKS.sub("\ufffd", data.decode("utf-8", errors="replace")).split("\n")
    if not isinstance(e.line, int) or not 1 <= e.line <= len(lines):
        return f"line {e.line} is outside the text (1..{len(lines)})"
    src = lines[e.line - 1]
    if not isinstance(e.col, int) or not 1 <= e.col <= len(src) + 1:
        return f"column {e.col} is outside line {e.line} (1..{len(src) + 1})"
    msg = str(e)
    head = f"{filename}:{e.line}:{e.col}: error: "
    if not msg.startswith(head) or not e.message.strip():
        return f"the message does not start {head!r} with a message"
    if "\n" in e.message:
        return "the message spans lines"
    if e.source_line != src.removesuffix("\r"):
        return f"the shown line {_short(e.source_line)} is not line {e.line} {_short(src)}"
    if not msg.endswith("\n  " + e.source_line + "\n  " + " " * (e.col - 1) + "^"):
        return "no caret under the column"
    return None


def _refusal_problem(r) -> str | None:
    from vxc.passes.findings import Finding

    if not r.findings:
        return "a refusal with no findings"
    for f in r.findings:
        if not isinstance(f, Finding) or not f.code or not f.message:
            return f"a finding without code or message: {f!r}"[:300]
    r.text()
    json.dumps(r.to_json(), allow_nan=False)  # what `vxc passes --json` prints: strict JSON
    return None


def _run(data: bytes, filename: str) -> Outcome:
    from vxc.ir.diagnostics import IRSyntaxError
    from vxc.ir.parser import parse, parse_bytes
    from vxc.ir.printer import print_module
    from vxc.passes import surfaces
    from vxc.passes.context import Context
    from vxc.passes.findings import Refusal
    from vxc.passes.manager import DEFAULT_PIPELINE, PassManager, parse_pipeline
    from vxc.passes.plan import print_plan

    try:
        m = parse_bytes(data, filename)
    except IRSyntaxError as e:
        problem = _syntax_problem(e, data, filename)
        return Outcome(SYNTAX) if problem is None else Outcome(CRASH, f"parse: badly located syntax error ({problem}): {_short(str(e), 300)}", where="parser")
    except Exception as e:
        return _crash(e, "parse")

    def fixed_point(module, step: str) -> Outcome | None:
        try:
            text = print_module(module)
        except Exception as e:
            return _crash(e, f"{step}: print")
        try:
            again = print_module(parse(text, "printed.vxir"))
        except Exception as e:
            return _crash(e, f"{step}: parse the printed text")
        if again != text:
            a, b = text.split("\n"), again.split("\n")
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return Outcome(CRASH, f"{step}: print → parse → print is not a fixed point at line {i + 1}: "
                           f"{_short(a[i] if i < len(a) else None, 120)} vs {_short(b[i] if i < len(b) else None, 120)}",
                           where="printer")
        return None

    bad = fixed_point(m, "parsed module")
    if bad is not None:
        return bad
    printed = print_module(m)
    dumps: list[str] = []
    try:
        ctx = PassManager(parse_pipeline(DEFAULT_PIPELINE), print_after_all=True, print_after_failure=True,
                          emit=dumps.append).run(Context(m))
    except Refusal as r:
        try:
            problem = _refusal_problem(r)
        except Exception as e:
            return _crash(e, "render the refusal")
        return Outcome(REFUSAL) if problem is None else Outcome(CRASH, f"pipeline: {problem}", where="refusal")
    except Exception as e:
        return _crash(e, "pipeline")
    try:
        changed = print_module(ctx.module) != printed  # the state pass adds regions to an IR without them
    except Exception as e:
        return _crash(e, "module after the pipeline: print")
    bad = fixed_point(ctx.module, "module after the pipeline") if changed else None
    if bad is not None:
        return bad
    try:
        from rich.console import Console

        from vxc.describe_view import render

        for context in (None, 0, 4096):
            d = surfaces.describe(ctx.plan, context)
            json.dumps(d, indent=1, allow_nan=False)
        render(d, Console(file=io.StringIO(), width=120))
        dot = surfaces.to_dot(ctx.plan)
        print_plan(ctx.plan)
    except Exception as e:
        return _crash(e, "describe")
    for i, line in enumerate(dot.split("\n")):  # Graphviz: every quoted string closed on its line
        if re.sub(r'\\.', "", line).count('"') % 2:
            return Outcome(CRASH, f"describe: to_dot wrote an unbalanced quoted string on line {i + 1}: {_short(line, 120)}", where="surfaces.to_dot")
    return Outcome(ACCEPTED)


def classify(data: bytes, filename: str = FILENAME, seconds: float | None = None) -> Outcome:
    """The outcome of one IR text (bytes, as read from a file); see the module docstring."""
    limit = CASE_SECONDS if seconds is None else seconds

    def alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    t0 = time.perf_counter()
    try:
        out = _run(data, filename)
    except CaseTimeout as e:
        frames = traceback.extract_tb(e.__traceback__)
        inner = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:4])
        out = Outcome(CRASH, f"timeout: more than {limit:g} s, in {inner}", where=f"timeout {_vxc_frame(e.__traceback__)}")
    except MemoryError as e:
        out = _crash(e, "memory cap")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    out.seconds = time.perf_counter() - t0
    if out.kind != CRASH and out.seconds > limit:
        out = Outcome(CRASH, f"slow: {out.seconds:.1f} s (limit {limit:g} s), otherwise {out.kind}", out.seconds, "timeout")
    return out


def run_case(seed: int) -> tuple[Case, Outcome]:
    case = make_case(seed)
    return case, classify(case.data)
