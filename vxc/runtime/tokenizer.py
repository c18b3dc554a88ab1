"""Tokenizer glue: ``tokenizer.json`` from the model directory, via the tokenizers library."""

from __future__ import annotations

from pathlib import Path


class Detokenizer:
    """Streams text: decodes the ids so far and yields only the new suffix."""

    def __init__(self, tok):
        self.tok, self.ids, self.text = tok, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        new = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return new


def load_tokenizer(model_dir: Path):
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
