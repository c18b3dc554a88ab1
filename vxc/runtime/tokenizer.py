"""Tokenizer glue: ``tokenizer.json`` from the model directory, via the tokenizers library, and the streaming
detokenizer that turns generated ids into text as they come."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


class Detokenizer:
    """Streams the text of generated ids, never repeating or garbling it: ``push`` returns only text that is final.

    Each push decodes a short window of the latest ids (special tokens included: ``skip_special_tokens=False``):
    the ids from the last point where the text was final but one (``_p``), with and without the ids since
    (``_r``), and takes the difference as the new text — as vLLM's and TGI's incremental detokenizers do, so a push
    costs the same at the 10th token and the 8000th (decoding every id each time made a long answer quadratic:
    2.2 ms a push at 8192 tokens of SmolLM2's vocabulary). Of that text it holds back

    - a trailing U+FFFD: a multi-byte character split across tokens decodes to U+FFFD until its last byte arrives
      (byte-level BPE and byte-fallback vocabularies both do this), and
    - a tail that could still become one of the ``stop`` strings (it is printed once it cannot).

    Once the text contains a stop string, it ends where the first one begins (``stopped`` is set); nothing from the
    stop string on is emitted (a push searches only the text a new match could touch). ``finish()`` emits what was
    held back (a U+FFFD the ids never completed, a tail that did not become a stop string). The concatenation of
    everything returned equals ``text``, which equals ``tok.decode(ids, skip_special_tokens=False)`` cut at the
    first stop string (for decoders whose decode of a sequence begins with the decode of its prefix — byte-level,
    byte-fallback and metaspace ones)."""

    def __init__(self, tok, stop: Iterable[str] = ()):
        self.tok, self.ids = tok, []
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.emitted = ""  # everything push / finish returned so far
        self.stopped: str | None = None  # the stop string that ended the text
        self._full = ""  # the decode of all ids (cut at a stop string once one is found)
        self._final = ""  # the part of it that no later id can change
        self._p = self._r = 0  # the window: ids[_p:_r] decode to the end of _final, ids[_r:] are not final yet
        self._prefix = ""  # the decode of ids[_p:_r]
        self._searched = 0  # the text before this offset holds no stop string, nor the start of one

    def _dec(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def push(self, token: int) -> str:
        if self.stopped is not None:
            return ""
        self.ids.append(token)
        new = self._dec(self.ids[self._p:])
        if new.startswith(self._prefix):
            pending = new[len(self._prefix):]
        else:  # a decoder that rewrote the window's earlier text: take the window's whole decode as the news
            pending = new
        if pending and not pending.endswith(REPLACEMENT):
            self._final += pending
            self._p, self._r = self._r, len(self.ids)
            self._prefix = self._dec(self.ids[self._p:self._r])
            pending = ""
        text = self._final + pending
        if self.stop:
            start = max(0, self._searched - self._longest + 1)
            hits = sorted((i, s) for s in self.stop if (i := text.find(s, start)) >= 0)
            if hits:
                at, self.stopped = hits[0]
                self._full = text[:at]
                return self._emit(self._full)
        self._full = text
        stable = text.rstrip(REPLACEMENT)
        self._searched = len(stable)
        hold = max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if stable.endswith(s[:k])), default=0)
        return self._emit(stable[: len(stable) - hold])

    def _emit(self, upto: str) -> str:
        # a decoder that rewrites earlier text (none of the byte-level / byte-fallback ones do) waits until its
        # text extends what was emitted again; finish() settles the rest
        if len(upto) <= len(self.emitted) or not upto.startswith(self.emitted):
            return ""
        new = upto[len(self.emitted):]
        self.emitted = upto
        return new

    def finish(self) -> str:
        """The rest of the text, once no more ids come."""
        if self._full.startswith(self.emitted):
            new = self._full[len(self.emitted):]
        else:  # only a decoder that rewrote emitted text gets here: what was printed stands, the rest follows it
            common = 0
            while common < min(len(self._full), len(self.emitted)) and self._full[common] == self.emitted[common]:
                common += 1
            new = self._full[common:]
        self.emitted += new
        return new

    @property
    def text(self) -> str:
        """The final text: what was emitted, once ``finish()`` ran."""
        return self.emitted


def load_tokenizer(model_dir: Path, module=None):
    """The model directory's tokenizer.json; else, for a model read from a GGUF file, the tokenizer its metadata
    describes (built by the GGUF frontend, vxc.frontends.gguf_tokenizer: what a tokenizer model type means is
    family knowledge); else None."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        gguf_files = [f for f in (module.files if module is not None else []) if f.format == "gguf"]
        if gguf_files:
            from ..frontends.gguf_tokenizer import tokenizer_from_gguf

            return tokenizer_from_gguf(Path(model_dir) / gguf_files[0].path)
        return None
    from tokenizers import Tokenizer

    from ..ir.diagnostics import VxcError

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own Exception subclass with the parse error
        raise VxcError(f"{path}: not a readable tokenizer ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable Latin-1 bytes spell themselves, every other byte the
    character 256 + k, k counting those bytes in order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, k = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + k)] = b
            k += 1
    return table


class TokenBytes:
    """The exact bytes of a token, where the vocabulary spells them: every token of a byte-level BPE vocabulary
    (its decoder is ``ByteLevel``), and the ``<0xNN>`` byte tokens of a byte-fallback one (``ByteFallback``); None
    for any other token (its text then comes from decoding it in context). Read from the tokenizer's own JSON
    description (its decoder), once."""

    def __init__(self, tok):
        import json

        self.tok = tok
        dec = json.loads(tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in ([dec] + list(dec.get("decoders") or []))}
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.alphabet = _byte_level_alphabet() if self.byte_level else None
        self._cache: dict[int, bytes | None] = {}

    def __call__(self, token: int) -> bytes | None:
        if token in self._cache:
            return self._cache[token]
        s = self.tok.id_to_token(token)
        out = None
        if s is not None:
            if self.byte_level and all(c in self.alphabet for c in s):
                out = bytes(self.alphabet[c] for c in s)
            elif self.byte_fallback and len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                try:
                    out = bytes([int(s[3:5], 16)])
                except ValueError:
                    out = None
        if len(self._cache) < 1 << 16:
            self._cache[token] = out
        return out
