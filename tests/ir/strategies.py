"""Hypothesis strategies for random but printable VINDEX3 modules.

"Valid" here means valid *text*: every value is one the printer can write and
the grammar (plus the parser's schema checks: roles, dtypes, placements,
region kinds, precisions, growths) accepts. The modules are not meant to pass
closure or the view algebra; shapes, indices and operator kinds are arbitrary.

Two representational facts the strategies respect (the text cannot tell them
apart, so neither side can round-trip them):
- ``Layer.regions`` is ``None`` or non-empty (``[]`` prints like ``None``);
- ``Region.window`` is 0 or positive (0 is printed as no ``window``);
- ``Op.defaults`` is a subset of ``Op.attrs``.

``canonical(obj)`` turns a module (or any part) into nested tuples that
compare field by field, ignoring ``loc``, keeping int/bool/float apart and
comparing floats by ``repr`` (so ``nan`` equals ``nan`` and ``-0.0`` is not
``0.0``).
"""

from __future__ import annotations

import dataclasses
import enum

from hypothesis import strategies as st

from vxc.ir.module import (
    DTYPES, BankPart, Fact, FileEntry, IndexEntry, Layer, Module, Op, Operand, Region, Source,
    Tensor, Transform,
)
from vxc.ir.operators import GROWTHS, PRECISIONS, REGION_KINDS
from vxc.ir.roles import Placement, Role

# Every keyword of grammar/vxir.lark, plus the words the lexer treats specially
# as values. Identifiers are drawn from these often: each is a lexer hazard
# somewhere.
KEYWORDS = (
    "vindex3", "schema", "module", "source", "frontend", "dialect", "model_dir", "config_sha256",
    "fact", "evidence", "compute", "index", "size", "sha256", "file", "header_sha256", "tensor",
    "bank", "experts", "operand", "layer", "role", "slice", "gather", "groups", "reshape",
    "transpose", "log_neg", "embedding", "final_norm", "head", "residual", "placement", "norm", "mixer", "ffn",
    "state", "window", "format", "activations", "concat",
)
SPECIAL_WORDS = ("true", "false", "inf", "nan", "infinity", "nan_", "inf0", "e5", "E", "_")

identifiers = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True),
    st.sampled_from(KEYWORDS + SPECIAL_WORDS),
)

AWKWARD = (
    "", '"', "\\", '\\"', '"\\', "{e}", "a.{e}.b", "{e}{e}", "{", "}", "\n", "\r\n", "\t", "\x00",
    "\x1f", "\x7f", "\x85", "\u2028", "\u2029", "é", "Ω", "日本語", "😀", "\U0010ffff", "\ufeff",
    "# not a comment", "$x", "@w0", "%o", "1..3", "role AttnQ", "'", "\\u0041",
)
texts = st.one_of(
    st.sampled_from(AWKWARD),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=16),
    st.lists(st.sampled_from(AWKWARD), max_size=4).map("".join),
)

# symbol names exactly as the grammar's FILESYM / TSYM / OSYM allow them
file_syms = st.from_regex(r"[A-Za-z0-9_.]{1,8}", fullmatch=True)
tensor_syms = st.from_regex(r"[A-Za-z0-9_.]{1,12}", fullmatch=True)
operand_syms = st.from_regex(r"[A-Za-z0-9_.\-]{1,12}", fullmatch=True)

dtypes = st.sampled_from(sorted(DTYPES))
roles = st.sampled_from(list(Role))
dims = st.one_of(st.integers(0, 9000), st.sampled_from([1, 2**31, 2**40]))
shapes = st.lists(dims, max_size=4).map(tuple)
small_ints = st.integers(-3, 64)
sizes = st.one_of(st.integers(0, 2**34), st.just(2**63 - 1))

ints = st.one_of(st.integers(-10, 10), st.integers(-(2**64), 2**64))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([
        float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308,
        1e-300, 1.7976931348623157e308, -1.7976931348623157e308, 1e16, 1e22, 1e-5, 0.1, 10000.0,
        0.08838834764831845, 1.5e300,
    ]),
)
values = st.one_of(
    ints,
    floats,
    st.booleans(),
    identifiers,  # enum-like bare words (and, among them, keywords and specials: printed quoted if needed)
    texts,  # anything, quoted
    st.lists(ints, max_size=5),  # including []
)


@st.composite
def transforms(draw) -> Transform:
    kind = draw(st.sampled_from(["slice", "gather", "reshape", "transpose"]))
    if kind == "slice":
        return Transform("slice", dim=draw(small_ints), start=draw(dims), stop=draw(dims))
    if kind == "gather":
        takes = draw(st.lists(st.tuples(dims, dims), min_size=1, max_size=5))
        return Transform("gather", dim=draw(small_ints), groups=draw(dims), takes=takes)
    if kind == "reshape":
        shape = draw(st.lists(st.one_of(dims, st.just(-1)), max_size=5).map(tuple))
        return Transform("reshape", shape=shape)
    return Transform("transpose", dim=draw(small_ints), dim2=draw(small_ints))


@st.composite
def ops(draw, role: bool = False) -> Op:
    attrs = draw(st.dictionaries(identifiers, values, max_size=6))
    names = list(attrs)
    defaults = {n for n in names if draw(st.booleans())}
    return Op(draw(identifiers), attrs, defaults, role=draw(roles) if role else None)


@st.composite
def tensors(draw) -> Tensor:
    sym, dtype, shape = draw(tensor_syms), draw(dtypes), draw(shapes)
    if draw(st.booleans()):
        return Tensor(sym, dtype, shape, draw(texts), file=draw(file_syms))
    key = draw(st.one_of(texts, texts.map(lambda s: s + ".{e}." + s)))
    parts = draw(st.lists(st.builds(BankPart, file_syms, st.integers(0, 600), st.integers(0, 600)), min_size=1, max_size=4))
    return Tensor(sym, dtype, shape, key, experts=draw(st.integers(0, 1024)), parts=parts)


@st.composite
def operands(draw) -> Operand:
    if draw(st.booleans()):
        encoding, names, sources = None, [], [draw(tensor_syms)]
    else:
        n = draw(st.integers(1, 4))
        encoding = draw(st.one_of(st.just("mxfp4"), identifiers.filter(lambda n: n != "concat")))  # (the keyword)
        names = draw(st.lists(identifiers, min_size=n, max_size=n))
        sources = draw(st.lists(tensor_syms, min_size=n, max_size=n))
    return Operand(
        draw(operand_syms), draw(dtypes), draw(shapes), sources, draw(roles),
        layer=draw(st.one_of(st.none(), st.integers(0, 200))), encoding=encoding, part_names=names,
        transforms=draw(st.lists(transforms(), max_size=5)),
    )


regions = st.builds(
    Region, identifiers, st.sampled_from(REGION_KINDS), shapes, st.sampled_from(PRECISIONS),
    st.sampled_from(GROWTHS), window=st.one_of(st.just(0), st.integers(1, 2**20)),
)


@st.composite
def layers(draw) -> Layer:
    placement = draw(st.sampled_from(list(Placement)))
    return Layer(
        draw(st.integers(0, 500)),
        draw(st.sampled_from(["fp32", "compute"])),
        placement,
        draw(st.lists(ops(role=True), max_size=3)),
        draw(ops()),
        ffn=draw(st.one_of(st.none(), ops())),
        regions=draw(st.one_of(st.none(), st.lists(regions, min_size=1, max_size=3))),
        # a second mixer line: only a Parallel layer may spell one
        parallel=draw(st.one_of(st.none(), ops())) if placement == Placement.Parallel else None,
    )


@st.composite
def modules(draw, max_items: int = 4) -> Module:
    lists = lambda s: st.lists(s, max_size=max_items)  # noqa: E731
    return Module(
        draw(texts),
        draw(st.builds(Source, texts, texts, texts, texts)),
        draw(dtypes),
        draw(lists(st.builds(FileEntry, file_syms, texts, sizes, texts))),
        draw(lists(tensors())),
        draw(lists(operands())),
        draw(ops()),
        draw(lists(layers())),
        draw(ops(role=True)),
        draw(ops()),
        facts=draw(lists(st.builds(Fact, identifiers, values, texts))),
        index=draw(st.one_of(st.none(), st.builds(IndexEntry, texts, sizes, texts))),
        schema=draw(st.one_of(st.just(6), st.integers(0, 99))),
    )


def canonical(obj):
    """Field-by-field comparable form: ignores ``loc``, types kept apart, floats by repr."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__,) + tuple(
            (f.name, canonical(getattr(obj, f.name))) for f in dataclasses.fields(obj) if f.name != "loc"
        )
    if isinstance(obj, enum.Enum):
        return ("enum", type(obj).__name__, obj.value)
    if isinstance(obj, bool):
        return ("bool", obj)
    if isinstance(obj, int):
        return ("int", obj)
    if isinstance(obj, float):
        return ("float", repr(obj))
    if isinstance(obj, str):
        return ("str", obj)
    if obj is None:
        return ("none",)
    if isinstance(obj, dict):
        return ("dict",) + tuple((canonical(k), canonical(v)) for k, v in obj.items())  # order matters: it is printed
    if isinstance(obj, (set, frozenset)):
        return ("set",) + tuple(sorted(canonical(x) for x in obj))
    if isinstance(obj, list):
        return ("list",) + tuple(canonical(x) for x in obj)
    if isinstance(obj, tuple):
        return ("tuple",) + tuple(canonical(x) for x in obj)
    raise TypeError(f"canonical: unexpected {type(obj).__name__} {obj!r}")
