"""VINDEX3 text → Module objects, with line:col positions kept.

Uses the LALR parser generated from ``grammar/vxir.lark`` (real-geometry IRs
have thousands of lines). Every error — lexical, syntactic or a value the
grammar admits but the schema does not (an unknown role, dtype or
placement) — is an :class:`IRSyntaxError` naming file:line:col with a caret.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from .diagnostics import IRSyntaxError
from .module import (
    DTYPES, BankPart, Fact, FileEntry, IndexEntry, Layer, Loc, Module, Op, Operand, Region,
    Source, Tensor, Transform,
)
from .ggml import ACTIVATION_PRECISIONS, ENCODINGS as GGML_ENCODINGS
from .operators import GROWTHS, PRECISIONS, REGION_KINDS
from .roles import Placement, Role

FILE_FORMATS = ("safetensors", "gguf")

GRAMMAR = Path(__file__).resolve().parents[2] / "grammar" / "vxir.lark"


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=True)


class _Semantic(Exception):
    def __init__(self, tok, message: str):
        self.line = getattr(tok, "line", 0) or 0
        self.col = getattr(tok, "column", 0) or 0
        self.message = message


def _role(tok: Token) -> Role:
    try:
        return Role(str(tok))
    except ValueError:
        raise _Semantic(tok, f"unknown role {tok}") from None


def _dtype(tok: Token) -> str:
    if str(tok) not in DTYPES:
        raise _Semantic(tok, f"unknown dtype {tok} (known: {', '.join(DTYPES)})")
    return str(tok)


def _str(tok: Token) -> str:
    try:
        value = json.loads(str(tok))
    except json.JSONDecodeError as e:  # a raw control character, a bad escape
        raise _Semantic(tok, f"invalid string literal: {e.msg}") from None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape (\ud800): no text can hold it, no printer could write it
        raise _Semantic(tok, "invalid string literal: a \\u escape names a lone surrogate") from None
    return value


class _Build(Transformer):
    def __init__(self, filename: str):
        super().__init__()
        self.filename = filename

    def _loc(self, tok) -> Loc:
        return Loc(self.filename, getattr(tok, "line", 0) or 0, getattr(tok, "column", 0) or 0)

    # values
    def int_value(self, c):
        return int(c[0])

    def float_value(self, c):
        return float(c[0])

    def str_value(self, c):
        return _str(c[0])

    def name_value(self, c):
        s = str(c[0])
        return {"true": True, "false": False}.get(s, s)

    def list_value(self, c):
        return [int(x) for x in c if x is not None]

    def shape(self, c):
        return tuple(int(x) for x in c if x is not None)

    def typed(self, c):
        return (_dtype(c[0]), c[1], c[0])

    def attr(self, c):
        name, value, default = c
        return (name, value, default is not None)  # the name token: a duplicate is reported at it

    # header / provenance
    def header(self, c):
        return ("schema", int(c[0]), c[0])

    def source(self, c):
        return ("source", Source(*(_str(x) for x in c)))

    def fact(self, c):
        return ("fact", Fact(str(c[0]), c[1], _str(c[2])))

    def compute(self, c):
        return ("compute", _dtype(c[0]))

    def index(self, c):
        return ("index", IndexEntry(_str(c[0]), int(c[1]), _str(c[2])))

    def file_format(self, c):
        if str(c[0]) not in FILE_FORMATS:
            raise _Semantic(c[0], f"unknown file format {c[0]} (known: {', '.join(FILE_FORMATS)})")
        return str(c[0])

    def file(self, c):
        sym, path, fmt, size, digest = c
        return ("file", FileEntry(str(sym)[1:], _str(path), int(size), _str(digest), format=fmt or "safetensors"))

    def tensor_single(self, c):
        sym, (dtype, shape, _), fsym, key = c
        return ("tensor", Tensor(str(sym)[1:], dtype, shape, _str(key), file=str(fsym)[1:], loc=self._loc(sym)))

    def bank_part(self, c):
        return BankPart(str(c[0])[1:], int(c[1]), int(c[2]))

    def tensor_bank(self, c):
        sym, (dtype, shape, _), key, experts, *parts = c
        return ("tensor", Tensor(str(sym)[1:], dtype, shape, _str(key), experts=int(experts), parts=parts, loc=self._loc(sym)))

    # operands
    def plain_source(self, c):
        return (None, [], [str(c[0])[1:]])

    def enc_part(self, c):
        return (str(c[0]), str(c[1])[1:])

    def encoded_source(self, c):
        parts = c[1:]
        return (str(c[0]), [p[0] for p in parts], [p[1] for p in parts])

    def concat_part(self, c):
        (enc, names, sources), *transforms = c
        return (enc, names, sources, list(transforms))

    def concat_source(self, c):
        return ("concat", int(c[0]), list(c[1:]))

    def slice(self, c):
        return Transform("slice", dim=int(c[0]), start=int(c[1]), stop=int(c[2]))

    def take(self, c):
        return (int(c[0]), int(c[1]))

    def gather(self, c):
        return Transform("gather", dim=int(c[0]), groups=int(c[1]), takes=list(c[2:]))

    def reshape(self, c):
        return Transform("reshape", shape=c[0])

    def transpose(self, c):
        return Transform("transpose", dim=int(c[0]), dim2=int(c[1]))

    def log_neg(self, c):
        return Transform("log_neg")

    def layer_ref(self, c):
        return int(c[0])

    def activations(self, c):
        return c[0]

    def operand(self, c):
        sym, (dtype, shape, _), src, *rest = c
        concat_dim, parts = None, []
        if src[0] == "concat":
            _, concat_dim, raw = src
            parts = [(e, n, s, t) for e, n, s, t in raw]
            enc, names, sources = None, [], [x for p in parts for x in p[2]]
        else:
            enc, names, sources = src
        act_tok = rest[-1]
        role_tok = rest[-2]
        layer = rest[-3]
        transforms = rest[:-3]
        act = None
        if act_tok is not None:
            act = str(act_tok)
            if act not in ACTIVATION_PRECISIONS:
                raise _Semantic(act_tok, f"unknown activation precision {act!r} (known: {', '.join(ACTIVATION_PRECISIONS)})")
            if enc not in GGML_ENCODINGS:
                raise _Semantic(act_tok, f"operand %{str(sym)[1:]} declares activations {act} but is not ggml "
                                         f"block-encoded (only an encoded weight's products quantise their activations)")
        role, loc = _role(role_tok), self._loc(sym)
        return ("operand", Operand(
            str(sym)[1:], dtype, shape, sources, role, layer=layer, encoding=enc,
            part_names=names, transforms=list(transforms), loc=loc, activations=act, concat_dim=concat_dim,
            parts=[Operand(f"{str(sym)[1:]}#{i}", dtype, (), s, role, layer=layer, encoding=e, part_names=n, transforms=t,
                           loc=loc) for i, (e, n, s, t) in enumerate(parts)],
        ))

    # operators
    def _op(self, kind_tok, attrs, role=None) -> Op:
        a, d = {}, set()
        for name_tok, value, is_default in attrs:
            name = str(name_tok)
            if name in a:
                raise _Semantic(name_tok, f"attribute {name} given twice")
            a[name] = value
            if is_default:
                d.add(name)
        return Op(str(kind_tok), a, d, role=role, loc=self._loc(kind_tok))

    def embedding(self, c):
        return ("embedding", self._op(c[0], c[1:]))

    def final_norm(self, c):
        return ("final_norm", self._op(c[1], c[2:], role=_role(c[0])))

    def head(self, c):
        return ("head", self._op(c[0], c[1:]))

    def residual(self, c):
        if str(c[0]) not in ("fp32", "compute"):
            raise _Semantic(c[0], f"residual must be fp32 or compute, not {c[0]}")
        return ("residual", str(c[0]))

    def placement(self, c):
        try:
            return ("placement", Placement(str(c[0])))
        except ValueError:
            raise _Semantic(c[0], f"unknown placement {c[0]} (known: {', '.join(p.value for p in Placement)})") from None

    def norm(self, c):
        return ("norm", self._op(c[1], c[2:], role=_role(c[0])))

    def mixer(self, c):
        return ("mixer", self._op(c[0], c[1:]))

    def ffn(self, c):
        return ("ffn", self._op(c[0], c[1:]))

    def window(self, c):
        return int(c[0])

    def region(self, c):
        name, kind, shape, precision, growth, window = c
        for tok, allowed, what in ((kind, REGION_KINDS, "region kind"), (precision, PRECISIONS, "precision"), (growth, GROWTHS, "growth")):
            if str(tok) not in allowed:
                raise _Semantic(tok, f"unknown {what} {tok} (known: {', '.join(allowed)})")
        return ("region", Region(str(name), str(kind), shape, str(precision), str(growth), window or 0, loc=self._loc(name)))

    def layer(self, c):
        idx_tok, *items = c
        fields = {"residual": None, "placement": None, "mixer": None, "ffn": None}
        norms, regions, parallel = [], [], None
        for tag, val in items:
            if tag == "norm":
                norms.append(val)
            elif tag == "region":
                regions.append(val)
            else:
                if tag == "mixer" and fields["mixer"] is not None and parallel is None:
                    parallel = val  # a second mixer line: only placement Parallel declares one (checked below)
                    continue
                if fields[tag] is not None:
                    raise _Semantic(idx_tok, f"layer {idx_tok}: {tag} given {'three times' if tag == 'mixer' else 'twice'}")
                fields[tag] = val
        if parallel is not None and fields["placement"] != Placement.Parallel:
            raise _Semantic(idx_tok, f"layer {idx_tok}: mixer given twice (only placement Parallel declares two mixers)")
        # PreFfn is the one placement without a mixer sub-block (verify checks the layer's structure)
        for tag in ("residual", "placement") + (() if fields["placement"] == Placement.PreFfn else ("mixer",)):
            if fields[tag] is None:
                raise _Semantic(idx_tok, f"layer {idx_tok}: missing {tag}")
        return ("layer", Layer(int(idx_tok), fields["residual"], fields["placement"], norms, fields["mixer"],
                               fields["ffn"], regions if regions else None, loc=self._loc(idx_tok), parallel=parallel))

    def module(self, c):
        name_tok, *items = c
        got: dict = {"files": [], "tensors": [], "operands": [], "layers": [], "facts": []}
        single = {"source": None, "compute": None, "index": None, "embedding": None, "final_norm": None, "head": None}
        plural = {"file": "files", "tensor": "tensors", "operand": "operands", "layer": "layers", "fact": "facts"}
        for tag, val in items:
            if tag in plural:
                got[plural[tag]].append(val)
            else:
                if single[tag] is not None:
                    raise _Semantic(name_tok, f"module: {tag} given twice")
                single[tag] = val
        for tag in ("source", "compute", "embedding", "final_norm", "head"):
            if single[tag] is None:
                raise _Semantic(name_tok, f"module: missing {tag}")
        return Module(
            _str(name_tok), single["source"], single["compute"], got["files"], got["tensors"],
            got["operands"], single["embedding"], got["layers"], single["final_norm"], single["head"],
            facts=got["facts"], index=single["index"], loc=self._loc(name_tok),
        )

    def start(self, c):
        (_, schema, tok), module = c
        module.schema = schema
        return module


def _describe_unexpected(e: UnexpectedInput) -> str:
    if isinstance(e, UnexpectedCharacters):
        return f"unexpected character {e.char!r}"
    if isinstance(e, UnexpectedEOF):
        return "unexpected end of input"
    if isinstance(e, UnexpectedToken):
        tok = e.token
        if tok.type == "$END":
            return "unexpected end of input"
        exp = sorted(x for x in e.expected if not x.startswith("__"))
        exp_txt = f" (expected one of: {', '.join(exp[:8])}{', …' if len(exp) > 8 else ''})" if exp else ""
        return f"unexpected {tok.type} {str(tok)!r}{exp_txt}"
    return str(e)


# Characters str.splitlines() breaks on but lark does not count as new lines
# (it counts "\n" only); a lone "\r" is one of them, "\r\n" is not.
_OTHER_LINE_BREAKS = re.compile("\r(?!\n)|[\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _error(filename: str, text: str, line: int, col: int, message: str) -> IRSyntaxError:
    # IRSyntaxError picks the source line with splitlines(); blank out the other
    # line breaks (one character each, so columns stay) to show lark's line
    return IRSyntaxError(filename, _OTHER_LINE_BREAKS.sub("\ufffd", text), line, col, message)


def parse(text: str, filename: str = "<input>") -> Module:
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        line = getattr(e, "line", 0)
        col = getattr(e, "column", 0)
        tok = getattr(e, "token", None)
        if isinstance(e, UnexpectedToken) and tok.type == "$END" and tok.end_line is not None:
            # lark places $END at the last token's start; point just past that token instead
            line, col = tok.end_line, tok.end_column
        elif isinstance(e, (UnexpectedEOF,)) or line in (-1, 0, None):
            lines = text.split("\n")
            line, col = len(lines), len(lines[-1]) + 1
        raise _error(filename, text, line, col, _describe_unexpected(e)) from None
    try:
        return _Build(filename).transform(tree)
    except VisitError as e:
        orig = e.orig_exc
        if isinstance(orig, _Semantic):
            raise _error(filename, text, orig.line, orig.col, orig.message) from None
        if isinstance(orig, (ValueError, OverflowError)):  # e.g. an integer literal past int()'s digit limit
            meta = getattr(e.obj, "meta", e.obj)
            line, col = getattr(meta, "line", 1) or 1, getattr(meta, "column", 1) or 1
            raise _error(filename, text, line, col, f"invalid literal: {str(orig)[:200]}") from None
        raise


def parse_bytes(data: bytes, filename: str = "<input>") -> Module:
    """Parse the bytes of an IR file; bytes that are not UTF-8 are a located syntax error, not a decode traceback."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8")
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        shown = data.decode("utf-8", errors="replace")
        raise _error(filename, shown, line, col, f"the file is not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    return parse(text, filename)


def parse_file(path: str | Path) -> Module:
    """Parse an IR file (see :func:`parse_bytes`)."""
    p = Path(path)
    return parse_bytes(p.read_bytes(), str(p))
