"""Frontend registry, keyed on an exact ``model_type`` or config dialect.

A config with a ``model_type`` is looked up by that exact string. A config
without one is identified by an exact dialect marker (see each frontend's
``dialect_of``). Nothing is fuzzy: an unknown family is a refusal that lists
what is supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from ..ir.module import Module
from .common import FrontendError, read_config


class LowerFn(Protocol):
    def __call__(self, model_dir: Path, cfg: dict, config_sha: str, relative_to: Path | None) -> Module: ...


_BY_MODEL_TYPE: dict[str, LowerFn] = {}
_BY_DIALECT: dict[str, tuple[Callable[[dict], bool], LowerFn]] = {}


def by_model_type(*names: str):
    def deco(fn: LowerFn) -> LowerFn:
        for n in names:
            assert n not in _BY_MODEL_TYPE, n
            _BY_MODEL_TYPE[n] = fn
        return fn
    return deco


def by_dialect(name: str, marker: Callable[[dict], bool]):
    def deco(fn: LowerFn) -> LowerFn:
        _BY_DIALECT[name] = (marker, fn)
        return fn
    return deco


def supported() -> list[str]:
    _load()
    return sorted(_BY_MODEL_TYPE) + [f"{d} (dialect)" for d in sorted(_BY_DIALECT)]


def _load() -> None:
    """Import every module of this package: a frontend registers itself (``by_model_type`` / ``by_dialect``) on
    import, so a new family file needs no list kept here."""
    import importlib
    import pkgutil

    from . import __path__ as package_path

    for m in sorted(pkgutil.iter_modules(package_path), key=lambda m: m.name):
        importlib.import_module(f"{__package__}.{m.name}")


def resolve(cfg: dict) -> tuple[str, LowerFn]:
    _load()
    mt = cfg.get("model_type")
    if isinstance(mt, str):
        if mt in _BY_MODEL_TYPE:
            return mt, _BY_MODEL_TYPE[mt]
        raise FrontendError(f"unknown model_type {mt!r}; supported: {', '.join(supported())}")
    hits = [(name, fn) for name, (marker, fn) in _BY_DIALECT.items() if marker(cfg)]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise FrontendError(f"config matches several dialects ({', '.join(h[0] for h in hits)}); refusing to guess")
    raise FrontendError(f"config.json has no model_type and matches no known dialect; supported: {', '.join(supported())}")


def lower(model_dir: str | Path, relative_to: Path | None = None) -> Module:
    """Lower a model directory to an (unverified) Module."""
    model_dir = Path(model_dir)
    from ..ir.gguf_container import is_gguf

    if model_dir.is_file() and is_gguf(model_dir):  # a GGUF file is a whole model: metadata, tensors, tokenizer
        from .gguf_model import lower_gguf

        return lower_gguf(model_dir, relative_to)
    cfg, sha = read_config(model_dir)
    _, fn = resolve(cfg)
    # a missing or ill-typed config value is the frontend's own ConfigError (a named refusal); anything else
    # raised here is a bug in vxc and propagates as one
    return fn(model_dir, cfg, sha, relative_to)
