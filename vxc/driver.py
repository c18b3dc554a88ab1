"""Glue between inputs and the pass manager: load a .vxir or lower a model
directory in memory, run a pipeline, write IR atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .ir.module import Module
from .ir.parser import parse_file
from .ir.printer import print_module
from .passes.context import Context
from .passes.manager import PassManager, parse_pipeline


def model_dir_of(m: Module, ir_path: Path | None, override: Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    base = ir_path.parent if ir_path is not None else Path.cwd()
    return (base / m.source.model_dir).resolve()


def load(input_path: str | Path, model_dir: Path | None = None) -> Context:
    """A .vxir file is parsed; a directory is lowered by its frontend."""
    p = Path(input_path)
    if not p.exists() and p.suffix == ".vxir":
        from .ir.diagnostics import VxcError

        raise VxcError(f"{p}: no such IR file (lower a model directory first: vxc lower DIR -o {p})")
    from .ir.gguf_container import is_gguf

    if p.is_dir() or not p.exists() or is_gguf(p):  # a model directory or a GGUF file: lowered in memory
        from .frontends import lower

        m = lower(p)
        return Context(m, model_dir=Path(model_dir) if model_dir else p.parent if p.is_file() else p)
    m = parse_file(p)
    return Context(m, model_dir=model_dir_of(m, p, model_dir))


def run(ctx: Context, pipeline: str, **kw) -> Context:
    return PassManager(parse_pipeline(pipeline), **kw).run(ctx)


def replace_atomic(path: Path, write) -> None:
    """``write(tmp)`` fills a temporary file beside ``path``, which is then renamed over ``path``; on any failure
    (including an interrupt) the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_safetensors_atomic(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` through :func:`replace_atomic`; a failed write (disk full, file too large)
    is an ``OSError`` naming ``path`` (the library raises its own error type for I/O failures)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as e:
            msg = str(e).split("I/O error: ")[-1]
            raise OSError(0, f"cannot write: {msg}", str(path)) from None

    replace_atomic(path, write)


def write_atomic(path: Path, text: str) -> None:
    replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def declare_activations(m, activations: str | None) -> int:
    """Declare ``activations`` (``vxc.ir.ggml.ACTIVATION_PRECISIONS``) on every ggml block-encoded operand of
    ``m`` — the precision its products quantise their input to (a gather ignores it); returns how many. A
    module with no such operand is refused: there is nothing the declaration could apply to."""
    from .ir.diagnostics import VxcError
    from .ir.ggml import ACTIVATION_PRECISIONS, ENCODINGS

    if activations is None:
        return 0
    if activations not in ACTIVATION_PRECISIONS:
        raise VxcError(f"unknown activation precision {activations!r} (known: {', '.join(ACTIVATION_PRECISIONS)})")
    n = 0
    for o in m.operands:
        if o.encoding in ENCODINGS:
            o.activations = activations
            n += 1
    if not n:
        raise VxcError(f"--activations {activations}: {m.name} has no ggml block-encoded operand (it applies to "
                       f"the products of encoded weights: lower a GGUF file or run vxc quantize first)")
    return n


def lower_to_file(model_dir: Path, out: Path, pipeline: str = "verify,bind,closure,state",
                  activations: str | None = None) -> Context:
    from .frontends import lower

    m = lower(model_dir, relative_to=out.resolve().parent)
    declare_activations(m, activations)
    ctx = run(Context(m, model_dir=model_dir_of(m, out.resolve())), pipeline, emit=lambda s: None)
    write_atomic(out, print_module(ctx.module))
    return ctx
