"""The VINDEX3 text: printer/parser round trip, lexer hazards, diagnostics, scale."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from vxc.ir import IRSyntaxError, parse, print_module
from vxc.ir.module import BankPart, Layer, Module, Op, Operand, Region, Source, Tensor, Transform
from vxc.ir.printer import fmt_str, fmt_value
from vxc.ir.roles import Placement, Role

from .strategies import KEYWORDS, SPECIAL_WORDS, canonical, modules, values

# ---------------------------------------------------------------- round trip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(modules())
def test_round_trip(m: Module):
    text = print_module(m)
    back = parse(text, "rt.vxir")
    assert print_module(back) == text
    assert canonical(back) == canonical(m)


@settings(max_examples=300, deadline=None)
@given(values)
def test_attribute_value_round_trip(v):
    m = _tiny_module(mixer_attrs={"a": v, "b": v})
    back = parse(print_module(m))
    assert canonical(back.layers[0].mixer.attrs) == canonical({"a": v, "b": v})


def _tiny_module(mixer_attrs=None, embedding_attrs=None, head_attrs=None, norm_attrs=None) -> Module:
    norm = Op("rmsnorm", dict(norm_attrs or {"eps": 1e-5}), role=Role.PreAttentionNorm)
    layer = Layer(0, "fp32", Placement.PreOnly, [norm], Op("softmax", dict(mixer_attrs or {})), ffn=Op("swiglu", {}))
    return Module(
        "tiny", Source("f", "d", ".", "00"), "bf16", [], [], [],
        Op("embedding", dict(embedding_attrs or {})), [layer], Op("rmsnorm", {}, role=Role.FinalNorm),
        Op("head", dict(head_attrs or {})),
    )


# Every keyword (and special word) as an attribute name, in every position an
# attribute can take: first after the kind, after each kind of value, last
# before the next item, in layer ops and in model-level ops. With LALR's merged
# lookaheads these positions accept different keyword sets, so all are tried.
_AFTER = {"first": {}, "int": {"x": 1}, "float": {"x": 1.5}, "list": {"x": [1]}, "name": {"x": "silu"},
          "str": {"x": "a b"}, "bool": {"x": True}}


@pytest.mark.parametrize("slot", ["mixer", "norm", "embedding", "head"])
@pytest.mark.parametrize("after", list(_AFTER))
def test_keyword_named_attributes(slot, after):
    for word in KEYWORDS + SPECIAL_WORDS:
        attrs = {**_AFTER[after], word: 7, "y": 2}  # "y" after it: the keyword is not last either
        m = _tiny_module(**{f"{slot}_attrs": attrs})
        text = print_module(m)
        back = parse(text)
        op = {"mixer": back.layers[0].mixer, "norm": back.layers[0].norms[0], "embedding": back.embedding, "head": back.head}[slot]
        assert op.attrs == attrs, (word, text)
        assert print_module(back) == text


def test_keyword_list_covers_the_grammar():
    grammar = (Path(__file__).resolve().parents[2] / "grammar" / "vxir.lark").read_text()
    words = set(re.findall(r'"([A-Za-z_][A-Za-z0-9_]*)"', grammar))
    assert words and words <= set(KEYWORDS), sorted(words - set(KEYWORDS))


def test_keyword_named_attribute_last_in_layer_and_module():
    # the attribute is the very last thing before "}" / the next item
    for word in KEYWORDS + SPECIAL_WORDS:
        m = _tiny_module(mixer_attrs={word: 1}, head_attrs={word: 2})
        m.layers[0].ffn = None
        back = parse(print_module(m))
        assert back.layers[0].mixer.attrs == {word: 1} and back.head.attrs == {word: 2}


def test_keyword_spacing_before_equals_is_accepted():
    m = _tiny_module(mixer_attrs={"state": 1})
    text = print_module(m).replace("state=1", "state =  1")
    assert parse(text).layers[0].mixer.attrs == {"state": 1}


def test_string_values_that_look_like_other_tokens_are_quoted():
    for s in ["true", "false", "inf", "nan", "-inf", "1", "1.5", "é", "a b", "", "x=y", "(default)"]:
        assert fmt_value(s).startswith('"'), s
        assert parse(print_module(_tiny_module(mixer_attrs={"a": s}))).layers[0].mixer.attrs == {"a": s}
    assert fmt_value("silu") == "silu" and fmt_value("state") == "state" and fmt_value("infinity") == "infinity"


def test_line_separators_inside_strings_are_escaped():
    # str.splitlines() (used for the diagnostic's source line) breaks on these; lark does not
    for ch in ["\x85", "\u2028", "\u2029"]:
        assert ch not in fmt_str("a" + ch + "b")
    m = _tiny_module()
    m.name = "x\u2028y\x85z"
    text = print_module(m)
    assert len(text.splitlines()) == text.count("\n")
    assert parse(text).name == m.name


@pytest.mark.parametrize("mutate, what", [
    (lambda m: m.layers[0].mixer.attrs.update({"bad-name": 1}), "attribute name"),
    (lambda m: m.layers[0].mixer.attrs.update({"é": 1}), "attribute name"),
    (lambda m: setattr(m.layers[0].mixer, "kind", "soft max"), "operator kind"),
    (lambda m: m.layers[0].mixer.attrs.update({"a": [1, True]}), "lists hold ints"),
    (lambda m: m.layers[0].mixer.attrs.update({"a": (1, 2)}), "cannot print attribute value"),
    (lambda m: m.tensors.append(Tensor("a b", "bf16", (1,), "k", file="w0")), "tensor"),
    (lambda m: m.tensors.append(Tensor("a", "bf16", (1,), "k", file="w-0")), "file"),
    (lambda m: m.tensors.append(Tensor("a", "bf16", (1,), "k.{e}", experts=2)), "no parts"),
    (lambda m: m.operands.append(Operand("o$", "bf16", (1,), ["a"], Role.AttnQ)), "operand"),
    (lambda m: m.operands.append(Operand("o", "bf16", (1,), ["a", "b"], Role.AttnQ)), "no encoding"),
    (lambda m: m.operands.append(Operand("o", "bf16", (1,), ["a"], Role.AttnQ, encoding="mxfp4", part_names=["x", "y"])), "do not match"),
    (lambda m: m.operands.append(Operand("o", "bf16", (1,), ["a"], Role.AttnQ, encoding="concat", part_names=["x"])), "concatenation keyword"),
    (lambda m: m.operands.append(Operand("o", "bf16", (1,), ["a", "b"], Role.AttnQ, parts=[
        Operand("o#0", "bf16", (), ["a"], Role.AttnQ), Operand("o#1", "bf16", (), ["b"], Role.AttnQ)])), "no concat dim"),
    (lambda m: setattr(m.layers[0], "regions", [Region("kv cache", "kv_rows", (1,), "compute", "per_token")]), "region name"),
])
def test_printer_refuses_what_it_cannot_write(mutate, what):
    m = _tiny_module()
    mutate(m)
    with pytest.raises((ValueError, TypeError), match=what):
        print_module(m)


# ---------------------------------------------------------------- diagnostics
#
# One hand-written module; each case mutates it and states, MLIR
# expected-error style, where the error must be reported and what it says.
# Line and column constants are counted by hand from BASE (1-based), never
# computed from the parser; `at` is the text the caret must sit on.

BASE = """\
vindex3 schema 6
module "tiny" {
  source frontend "f" dialect "d" model_dir "." config_sha256 "abc"
  fact tied true evidence "no lm_head tensor"
  compute bf16
  file @w0 "model.safetensors" size 1024 header_sha256 "00"
  tensor $emb bf16[8,4] @w0 "embed.weight"
  tensor $qkv bf16[12,4] @w0 "layers.0.qkv.weight"
  tensor $exp bf16[4,4] bank "experts.{e}.w" experts 2 @w0 0..1
  operand %emb bf16[8,4] = $emb role Embedding
  operand %q bf16[4,4] = $qkv | slice 0 [0:4] layer 0 role AttnQ
  embedding embedding vocab=8 padded_vocab=8 dim=4
  layer 0 {
    residual fp32
    placement PreOnly
    norm PreAttentionNorm rmsnorm dim=4 eps=1e-05 zero_centred=false
    mixer softmax heads=1 kv_heads=1 head_dim=4 window=0 scale=0.5 (default)
    state kv kv_rows [2,1,4] compute per_token
  }
  final_norm FinalNorm rmsnorm dim=4 eps=1e-05 zero_centred=false
  head head tied=true padded_vocab=8 dim=4
}
"""


def _replace_line(n: int, old: str, new: str):
    def f(text: str) -> str:
        lines = text.split("\n")
        assert lines[n - 1].count(old) == 1, (n, old)
        lines[n - 1] = lines[n - 1].replace(old, new)
        return "\n".join(lines)
    return f


def _delete_line(n: int):
    return lambda text: "\n".join(l for i, l in enumerate(text.split("\n"), 1) if i != n)


def _truncate_after(n: int, prefix: str):
    def f(text: str) -> str:
        lines = text.split("\n")
        assert lines[n - 1].startswith(prefix), (n, prefix)
        return "\n".join(lines[: n - 1] + [prefix])
    return f


# (case id, mutation, expected line, expected column, text at the caret, message substring)
ERRORS = [
    ("unknown-role", _replace_line(10, "role Embedding", "role Embeding"), 10, 38, "Embeding", "unknown role Embeding"),
    ("unknown-role-layer-op", _replace_line(16, "PreAttentionNorm", "PreAttnNorm"), 16, 10, "PreAttnNorm", "unknown role PreAttnNorm"),
    ("unknown-dtype", _replace_line(7, "bf16", "bf17"), 7, 15, "bf17", "unknown dtype bf17"),
    ("unknown-operand-dtype", _replace_line(11, "bf16", "fp4"), 11, 14, "fp4", "unknown dtype fp4"),
    ("unknown-compute-dtype", _replace_line(5, "bf16", "half"), 5, 11, "half", "unknown dtype half"),
    ("unknown-placement", _replace_line(15, "PreOnly", "PreOnce"), 15, 15, "PreOnce", "unknown placement PreOnce"),
    ("unknown-region-kind", _replace_line(18, "kv_rows", "kv_cols"), 18, 14, "kv_cols", "unknown region kind kv_cols"),
    ("unknown-precision", _replace_line(18, "compute", "f8"), 18, 30, "f8", "unknown precision f8"),
    ("unknown-growth", _replace_line(18, "per_token", "grows"), 18, 38, "grows", "unknown growth grows"),
    ("bad-residual", _replace_line(14, "fp32", "bf16"), 14, 14, "bf16", "residual must be fp32 or compute"),
    # the layer's "}" is missing: the next model-level item is found inside the layer
    ("missing-layer-brace", _delete_line(19), 19, 3, "final_norm", "unexpected FINAL_NORM 'final_norm'"),
    # the module's "}" is missing: the input ends just after the head's last attribute
    ("missing-module-brace", _delete_line(22), 21, 43, "", "unexpected end of input"),
    ("truncated-mid-attribute", _truncate_after(17, "    mixer softmax heads=1 kv_heads=1 head_dim=4 window=0 scale="), 17, 64, "", "unexpected end of input"),
    ("truncated-at-line-end", _truncate_after(14, "    residual fp32"), 14, 18, "", "unexpected end of input"),
    ("empty-file", lambda text: "", 1, 1, "", "unexpected end of input"),
    ("garbage-unicode", _replace_line(5, "bf16", "bf16 §"), 5, 16, "§", "unexpected character '§'"),
    ("garbage-ascii", _replace_line(17, "head_dim=4", "head_dim=4 ~~"), 17, 49, "~~", "unexpected character '~'"),
    ("garbage-word", _replace_line(8, '"layers.0.qkv.weight"', '"layers.0.qkv.weight" junk'), 8, 52, "junk", "unexpected"),
    ("attribute-twice", _replace_line(16, "zero_centred=false", "zero_centred=false dim=5"), 16, 70, "dim=5", "attribute dim given twice"),
    ("attribute-twice-model-level", _replace_line(21, "dim=4", "dim=4 tied=false"), 21, 44, "tied=false", "attribute tied given twice"),
    ("layer-missing-mixer", _delete_line(17), 13, 9, "0 {", "layer 0: missing mixer"),
    ("layer-missing-placement", _delete_line(15), 13, 9, "0 {", "layer 0: missing placement"),
    ("module-missing-head", _delete_line(21), 2, 8, '"tiny"', "module: missing head"),
    ("raw-control-char-in-string", _replace_line(7, '"embed.weight"', '"embed\tweight"'), 7, 29, '"embed', "invalid string literal: Invalid control character"),
    ("bad-escape-in-string", _replace_line(6, '"model.safetensors"', '"model\\qx"'), 6, 12, '"model', "invalid string literal: Invalid \\escape"),
    ("newline-in-string", _replace_line(3, '"abc"', '"a\nbc"'), 3, 63, '"a', "invalid string literal"),
]


@pytest.mark.parametrize("case, mutate, line, col, at, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_diagnostics(case, mutate, line, col, at, message):
    parse(BASE, "tiny.vxir")  # the base itself is valid
    text = mutate(BASE)
    with pytest.raises(IRSyntaxError) as info:
        parse(text, "tiny.vxir")
    e = info.value
    out = str(e).split("\n")
    assert out[0].startswith(f"tiny.vxir:{line}:{col}: error: "), out[0]
    assert message in out[0], out[0]
    source_line = text.split("\n")[line - 1] if text else ""
    assert out[1] == "  " + source_line
    assert out[2] == "  " + " " * (col - 1) + "^"
    assert source_line[col - 1:].startswith(at)
    if at == "":  # end of input: the caret sits just past the line's last character
        assert col == len(source_line.rstrip()) + 1 or text == ""
    assert (e.line, e.col, e.filename) == (line, col, "tiny.vxir")


@pytest.mark.parametrize("odd", ['"embed\\n\\nweight"', '"embed\u2028weight"', '"embed\u2029weight"',
                                 '"embed\x85weight"', '"embed.weight"\x0c', '"embed.weight" \r '])
def test_error_after_odd_line_breaks_shows_the_right_line(odd):
    # lark counts "\n" only; str.splitlines() also breaks on these (raw, in or after a key on line 7)
    text = BASE.replace('"embed.weight"', odd).replace("role Embedding", "role Embeding")
    with pytest.raises(IRSyntaxError) as info:
        parse(text, "tiny.vxir")
    out = str(info.value).split("\n")
    assert out[0] == "tiny.vxir:10:38: error: unknown role Embeding"
    assert out[1] == "  " + BASE.split("\n")[9].replace("Embedding", "Embeding")
    assert out[2].index("^") == 2 + 37


def test_error_on_a_line_holding_an_odd_line_break():
    text = BASE.replace("role Embedding", "role Embeding").replace("operand %emb", "operand %emb\u2028")
    with pytest.raises(IRSyntaxError) as info:
        parse(text, "tiny.vxir")
    out = str(info.value).split("\n")
    assert out[0].startswith("tiny.vxir:10:")  # the raw U+2028 is garbage there, reported on line 10
    assert out[1].startswith("  ") and "%emb" in out[1]


# ---------------------------------------------------------------- scale


def _big_module(n_layers: int = 240) -> Module:
    tensors, operands, layers = [], [], []
    for i in range(n_layers):
        for j, role in enumerate([Role.AttnQ, Role.AttnK, Role.AttnV, Role.AttnO, Role.FfnGate, Role.FfnUp, Role.FfnDown]):
            tensors.append(Tensor(f"l{i}.t{j}", "bf16", (4096, 4096), f"model.layers.{i}.w{j}.weight", file=f"w{i % 7}"))
            operands.append(Operand(f"l{i}.o{j}", "bf16", (4096, 4096), [f"l{i}.t{j}"], role, layer=i,
                                    transforms=[Transform("slice", dim=0, start=0, stop=4096)] if j == 0 else []))
        tensors.append(Tensor(f"l{i}.e", "bf16", (512, 2048), "model.layers.%d.mlp.experts.{e}.gate_proj.weight" % i,
                              experts=512, parts=[BankPart("w0", 0, 255), BankPart("w1", 256, 511)]))
        layers.append(Layer(
            i, "fp32", Placement.PreOnly,
            [Op("rmsnorm", {"dim": 4096, "eps": 1e-6, "zero_centred": False}, role=Role.PreAttentionNorm),
             Op("rmsnorm", {"dim": 4096, "eps": 1e-6, "zero_centred": False}, role=Role.PreFfnNorm)],
            Op("softmax", {"d_model": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "window": 0,
                           "scale": 0.08838834764831845, "rotary_layout": "half"}, defaults={"scale"}),
            ffn=Op("swiglu", {"d_model": 4096, "intermediate": 14336, "act": "silu"}),
            regions=[Region("kv", "kv_rows", (2, 8, 128), "compute", "per_token")],
        ))
    return Module(
        "big", Source("f", "d", ".", "00"), "bf16", [], tensors, operands,
        Op("embedding", {"vocab": 128256}), layers, Op("rmsnorm", {"eps": 1e-6}, role=Role.FinalNorm),
        Op("head", {"tied": False}),
    )


def test_parse_5000_lines():
    m = _big_module()
    text = print_module(m)
    n_lines = text.count("\n")
    assert n_lines >= 5000
    t0 = time.perf_counter()
    back = parse(text, "big.vxir")
    dt = time.perf_counter() - t0
    print(f"parsed {n_lines} lines in {dt:.3f} s")  # informative only: no timing assert
    assert canonical(back) == canonical(m)
