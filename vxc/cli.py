"""The vxc command line (typer): lower, quantize, passes, describe, exec, chat, serve, demo.

``lower``, ``passes`` and ``describe`` never import torch: they only read JSON
headers, so they start fast."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from .ir.diagnostics import IRSyntaxError, VxcError
from .passes.findings import Refusal

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vxc: compile LLM architectures via the VINDEX3 IR")


def _fail(message: str, code: int = 1, as_json: bool = False, prefix: str = "error: ") -> None:
    if as_json:
        print(json.dumps({"error": message}))
    else:
        print(f"{prefix}{message}", file=sys.stderr)
    raise typer.Exit(code)


def _refused(r: Refusal, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r.to_json(), indent=1))
    else:
        print(r.text())
    raise typer.Exit(2)


MAX_CONTEXT = 1 << 24  # positions: far past any model's window, small enough to refuse before allocating


def _finite(value: float) -> float:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _check_output_path(path: Path, what: str, as_json: bool) -> None:
    """An output path must be writable as a file: not a directory, under directories (or a path that can become
    them) that the user may write. Checked before the work that would produce it."""
    if path.is_dir():
        _fail(f"{what} {path}: is a directory", 1, as_json)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        _fail(f"{what} {path}: {parent} is not a directory", 1, as_json)
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(f"{what} {path}: {parent} is not writable", 1, as_json)


def _guard(fn, as_json: bool = False):
    try:
        return fn()
    except Refusal as r:
        _refused(r, as_json)
    except IRSyntaxError as e:  # already "file:line:col: error: …" + the line + a caret
        _fail(str(e), 1, as_json, prefix="")
    except VxcError as e:
        _fail(str(e), 1, as_json)
    except OSError as e:
        _fail(f"{e.filename or ''}: {e.strerror}", 1, as_json)


@app.command()
def lower(
    model_dir: Path = typer.Argument(..., help="Hugging Face model directory (config.json + safetensors)"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the .vxir"),
    activations: Optional[str] = typer.Option(None, "--activations", help="int8_block32: the products of encoded weights quantise their input per 32-value block to int8 (declared on each operand; default: fp32 as given)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable result"),
):
    """Lower MODEL_DIR, run verify,bind,closure,state and write the IR only if closure holds."""
    from .driver import lower_to_file

    t0 = time.perf_counter()

    # lower_to_file writes a temporary file and renames it over OUTPUT only once closure holds: a refusal or
    # an error leaves whatever was at OUTPUT untouched (a user's earlier IR is never deleted)
    _check_output_path(output, "-o", as_json)
    ctx = _guard(lambda: lower_to_file(model_dir, output, activations=activations), as_json)
    m = ctx.module
    kinds: dict[str, int] = {}
    for layer in m.layers:
        for mixer in layer.mixers():  # none (FFN-only), one, or two side by side (Parallel)
            kinds[mixer.kind] = kinds.get(mixer.kind, 0) + 1
    dt = time.perf_counter() - t0
    if as_json:
        print(json.dumps({"ok": True, "output": str(output), "layers": len(m.layers), "mixers": kinds,
                          "tensors": len(m.tensors), "operands": len(m.operands), "seconds": round(dt, 4)}))
    else:
        mix = ", ".join(f"{n} {k}" for k, n in kinds.items())
        print(f"lowered {m.name} ({m.source.frontend}/{m.source.dialect}): {len(m.layers)} layers ({mix}), "
              f"{len(m.tensors)} tensors, {len(m.operands)} operands → {output} in {dt:.2f} s")
        exact = _fp32_activation_blocks(m)
        if exact:
            print(f"note: {exact} ggml-encoded operands multiply fp32 activations as given (exact: the fp32 floor of "
                  f"the dequantised model); --activations int8_block32 declares llama.cpp's int8 products instead, "
                  f"1.7-3.3x faster decode measured on CPU (README, \"int8 activations\")")



def _fp32_activation_blocks(m) -> int:
    """How many ggml block-encoded operands of ``m`` declare no activation precision (fp32 products as given)."""
    from .ir.ggml import ENCODINGS

    return sum(1 for o in m.operands if o.encoding in ENCODINGS and o.activations is None)


@app.command()
def quantize(
    model: Path = typer.Argument(..., help="a .vxir file, a model directory or a GGUF file"),
    output: Path = typer.Option(..., "-o", "--output", help="the .vxir to write (its weights: OUTPUT.safetensors)"),
    scheme: str = typer.Option(..., "--scheme", help="q8_0, q4_0, q4_1 (one ggml block format), q4_k_m / q5_k_m / q3_k_m / q2_k (the mixes) tq1_0 / tq2_0 (ternary, q6_k head) or iq4_nl / iq4_xs (llama.cpp's IQ4 mixes)"),
    keep: List[str] = typer.Option([], "--keep", help="a role to leave unquantised (repeatable)"),
    activations: Optional[str] = typer.Option(None, "--activations", help="int8_block32: the products of encoded weights quantise their input per 32-value block to int8 (declared on each operand; default: fp32 as given)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable result"),
):
    """Encode the operands whose roles are declared quantisable (projections, embedding, head) in SCHEME's
    blocks; write the weights and the IR declaring them (data preparation: nothing runs)."""
    from .quantize import quantize_to_file

    t0 = time.perf_counter()
    _check_output_path(output, "-o", as_json)
    rep = _guard(lambda: quantize_to_file(model, output, scheme, list(keep), activations), as_json)
    dt = time.perf_counter() - t0
    if as_json:
        print(json.dumps({"ok": True, "output": str(output), "scheme": rep.scheme, "encoded": len(rep.encoded),
                          "formats": rep.counts(), "operands": rep.encoded, "kept": [{"operand": o, "why": w} for o, w in rep.kept],
                          "fallbacks": [{"operand": o, "why": w} for o, w in rep.fallbacks], "notes": rep.notes,
                          "bytes_before": rep.bytes_before, "bytes_after": rep.bytes_after, "seconds": round(dt, 4)}))
    else:
        mix = ", ".join(f"{n} {f}" for f, n in sorted(rep.counts().items()))
        print(f"quantized {len(rep.encoded)} operands to {rep.scheme} ({mix or 'none'}): {rep.bytes_before / 1e6:.1f} → "
              f"{rep.bytes_after / 1e6:.1f} MB → {output} in {dt:.2f} s")
        for o, w in rep.fallbacks:
            print(f"  fell back %{o}: {w}")
        for o, w in rep.kept:
            print(f"  kept %{o}: {w}")
        for n in rep.notes:
            print(f"  note: {n}")


@app.command()
def passes(
    input: Path = typer.Argument(..., help="a .vxir file or a model directory (lowered in memory)"),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="comma-separated pass names"),
    print_after: List[str] = typer.Option([], "--print-after", help="dump after this pass (repeatable)"),
    print_after_all: bool = typer.Option(False, "--print-after-all"),
    print_after_failure: bool = typer.Option(False, "--print-after-failure"),
    no_verify_each: bool = typer.Option(False, "--no-verify-each", help="skip the verifier between passes"),
    tp: int = typer.Option(1, "--tp", min=1, max=1024, help="tensor parallel: ranks the shard pass splits for"),
    rank: int = typer.Option(0, "--rank", min=0, help="with --tp: the rank whose part the shard pass makes"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run a pass pipeline over INPUT and print what was asked for."""
    from .driver import load, run
    from .passes.manager import DEFAULT_PIPELINE, parse_pipeline

    from .passes.manager import ORDER

    text = pipeline or DEFAULT_PIPELINE
    if pipeline is None:  # extend the default pipeline to the furthest pass asked for
        want = max([ORDER.index(n) for n in print_after if n in ORDER] + [ORDER.index("plan")])
        text = ",".join(ORDER[: want + 1])
        if tp > 1 or "shard" in print_after:  # tensor parallel: the shard pass right after plan
            text = text.replace("plan", "plan,shard", 1)
    if rank >= tp:
        _fail(f"--rank {rank}: ranks of --tp {tp} are 0..{tp - 1}", 1, as_json)
    try:
        names = parse_pipeline(text)
    except ValueError as e:
        _fail(str(e), 1, as_json)
    for n in print_after:
        if n not in ORDER and n != "shard":
            _fail(f"--print-after {n}: unknown pass; known passes: {', '.join(ORDER)}", 1, as_json)
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
        ctx.tp, ctx.rank = tp, rank
        return run(ctx, ",".join(names), print_after=set(print_after), print_after_all=print_after_all,
                   print_after_failure=print_after_failure, verify_each=not no_verify_each, emit=emit)

    _guard(go, as_json)
    if as_json:
        print(json.dumps({"ok": True, "pipeline": ",".join(names), "dumps": dumps}, indent=1))
    elif not (print_after or print_after_all):
        print(f"ok: {','.join(names)}")


KV_HELP = ("fp32 | bf16 | fp16: the element type of the growing row caches (KV / latent rows; default: the compute "
           "dtype). fp16 halves an fp32 model's cache and the bytes a decode step reads from it, as llama.cpp's "
           "default f16 cache; fixed regions (recurrent, conv) keep their declared precision")


@app.command()
def describe(
    input: Path = typer.Argument(..., help="a .vxir file or a model directory"),
    as_json: bool = typer.Option(False, "--json"),
    context: Optional[int] = typer.Option(None, "--context", min=0, max=MAX_CONTEXT, help="also report state bytes at this many tokens"),
    dot: Optional[Path] = typer.Option(None, "--dot", help="write layers, operators and state regions as Graphviz"),
    sequences: int = typer.Option(1, "--sequences", min=1, max=4096,
                                  help="with --context: the state of this many sequence slots (vxc serve --sequences)"),
    tp: int = typer.Option(1, "--tp", min=1, max=1024, help="also each rank's weight and state bytes under tensor "
                                                             "parallelism over N ranks"),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help=KV_HELP),
):
    """The surfaces of a model, read from its plan."""
    from .driver import load, run
    from .passes.manager import DEFAULT_PIPELINE
    from .passes.surfaces import describe as surfaces, to_dot

    if dot is not None:
        _check_output_path(dot, "--dot", as_json)
    ctx = _guard(lambda: run(load(input), DEFAULT_PIPELINE, emit=lambda s: None), as_json)
    if sequences != 1 and context is None:
        _fail("--sequences needs --context (the bytes of S slots at that many tokens each)", 1, as_json)
    kv = None
    if kv_dtype is not None:
        from .exec_cmd import DTYPE_NAMES

        if kv_dtype not in DTYPE_NAMES:
            _fail(f"--kv-dtype {kv_dtype}: expected one of {' | '.join(DTYPE_NAMES)}", 1, as_json)
        kv = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}[kv_dtype]
    d = surfaces(ctx.plan, context, sequences=sequences, kv=kv)
    if tp > 1:
        from .passes.surfaces import tp_ranks

        d["tp"] = _guard(lambda: tp_ranks(lambda: load(input), tp, context, sequences), as_json)
    if dot is not None:
        from .driver import write_atomic

        _guard(lambda: write_atomic(dot, to_dot(ctx.plan)), as_json)
    if as_json:
        print(json.dumps(d, indent=1))
        return
    from .describe_view import render

    render(d)


DTYPE_HELP = "fp32 | bf16 | fp16"


def _stop_help() -> str:
    return "end generation when the text contains STRING (repeatable; the string itself is not printed)"


@app.command("exec")
def exec_(
    model: Path = typer.Argument(..., help="a .vxir file (from `vxc lower`)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="text, encoded with the model directory's tokenizer.json"),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="comma-separated token ids, e.g. 1,2,3"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=0, max=MAX_CONTEXT),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, callback=_finite, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, callback=_finite),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help=KV_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, max=MAX_CONTEXT,
                                              help="positions preallocated for growing state (default: the model's "
                                                   "max_position_embeddings, capped by a state budget of 4 GiB)"),
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="where the safetensors live (default: as recorded in the IR)"),
    logits_out: Optional[Path] = typer.Option(None, "--logits-out", help="write teacher-forced logits of the given tokens (fp32, shape positions x vocab)"),
    save_state: Optional[Path] = typer.Option(None, "--save-state", help="save the continuation state after generating"),
    resume_state: Optional[Path] = typer.Option(None, "--resume-state", help="continue from a saved state"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="do not stop at the model's EOS token(s)"),
    stop: List[str] = typer.Option([], "--stop", help=_stop_help()),
    chat: bool = typer.Option(False, "--chat", help="render --prompt as the user turn with the model's chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="with --chat: the system turn"),
    kernels: str = typer.Option("auto", "--kernels", help="auto | torch | triton | native (triton on CPU needs TRITON_INTERPRET=1)"),
    kernel_report: bool = typer.Option(False, "--kernel-report", help="print the kernel backend and every fallback to a torch twin (--json: always in its \"kernels\" object)"),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", min=0, help="prefill a longer prompt as chunks of this "
                                                "many tokens (bounds the activations; 0: the prompt in one piece; default 128 "
                                                "where the model's matmuls run packed int8 products, else 256)"),
    compile_decode: bool = typer.Option(False, "--compile", help="torch.compile the fixed-shape decode graph"),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="constrain the answer to JSON this schema "
                                               "(a JSON file) accepts (llguidance); it ends once the JSON is complete"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming text"),
    tp: int = typer.Option(1, "--tp", min=1, max=1024, help="tensor parallel over N ranks: spawned here (gloo on "
                                                             "loopback), or the ranks of torchrun"),
    profile: bool = typer.Option(False, "--profile", help="time the replayed decode steps kernel by kernel and print "
                                 "where a step goes, by op, native kernel and weight encoding (--json: a \"decode_profile\" object)"),
):
    """Execute a lowered model: teacher-forced prefill of the prompt, then generation until an EOS token, a --stop
    string, --max-new-tokens or a full context."""
    for path, what in ((logits_out, "--logits-out"), (save_state, "--save-state")):
        if path is not None:  # checked before any work: a bad path must not cost a whole generation
            _check_output_path(path, what, as_json)

    def go():
        from .exec_cmd import run_exec

        return run_exec(model=model, prompt=prompt, tokens=tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p, top_k=top_k, seed=seed, dtype=dtype, device=device, max_context=max_context,
                        model_dir=model_dir, logits_out=logits_out, save_state=save_state, resume_state=resume_state,
                        kernels=kernels, compile_decode=compile_decode, as_json=as_json, kernel_report=kernel_report,
                        ignore_eos=ignore_eos, stop=list(stop), chat=chat, system=system, tp=tp, prefill_chunk=prefill_chunk,
                        kv_dtype=kv_dtype, json_schema=json_schema, profile=profile)

    _guard(go, as_json)


@app.command("chat")
def chat_(
    model: Path = typer.Argument(..., help="a .vxir file (from `vxc lower`) whose model has a chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="the system turn"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=0, max=MAX_CONTEXT, help="per answer"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, callback=_finite, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, callback=_finite),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(0, "--seed", min=0, max=2**63 - 1),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help=KV_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, max=MAX_CONTEXT,
                                              help="positions for the whole conversation (default: the model's "
                                                   "max_position_embeddings, capped by a state budget of 4 GiB)"),
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="where the safetensors live (default: as recorded in the IR)"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="do not stop at the model's EOS token(s)"),
    stop: List[str] = typer.Option([], "--stop", help=_stop_help()),
    kernels: str = typer.Option("auto", "--kernels", help="auto | torch | triton | native"),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", min=0, help="prefill a longer prompt as chunks of this "
                                                "many tokens (bounds the activations; 0: the prompt in one piece; default 128 "
                                                "where the model's matmuls run packed int8 products, else 256)"),
    compile_decode: bool = typer.Option(False, "--compile", help="torch.compile the fixed-shape decode graph"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per turn instead of streaming text"),
    tp: int = typer.Option(1, "--tp", min=1, max=1024, help="tensor-parallel ranks: this process reads the turns as "
                                                             "rank 0 and spawns the others (or is one of torchrun's)"),
):
    """A conversation: one user turn per line on stdin (an empty line or EOF ends it). The continuation state is kept
    between turns, so each turn prefills only its own tokens, not the history."""

    def go():
        from .chat import run_chat

        return run_chat(model=model, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, dtype=dtype, device=device, max_context=max_context, model_dir=model_dir,
                        kernels=kernels, compile_decode=compile_decode, as_json=as_json, ignore_eos=ignore_eos, stop=list(stop),
                        tp=tp, prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)

    code = _guard(go, as_json)
    if code:
        raise typer.Exit(code)


@app.command("serve")
def serve_(
    model: Path = typer.Argument(..., help="a .vxir file (from `vxc lower`) whose model has a tokenizer"),
    host: str = typer.Option("127.0.0.1", "--host", help="the address to listen on"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    sequences: int = typer.Option(4, "--sequences", min=1, max=4096, help="state slots: requests decoded together"),
    dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help=KV_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, max=MAX_CONTEXT,
                                              help="positions per slot (default: the model's max_position_embeddings, "
                                                   "capped by a state budget of 4 GiB for all slots)"),
    chunk: int = typer.Option(64, "--chunk", min=1, max=MAX_CONTEXT, help="prefill chunk: a long prompt stalls decoding for at most this many tokens"),
    max_queue: int = typer.Option(64, "--max-queue", min=1, max=1 << 20, help="requests waiting for a slot; one more gets HTTP 429"),
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="where the safetensors live (default: as recorded in the IR)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the name /v1/models lists and requests may give (default: the IR file's stem)"),
    kernels: str = typer.Option("auto", "--kernels", help="auto | torch | triton | native"),
    prefix_cache_mib: float = typer.Option(256.0, "--prefix-cache-mib", min=0.0, max=float(1 << 30),
                                           help="budget of the exact prefix cache (state snapshots by token prefix, LRU); 0 = off"),
    tp: int = typer.Option(1, "--tp", min=1, max=1024, help="tensor-parallel ranks: this process serves as rank 0 and "
                                                             "spawns the others (or is one of torchrun's)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VXC_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every endpoint but /health"),
):
    """An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health): requests share
    the engine's SEQUENCES state slots by continuous batching (chunked prefill beside one batched decode step)."""

    # (No OpenMP wait policy is forced: the engine is built and stepped in one thread (serve._serve), so its thread
    # team is the only one and libgomp lets its threads spin briefly between a step's parallel regions. Measured on 2
    # cores, qwen3-0.6b bf16 over loopback: 15 -> 20-22 tok/s with one stream and 42 -> 60 with eight, against
    # OMP_WAIT_POLICY=PASSIVE, which this command used to set; the demo miniature 957 -> 1405 / 1498 -> 2092.)

    def go():
        from .serve import run_serve

        return run_serve(model=model, host=host, port=port, sequences=sequences, dtype=dtype, device=device,
                         max_context=max_context, chunk=chunk, max_queue=max_queue, model_dir=model_dir,
                         model_name=model_name, kernels=kernels, prefix_cache_bytes=int(prefix_cache_mib * 2**20), tp=tp,
                         kv_dtype=kv_dtype, api_key=api_key)

    _guard(go)


@app.command()
def demo(
    directory: Optional[Path] = typer.Option(None, "--dir", help="where to create the miniature witness (default: a temp dir)"),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
):
    """Create the built-in miniature witness, lower it, describe it and execute it."""
    import tempfile

    from .demo import build_demo
    from .driver import lower_to_file

    root = directory or Path(tempfile.mkdtemp(prefix="vxc-demo-"))
    mdir = build_demo(root / "mini-mamba2attn")
    ir = root / "mini-mamba2attn.vxir"
    print(f"== built miniature witness in {mdir}")
    ctx = _guard(lambda: lower_to_file(mdir, ir))
    print(f"== lowered → {ir} ({len(ctx.module.layers)} layers, {len(ctx.module.operands)} operands)")
    describe(ir, as_json=False, context=None, dot=None, sequences=1, tp=1, kv_dtype=None)
    print("== exec --prompt 'The state of ' --temperature 0.9 --top-k 40 --seed 0 --profile (random weights: the text is "
          "noise; --profile: where a decode step goes)")
    exec_(ir, prompt="The state of ", tokens=None, max_new_tokens=max_new_tokens, temperature=0.9, top_p=1.0, top_k=40, seed=0,
          dtype="fp32", device="cpu", max_context=256, model_dir=None, logits_out=None, save_state=None, resume_state=None,
          kernels="auto", kernel_report=False, compile_decode=False, as_json=False, ignore_eos=False, stop=[], chat=False,
          prefill_chunk=None, kv_dtype=None, json_schema=None,
          system=None, tp=1, profile=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
