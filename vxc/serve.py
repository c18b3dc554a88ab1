"""``vxc serve``: an OpenAI-compatible HTTP server over the :class:`~vxc.runtime.scheduler.Scheduler`.

One engine with S state slots serves every client: requests are admitted into free slots (FIFO, a bounded queue
in front) and advanced together by continuous batching — each scheduler step runs one prefill chunk of one request
beside one batched decode step of every request that has a token to feed. All ``step()`` calls happen in one
engine worker thread (:class:`EngineWorker`), which sleeps on a condition when no request is in flight and is
woken by a submit; the HTTP side (FastAPI on the event loop) only submits and cancels, which the scheduler allows
from any thread.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events or not),
``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). A request's choices (``n`` per prompt, several prompts) are scheduler
requests of their own, sharing the request's event queue; log-probabilities are the scheduler's (the model's own,
before a sampler's bias and penalties), formatted here on the event loop. Errors are OpenAI's JSON shape ``{"error": {"message", "type", "param",
"code"}}``: 400 for a request that cannot be served as written (unknown field, wrong type, a value outside what
is supported, a prompt longer than the context, a body that is not UTF-8 JSON), 404 for another model name or
path, 429 when the scheduler's queue is full, 500 when the engine fails a request (the server keeps serving the
others). A client that disconnects cancels its request at once: its slot is free at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .ir.diagnostics import VxcError

log = logging.getLogger("vxc.serve")

MAX_STOP_STRINGS = 16  # a stop list is checked on every token in the engine's thread: bounded
SEED_MAX = 2**63 - 1
DISCONNECT_POLL_S = 0.2  # how often a request that is not streamed checks that its client is still there
MAX_LOGPROBS = 20  # the most likely ids a log-probability entry lists (OpenAI's chat limit; vLLM's default)
MAX_CHOICES = 128  # n: choices of one prompt
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias map


class ServeError(VxcError):
    pass


# ---------------------------------------------------------------------------------------------------- the worker


class EngineWorker:
    """The one thread that calls :meth:`Scheduler.step`: it steps while any request is in flight and sleeps on a
    condition when none is; :meth:`submit` and :meth:`cancel` (any thread) wake it."""

    def __init__(self, scheduler, executor=None):
        """``executor``: a one-thread executor to step in (the thread that built the engine, see :func:`_serve`);
        None: a thread of the worker's own."""
        self.scheduler = scheduler
        self.executor = executor
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._future = None
        self.stepped_in: str | None = None  # the name of the thread that steps
        self.step_failures = 0  # steps that raised outside the scheduler's own per-request handling

    def start(self) -> None:
        if self.executor is not None:
            if self._future is None:
                self._future = self.executor.submit(self._run)
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vxc-engine", daemon=True)
            self._thread.start()

    def _alive(self) -> bool:
        if self._future is not None:
            return not self._future.done()
        return self._thread is not None and self._thread.is_alive()

    def _join(self, timeout: float) -> None:
        if self._future is not None:
            import concurrent.futures

            try:
                self._future.result(timeout)
            except concurrent.futures.TimeoutError:
                pass
        elif self._thread is not None:
            self._thread.join(timeout)

    def submit(self, prompt: list[int], **kw):
        req = self.scheduler.submit(prompt, **kw)  # raises QueueFull / SchedulerError: nothing was queued
        with self._cv:
            self._cv.notify()
        return req

    def cancel(self, req) -> None:
        if req.finish_reason is None:
            self.scheduler.cancel(req)
            with self._cv:
                self._cv.notify()

    def _run(self) -> None:
        from .codegen.kernels import native

        sch = self.scheduler
        self.stepped_in = threading.current_thread().name
        native.apply_thread_limit()  # (a tensor-parallel rank 0's share of the CPUs, in the thread that steps)
        while True:
            with self._cv:
                # submit appends under the scheduler's lock before it notifies under this condition, so a request
                # submitted while we test ``idle`` is either seen here or wakes the wait
                while not self._stopping and sch.idle:
                    if sch.sync is None:
                        self._cv.wait()
                    elif not self._cv.wait(sch.sync.HEARTBEAT_S):
                        break  # tensor parallel: an idle step now and then keeps the other ranks' wait short
                if self._stopping:
                    return
            try:
                sch.step()
            except Exception as e:  # the scheduler fails requests whose step failed; this is anything else
                self.step_failures += 1
                log.exception("scheduler step failed; failing the requests in slots")
                with sch.lock:
                    for r in list(sch.active):
                        if r.finish_reason is None:
                            r.error = e
                            sch._finish(r, "error")
                time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping and end every request still in flight (``cancelled``)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._join(timeout)
        sch = self.scheduler
        for r in list(sch.waiting) + list(sch.active):
            sch.cancel(r)
        if not self._alive():
            try:
                sch.step()  # retires the cancelled requests in slots (their on_finish runs); the worker is gone
            except Exception:
                log.exception("retiring requests at shutdown")
            if sch.sync is not None:
                sch.sync.close()  # tensor parallel: the other ranks stop


# ---------------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                             503: "server_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _validation_error(err: ValidationError | list) -> ApiError:
    """The first pydantic error as one OpenAI-style 400 (``param`` is the field's dotted path)."""
    errors = err.errors() if isinstance(err, ValidationError) else list(err)
    first = errors[0]
    # the field's path, without pydantic's union-member tags ("str", "list[int]", ...)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unsupported field {param!r}: vxc serve does not implement it"
    elif kind == "missing":
        msg = f"missing required field {param!r}"
    elif kind == "json_invalid":
        msg = f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
        param = None
    else:
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return ApiError(400, msg, param=param, code=kind or None)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _parse_body(raw: bytes, model: type[BaseModel]):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_utf8") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON ({e})", code="json_invalid") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(obj).__name__}", code="json_invalid")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None


# ---------------------------------------------------------------------------------------------------- requests

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None


class _Common(BaseModel):
    """Fields both endpoints take. Strict: a wrong JSON type is an error, never coerced."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=0)
    seed: Optional[int] = Field(default=None, ge=0, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an end-user id for the caller's own records; it changes nothing here
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None


class CompletionRequest(_Common):
    # one prompt (text or token ids) or several (each gets n choices: choice index = prompt index * n + j)
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` as /v1/completions encodes it, or ``messages`` as
    /v1/chat/completions renders them."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: Optional[bool] = None  # default: True for a prompt, False for messages (the template writes them)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Optional[str] = None
    tokens: list[int]


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_value")


def _check_common(r: _Common, served_name: str, vocab: int) -> list[str]:
    """The checks pydantic cannot express; returns the stop strings."""
    if r.model is not None and r.model != served_name:
        raise ApiError(404, f"the model {r.model!r} does not exist: this server serves {served_name!r}",
                       param="model", code="model_not_found")
    if r.logit_bias:
        if len(r.logit_bias) > MAX_LOGIT_BIAS:
            raise _unsupported("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, not {len(r.logit_bias)}")
        for k, v in r.logit_bias.items():
            if not (k.isascii() and k.isdigit()) or not 0 <= int(k) < vocab:
                raise ApiError(400, f"logit_bias: {k!r} is not a token id of this model (0..{vocab - 1})",
                               param="logit_bias", code="invalid_value")
            if not -100.0 <= v <= 100.0:  # (strict floats: never NaN or infinite)
                raise ApiError(400, f"logit_bias: the bias of token {k} is {v}; it must be in -100..100",
                               param="logit_bias", code="invalid_value")
    f = r.response_format
    if f is not None and (f.type == "json_schema") != (f.json_schema is not None):
        raise ApiError(400, "response_format: json_schema goes with type json_schema, and only with it",
                       param="response_format", code="invalid_value")
    if r.stream_options is not None and not r.stream:
        raise _unsupported("stream_options", "stream_options is only allowed with stream: true")
    stop = [] if r.stop is None else [r.stop] if isinstance(r.stop, str) else list(r.stop)
    if any(s == "" for s in stop):
        raise _unsupported("stop", "an empty stop string would end generation at once")
    if len(stop) > MAX_STOP_STRINGS:
        raise _unsupported("stop", f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}")
    return stop


def _sampler(r: _Common, vocab: int, j: int, constraint=None):
    """Choice ``j``'s sampler: with a ``seed``, choice j draws from ``seed + j`` (n choices of one seeded request
    differ from each other, and each repeats with the same seed); without one, from a fresh random seed."""
    from .runtime.sampling import Sampler

    temperature = 1.0 if r.temperature is None else r.temperature  # OpenAI's default; 0 is greedy
    seed = (r.seed + j) % (SEED_MAX + 1) if r.seed is not None else secrets.randbits(63)
    bias = {int(k): float(v) for k, v in r.logit_bias.items()} if r.logit_bias else None
    return Sampler(temperature, r.top_k or 0, 1.0 if r.top_p is None else r.top_p, seed, vocab=vocab,
                   presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
                   logit_bias=bias, constraint=constraint)


# ---------------------------------------------------------------------------------------------------- log-probabilities


CONTEXT_TOKENS = 4  # ids before a token decoded with it to find its text (a UTF-8 character spans at most 4 byte tokens)


def _clean(v: float) -> float | None:
    """A log-probability as JSON can carry it: -inf (a logit of -inf) as -9999.0, as vLLM writes it; NaN as null."""
    if v != v:
        return None
    return max(v, -9999.0)


class _TokenText:
    """The text of each token in its sequence, as the log-probability entries show it.

    A token's ``piece`` is what it adds to the decode of the ids before it (the ``CONTEXT_TOKENS`` ids before it
    decoded with and without it): a token that ends inside a multi-byte character adds nothing, the one that
    completes it adds the character, so the pieces of a sequence concatenate to its text (``text_offset`` counts
    them). What an entry shows is the piece, except for a token whose own bytes are not that piece (one byte of a
    character split across tokens): it shows ``"bytes:\\xe6\\x9d"``, as OpenAI writes such tokens, with those exact
    bytes (:class:`~vxc.runtime.tokenizer.TokenBytes`; where the vocabulary does not spell them, the piece). An
    alternative id at a position is decoded against the same context."""

    def __init__(self, tok, raw, context: list[int]):
        self.tok, self.raw, self.ids = tok, raw, list(context)

    def _dec(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _one(self, before: list[int], prev: str, t: int) -> tuple[str, bytes, str]:
        from .runtime.tokenizer import REPLACEMENT

        base = prev.rstrip(REPLACEMENT)
        cur = self._dec(before + [t])
        stable = cur.rstrip(REPLACEMENT)
        piece = stable[len(base):] if stable.startswith(base) else stable
        own = piece.encode("utf-8")
        raw = self.raw(t)
        if raw is not None and raw != own or (raw is None and stable != cur):
            b = raw if raw is not None else own
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b), b, piece
        return piece, own, piece

    def next(self, t: int, alts: list[int] = ()) -> tuple[tuple[str, bytes, str], list[tuple[str, bytes, str]]]:
        """((shown text, bytes, piece) of ``t``, the same of each alternative id) at the next position; ``t`` joins
        the context."""
        before = self.ids[-CONTEXT_TOKENS:]
        prev = self._dec(before)
        out = self._one(before, prev, t), [self._one(before, prev, a) for a in alts]
        self.ids.append(t)
        return out


@dataclass
class _Logprob:
    """One token's log-probability entry, formatted: its shown text and bytes, its piece of the text, its
    log-probability (None for a prompt's first token, which nothing predicts) and the most likely ids' (shown
    text, bytes, log-probability) at its position."""
    text: str
    bytes: bytes
    piece: str
    logprob: float | None
    top: list[tuple[str, bytes, float | None]] | None


def _entries(texts: _TokenText, toks: list[int], lps: list) -> list[_Logprob]:
    out = []
    for t, lp in zip(toks, lps):
        if lp is None:
            (shown, b, piece), _ = texts.next(t)
            out.append(_Logprob(shown, b, piece, None, None))
            continue
        value, top = lp
        (shown, b, piece), alts = texts.next(t, [a for a, _ in top])
        out.append(_Logprob(shown, b, piece, _clean(value),
                            [(x[0], x[1], _clean(v)) for x, (_, v) in zip(alts, top)]))
    return out


def _completion_logprobs(entries: list[_Logprob], offset: int) -> dict:
    """The completions endpoint's ``logprobs`` object: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the most
    likely texts and the chosen one's, as OpenAI writes them: up to logprobs + 1 keys) and ``text_offset`` (where
    each token's piece starts in the choice's text, from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.text)
        out["token_logprobs"].append(e.logprob)
        if e.top is None:
            out["top_logprobs"].append(None)
        else:
            top = {text: v for text, _, v in e.top}
            top[e.text] = e.logprob
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(e.piece)
    return out


def _chat_logprobs(entries: list[_Logprob]) -> dict:
    """The chat endpoint's ``logprobs`` object: ``content``, one entry per token with its exact ``bytes``."""
    def one(text, b, lp):
        return {"token": text, "logprob": lp, "bytes": list(b)}

    return {"content": [dict(one(e.text, e.bytes, e.logprob), top_logprobs=[one(*a) for a in e.top or []])
                        for e in entries]}


# ---------------------------------------------------------------------------------------------------- one request


class _Choice:
    """One choice of a request (one scheduler request): its detokenizer and where its events go. Engine-thread
    callbacks push ``("text", index, piece, tokens)`` onto the request's queue as the detokenizer makes text final
    (``tokens``: how many chosen tokens that text covers; streamed requests only), then ``("end", index, None,
    tokens)``."""

    def __init__(self, index: int, prompt: list[int], prompt_text: str, events: "_Events", stop: list[str]):
        from .runtime.tokenizer import Detokenizer

        self.index, self.prompt, self.prompt_text, self.events = index, prompt, prompt_text, events
        self.detok = Detokenizer(events.tok, stop)
        self.callback_error: BaseException | None = None
        self.req = None  # the scheduler's Request
        self.constraint = None  # structured output: the grammar its tokens follow (vxc.runtime.grammar.Constraint)
        self.text = ""
        self.sent = 0  # chosen tokens whose log-probabilities went out (streamed)
        self.echoed = False
        self.texts: _TokenText | None = None  # the token texts of the completion (log-probabilities)
        self.metrics = None  # the app's serve_metrics.Metrics
        self.queued = 0.0  # perf_counter() when it was queued
        self.first_seen = False

    def on_token(self, req, tok: int) -> bool:  # engine thread
        if not self.first_seen:
            self.first_seen = True
            if self.metrics is not None:
                self.metrics.first_token(self.queued)
        try:
            piece = self.detok.push(tok)
        except Exception as e:  # never let a callback fail the scheduler's whole step
            self.callback_error = e
            return True
        if piece and self.events.stream:
            self.events.put(("text", self.index, piece, len(req.generated)))
        con = self.constraint
        if con is not None:
            if con.error is not None:
                from .runtime.grammar import GrammarError

                self.callback_error = GrammarError(f"structured output: {con.error}")
                return True
            if con.stopped:  # the grammar is complete: nothing more may follow
                return True
        return self.detok.stopped is not None

    def on_finish(self, req) -> None:  # engine thread (or the canceller's)
        rest = ""
        if req.finish_reason not in ("error", "cancelled") and self.callback_error is None:
            try:
                rest = self.detok.finish()
            except Exception as e:
                self.callback_error = e
        self.text = self.detok.emitted
        if self.metrics is not None:
            try:
                self.metrics.ended(req, self.queued, self.first_seen)
            except Exception:  # figures must never fail a request
                log.exception("recording a request's metrics")
        self.events.put(("end", self.index, rest if self.events.stream else "", len(req.generated)))


class _Events:
    """A request's event queue on the event loop, fed from the engine's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tok, stream: bool):
        self.loop, self.queue, self.tok, self.stream = loop, asyncio.Queue(), tok, stream

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


@dataclass
class Served:
    """What the app serves: the worker over the scheduler, and the model's text side."""
    worker: EngineWorker
    tok: Any
    model_name: str
    stop_ids: list[int]
    chat_template: Any = None  # model_files.ChatTemplate
    chat_error: str | None = None  # why there is no chat template
    created: int = field(default_factory=lambda: int(time.time()))
    _token_bytes: Any = None
    _grammars: Any = None
    metrics: Any = None  # serve_metrics.Metrics (GET /metrics)

    @property
    def grammars(self):
        """Structured output's side of the model (vxc.runtime.grammar.Grammars; its tokenizer built on first use)."""
        if self._grammars is None:
            from .runtime.grammar import Grammars

            self._grammars = Grammars(self.tok, self.engine.vocab, self.stop_ids)
        return self._grammars

    @property
    def token_bytes(self):
        """The vocabulary's exact token bytes (built on the first request that asks for log-probabilities)."""
        if self._token_bytes is None:
            from .runtime.tokenizer import TokenBytes

            self._token_bytes = TokenBytes(self.tok)
        return self._token_bytes

    @property
    def scheduler(self):
        return self.worker.scheduler

    @property
    def engine(self):
        return self.worker.scheduler.engine


def _failure(c: _Choice) -> ApiError | None:
    req = c.req
    if req.finish_reason == "error" or c.callback_error is not None:
        e = req.error or c.callback_error
        return ApiError(500, f"the engine failed this request: {type(e).__name__}: {e}", code="engine_error")
    if req.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled (the server is shutting down)", code="cancelled")
    return None


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n\n"


@dataclass
class _Ask:
    """What one endpoint call asks for, past validation."""
    prompts: list[list[int]]
    prompt_texts: list[str]
    stop: list[str]
    chat: bool
    param: str
    n: int = 1
    logprobs: Optional[int] = None  # None: no log-probabilities; k: the chosen token's and the k most likely
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' log-probabilities) first


async def _run_request(request: Request, s: Served, body: _Common, ask: _Ask):
    from .runtime.scheduler import QueueFull, SchedulerError

    e = s.engine
    chat = ask.chat
    max_new = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        if max_new is not None and max_new != body.max_completion_tokens:
            raise _unsupported("max_completion_tokens", "max_tokens and max_completion_tokens differ")
        max_new = body.max_completion_tokens
    if max_new is None:  # completions: OpenAI's 16; chat: until the context is full
        max_new = e.max_context if chat else 16
    for i, p in enumerate(ask.prompts):
        if len(p) > e.max_context:
            where = f" (prompt {i})" if len(ask.prompts) > 1 else ""
            raise ApiError(400, f"the prompt{where} has {len(p)} tokens; the context holds {e.max_context}",
                           param=ask.param, code="context_length_exceeded")
    total = len(ask.prompts) * ask.n
    if total > s.scheduler.max_queue:
        raise _unsupported("n", f"{total} choices in one request; this server queues at most {s.scheduler.max_queue}")
    ev = _Events(asyncio.get_running_loop(), s.tok, body.stream)
    choices = [_Choice(i * ask.n + j, p, t, ev, ask.stop) for i, (p, t) in enumerate(zip(ask.prompts, ask.prompt_texts))
               for j in range(ask.n)]
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        from .runtime.grammar import GrammarError

        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else {"type": "object"}

        g = s.grammars

        def constraints():  # (a thread: building the tokenizer's side once takes seconds on a large vocabulary)
            grammar = g.json_schema(schema)
            return [g.constraint(grammar) for _ in choices]

        try:
            for c, con in zip(choices, await asyncio.to_thread(constraints)):
                c.constraint = con
        except GrammarError as err:
            raise ApiError(400, f"response_format: {err}", param="response_format", code="invalid_response_format") from None

    def cancel_all():
        for c in choices:
            if c.req is not None:
                s.worker.cancel(c.req)

    try:
        for c in choices:
            c.metrics, c.queued = s.metrics, time.perf_counter()
            c.req = s.worker.submit(c.prompt, max_new_tokens=max_new,
                                    sampler=_sampler(body, e.vocab, c.index % ask.n, c.constraint),
                                    stop_ids=s.stop_ids, on_token=c.on_token, on_finish=c.on_finish,
                                    logprobs=ask.logprobs, prompt_logprobs=ask.echo and ask.logprobs is not None)
    except QueueFull as err:
        cancel_all()
        raise ApiError(429, f"the server is busy: {err}; retry later", code="queue_full") from None
    except SchedulerError as err:
        cancel_all()
        raise ApiError(400, str(err), param=ask.param, code="invalid_prompt") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": s.model_name}
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def usage() -> dict:
        p = sum(len(x) for x in ask.prompts)  # each prompt once, whatever n
        c = sum(len(x.req.generated) for x in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def logprobs_of(c: _Choice, upto: int, with_prompt: bool) -> list[_Logprob]:
        """The formatted entries of ``c``'s chosen tokens ``c.sent .. upto`` (and first its prompt's, echoed)."""
        out = []
        if with_prompt:
            prompt_lps = [None] + list(c.req.prompt_token_logprobs) if ask.logprobs is not None else [None] * len(c.prompt)
            out += _entries(_TokenText(s.tok, s.token_bytes, []), c.prompt, prompt_lps)
        if c.texts is None:
            c.texts = _TokenText(s.tok, s.token_bytes, c.prompt[-CONTEXT_TOKENS:])
        out += _entries(c.texts, c.req.generated[c.sent:upto], c.req.token_logprobs[c.sent:upto])
        c.sent = upto
        return out

    def lp_object(entries: list[_Logprob], offset: int):
        if ask.logprobs is None:
            return None
        return _chat_logprobs(entries) if chat else _completion_logprobs(entries, offset)

    if body.stream:
        offsets = {c.index: 0 for c in choices}

        def chunk(c: _Choice, text: str | None, finish: str | None, entries=None, first: bool = False) -> bytes:
            lp = None
            if entries is not None:
                lp = lp_object(entries, offsets[c.index])
                offsets[c.index] += sum(len(x.piece) for x in entries)
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            out = dict(base, choices=[choice])
            if include_usage:
                out["usage"] = None
            return _sse(out)

        def echo(c: _Choice) -> list[bytes]:
            if not ask.echo or c.echoed:
                return []
            c.echoed = True  # (the prompt's log-probabilities are whole once its first event comes: prefill is done)
            return [chunk(c, c.prompt_text, None, logprobs_of(c, 0, True) if ask.logprobs is not None else None)]

        async def events():
            if chat:
                for c in choices:
                    yield chunk(c, None, None, first=True)
            left = len(choices)
            while left:
                kind, index, piece, upto = await ev.queue.get()
                c = choices[index]
                for b in echo(c):
                    yield b
                entries = logprobs_of(c, upto, False) if ask.logprobs is not None else None
                if kind == "text":
                    yield chunk(c, piece, None, entries)
                    continue
                left -= 1
                fail = _failure(c)
                if fail is not None:
                    yield _sse(fail.body())
                    yield b"data: [DONE]\n\n"
                    return  # (the response's end cancels the other choices)
                if piece or entries:
                    yield chunk(c, piece, None, entries)
                yield chunk(c, None, FINISH[c.req.finish_reason])
            if include_usage:
                yield _sse(dict(base, choices=[], usage=usage()))
            yield b"data: [DONE]\n\n"

        return _Stream(events(), cancel_all)

    # not streamed: wait for every choice's end (the only events), cancelling if the client goes away meanwhile
    try:
        left = len(choices)
        while left:
            try:
                await asyncio.wait_for(ev.queue.get(), DISCONNECT_POLL_S)
                left -= 1
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel_all()
                    return JSONResponse({}, status_code=499)  # nobody reads it
    finally:
        cancel_all()  # a no-op once they ended; else (handler cancelled) it frees their slots
    out = []
    for c in choices:
        fail = _failure(c)
        if fail is not None:
            raise fail
        reason = FINISH[c.req.finish_reason]
        text = (c.prompt_text if ask.echo else "") + c.text
        lp = None
        if ask.logprobs is not None:
            lp = lp_object(logprobs_of(c, len(c.req.generated), ask.echo), 0)
        if chat:
            out.append({"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": reason})
        else:
            out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason})
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": s.model_name, "choices": out, "usage": usage()})


class _Stream(StreamingResponse):
    """Server-sent events whose end — done, failed, or the client gone — always releases the request."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ---------------------------------------------------------------------------------------------------- the app


def create_app(engine=None, *, tokenizer, model_name: str, stop_ids=(), chat_template=None,
               chat_template_error: str | None = None, scheduler=None, chunk: int = 64, max_queue: int = 64,
               prefix_cache=None, executor=None, api_key: str | None = None):
    """The FastAPI app serving ``engine`` (an :class:`Engine` built with ``sequences=S``; or pass a ready
    ``scheduler``). ``tokenizer`` is a ``tokenizers.Tokenizer``; ``stop_ids`` the model's EOS ids (as
    :func:`vxc.model_files.stop_ids` finds them); ``api_key``: every endpoint but ``/health`` then needs
    ``Authorization: Bearer <api_key>`` (401 without it); ``chat_template`` a :class:`vxc.model_files.ChatTemplate` (None:
    ``/v1/chat/completions`` answers 400 with ``chat_template_error``). The engine worker thread starts and stops
    with the app's lifespan (in ``executor``'s one thread when given: see :class:`EngineWorker`)."""
    from .runtime.scheduler import Scheduler

    if tokenizer is None:
        raise ServeError("vxc serve needs the model's tokenizer (tokenizer.json, or a GGUF file's)")
    if scheduler is None:
        if engine is None:
            raise ServeError("create_app needs an engine or a scheduler")
        scheduler = Scheduler(engine, chunk=chunk, max_queue=max_queue, prefix_cache=prefix_cache)
    worker = EngineWorker(scheduler, executor)
    served = Served(worker, tokenizer, model_name, [int(i) for i in stop_ids], chat_template,
                    chat_template_error if chat_template is None else None)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="vxc serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    from .serve_metrics import Metrics

    served.metrics = Metrics(served)

    if api_key is not None:
        if not api_key:
            raise ServeError("--api-key is empty")
        want = ("Bearer " + api_key).encode("utf-8")

        @app.middleware("http")
        async def _authorised(request: Request, call_next):
            if request.url.path != "/health":
                got = request.headers.get("authorization", "").encode("utf-8")
                if not secrets.compare_digest(got, want):  # (constant time: the key is not guessed byte by byte)
                    e = ApiError(401, "a valid API key is needed: 'Authorization: Bearer <key>'", code="invalid_api_key",
                                 type="invalid_request_error")
                    return _error_response(e)
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _error_response(_validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), type=kind,
                                        code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("request failed")
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = _parse_body(await request.body(), CompletionRequest)
        stop = _check_common(body, served.model_name, served.engine.vocab)
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise _unsupported("best_of", f"best_of={body.best_of} is not supported (only best_of = n)")
        if body.suffix is not None:
            raise _unsupported("suffix", "suffix (insertion) is not supported")
        many = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], int)
        items = list(body.prompt) if many else [body.prompt]
        if not items:
            raise ApiError(400, "the prompt has no tokens", param="prompt", code="invalid_prompt")
        prompts, texts = [], []
        for i, p in enumerate(items):
            where = f"prompt {i}" if many else "the prompt"
            if isinstance(p, str):
                if p == "":
                    raise ApiError(400, f"{where} is empty", param="prompt", code="invalid_prompt")
                ids = served.tok.encode(p).ids
                if not ids:
                    raise ApiError(400, f"{where} encodes to no tokens", param="prompt", code="invalid_prompt")
                texts.append(p)
            else:
                ids = list(p)
                if not ids:
                    raise ApiError(400, f"{where} has no tokens", param="prompt", code="invalid_prompt")
                bad = [t for t in ids if not 0 <= t < served.engine.vocab]
                if bad:
                    raise ApiError(400, f"{where}: token ids outside the vocabulary 0..{served.engine.vocab - 1}: "
                                        f"{bad[:5]}", param="prompt", code="invalid_prompt")
                texts.append(served.tok.decode(ids, skip_special_tokens=False) if body.echo else "")
            prompts.append(ids)
        ask = _Ask(prompts, texts, stop, chat=False, param="prompt", n=body.n or 1, logprobs=body.logprobs,
                   echo=bool(body.echo))
        return await _run_request(request, served, body, ask)

    def chat_ids(messages: list[Message], add_generation_prompt: bool = True, add_special_tokens: bool = False):
        """The token ids of ``messages`` rendered with the model's chat template (as ``vxc exec --chat`` renders
        them)."""
        from .chat import ChatError, render

        tpl = served.chat_template
        if tpl is None:
            raise ApiError(400, f"this model has no chat template: {served.chat_error or 'none was given'}; "
                                f"use /v1/completions", param="messages", code="no_chat_template")
        # OpenAI's "developer" role is its newer name for "system"; text parts are joined as the message's text
        msgs = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                for m in messages]
        try:
            text = render(tpl.template, msgs, add_generation_prompt=add_generation_prompt, special=tpl.special,
                          source=tpl.source)
        except ChatError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
        # the template writes the special tokens
        ids = served.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids:
            raise ApiError(400, "the chat template renders these messages to no tokens", param="messages",
                           code="invalid_messages")
        return ids

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = _parse_body(await request.body(), ChatRequest)
        stop = _check_common(body, served.model_name, served.engine.vocab)
        if body.top_logprobs is not None and not body.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        if not body.messages:
            raise ApiError(400, "messages is empty", param="messages", code="invalid_messages")
        ids = chat_ids(body.messages)
        ask = _Ask([ids], [""], stop, chat=True, param="messages", n=body.n or 1,
                   logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return await _run_request(request, served, body, ask)

    def check_model(name):
        if name is not None and name != served.model_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves {served.model_name!r}",
                           param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: the ids a completion or chat request would prefill, and the context they go into."""
        body = _parse_body(await request.body(), TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give a prompt or messages (one of them)", param="prompt", code="invalid_request")
        if body.prompt is not None:
            ids = served.tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False).ids
        else:
            if not body.messages:
                raise ApiError(400, "messages is empty", param="messages", code="invalid_messages")
            ids = chat_ids(body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": served.engine.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's /detokenize: the text of token ids (special tokens written out, as the completions show them)."""
        body = _parse_body(await request.body(), DetokenizeRequest)
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < served.engine.vocab]
        if bad:
            raise ApiError(400, f"token ids outside the vocabulary 0..{served.engine.vocab - 1}: {bad[:5]}",
                           param="tokens", code="invalid_tokens")
        return {"prompt": served.tok.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text exposition (vxc.serve_metrics)."""
        from fastapi.responses import Response

        body, kind = served.metrics.render()
        return Response(body, media_type=kind)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": served.created,
                                            "owned_by": "vxc", "max_context": served.engine.max_context}]}

    @app.get("/health")
    async def health():
        st = served.scheduler.stats()
        cache = served.scheduler.cache
        cache_stats = cache.stats() if cache is not None and callable(getattr(cache, "stats", None)) else None
        return {"status": "ok", "model": served.model_name, "slots": st["slots"], "active": st["active"],
                "waiting": st["waiting"], "max_queue": served.scheduler.max_queue,
                "max_context": served.engine.max_context,
                "kv_dtype": str(served.engine.kv_dtype or served.engine.dtype).replace("torch.", ""),
                "scheduler": st, "prefix_cache": cache_stats,
                "step_failures": worker.step_failures,
                "engine_threads": {"built": getattr(served.engine, "built_in", None), "stepped": worker.stepped_in}}

    return app


# ---------------------------------------------------------------------------------------------------- the command


def load_app(model, *, dtype: str = "fp32", device: str = "cpu", max_context: int | None = None, sequences: int = 1,
             chunk: int = 64, max_queue: int = 64, model_dir=None, model_name: str | None = None, kernels: str = "auto",
             prefix_cache_bytes: int = 0, tp: int = 1, rank: int = 0, executor=None, kv_dtype: str | None = None,
             api_key: str | None = None):
    """(app, loaded model): the IR loaded as ``vxc exec`` loads it (tokenizer, EOS ids, --max-context, dtype) on an
    engine with ``sequences`` slots, and the model's chat template when it has one; with ``prefix_cache_bytes`` > 0,
    an exact prefix cache (vxc.runtime.prefix_cache) of that budget shared by every request. ``executor``: the
    one-thread executor the engine worker steps in (see :func:`_serve`)."""
    from pathlib import Path

    from .exec_cmd import load_model
    from .model_files import ModelFileError, chat_template

    if sequences < 1:
        raise ServeError(f"--sequences must be at least 1, not {sequences}")
    if chunk < 1:
        raise ServeError(f"--chunk must be at least 1, not {chunk}")
    if max_queue < 1:
        raise ServeError(f"--max-queue must be at least 1, not {max_queue} (every request waits in the queue "
                         f"until the engine's thread admits it)")
    lm = load_model(model=Path(model), dtype=dtype, device=device, max_context=max_context, model_dir=model_dir,
                    kernels=kernels, compile_decode=False, need_tokenizer="vxc serve", sequences=sequences, kv_dtype=kv_dtype,
                    **({"tp": tp, "rank": rank} if tp > 1 else {}))
    if rank != 0:  # a tensor-parallel rank without clients: its scheduler, stepped as rank 0 says
        _warm(lm)
        return _scheduler(lm.engine, chunk, max_queue, prefix_cache_bytes), lm
    try:
        tpl, tpl_error = chat_template(lm.model_dir, lm.module, lm.tok), None
    except ModelFileError as e:
        tpl, tpl_error = None, str(e)
    from .ir.gguf_container import forget

    forget()  # every header read is done
    _warm(lm)
    app = create_app(tokenizer=lm.tok, model_name=model_name or Path(model).stem, stop_ids=lm.stop.ids,
                     chat_template=tpl, chat_template_error=tpl_error,
                     scheduler=_scheduler(lm.engine, chunk, max_queue, prefix_cache_bytes), executor=executor,
                     api_key=api_key)
    if tp > 1:
        from .runtime.lockstep import Lockstep

        app.state.served.scheduler.sync = Lockstep(0)
    return app, lm


@contextmanager
def _graceful_signals(server):
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _warm(lm) -> None:
    if lm.max_context >= 1:  # the batched step's first call (graph build) is not a client's latency
        lm.engine.decode_batch([0], [0], [0])
        lm.engine.state.zero_(0)


def _scheduler(engine, chunk: int, max_queue: int, prefix_cache_bytes: int):
    from .runtime.scheduler import Scheduler

    cache = None
    if prefix_cache_bytes < 0:
        raise ServeError("--prefix-cache-mib must be >= 0 (0: no prefix cache)")
    if prefix_cache_bytes > 0:
        from .runtime.prefix_cache import PrefixCache

        cache = PrefixCache(prefix_cache_bytes)
    return Scheduler(engine, chunk=chunk, max_queue=max_queue, prefix_cache=cache)


def _follower(rank: int, kw: dict) -> None:
    """Rank ``rank`` > 0 of ``vxc serve --tp N``: the model's part and a scheduler, no HTTP."""
    from .runtime.lockstep import follow

    sch, _ = load_app(**kw, rank=rank)
    follow(sch, rank)


def run_serve(*, model, host: str, port: int, sequences: int, dtype: str, device: str, max_context: int | None,
              chunk: int, max_queue: int, model_dir, model_name: str | None, kernels: str = "auto",
              prefix_cache_bytes: int = 0, tp: int = 1, kv_dtype: str | None = None, api_key: str | None = None) -> None:
    import uvicorn  # noqa: F401  (before any rank or engine starts: a missing HTTP stack fails at once)

    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port}: expected 0..65535")
    kw = dict(model=model, dtype=dtype, device=device, max_context=max_context, sequences=sequences, chunk=chunk,
              max_queue=max_queue, model_dir=model_dir, model_name=model_name, kernels=kernels,
              prefix_cache_bytes=prefix_cache_bytes, tp=tp, kv_dtype=kv_dtype)
    followers = None
    if tp > 1:  # tensor parallel: this process serves as rank 0; the others follow its scheduler (vxc.runtime.lockstep)
        from .exec_cmd import check_tp
        from .runtime import tp as TP

        check_tp(model, model_dir, tp)  # a model that does not split is refused before any rank starts
        backend = TP.backend_for(device)
        if TP.under_torchrun():
            rank = TP.join(tp, backend)
            if rank != 0:
                return _follower(rank, kw)
        else:
            followers = TP.start_followers(_follower, tp, kw, backend=backend)
    try:
        _serve(kw, host, port, sequences, chunk, max_queue, prefix_cache_bytes, tp, api_key)
    except BaseException:
        if followers is not None:
            followers.abort()  # (rank 0's own error is the one to report)
        raise
    if followers is not None:
        TP.join_followers(followers)


def _serve(kw: dict, host: str, port: int, sequences: int, chunk: int, max_queue: int, prefix_cache_bytes: int,
           tp: int, api_key: str | None = None) -> None:
    import sys

    import uvicorn

    # The engine is built, warmed and stepped in one thread: the OpenMP thread team of the thread that runs a
    # parallel region is the process's only one then. A second team (one built by loading in this thread, then
    # stepping in another) keeps its idle threads: libgomp then counts more threads than cores and stops letting
    # waiting threads spin between parallel regions, and each of a step's hundreds of regions pays a wake-up
    # (qwen3-0.6b bf16: 47 -> 61 ms a step at one sequence, 86 -> 122 ms at eight).
    from concurrent.futures import ThreadPoolExecutor

    engine_thread = ThreadPoolExecutor(1, thread_name_prefix="vxc-engine")
    app, lm = engine_thread.submit(lambda: load_app(**kw, executor=engine_thread, api_key=api_key)).result()
    for w in lm.warnings:
        print(w, file=sys.stderr)
    served = app.state.served
    line = (f"{sequences} slot(s) × --max-context {lm.max_context} ({lm.max_context_note}) · "
            f"{f'--tp {tp} (this process rank 0) · ' if tp > 1 else ''}chunk {chunk} · queue "
            f"{max_queue} · prefix cache {prefix_cache_bytes / 2**20:g} MiB · stop ids {served.stop_ids} · chat template: "
            f"{served.chat_template.source if served.chat_template else 'none'} · API key "
            f"{'required' if api_key else 'none (anyone who reaches the port may use it)'}")

    class Server(uvicorn.Server):
        def capture_signals(self):
            if tp == 1:
                return super().capture_signals()
            # tensor parallel: SIGINT / SIGTERM stop the server gracefully (the other ranks are told to stop as the app
            # shuts down), and run_serve then waits for them -- uvicorn would re-raise the signal and kill this
            # process before that
            return _graceful_signals(self)

        async def startup(self, sockets=None):
            await super().startup(sockets)  # binds (a failure is uvicorn's error message and exit)
            if self.started:
                bound = [s.getsockname() for srv in getattr(self, "servers", []) for s in (srv.sockets or [])]
                where = f"{bound[0][0]}:{bound[0][1]}" if bound else f"{host}:{port}"
                print(f"vxc serve: {served.model_name} on http://{where} · {line}", file=sys.stderr, flush=True)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    server.run()
    if not server.started:
        raise ServeError(f"could not serve on {host}:{port} (see the error above)")
