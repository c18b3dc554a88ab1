"""``vxc exec``: load the IR, build the engine, prefill, generate, report throughput."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .ir.diagnostics import VxcError

MAX_TOKEN_ID = 2**31 - 1  # larger than any vocabulary; the exact bound is the model's vocab, checked by the session
DTYPE_NAMES = ("fp32", "bf16", "fp16")  # what --dtype accepts
# the default --max-context is the model's trained positions, capped so the growing state stays within this
# many bytes (and half the memory available for it)
STATE_BUDGET = 4 << 30
FALLBACK_CONTEXT = 2048  # the default when the model's files do not say how many positions it was trained for


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


def note(s: str) -> None:
    print(s, file=sys.stderr)


@dataclass
class Loaded:
    """A model ready to generate: its engine and session, tokenizer, stop ids and the timings of getting there."""
    module: object
    model_dir: Path
    tok: object | None
    engine: object
    session: object
    max_context: int
    max_context_note: str  # how the --max-context in use was chosen
    load_s: float  # building the engine: weights mapped, graphs built, state allocated
    warmup_s: float  # one short prefill run once and discarded (imports, native library load, first-call costs)
    stop: object = None  # model_files.StopIds
    warnings: list[str] = field(default_factory=list)


def check_common(*, model: Path, dtype: str, device: str, kernels: str, kv_dtype: str | None = None) -> None:
    import torch

    from .codegen import kernels as K

    if Path(model).is_dir():
        raise VxcError(f"{model} is a directory, not an IR file: lower it first (vxc lower {model} -o model.vxir)")
    if not Path(model).is_file():
        raise VxcError(f"{model}: no such IR file (lower a model directory first: vxc lower DIR -o {model})")
    if dtype not in DTYPE_NAMES:
        raise VxcError(f"--dtype {dtype}: expected one of {' | '.join(DTYPE_NAMES)}")
    if kv_dtype is not None and kv_dtype not in DTYPE_NAMES:
        raise VxcError(f"--kv-dtype {kv_dtype}: expected one of {' | '.join(DTYPE_NAMES)}")
    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", device):
        raise VxcError(f"--device {device}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise VxcError(f"--device {device}: no CUDA device is available")
        if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
            raise VxcError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kernels not in K.BACKENDS:
        raise VxcError(f"--kernels {kernels}: expected one of {', '.join(K.BACKENDS)}")


def choose_max_context(m, mdir: Path, dtype: str, device: str, asked: int | None,
                       sequences: int = 1, kv_dtype: str | None = None) -> tuple[int, str]:
    """``--max-context`` as given; by default the model's trained positions (its files' ``max_position_embeddings``
    / GGUF ``context_length``), capped by the state budget (STATE_BUDGET, and half the memory available) for
    ``sequences`` slots together."""
    if asked is not None:
        return asked, "as given"
    from .model_files import max_positions

    found = max_positions(mdir, m)
    if found is None:
        return FALLBACK_CONTEXT, f"the model's files do not state its trained positions; default {FALLBACK_CONTEXT}"
    n, where = found
    import torch

    from .passes.context import Context
    from .passes.manager import DEFAULT_PIPELINE, PassManager, parse_pipeline
    from .runtime.engine import DTYPES, available_bytes
    from .runtime.state import StateProvider

    plan = PassManager(parse_pipeline(DEFAULT_PIPELINE), emit=lambda s: None).run(Context(m, model_dir=Path(mdir))).plan
    prov, dt = StateProvider(), DTYPES[dtype]
    kv = DTYPES[kv_dtype] if kv_dtype is not None else None
    per = prov.nbytes(plan, dt, 1, sequences, kv) - prov.nbytes(plan, dt, 0, sequences, kv)
    avail = available_bytes(torch.device(device))
    budget = STATE_BUDGET if avail is None else min(STATE_BUDGET, avail // 2)
    if per > 0 and n * per > budget:
        fits = max(int(budget // per), 1)
        slots = f" for {sequences} slots" if sequences > 1 else ""
        return fits, (f"{where} {n}, capped at {fits} by the state budget of {budget / 2**30:.2f} GiB{slots} "
                      f"({per:,} bytes per position); raise it with --max-context")
    return n, f"{where}"


def load_model(*, model: Path, dtype: str, device: str, max_context: int | None, model_dir, kernels: str,
               compile_decode: bool, need_tokenizer: str | None, ignore_eos: bool = False, sequences: int = 1,
               tp: int = 1, rank: int = 0, prefill_chunk: int | None = None, kv_dtype: str | None = None) -> Loaded:
    """Parse the IR, load the tokenizer (an error when ``need_tokenizer`` names why one is needed), build the
    engine at the chosen --max-context (with ``sequences`` state slots: ``vxc serve``) and warm it up."""
    from .codegen import kernels as K
    from .driver import model_dir_of
    from .ir.parser import parse_file
    from .model_files import StopIds, stop_ids
    from .runtime.engine import DTYPES, Engine
    from .runtime.session import Session
    from .runtime.tokenizer import load_tokenizer

    check_common(model=model, dtype=dtype, device=device, kernels=kernels, kv_dtype=kv_dtype)
    if kernels != "auto":
        K.set_backend(kernels)
    K.reset_fallbacks()  # the report covers this run
    m = parse_file(model)
    mdir = model_dir_of(m, Path(model), model_dir)
    warnings = []
    if need_tokenizer:
        tok = load_tokenizer(mdir, m)
        if tok is None:
            raise VxcError(f"{need_tokenizer} needs {mdir}/tokenizer.json (or a GGUF file's tokenizer), which does not exist"
                           + ("; pass token ids with --tokens" if need_tokenizer == "--prompt" else ""))
    else:  # token ids in: the tokenizer only renders the output, so a broken one is named and ids are printed
        try:
            tok = load_tokenizer(mdir, m)
        except VxcError as e:
            tok = None
            warnings.append(f"warning: {e}; output is token ids")
    stop = StopIds() if ignore_eos else stop_ids(mdir, m, tok)
    ctx_n, ctx_note = choose_max_context(m, mdir, dtype, device, max_context, sequences, kv_dtype)
    if tp > 1:  # the ranks must agree on it (the memory each process sees differs): rank 0's choice
        from .runtime.tp import broadcast_object

        ctx_n, ctx_note = broadcast_object((ctx_n, ctx_note))
    t0 = time.perf_counter()
    engine = Engine(m, mdir, dtype=DTYPES[dtype], device=device, max_context=ctx_n, compile_decode=compile_decode,
                    sequences=sequences, kv_dtype=DTYPES[kv_dtype] if kv_dtype is not None else None,
                    **({"tp": tp, "rank": rank} if tp > 1 else {}),
                    **({} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}))
    load_s = time.perf_counter() - t0
    stop.ids = [i for i in stop.ids if i < engine.vocab]
    session = Session(engine)
    t1 = time.perf_counter()
    if ctx_n >= 2:  # one short prefill, run once and discarded: the first call's one-time costs are not throughput
        session.prefill([0, 0], last_only=True)
        session.reset()
    warmup_s = time.perf_counter() - t1
    return Loaded(m, mdir, tok, engine, session, ctx_n, ctx_note, load_s, warmup_s, stop, warnings)


@dataclass
class Turn:
    ids: list[int]  # generated, the stop token included when one ended it
    text: str | None  # their text (special tokens included), the stop token and any stop string left out
    finish_reason: str
    seconds: float


def generate(lm: Loaded, sampler, prompt_ids: list[int], logits, max_new_tokens: int, stop_strings: list[str],
             write: Callable[[str], None] | None) -> Turn:
    """Generate from the prompt's last logits, streaming text (or ids without a tokenizer) through ``write``."""
    from .runtime.tokenizer import Detokenizer

    detok = Detokenizer(lm.tok, stop_strings) if lm.tok is not None else None
    stop_ids = set(lm.stop.ids) if lm.stop is not None else set()

    def on_token(t: int) -> bool:
        if t in stop_ids:
            return False  # the session stops on it; it is not shown
        if detok is None:
            if write:
                write(f"{t} ")
            return False
        piece = detok.push(t)
        if write and piece:
            write(piece)
        con = getattr(sampler, "constraint", None)  # --json-schema: the answer ends once the grammar is complete
        if con is not None and (con.stopped or con.error is not None):
            if con.error is not None:
                raise VxcError(f"--json-schema: {con.error}")
            return True
        return detok.stopped is not None

    t0 = time.perf_counter()
    s = lm.session
    if max_new_tokens > 0:
        out = s.generate(prompt_ids, max_new_tokens, sampler, on_token=on_token, logits=logits, stop_ids=stop_ids)
        reason = s.finish_reason
    else:
        out, reason = [], "length"
    secs = time.perf_counter() - t0
    text = None
    if detok is not None:
        rest = detok.finish()
        if write and rest:
            write(rest)
        text = detok.text
    return Turn(out, text, reason, secs)


def context_full_note(lm: Loaded) -> str:
    return (f"context full: position {lm.session.pos} of --max-context {lm.max_context} ({lm.max_context_note}); "
            f"generation stopped")


def run_exec(*, model: Path, prompt, tokens, max_new_tokens, temperature, top_p, top_k, seed, dtype, device, max_context,
             model_dir, logits_out, save_state, resume_state, kernels, compile_decode, as_json,
             kernel_report=False, ignore_eos=False, stop=(), chat=False, system=None, tp=1, rank=None,
             prefill_chunk=None, kv_dtype=None, json_schema=None, profile=False) -> None:
    from .codegen import kernels as K
    from .runtime.sampling import Sampler

    if tp > 1 and rank is None:  # tensor parallel: this process is one rank (torchrun) or spawns them all
        from .runtime import tp as TP

        kw = dict(model=model, prompt=prompt, tokens=tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_p=top_p, top_k=top_k, seed=seed, dtype=dtype, device=device, max_context=max_context,
                  model_dir=model_dir, logits_out=logits_out, save_state=save_state, resume_state=resume_state,
                  kernels=kernels, compile_decode=compile_decode, as_json=as_json, kernel_report=kernel_report,
                  ignore_eos=ignore_eos, stop=stop, chat=chat, system=system, tp=tp, prefill_chunk=prefill_chunk,
                  kv_dtype=kv_dtype, json_schema=json_schema, profile=profile)
        check_tp(model, model_dir, tp)  # a model that does not split is refused before any rank starts
        backend = TP.backend_for(device)
        if TP.under_torchrun():
            return _exec_rank(TP.join(tp, backend), kw)
        import torch.multiprocessing as mp

        try:
            TP.spawn(_exec_rank, tp, kw, backend=backend)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            raise TP.rank_failure(e) from None  # (a rank's error in one line, not its traceback)
        return
    rank = rank or 0

    stop = list(stop or ())
    resume_hint = " (after --resume-state: the next token(s), e.g. the last generated id)" if resume_state else ""
    if prompt is not None and tokens is not None:
        raise VxcError("give either --prompt or --tokens, not both")
    if prompt is None and tokens is None:
        raise VxcError("nothing to run: give --prompt TEXT or --tokens 1,2,3" + resume_hint)
    if prompt == "":
        raise VxcError("--prompt is empty: give the text to " + ("continue from" if resume_state else "start from")
                       + " (or token ids with --tokens 1,2,3)" + resume_hint)
    if any(s == "" for s in stop):
        raise VxcError("--stop: an empty stop string would end generation at once")
    if chat and prompt is None:
        raise VxcError("--chat renders --prompt as the user turn: give --prompt TEXT (not --tokens)")
    schema = None
    if json_schema is not None and tp > 1:
        raise VxcError("--json-schema is not supported with --tp (each rank would follow the grammar on its own)")
    if json_schema is not None:  # read and parsed before the model loads: a bad file costs nothing
        import json as _json  # (a local ``json`` would shadow the module's for the whole function)

        try:
            schema = _json.loads(Path(json_schema).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise VxcError(f"--json-schema {json_schema}: not a readable JSON file ({e})") from None
    if system is not None and not chat:
        raise VxcError("--system is the system turn of a chat: it needs --chat")
    if chat and resume_state is not None:
        raise VxcError("--chat renders a whole conversation from its start; it cannot continue a --resume-state "
                       "(use `vxc chat` for a conversation that continues)")
    ids = _parse_tokens(tokens) if tokens is not None else None
    need = "--chat" if chat else "--prompt" if prompt is not None else "--stop" if stop else None
    lm = load_model(model=model, dtype=dtype, device=device, max_context=max_context, model_dir=model_dir,
                    kernels=kernels, compile_decode=compile_decode, need_tokenizer=need, ignore_eos=ignore_eos,
                    tp=tp, rank=rank, prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)
    for w in lm.warnings:
        note(w)
    if profile:
        lm.engine.start_profile()
    tok, session = lm.tok, lm.session
    if tok is None and not as_json:
        note(f"note: no tokenizer.json in {lm.model_dir}: input and output are token ids only")
    if max_context is None and not as_json:
        note(f"note: --max-context {lm.max_context} ({lm.max_context_note})")
    if chat:
        from .chat import Chat

        ids = Chat(lm.model_dir, lm.module, tok, system).start(prompt)
    elif prompt is not None:
        ids = tok.encode(prompt).ids
        if not ids:
            raise VxcError(f"--prompt {prompt!r} encodes to no tokens; give some text or --tokens")
    from .ir.gguf_container import forget

    forget()  # every header read is done: the GGUF metadata snapshot need not stay resident
    constraint = None
    if schema is not None:
        from .runtime.grammar import Grammars

        if lm.tok is None:
            raise VxcError("--json-schema needs the model's tokenizer")
        g = Grammars(lm.tok, lm.engine.vocab, lm.stop.ids if lm.stop is not None else [])
        constraint = g.constraint(g.json_schema(schema))  # (a GrammarError names what is wrong)
    sampler = Sampler(temperature, top_k, top_p, seed, vocab=lm.engine.vocab, constraint=constraint)
    if tp > 1:
        from .runtime.tp import Agreed, rank_path

        sampler = Agreed(sampler)  # every rank continues with rank 0's choice
        resume_state = rank_path(resume_state, rank) if resume_state is not None else None
        save_state = rank_path(save_state, rank) if save_state is not None else None
    if resume_state is not None:
        session.load_state(resume_state, sampler)
    t1 = time.perf_counter()
    logits = session.prefill(ids, last_only=logits_out is None)  # the head on every position only when asked for
    prefill_s = time.perf_counter() - t1
    if logits_out is not None and rank == 0:  # (tensor parallel: every rank holds the same logits; rank 0 writes)
        from .driver import save_safetensors_atomic

        save_safetensors_atomic(Path(logits_out), {"logits": logits.float().contiguous().cpu()})

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    if not as_json and tok is not None and prompt is not None and not chat:
        write(prompt)
    turn = generate(lm, sampler, ids, logits[-1], max_new_tokens, stop, None if as_json else write)
    n_decode = max(len(turn.ids) - 1, 0)  # the first new token comes from the prefill logits
    if save_state is not None:
        session.save_state(save_state, sampler)
    result = {
        "generated_ids": turn.ids,
        "finish_reason": turn.finish_reason,
        "prompt_tokens": len(ids),
        "position": session.pos,
        "max_context": lm.max_context,
        "max_context_source": lm.max_context_note,
        "stop_ids": lm.stop.ids,
        "prefill_tokens_per_s": len(ids) / prefill_s if prefill_s > 0 else None,
        "decode_tokens_per_s": n_decode / turn.seconds if n_decode and turn.seconds > 0 else None,
        "prefill_seconds": prefill_s,
        "decode_seconds": turn.seconds,
        "load_seconds": lm.load_s,
        "warmup_seconds": lm.warmup_s,
        "dtype": dtype,
        "kv_dtype": kv_dtype or dtype,
        "device": device,
        "kernels": K.report(),  # the backend, the native library's status, every fallback to a torch twin
        "decode_replay": lm.engine.replay_status(),
        "decode_threads": lm.engine.thread_report(),  # the thread governor's count for replayed steps
        "compute_threads": _compute_threads(),
        "packed_weight_bytes": _packed_bytes(),  # the 16-row packed copies int8_block32 products read (AVX-512)
    }
    if turn.text is not None:
        result["generated_text"] = turn.text
    if profile:
        result["prefill_profile"] = lm.engine.prefill_profile.summary()
        result["decode_profile"] = lm.engine.decode_profile()
    if as_json:
        print(json.dumps(result))
        return
    write("\n")
    if turn.finish_reason == "context":
        note(context_full_note(lm))
    if kernel_report:
        note(K.format_report(result["kernels"]))
    if profile:
        from .runtime.prefill_profile import format_prefill
        from .runtime.replay import format_profile

        note(format_prefill(result["prefill_profile"]))
        note(format_profile(result["decode_profile"], _no_replay_reason(result["decode_replay"])))
    p = result["prefill_tokens_per_s"]
    d = result["decode_tokens_per_s"]
    note(f"prefill {len(ids)} tokens: {p:.1f} tok/s · decode {n_decode} tokens: " + (f"{d:.1f} tok/s" if d else "n/a")
         + f" · ended by {turn.finish_reason} · load {lm.load_s:.2f} s + warm-up {lm.warmup_s:.2f} s · position {session.pos}")


def _no_replay_reason(status: str) -> str:
    """Why a decode profile may be empty, in the user's terms (the replay's status otherwise)."""
    from .codegen import kernels as K
    from .runtime.replay import CAPTURES

    if K.get_backend() not in ("auto", "native"):
        return f"--kernels {K.get_backend()}: the decode steps run their graph, and only native replays are profiled"
    if status == "capturing":
        return f"the first {CAPTURES} decode steps are captured, not replayed"
    return status


def check_tp(model: Path, model_dir, tp: int) -> None:
    """Refuse (``Refusal``) a model whose rank-0 part the shard pass refuses, without torch or any rank."""
    from .driver import load
    from .passes.manager import TP_PIPELINE, PassManager, parse_pipeline

    check_path = Path(model)
    if not check_path.is_file():
        return  # load_model names the problem
    ctx = load(check_path)
    ctx.tp, ctx.rank = tp, 0
    PassManager(parse_pipeline(TP_PIPELINE), emit=lambda s: None).run(ctx)


def _exec_rank(rank: int, kw: dict) -> None:
    """One rank of ``vxc exec --tp N``: rank 0 prints what ``vxc exec`` prints; the others print nothing. An error
    on rank 0 is printed as the CLI prints it and ends the rank with the CLI's exit status."""
    import os

    if rank != 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        run_exec(**kw, rank=rank)
        return
    from .passes.findings import Refusal

    try:
        run_exec(**kw, rank=rank)
    except Refusal as r:
        print(json.dumps(r.to_json(), indent=1) if kw.get("as_json") else r.text())
        sys.stdout.flush()
        sys.exit(2)
    except VxcError as e:
        if kw.get("as_json"):
            print(json.dumps({"error": str(e)}))
        else:
            print(f"error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def _compute_threads() -> dict:
    """The thread counts this process computes with: torch's, and the native library's parallel regions' (a
    tensor-parallel rank on a shared machine takes its share: ``tp.local_rank_threads``)."""
    import torch

    from .codegen.kernels import native

    return {"torch": torch.get_num_threads(), "native": native.max_threads() if native.available() else None}


def _packed_bytes() -> int:
    from .codegen.kernels.quant import packed_bytes

    return packed_bytes()
