"""Structured output: token choices constrained by a grammar (a JSON schema), through llguidance.

llguidance (the constrained-decoding library vLLM uses) compiles a JSON schema to a grammar and, at
each step, computes which token ids may come next given the ids chosen so far — from the tokenizer's own JSON
description, so for byte-level, byte-fallback and metaspace vocabularies alike. Nothing here writes a parser.

A :class:`Constraint` is what a :class:`~vxc.runtime.sampling.Sampler` takes: ``mask(x)`` sets the logits of the
ids the grammar does not allow next to -inf (a copy), ``consume(id)`` advances the grammar by the chosen id.
``stopped`` turns True once the grammar allows nothing more (the answer is complete); an id the grammar refuses
(which a masked choice never is) or a mask with no id left puts it in ``error`` and never raises: one request's
grammar must not fail a batched step of several.
"""

from __future__ import annotations

import threading

import torch

from ..ir.diagnostics import VxcError


class GrammarError(VxcError):
    pass


# The whitespace a JSON grammar allows between tokens: none, one space, or one or two newlines and up to 20 spaces
# or tabs of indentation (the rule of the GBNF grammars the C++ engine of benchmarks/ writes for JSON schemas).
# Unbounded whitespace (llguidance's default) lets a weak or confused model write whitespace until max_tokens;
# this keeps both compact and indented JSON.
JSON_WHITESPACE = r"(?:[ ]|\n{1,2}[ \t]{0,20})?"


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GrammarError(f"structured output needs the llguidance package ({e})") from None
    return llguidance


class Grammars:
    """The model's grammar side: its tokenizer as llguidance reads it (built once: ~2.5 s for Gemma 3's 262144-id
    vocabulary), grammars compiled from JSON schemas, and a matcher per answer."""

    def __init__(self, tok, vocab: int, eos_ids):
        self.tok, self.vocab, self.eos_ids = tok, vocab, [int(i) for i in eos_ids]
        self._lltok = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._lltok is None:
                if not self.eos_ids:
                    raise GrammarError("structured output needs the model's EOS id (to end an answer the grammar "
                                       "has completed), and this model declares none")
                llg = _llg()
                try:
                    self._lltok = llg.LLTokenizer(self.tok.to_str(), n_vocab=self.vocab, eos_token=self.eos_ids)
                except Exception as e:
                    raise GrammarError(f"llguidance cannot read this model's tokenizer: {e}") from None
            return self._lltok

    def json_schema(self, schema) -> str:
        """A grammar for JSON text that ``schema`` (a dict) accepts; a schema llguidance refuses is a
        GrammarError with its message."""
        llg = _llg()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"not a JSON schema: {e}") from None
        failed, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if failed:
            raise GrammarError(f"the JSON schema cannot be used: {'; '.join(msgs)}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer(), grammar, log_level=0)  # (errors are read back: is_error / get_error)
        if m.is_error():
            raise GrammarError(f"the grammar cannot be used: {m.get_error()}")
        return Constraint(m, self.vocab)


class Constraint:
    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.error: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """A bool [vocab]: the ids the grammar allows next."""
        import numpy as np

        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            return x
        ok = self.allowed()
        if not bool(ok.any()):
            self.error = self.matcher.get_error() or "the grammar allows no token here"
            return x
        return x.masked_fill(~ok[: x.numel()], float("-inf"))

    def consume(self, token: int) -> None:
        if self.error is None and not self.matcher.consume_token(int(token)):
            self.error = self.matcher.get_error() or f"the grammar refused token {token}"
