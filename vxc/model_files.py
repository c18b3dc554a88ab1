"""What generation reads from a model directory besides the weights: the stop token ids, the chat template with
the special tokens it is rendered with, and the number of positions the model was trained for.

Sources, in the conventions of the Hugging Face file layout and of GGUF metadata (file formats, not families):

- stop ids: ``generation_config.json``'s ``eos_token_id`` (an int or a list; when the file is absent,
  ``config.json``'s, as transformers' ``GenerationConfig.from_model_config`` takes it) and the tokenizer's EOS
  (``tokenizer_config.json``'s ``eos_token``, looked up in the tokenizer); for a GGUF file,
  ``tokenizer.ggml.eos_token_id`` and ``tokenizer.ggml.eot_token_id``.
- chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
  named templates of which ``default`` is used, as transformers does); for a GGUF file, ``tokenizer.chat_template``.
- trained positions: ``config.json``'s ``max_position_embeddings`` (or its ``text_config``'s); for a GGUF file,
  ``<general.architecture>.context_length``.

Nothing here imports torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ir.diagnostics import VxcError


class ModelFileError(VxcError):
    pass


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ModelFileError(f"{path}: not a JSON object")
    return obj


def _gguf_path(model_dir: Path, module) -> Path | None:
    files = [f for f in (module.files if module is not None else []) if f.format == "gguf"]
    return Path(model_dir) / files[0].path if files else None


def _gguf_fields(path: Path, keys: tuple[str, ...], prefix_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The named metadata fields of a GGUF file (absent ones left out); ``prefix_keys``: ``.``-suffixes looked up
    under the file's ``general.architecture``."""
    from .ir.gguf_container import reader as gguf_reader

    try:
        reader = gguf_reader(path)
    except Exception as e:  # OSError, or the gguf package's ValueError / struct.error on a corrupt file
        raise ModelFileError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    out: dict[str, Any] = {}
    want = list(keys)
    arch = reader.fields.get("general.architecture")
    if arch is not None and prefix_keys:
        a = arch.contents()
        want += [f"{a}.{k}" for k in prefix_keys]
        out["general.architecture"] = a
    for k in want:
        f = reader.fields.get(k)
        if f is not None:
            try:
                out[k] = f.contents()
            except Exception as e:
                raise ModelFileError(f"{path}: metadata field {k!r} is unreadable ({type(e).__name__})") from None
    return out


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken-like object."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _ids(v: Any, where: str) -> list[int]:
    if v is None:
        return []
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise ModelFileError(f"{where}: eos_token_id {v!r} is not a token id or a list of them")
    return list(vals)


@dataclass
class StopIds:
    ids: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # one "file: id" note per source that gave one


def stop_ids(model_dir: Path, module=None, tok=None) -> StopIds:
    """The EOS ids generation stops at, in the order found, without repeats (see the module docstring)."""
    model_dir = Path(model_dir)
    found: list[tuple[int, str]] = []
    gguf = _gguf_path(model_dir, module)
    if gguf is not None:
        meta = _gguf_fields(gguf, ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"))
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            for i in _ids(meta.get(k), f"{gguf.name} {k}"):
                found.append((i, f"{gguf.name} {k}"))
    gen = _json(model_dir / "generation_config.json")
    if gen is not None:
        found += [(i, "generation_config.json") for i in _ids(gen.get("eos_token_id"), str(model_dir / "generation_config.json"))]
    else:
        cfg = _json(model_dir / "config.json")
        if cfg is not None:
            found += [(i, "config.json") for i in _ids(cfg.get("eos_token_id"), str(model_dir / "config.json"))]
    tc = _json(model_dir / "tokenizer_config.json")
    if tc is not None and tok is not None:
        text = _token_text(tc.get("eos_token"))
        if text is not None:
            i = tok.token_to_id(text)
            if i is not None:
                found.append((i, f"tokenizer_config.json eos_token {text!r}"))
    out = StopIds()
    for i, src in found:
        if i not in out.ids:
            out.ids.append(i)
            out.sources.append(f"{src}: {i}")
    return out


@dataclass
class ChatTemplate:
    source: str  # where the template came from
    template: str
    special: dict[str, str]  # bos_token, eos_token, ... as the template sees them


def chat_template(model_dir: Path, module=None, tok=None) -> ChatTemplate:
    """The model's chat template and its special tokens; a model without one is a ModelFileError."""
    model_dir = Path(model_dir)
    tc = _json(model_dir / "tokenizer_config.json") or {}
    special = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        t = _token_text(tc.get(k))
        if t is not None:
            special[k] = t
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return ChatTemplate(str(jinja), jinja.read_text(encoding="utf-8"), special)
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{jinja}: not readable ({e})") from None
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: transformers uses "default"
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
        if t is None:
            raise ModelFileError(f"{model_dir / 'tokenizer_config.json'}: chat_template lists templates "
                                 f"{sorted(map(str, named))} but none named 'default'")
    if isinstance(t, str):
        return ChatTemplate(f"{model_dir / 'tokenizer_config.json'} chat_template", t, special)
    gguf = _gguf_path(model_dir, module)
    if gguf is not None:
        meta = _gguf_fields(gguf, ("tokenizer.chat_template", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"))
        if isinstance(meta.get("tokenizer.chat_template"), str):
            if tok is not None:
                for k, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
                    i = meta.get(key)
                    if isinstance(i, int) and tok.id_to_token(i) is not None:
                        special.setdefault(k, tok.id_to_token(i))
            return ChatTemplate(f"{gguf} tokenizer.chat_template", meta["tokenizer.chat_template"], special)
    raise ModelFileError(f"{model_dir}: the model has no chat template (no chat_template.jinja, no chat_template in "
                         f"tokenizer_config.json{', none in the GGUF metadata' if gguf is not None else ''}); "
                         f"--chat needs one: give the raw text with --prompt instead")


def max_positions(model_dir: Path, module=None) -> tuple[int, str] | None:
    """(positions the model was trained for, where that was read), or None when the files do not say."""
    model_dir = Path(model_dir)
    gguf = _gguf_path(model_dir, module)
    if gguf is not None:
        meta = _gguf_fields(gguf, (), ("context_length",))
        a = meta.get("general.architecture")
        v = meta.get(f"{a}.context_length")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"{gguf.name} {a}.context_length"
        return None
    cfg = _json(model_dir / "config.json")
    if cfg is None:
        return None
    for where, c in (("config.json", cfg), ("config.json text_config", cfg.get("text_config"))):
        v = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"{where} max_position_embeddings"
    return None
