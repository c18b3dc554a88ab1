"""``vxc serve``: an OpenAI-compatible HTTP server over the :class:`~vxc.runtime.scheduler.Scheduler`.

One engine with S state slots serves every client: requests are admitted into free slots (FIFO, a bounded queue
in front) and advanced together by continuous batching — each scheduler step runs one prefill chunk of one request
beside one batched decode step of every request that has a token to feed. All ``step()`` calls happen in one
engine worker thread (:class:`EngineWorker`), which sleeps on a condition when no request is in flight and is
woken by a submit; the HTTP side (FastAPI on the event loop) only submits and cancels, which the scheduler allows
from any thread.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events or not),
``GET /v1/models``, ``GET /health``. Errors are OpenAI's JSON shape ``{"error": {"message", "type", "param",
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
        sch = self.scheduler
        self.stepped_in = threading.current_thread().name
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
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an end-user id for the caller's own records; it changes nothing here
    # accepted only at their neutral value (anything else is a 400: vxc serve does not implement them)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_value")


def _check_common(r: _Common, served_name: str) -> list[str]:
    """The checks pydantic cannot express; returns the stop strings."""
    if r.model is not None and r.model != served_name:
        raise ApiError(404, f"the model {r.model!r} does not exist: this server serves {served_name!r}",
                       param="model", code="model_not_found")
    if r.n is not None and r.n != 1:
        raise _unsupported("n", f"only n=1 is supported, not {r.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(r, name)
        if v is not None and v != 0:
            raise _unsupported(name, f"only 0 is supported, not {v}")
    if r.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported")
    if r.stream_options is not None and not r.stream:
        raise _unsupported("stream_options", "stream_options is only allowed with stream: true")
    stop = [] if r.stop is None else [r.stop] if isinstance(r.stop, str) else list(r.stop)
    if any(s == "" for s in stop):
        raise _unsupported("stop", "an empty stop string would end generation at once")
    if len(stop) > MAX_STOP_STRINGS:
        raise _unsupported("stop", f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}")
    return stop


def _sampler(r: _Common, vocab: int):
    from .runtime.sampling import Sampler

    temperature = 1.0 if r.temperature is None else r.temperature  # OpenAI's default; 0 is greedy
    seed = r.seed if r.seed is not None else secrets.randbits(63)
    return Sampler(temperature, r.top_k or 0, 1.0 if r.top_p is None else r.top_p, seed, vocab=vocab)


# ---------------------------------------------------------------------------------------------------- one request


class _Events:
    """One request's events, pushed from the engine's thread onto the event loop: ``("text", piece)`` as the
    detokenizer makes text final, then ``("end", None)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tok, stop: list[str], stream: bool):
        from .runtime.tokenizer import Detokenizer

        self.loop, self.queue, self.stream = loop, asyncio.Queue(), stream  # not streamed: only the end is sent
        self.detok = Detokenizer(tok, stop)
        self.callback_error: BaseException | None = None
        self.text = ""

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def on_token(self, req, tok: int) -> bool:  # engine thread
        try:
            piece = self.detok.push(tok)
        except Exception as e:  # never let a callback fail the scheduler's whole step
            self.callback_error = e
            return True
        if piece and self.stream:
            self._put(("text", piece))
        return self.detok.stopped is not None

    def on_finish(self, req) -> None:  # engine thread (or the canceller's)
        if req.finish_reason not in ("error", "cancelled") and self.callback_error is None:
            try:
                rest = self.detok.finish()
                if rest and self.stream:
                    self._put(("text", rest))
            except Exception as e:
                self.callback_error = e
        self.text = self.detok.emitted
        self._put(("end", None))


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

    @property
    def scheduler(self):
        return self.worker.scheduler

    @property
    def engine(self):
        return self.worker.scheduler.engine


def _usage(prompt_n: int, req) -> dict:
    c = len(req.generated)
    return {"prompt_tokens": prompt_n, "completion_tokens": c, "total_tokens": prompt_n + c}


def _failure(req, ev: _Events) -> ApiError | None:
    if req.finish_reason == "error" or ev.callback_error is not None:
        e = req.error or ev.callback_error
        return ApiError(500, f"the engine failed this request: {type(e).__name__}: {e}", code="engine_error")
    if req.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled (the server is shutting down)", code="cancelled")
    return None


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


async def _run_request(request: Request, s: Served, body: _Common, prompt_ids: list[int], stop: list[str], *,
                       chat: bool, param: str):
    from .runtime.scheduler import QueueFull, SchedulerError

    e = s.engine
    max_new = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        if max_new is not None and max_new != body.max_completion_tokens:
            raise _unsupported("max_completion_tokens", "max_tokens and max_completion_tokens differ")
        max_new = body.max_completion_tokens
    if max_new is None:  # completions: OpenAI's 16; chat: until the context is full
        max_new = e.max_context if chat else 16
    if len(prompt_ids) > e.max_context:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the context holds {e.max_context}",
                       param=param, code="context_length_exceeded")
    ev = _Events(asyncio.get_running_loop(), s.tok, stop, body.stream)
    try:
        req = s.worker.submit(prompt_ids, max_new_tokens=max_new, sampler=_sampler(body, e.vocab), stop_ids=s.stop_ids,
                              on_token=ev.on_token, on_finish=ev.on_finish)
    except QueueFull as err:
        raise ApiError(429, f"the server is busy: {err}; retry later", code="queue_full") from None
    except SchedulerError as err:
        raise ApiError(400, str(err), param=param, code="invalid_prompt") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": s.model_name}
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

    if body.stream:
        def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = dict(base, choices=[choice])
            if include_usage:
                out["usage"] = None
            return _sse(out)

        async def events():
            if chat:
                yield chunk(None, None, first=True)
            while True:
                kind, val = await ev.queue.get()
                if kind == "end":
                    break
                yield chunk(val, None)
            fail = _failure(req, ev)
            if fail is not None:
                yield _sse(fail.body())
            else:
                yield chunk(None, FINISH[req.finish_reason])
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=_usage(len(prompt_ids), req)))
            yield b"data: [DONE]\n\n"

        return _Stream(events(), lambda: s.worker.cancel(req))

    # not streamed: wait for the end (the only event), cancelling if the client goes away meanwhile
    try:
        while True:
            try:
                await asyncio.wait_for(ev.queue.get(), DISCONNECT_POLL_S)
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    s.worker.cancel(req)
                    return JSONResponse({}, status_code=499)  # nobody reads it
    finally:
        s.worker.cancel(req)  # a no-op once it ended; else (handler cancelled) it frees the slot
    fail = _failure(req, ev)
    if fail is not None:
        raise fail
    reason = FINISH[req.finish_reason]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": ev.text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": reason}
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": s.model_name, "choices": [choice], "usage": _usage(len(prompt_ids), req)})


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
               prefix_cache=None, executor=None):
    """The FastAPI app serving ``engine`` (an :class:`Engine` built with ``sequences=S``; or pass a ready
    ``scheduler``). ``tokenizer`` is a ``tokenizers.Tokenizer``; ``stop_ids`` the model's EOS ids (as
    :func:`vxc.model_files.stop_ids` finds them); ``chat_template`` a :class:`vxc.model_files.ChatTemplate` (None:
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
        stop = _check_common(body, served.model_name)
        for name, neutral in (("echo", False), ("logprobs", None), ("best_of", 1), ("suffix", None)):
            v = getattr(body, name)
            if v is not None and v != neutral:
                raise _unsupported(name, f"{name}={v!r} is not supported")
        if isinstance(body.prompt, str):
            if body.prompt == "":
                raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
            ids = served.tok.encode(body.prompt).ids
            if not ids:
                raise ApiError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_prompt")
        else:
            ids = list(body.prompt)
            if not ids:
                raise ApiError(400, "the prompt has no tokens", param="prompt", code="invalid_prompt")
        return await _run_request(request, served, body, ids, stop, chat=False, param="prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from .chat import ChatError, render

        body = _parse_body(await request.body(), ChatRequest)
        stop = _check_common(body, served.model_name)
        if body.logprobs:
            raise _unsupported("logprobs", "logprobs are not supported")
        if body.top_logprobs is not None:
            raise _unsupported("top_logprobs", "top_logprobs are not supported")
        if not body.messages:
            raise ApiError(400, "messages is empty", param="messages", code="invalid_messages")
        tpl = served.chat_template
        if tpl is None:
            raise ApiError(400, f"this model has no chat template: {served.chat_error or 'none was given'}; "
                                f"use /v1/completions", param="messages", code="no_chat_template")
        msgs = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            text = render(tpl.template, msgs, add_generation_prompt=True, special=tpl.special, source=tpl.source)
        except ChatError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
        ids = served.tok.encode(text, add_special_tokens=False).ids  # the template writes the special tokens
        if not ids:
            raise ApiError(400, "the chat template renders these messages to no tokens", param="messages",
                           code="invalid_messages")
        return await _run_request(request, served, body, ids, stop, chat=True, param="messages")

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
             prefix_cache_bytes: int = 0, tp: int = 1, rank: int = 0, executor=None, kv_dtype: str | None = None):
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
                     scheduler=_scheduler(lm.engine, chunk, max_queue, prefix_cache_bytes), executor=executor)
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
              prefix_cache_bytes: int = 0, tp: int = 1, kv_dtype: str | None = None) -> None:
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
        _serve(kw, host, port, sequences, chunk, max_queue, prefix_cache_bytes, tp)
    finally:
        if followers is not None:
            followers.join(timeout=60)


def _serve(kw: dict, host: str, port: int, sequences: int, chunk: int, max_queue: int, prefix_cache_bytes: int,
           tp: int) -> None:
    import sys

    import uvicorn

    # The engine is built, warmed and stepped in one thread: the OpenMP thread team of the thread that runs a
    # parallel region is the process's only one then. A second team (one built by loading in this thread, then
    # stepping in another) keeps its idle threads: libgomp then counts more threads than cores and stops letting
    # waiting threads spin between parallel regions, and each of a step's hundreds of regions pays a wake-up
    # (qwen3-0.6b bf16: 47 -> 61 ms a step at one sequence, 86 -> 122 ms at eight).
    from concurrent.futures import ThreadPoolExecutor

    engine_thread = ThreadPoolExecutor(1, thread_name_prefix="vxc-engine")
    app, lm = engine_thread.submit(lambda: load_app(**kw, executor=engine_thread)).result()
    for w in lm.warnings:
        print(w, file=sys.stderr)
    served = app.state.served
    line = (f"{sequences} slot(s) × --max-context {lm.max_context} ({lm.max_context_note}) · "
            f"{f'--tp {tp} (this process rank 0) · ' if tp > 1 else ''}chunk {chunk} · queue "
            f"{max_queue} · prefix cache {prefix_cache_bytes / 2**20:g} MiB · stop ids {served.stop_ids} · chat template: "
            f"{served.chat_template.source if served.chat_template else 'none'}")

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
