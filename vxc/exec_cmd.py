"""``vxc exec``: load the IR, build the engine, prefill, generate, report throughput."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .ir.diagnostics import VxcError


def run_exec(*, model: Path, prompt, tokens, max_new_tokens, temperature, top_p, top_k, seed, dtype, device, max_context,
             model_dir, logits_out, save_state, resume_state, kernels, compile_decode, as_json,
             kernel_report=False) -> None:
    import torch

    from .codegen import kernels as K
    from .driver import model_dir_of
    from .ir.parser import parse_file
    from .runtime.engine import DTYPES, Engine
    from .runtime.sampling import Sampler
    from .runtime.session import Session
    from .runtime.tokenizer import Detokenizer, load_tokenizer

    if not Path(model).is_file():
        raise VxcError(f"{model}: no such IR file (lower a model directory first: vxc lower DIR -o {model})")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise VxcError(f"--dtype {dtype}: expected fp32 or bf16")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VxcError("--device cuda: no CUDA device is available")
    if kernels not in K.BACKENDS:
        raise VxcError(f"--kernels {kernels}: expected one of {', '.join(K.BACKENDS)}")
    if kernels != "auto":
        K.set_backend(kernels)
    K.reset_fallbacks()  # the report covers this run
    m = parse_file(model)
    mdir = model_dir_of(m, Path(model), model_dir)
    tok = load_tokenizer(mdir)
    note = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if prompt is not None and tokens is not None:
        raise VxcError("give either --prompt or --tokens, not both")
    if prompt is not None:
        if tok is None:
            raise VxcError(f"--prompt needs {mdir}/tokenizer.json, which does not exist; pass token ids with --tokens")
        ids = tok.encode(prompt).ids
    elif tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            raise VxcError(f"--tokens {tokens!r}: expected comma-separated integers") from None
    elif resume_state is None:
        raise VxcError("nothing to run: give --prompt TEXT or --tokens 1,2,3")
    else:
        ids = []
    if tok is None and not as_json:
        note(f"note: no tokenizer.json in {mdir}: input and output are token ids only")
    t0 = time.perf_counter()
    engine = Engine(m, mdir, dtype=DTYPES[dtype], device=device, max_context=max_context, compile_decode=compile_decode)
    load_s = time.perf_counter() - t0
    session = Session(engine)
    sampler = Sampler(temperature, top_k, top_p, seed, vocab=engine.vocab)
    if resume_state is not None:
        session.load_state(resume_state, sampler)
    if not ids:
        raise VxcError("--resume-state continues from the saved position: pass the next token(s) with --tokens (e.g. the last generated id)")
    t1 = time.perf_counter()
    logits = session.prefill(ids, last_only=logits_out is None)  # the head on every position only when asked for
    prefill_s = time.perf_counter() - t1
    if logits_out is not None:
        from safetensors.torch import save_file

        from .driver import write_atomic  # noqa: F401  (same atomic discipline)
        tmp = Path(str(logits_out) + ".tmp")
        save_file({"logits": logits.float().contiguous().cpu()}, str(tmp))
        tmp.replace(logits_out)
    detok = Detokenizer(tok) if tok is not None else None

    def stream(t: int) -> None:
        if as_json:
            return
        sys.stdout.write(detok.push(t) if detok else f"{t} ")
        sys.stdout.flush()

    if not as_json and detok is not None and prompt is not None:
        sys.stdout.write(prompt)
    t2 = time.perf_counter()
    out = session.generate(ids, max_new_tokens, sampler, on_token=stream, logits=logits[-1]) if max_new_tokens > 0 else []
    decode_s = time.perf_counter() - t2
    n_decode = max(len(out) - 1, 0)  # the first new token comes from the prefill logits
    if save_state is not None:
        session.save_state(save_state, sampler)
    result = {
        "generated_ids": out,
        "prompt_tokens": len(ids),
        "position": session.pos,
        "prefill_tokens_per_s": len(ids) / prefill_s if prefill_s > 0 else None,
        "decode_tokens_per_s": n_decode / decode_s if n_decode and decode_s > 0 else None,
        "load_seconds": load_s,
        "dtype": dtype,
        "device": device,
        "kernels": K.report(),  # the backend, the native library's status, every fallback to a torch twin
    }
    if tok is not None:
        result["generated_text"] = tok.decode(out)
    if as_json:
        print(json.dumps(result))
        return
    sys.stdout.write("\n")
    if kernel_report:
        note(K.format_report(result["kernels"]))
    p = result["prefill_tokens_per_s"]
    d = result["decode_tokens_per_s"]
    note(f"prefill {len(ids)} tokens: {p:.1f} tok/s · decode {n_decode} tokens: " + (f"{d:.1f} tok/s" if d else "n/a")
         + f" · load {load_s:.2f} s · position {session.pos}")
