"""Chat: the model's chat template rendered with jinja2 the way transformers renders it
(``apply_chat_template``: a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks`` and loop controls,
``tojson`` without HTML escaping, the ``raise_exception`` and ``strftime_now`` helpers; the template sees
``messages``, ``add_generation_prompt``, ``tools`` / ``documents`` (none) and the special tokens ``bos_token``,
``eos_token``, …), tokenized without adding special tokens (the template writes them), and ``vxc chat``: a
conversation that keeps the continuation state between turns, so each turn prefills only its own tokens."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path

from .ir.diagnostics import VxcError


class ChatError(VxcError):
    pass


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True, special: dict | None = None,
           source: str = "the chat template") -> str:
    import jinja2

    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               **(special or {}))
    except jinja2.exceptions.TemplateError as e:  # a syntax error, or the template's own raise_exception
        raise ChatError(f"{source}: {type(e).__name__}: {e}") from None


class Chat:
    """One conversation's messages and the text / tokens of it that the model has consumed."""

    def __init__(self, model_dir: Path, module, tok, system: str | None = None):
        from .model_files import chat_template

        self.tpl = chat_template(model_dir, module, tok)
        self.tok = tok
        self.messages: list[dict] = [{"role": "system", "content": system}] if system is not None else []
        self.consumed_text = ""  # the rendered conversation up to what the model has been given

    def render(self, messages, add_generation_prompt=True) -> str:
        return render(self.tpl.template, messages, add_generation_prompt=add_generation_prompt, special=self.tpl.special,
                      source=self.tpl.source)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def start(self, user: str) -> list[int]:
        """The first turn's prompt ids: the conversation so far with ``user`` appended, and the generation prompt."""
        self.messages.append({"role": "user", "content": user})
        text = self.render(self.messages)
        self.consumed_text = text
        ids = self.encode(text)
        if not ids:
            raise ChatError("the chat template renders this conversation to no tokens")
        return ids

    def reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.consumed_text += text

    def next_turn(self, user: str) -> tuple[list[int], bool]:
        """(ids to prefill, continued): the text the template adds after what the model has consumed, when the new
        rendering extends it (continued=True); else the whole conversation, to be prefilled from position 0."""
        self.messages.append({"role": "user", "content": user})
        full = self.render(self.messages)
        if full.startswith(self.consumed_text):
            new = full[len(self.consumed_text):]
            self.consumed_text = full
            return self.encode(new), True
        self.consumed_text = full
        return self.encode(full), False


def _chat_follower(rank: int, kw: dict) -> None:
    """Rank ``rank`` > 0 of ``vxc chat --tp N``: the same conversation as rank 0 (its turns, broadcast), silently."""
    import os

    sys.stdout = sys.stderr = open(os.devnull, "w")
    run_chat(**kw, rank=rank)


def run_chat(*, model: Path, system, max_new_tokens, temperature, top_p, top_k, seed, dtype, device, max_context,
             model_dir, kernels, compile_decode, as_json, ignore_eos=False, stop=(), input_stream=None, tp: int = 1,
             rank: int | None = None, prefill_chunk: int | None = None, kv_dtype: str | None = None) -> int:
    """Read one user turn per line from stdin; answer each, continuing from the state the previous turn left.

    Each turn prefills only the text the template adds to what the model has consumed: the end of the previous
    answer (the stop token that ended it, which was chosen but not yet fed; or the last token, when the answer
    ended by length) and the new user turn with the generation prompt. An answer cut by a --stop string leaves
    tokens in the state that the rendered history does not hold, so the next turn prefills the whole
    conversation again from position 0 (and says so)."""
    from .exec_cmd import context_full_note, generate, load_model, note
    from .runtime.sampling import Sampler

    stop = list(stop or ())
    if any(s == "" for s in stop):
        raise VxcError("--stop: an empty stop string would end generation at once")
    if tp > 1 and rank is None:  # tensor parallel: this process reads the turns as rank 0; the others follow
        from .exec_cmd import check_tp
        from .runtime import tp as TP

        check_tp(model, model_dir, tp)  # a model that does not split is refused before any rank starts
        kw = dict(model=model, system=system, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                  top_k=top_k, seed=seed, dtype=dtype, device=device, max_context=max_context, model_dir=model_dir,
                  kernels=kernels, compile_decode=compile_decode, as_json=as_json, ignore_eos=ignore_eos, stop=stop,
                  tp=tp, prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)
        backend = TP.backend_for(device)
        if TP.under_torchrun():
            r = TP.join(tp, backend)
            if r:
                return _chat_follower(r, kw)
            return run_chat(**kw, input_stream=input_stream, rank=0)
        followers = TP.start_followers(_chat_follower, tp, kw, backend=backend)
        try:
            out = run_chat(**kw, input_stream=input_stream, rank=0)
        except BaseException:
            followers.abort()  # (rank 0's own error is the one to report)
            raise
        TP.join_followers(followers)
        return out
    rank = rank or 0
    lm = load_model(model=model, dtype=dtype, device=device, max_context=max_context, model_dir=model_dir,
                    kernels=kernels, compile_decode=compile_decode, need_tokenizer="vxc chat", ignore_eos=ignore_eos,
                    prefill_chunk=prefill_chunk, kv_dtype=kv_dtype, **({"tp": tp, "rank": rank} if tp > 1 else {}))
    for w in lm.warnings:
        note(w)
    chat = Chat(lm.model_dir, lm.module, lm.tok, system)
    from .ir.gguf_container import forget

    forget()  # every header read is done: the GGUF metadata snapshot need not stay resident
    sampler = Sampler(temperature, top_k, top_p, seed, vocab=lm.engine.vocab)
    if tp > 1:
        from .runtime.tp import Agreed

        sampler = Agreed(sampler)  # rank 0's choices (the same tokens give every rank the same text and stops)
    session = lm.session
    stream = input_stream or sys.stdin
    interactive = not as_json and stream.isatty()
    if not as_json:
        note(f"chat template: {chat.tpl.source} · --max-context {lm.max_context} ({lm.max_context_note}) · "
             f"stop ids {lm.stop.ids} · one user turn per line; end with an empty line or EOF")

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    pending: list[int] = []  # the previous answer's last token: chosen, not yet fed
    turn_no = 0
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = stream.readline() if rank == 0 else None
        if tp > 1:
            from .runtime.tp import broadcast_object

            line = broadcast_object(line)  # rank 0's turn on every rank
        if not line or not line.rstrip("\n"):
            return 0
        user = line.rstrip("\n")
        if turn_no == 0:
            ids, continued = chat.start(user), False
        else:
            new, continued = chat.next_turn(user)
            if continued:
                ids = pending + new
            else:
                session.reset()
                ids = chat.encode(chat.consumed_text)
                if not as_json:
                    note("note: the previous answer was cut by a --stop string; prefilling the whole conversation again")
        room = lm.max_context - session.pos
        if len(ids) > room:
            msg = (f"context full: this turn needs {len(ids)} tokens at position {session.pos}, --max-context "
                   f"{lm.max_context} ({lm.max_context_note}) leaves {room}; the conversation ends here")
            if as_json:
                print(json.dumps({"error": msg}))
            else:
                note(msg)
            return 1
        t0 = time.perf_counter()
        logits = session.prefill(ids, last_only=True)
        prefill_s = time.perf_counter() - t0
        turn = generate(lm, sampler, ids, logits[-1], max_new_tokens, stop, None if as_json else write)
        chat.reply(turn.text)
        if turn.finish_reason == "stop":
            chat.consumed_text = "\ufffe"  # never a prefix: the next turn re-renders from the start
        pending = [] if turn.finish_reason == "eos" or not turn.ids else [turn.ids[-1]]
        turn_no += 1
        n_dec = max(len(turn.ids) - 1, 0)
        rec = {"turn": turn_no, "prefill_tokens": len(ids), "continued": continued, "generated_ids": turn.ids,
               "generated_text": turn.text, "finish_reason": turn.finish_reason, "position": session.pos,
               "prefill_tokens_per_s": len(ids) / prefill_s if prefill_s > 0 else None,
               "decode_tokens_per_s": n_dec / turn.seconds if n_dec and turn.seconds > 0 else None}
        if turn_no == 1:
            rec |= {"load_seconds": lm.load_s, "warmup_seconds": lm.warmup_s, "max_context": lm.max_context,
                    "stop_ids": lm.stop.ids}
        if as_json:
            print(json.dumps(rec))
            sys.stdout.flush()
        else:
            write("\n")
            if turn.finish_reason == "context":
                note(context_full_note(lm))
            p, d = rec["prefill_tokens_per_s"], rec["decode_tokens_per_s"]
            note(f"[prefill {len(ids)} tokens: {p:.1f} tok/s · decode {n_dec} tokens: " + (f"{d:.1f} tok/s" if d else "n/a")
                 + f" · ended by {turn.finish_reason} · position {session.pos}]")
        if turn.finish_reason == "context":
            return 0  # the answer was given up to the last position; nothing more fits
