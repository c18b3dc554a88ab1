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
