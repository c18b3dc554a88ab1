"""``vxc exec``: load the IR, build the engine, prefill, generate, report throughput."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from .ir.diagnostics import VxcError

MAX_TOKEN_ID = 2**31 - 1  # larger than any vocabulary; the exact bound is the model's vocab, checked by the session


def _parse_tokens(text: str) -> list[int]:
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise VxcError(f"--tokens {text!r}: no token ids")
    ids = []
    for t in parts:
        if not t:
            continue
        if not re.fullmatch(r"[+-]?\d{1,12}", t):
            raise VxcError(f"--tokens: {t[:40]!r} is not a token id (comma-separated integers, e.g. 1,2,3)")
        v = int(t)
        if not 0 <= v <= MAX_TOKEN_ID:
            raise VxcError(f"--tokens: {v} is not a token id (ids are 0..vocab-1)")
        ids.append(v)
    return ids


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

    if Path(model).is_dir():
        raise VxcError(f"{model} is a directory, not an IR file: lower it first (vxc lower {model} -o model.vxir)")
    if not Path(model).is_file():
        raise VxcError(f"{model}: no such IR file (lower a model directory first: vxc lower DIR -o {model})")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise VxcError(f"--dtype {dtype}: expected fp32, bf16 or fp16")
    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", device):
        raise VxcError(f"--device {device}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise VxcError(f"--device {device}: no CUDA device is available")
        if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
            raise VxcError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kernels not in K.BACKENDS:
        raise VxcError(f"--kernels {kernels}: expected one of {', '.join(K.BACKENDS)}")
    if kernels != "auto":
        K.set_backend(kernels)
    K.reset_fallbacks()  # the report covers this run
    if prompt is not None and tokens is not None:
        raise VxcError("give either --prompt or --tokens, not both")
    if prompt is None and tokens is None:
        raise VxcError("nothing to run: give --prompt TEXT or --tokens 1,2,3" +
                       (" (after --resume-state: the next token(s), e.g. the last generated id)" if resume_state else ""))
    ids = _parse_tokens(tokens) if tokens is not None else None
    m = parse_file(model)
    mdir = model_dir_of(m, Path(model), model_dir)
    note = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if prompt is not None:  # the text needs the tokenizer: a missing or broken one is an error
        tok = load_tokenizer(mdir, m)
        if tok is None:
            raise VxcError(f"--prompt needs {mdir}/tokenizer.json (or a GGUF file's tokenizer), which does not exist; pass token ids with --tokens")
        ids = tok.encode(prompt).ids
        if not ids:
            raise VxcError(f"--prompt {prompt!r} encodes to no tokens; give some text or --tokens")
    else:  # token ids in: the tokenizer only renders the output, so a broken one is named and ids are printed
        try:
            tok = load_tokenizer(mdir, m)
        except VxcError as e:
            tok = None
            note(f"warning: {e}; output is token ids")
        else:
            if tok is None and not as_json:
                note(f"note: no tokenizer.json in {mdir}: input and output are token ids only")
    t0 = time.perf_counter()
    engine = Engine(m, mdir, dtype=DTYPES[dtype], device=device, max_context=max_context, compile_decode=compile_decode)
    load_s = time.perf_counter() - t0
    session = Session(engine)
    sampler = Sampler(temperature, top_k, top_p, seed, vocab=engine.vocab)
    if resume_state is not None:
        session.load_state(resume_state, sampler)
    t1 = time.perf_counter()
    logits = session.prefill(ids, last_only=logits_out is None)  # the head on every position only when asked for
    prefill_s = time.perf_counter() - t1
    if logits_out is not None:
        from .driver import save_safetensors_atomic

        save_safetensors_atomic(Path(logits_out), {"logits": logits.float().contiguous().cpu()})
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
