"""A ``tokenizers.Tokenizer`` built from a GGUF file's metadata (``tokenizer.ggml.*``), token-identical to the one
transformers builds from the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, transformers 5.x).

Supported ``tokenizer.ggml.model`` values:

``gpt2``  byte-level BPE. The vocabulary is the token list (already spelled in GPT-2's byte-to-unicode alphabet; a
          token with any character outside that alphabet is re-spelled from its UTF-8 bytes, as transformers does),
          the merges are the file's. Text is split by the regex ``tokenizer.ggml.pre`` names (table below); a
          ``pre`` the table lacks, or none, gets GPT-2's own split (the ``ByteLevel`` regex), silently, as in
          transformers. ``ByteLevel`` decoder.
``llama`` SentencePiece-style BPE over ``▁``-spelled pieces with byte fallback (``<0xNN>`` pieces): merges from the
          file, or, when it has none, rebuilt from the vocabulary and ``tokenizer.ggml.scores`` the way
          transformers' ``generate_merges`` does. ``Metaspace`` pre-tokenizer prepending ``▁`` to the first word
          (transformers ignores ``tokenizer.ggml.add_space_prefix``, so this does too).
          Files whose ``general.architecture`` is gemma/gemma2/gemma3 are built as transformers' ``gemma_tokenizer``
          builds them: a token of only spaces respelled as that many ``▁``, merges (absent from these files) rebuilt
          ranked by the token's position in the file (Gemma's scores do not follow its merge order), spaces turned
          into ``▁`` by a normalizer with no prefix space, and GemmaTokenizer's ``<unk> <bos> <eos> <pad> <mask>``
          as its default special names. phi3 is refused: transformers builds it differently and this module
          does not reproduce it.

Special tokens, as transformers makes them: every token typed CONTROL (3) becomes a special added token (for
``gpt2`` only when spelled in the byte alphabet: a CONTROL token with other characters is a llama.cpp mislabel and
stays an ordinary vocabulary entry); every USER_DEFINED (4) token present in the vocabulary becomes a non-special
added token; the bos/eos/unk/pad tokens the file names, and the builder's default names (``<|endoftext|>`` for
``gpt2``; ``<unk>``, ``<s>``, ``</s>`` for ``llama``), become special added tokens. All match the raw text
(``normalized=False``).

BOS/EOS on ``encode(..., add_special_tokens=True)``: a post-processor prepends BOS when
``tokenizer.ggml.add_bos_token`` is true (absent: false for ``gpt2``, true for ``llama``) and appends EOS when
``tokenizer.ggml.add_eos_token`` is true (absent: false); a flag naming a token the file does not give is off.

One deliberate divergence: when one of those special names is not in the vocabulary (``<|endoftext|>`` in a llama-3
vocabulary, say), transformers appends it as a new token with an id past the end of the file's vocabulary -- an id
the model has no embedding for. This module does not add it: such text is tokenized as ordinary text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from vxc.ir.gguf_container import GGUFError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

# sentencepiece-vocabulary architectures transformers builds with other rules (normalizers, respelled pieces)
_SP_ARCHITECTURES_REFUSED = ("phi3",)
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# the split regexes, by tokenizer.ggml.pre, that transformers uses (integrations/gguf/gguf_tokenizer_mapping.py)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_SPLITS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}

# names the builders transformers hands the vocabulary to always register as special tokens
_DEFAULT_SPECIALS = {"gpt2": ("<|endoftext|>",), "llama": ("<unk>", "<s>", "</s>"),
                     "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")}

_ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


class GGUFTokenizerError(GGUFError):
    """A GGUF file whose tokenizer metadata vxc cannot turn into a tokenizer."""


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (the spelling of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(spelling.items()))


class _Meta:
    """The ``tokenizer.*`` (and ``general.architecture``) metadata of one file, read with ``gguf.GGUFReader``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.name = str(path)
        try:
            from ..ir.gguf_container import reader as gguf_reader

            reader = gguf_reader(self.path)
        except OSError as e:
            raise GGUFTokenizerError(f"{self.name}: cannot read: {e.strerror or e}") from None
        except Exception as e:  # the gguf package raises ValueError / struct.error / numpy errors on a corrupt file
            raise GGUFTokenizerError(f"{self.name}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") \
                from None
        self.fields = {k: f for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general.architecture"))}
        self._cache: dict[str, Any] = {}

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self.fields:
            return default
        if key not in self._cache:
            try:
                self._cache[key] = self.fields[key].contents()
            except Exception as e:  # a string field that is not UTF-8, a truncated array
                raise GGUFTokenizerError(f"{self.name}: metadata field {key!r} is unreadable "
                                         f"({type(e).__name__}: {str(e)[:200]})") from None
        return self._cache[key]

    def require(self, key: str, why: str) -> Any:
        if key not in self.fields:
            raise GGUFTokenizerError(f"{self.name}: metadata field {key!r} is missing ({why})")
        return self.get(key)

    def typed(self, key: str, kind: type, default: Any = None, *, array: bool = False) -> Any:
        """The field's value, checked to be a ``kind`` (or, with ``array``, a list of them); ``default`` if absent."""
        if key not in self.fields:
            return default
        value = self.get(key)
        kinds = (int, float) if kind is float else (kind,)

        def fits(v: Any) -> bool:
            return isinstance(v, kinds) and (kind is bool or not isinstance(v, bool))

        if not (all(fits(v) for v in value) if array and isinstance(value, list) else not array and fits(value)):
            want = f"an array of {kind.__name__}" if array else kind.__name__
            raise GGUFTokenizerError(f"{self.name}: metadata field {key!r} is not {want}")
        return value


def _special_ids(meta: _Meta, n_tokens: int) -> dict[str, int]:
    ids = {}
    for name, key in _ID_KEYS.items():
        value = meta.typed(key, int)
        if value is None:
            continue
        if not 0 <= value < n_tokens:
            raise GGUFTokenizerError(f"{meta.name}: metadata field {key!r} = {value} is outside the vocabulary "
                                     f"(0..{n_tokens - 1})")
        ids[name] = value
    return ids


def special_ids(path: Path) -> dict[str, int]:
    """The bos/eos/unk/pad token ids the file states (keys ``bos``, ``eos``, ``unk``, ``pad``; absent ones left
    out), each checked to lie inside the vocabulary."""
    meta = _Meta(path)
    tokens = meta.typed("tokenizer.ggml.tokens", str, array=True)
    if tokens is None:
        meta.require("tokenizer.ggml.tokens", "the token list")
    return _special_ids(meta, len(tokens))


def _merges(meta: _Meta) -> list[tuple[str, str]]:
    """The file's merges, each ``"left right"``."""
    merges = meta.typed("tokenizer.ggml.merges", str, array=True)
    if merges is not None:
        out = []
        for i, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2:
                raise GGUFTokenizerError(f"{meta.name}: metadata field 'tokenizer.ggml.merges' entry {i} ({m!r}) "
                                         f"is not two pieces separated by one space")
            out.append((parts[0], parts[1]))
        return out
    return []


def _merges_from_scores(meta: _Meta, vocab: dict[str, int], tokens: list[str],
                        scores: list[float] | None = None) -> list[tuple[str, str]]:
    """transformers' ``generate_merges(vocab, scores)``: every split of a piece into two vocabulary pieces, ranked by
    the piece's score (the file's ``tokenizer.ggml.scores`` unless given), best first (ties: longer left piece, then
    longer right piece, first)."""
    if scores is None:
        meta.require("tokenizer.ggml.scores", "a 'llama' vocabulary without merges is ranked by its scores")
        scores = meta.typed("tokenizer.ggml.scores", float, array=True)
        if len(scores) != len(tokens):
            raise GGUFTokenizerError(f"{meta.name}: metadata field 'tokenizer.ggml.scores' has {len(scores)} entries "
                                     f"for {len(tokens)} tokens")
    ranked = []
    for piece, score in dict(zip(tokens, scores)).items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def tokenizer_from_gguf(path: Path) -> tokenizers.Tokenizer:
    """The tokenizer a GGUF file describes (see the module docstring for what is supported and how it matches
    transformers). Raises ``GGUFTokenizerError`` (a ``VxcError``) naming the file and the field or type."""
    meta = _Meta(path)
    model = meta.typed("tokenizer.ggml.model", str)
    if model is None:
        meta.require("tokenizer.ggml.model", "the tokenizer type")
    if model not in SUPPORTED_MODELS:
        raise GGUFTokenizerError(f"{meta.name}: tokenizer type {model!r} (metadata field 'tokenizer.ggml.model') "
                                 f"is not supported; supported: {', '.join(SUPPORTED_MODELS)}")
    architecture = meta.typed("general.architecture", str)
    if model == "llama" and architecture in _SP_ARCHITECTURES_REFUSED:
        raise GGUFTokenizerError(f"{meta.name}: a 'llama' (sentencepiece) tokenizer for architecture "
                                 f"{architecture!r} (metadata field 'general.architecture') is not supported")
    tokens = meta.typed("tokenizer.ggml.tokens", str, array=True)
    if tokens is None:
        meta.require("tokenizer.ggml.tokens", "the token list")
    if not tokens:
        raise GGUFTokenizerError(f"{meta.name}: metadata field 'tokenizer.ggml.tokens' is empty")
    types = meta.typed("tokenizer.ggml.token_type", int, array=True) or []
    if types and len(types) != len(tokens):
        raise GGUFTokenizerError(f"{meta.name}: metadata field 'tokenizer.ggml.token_type' has {len(types)} entries "
                                 f"for {len(tokens)} tokens")
    ids = _special_ids(meta, len(tokens))
    raw = tokens

    if model == "gpt2":
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        meta.require("tokenizer.ggml.merges", "a 'gpt2' (byte-level BPE) vocabulary needs its merges")
        merges = _merges(meta)
        tok = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
        pre = meta.typed("tokenizer.ggml.pre", str)
        if pre in PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        controls_ok = lambda t: set(t) <= alphabet  # noqa: E731
        add_bos_default = False
    elif architecture in _GEMMA_ARCHITECTURES:
        raw = tokens  # the file's spelling: what the added-token rules below read
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _merges(meta) if meta.has("tokenizer.ggml.merges") else \
            _merges_from_scores(meta, vocab, tokens, [-float(i) for i in range(len(tokens))])
        tok = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", byte_fallback=True,
                                       dropout=None))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        controls_ok = lambda t: True  # noqa: E731
        add_bos_default = True
    else:
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = _merges(meta) if meta.has("tokenizer.ggml.merges") else \
            _merges_from_scores(meta, vocab, tokens)
        tok = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
        controls_ok = lambda t: True  # noqa: E731
        add_bos_default = True

    # added tokens, in transformers' order: the builder's default names, the CONTROL tokens, the USER_DEFINED ones,
    # then the named bos/eos/unk/pad tokens not yet added; a name missing from the vocabulary is never added
    def present(t: str) -> bool:
        return tok.token_to_id(t) is not None

    added: set[str] = set()

    def add(contents: list[str], special: bool) -> None:
        fresh = [c for c in dict.fromkeys(contents) if c not in added and present(c)]
        if not fresh:
            return
        new = [AddedToken(c, normalized=False, special=special) for c in fresh]
        if special:
            tok.add_special_tokens(new)
        else:
            tok.add_tokens(new)
        added.update(fresh)

    add(list(_DEFAULT_SPECIALS["gemma" if model == "llama" and architecture in _GEMMA_ARCHITECTURES else model]), True)
    add([t for t, ty in zip(tokens, types) if ty == CONTROL and controls_ok(t)], True)
    # a USER_DEFINED token is added only when its text (not a re-spelling) is a vocabulary entry
    add([t for t, ty in zip(raw, types) if ty == USER_DEFINED], False)
    add([tokens[i] for i in ids.values()], True)

    add_bos = meta.typed("tokenizer.ggml.add_bos_token", bool, add_bos_default)
    add_eos = meta.typed("tokenizer.ggml.add_eos_token", bool, False)

    def named(which: str) -> tuple[str, int] | None:
        if which not in ids:
            return None
        content = tokens[ids[which]]
        token_id = tok.token_to_id(content)  # a repeated token string resolves to its last id, as in transformers
        return (content, token_id if token_id is not None else ids[which])

    bos = named("bos") if add_bos else None
    eos = named("eos") if add_eos else None
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    specials = [s for s in (bos, eos) if s]
    try:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    except Exception as e:  # a token whose text the template syntax cannot hold (a space, a ':')
        raise GGUFTokenizerError(f"{meta.name}: cannot place the bos/eos token in the encoding template "
                                 f"({type(e).__name__}: {e})") from None
    return tok


__all__ = ["GGUFTokenizerError", "PRE_SPLITS", "SUPPORTED_MODELS", "byte_alphabet", "special_ids",
           "tokenizer_from_gguf"]
