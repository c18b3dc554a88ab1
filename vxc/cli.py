"""The vxc command line (typer): lower, passes, describe, exec, demo.

``lower``, ``passes`` and ``describe`` never import torch: they only read JSON
headers, so they start fast."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from .ir.diagnostics import IRSyntaxError, VxcError
from .passes.findings import Refusal

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vxc: compile LLM architectures via the VINDEX3 IR")


def _fail(message: str, code: int = 1, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"error": message}))
    else:
        print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _refused(r: Refusal, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r.to_json(), indent=1))
    else:
        print(r.text())
    raise typer.Exit(2)


def _guard(fn, as_json: bool = False):
    try:
        return fn()
    except Refusal as r:
        _refused(r, as_json)
    except IRSyntaxError as e:
        _fail(str(e), 1, as_json)
    except VxcError as e:
        _fail(str(e), 1, as_json)
    except OSError as e:
        _fail(f"{e.filename or ''}: {e.strerror}", 1, as_json)


@app.command()
def lower(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the .vxir"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable result"),
):
    """Lower MODEL_DIR, run verify,bind,closure,state and write the IR only if closure holds."""
    from .driver import lower_to_file

    t0 = time.perf_counter()

    def go():
        try:
            return lower_to_file(model_dir, output)
        except BaseException:
            if output.exists():  # never leave a stale IR behind a refusal
                output.unlink()
            raise

    ctx = _guard(go, as_json)
    m = ctx.module
    kinds: dict[str, int] = {}
    for layer in m.layers:
        kinds[layer.mixer.kind] = kinds.get(layer.mixer.kind, 0) + 1
    dt = time.perf_counter() - t0
    if as_json:
        print(json.dumps({"ok": True, "output": str(output), "layers": len(m.layers), "mixers": kinds,
                          "tensors": len(m.tensors), "operands": len(m.operands), "seconds": round(dt, 4)}))
    else:
        mix = ", ".join(f"{n} {k}" for k, n in kinds.items())
        print(f"lowered {m.name} ({m.source.frontend}/{m.source.dialect}): {len(m.layers)} layers ({mix}), "
              f"{len(m.tensors)} tensors, {len(m.operands)} operands → {output} in {dt:.2f} s")


@app.command()
def passes(
    input: Path = typer.Argument(..., help="a .vxir file or a model directory (lowered in memory)"),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="comma-separated pass names"),
    print_after: List[str] = typer.Option([], "--print-after", help="dump after this pass (repeatable)"),
    print_after_all: bool = typer.Option(False, "--print-after-all"),
    print_after_failure: bool = typer.Option(False, "--print-after-failure"),
    no_verify_each: bool = typer.Option(False, "--no-verify-each", help="skip the verifier between passes"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run a pass pipeline over INPUT and print what was asked for."""
    from .driver import load, run
    from .passes.manager import DEFAULT_PIPELINE, PASSES, parse_pipeline

    _register_late_passes()
    text = pipeline or DEFAULT_PIPELINE
    try:
        names = parse_pipeline(text)
    except ValueError as e:
        _fail(str(e), 1, as_json)
    for n in print_after:
        if n not in PASSES:
            _fail(f"--print-after {n}: unknown pass; known passes: {', '.join(PASSES)}", 1, as_json)
        if n not in names:
            _fail(f"--print-after {n}: pass is not in the pipeline {','.join(names)}", 1, as_json)
    dumps: dict[str, str] = {}

    def emit(s: str) -> None:
        if as_json:
            header, _, body = s.partition("\n")
            dumps[header] = body
        else:
            sys.stdout.write(s if s.endswith("\n") else s + "\n")

    def go():
        ctx = load(input)
        return run(ctx, ",".join(names), print_after=set(print_after), print_after_all=print_after_all,
                   print_after_failure=print_after_failure, verify_each=not no_verify_each, emit=emit)

    _guard(go, as_json)
    if as_json:
        print(json.dumps({"ok": True, "pipeline": ",".join(names), "dumps": dumps}, indent=1))
    elif not (print_after or print_after_all):
        print(f"ok: {','.join(names)}")


def _register_late_passes() -> None:
    """fuse/codegen live in vxc.codegen (they import torch); registered only when present."""
    try:
        from .codegen import passes as _  # noqa: F401
    except ImportError:
        pass


@app.command()
def describe(
    input: Path = typer.Argument(..., help="a .vxir file or a model directory"),
    as_json: bool = typer.Option(False, "--json"),
    context: Optional[int] = typer.Option(None, "--context", help="also report state bytes at this many tokens"),
    dot: Optional[Path] = typer.Option(None, "--dot", help="write layers, operators and state regions as Graphviz"),
):
    """The surfaces of a model, read from its plan."""
    from .driver import load, run
    from .passes.manager import DEFAULT_PIPELINE
    from .passes.surfaces import describe as surfaces, to_dot

    ctx = _guard(lambda: run(load(input), DEFAULT_PIPELINE, emit=lambda s: None), as_json)
    d = surfaces(ctx.plan, context)
    if dot is not None:
        from .driver import write_atomic

        write_atomic(dot, to_dot(ctx.plan))
    if as_json:
        print(json.dumps(d, indent=1))
        return
    from .describe_view import render

    render(d)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
