"""Many sequences at once: requests in state slots, chunked prefill beside batched decode.

An engine built with ``sequences=S`` holds S independent copies of every declared state region (one per
slot). The :class:`Scheduler` admits requests into free slots (FIFO, a bounded queue in front), and each
:meth:`Scheduler.step` does one iteration:

1. requests that finished or were cancelled leave their slot (it is zeroed when the next request takes it);
2. waiting requests take the free slots (a prefix-cache hit restores the slot's state at the matched length;
   a prompt cached whole, with the logits its last token gave, chooses its first token from those logits);
3. one prefill chunk of the oldest request still prefilling: chunks end at multiples of ``chunk`` tokens
   (absolute positions) and at the end of the prompt, so a long prompt never stalls the decoding requests for
   more than one chunk, and the states at chunk ends are the same whoever shares the engine;
4. one batched decode step (:meth:`Engine.decode_batch`) for every request that has a token to feed: each
   row at its own position in its own slot, the weights read once for all of them.

A prompt token that a chunk would hold alone (a prompt's last token after a prefix-cache restore, or after the
last multiple of ``chunk``) is a row of that step's batched decode: each row of a batched step gets exactly the
values the single-token kernels give it alone, so it is fed as a single-sequence session feeds one token.

Generation follows :meth:`Session.generate`: a chosen token is reported at once and fed on the next step; a
request ends on an EOS id (``eos``), when its ``on_token`` callback returns True (``stop``), after
``max_new_tokens`` (``length``), when its slot's context is full (``context``), or when cancelled
(``cancelled``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from ..ir.diagnostics import VxcError
from .sampling import Sampler


class SchedulerError(VxcError):
    pass


class QueueFull(SchedulerError):
    pass


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_ids: frozenset = frozenset()
    # called with each chosen token (in the scheduler's thread); returning True ends the request ("stop")
    on_token: Optional[Callable[["Request", int], Optional[bool]]] = None
    # called once when the request ends (in the scheduler's thread)
    on_finish: Optional[Callable[["Request"], None]] = None
    id: int = 0
    slot: Optional[int] = None
    pos: int = 0  # tokens of this request's sequence already fed (the slot's position)
    cached: int = 0  # prompt tokens restored from the prefix cache
    next_token: Optional[int] = None  # chosen, not yet fed
    generated: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    keep_logits: bool = False  # keep the logits row each token was chosen from (in ``logits``; for tests)
    logits: list = field(default_factory=list)
    # log-probabilities (the model's: log-softmax of the logits over the vocabulary, before a sampler's logit bias,
    # penalties, temperature or top-k / top-p). ``logprobs``: None (none kept) or k >= 0: for every chosen token,
    # ``(its log-probability, [(id, log-probability)] of the k most likely ids)`` in ``token_logprobs``.
    # ``prompt_logprobs`` (with ``logprobs``): the same for prompt tokens 1.. in ``prompt_token_logprobs``: the
    # request prefills with the head on every position and takes nothing from the prefix cache (the cache holds no
    # per-position logits; what it prefills is still stored)
    logprobs: Optional[int] = None
    prompt_logprobs: bool = False
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.finish_reason is None and self.pos < len(self.prompt)


class Scheduler:
    def __init__(self, engine, *, chunk: int = 64, max_queue: int = 64, prefix_cache=None, prefix_cache_bytes: int = 0):
        """``prefix_cache``: an object with the two hooks (see :mod:`vxc.runtime.prefix_cache`); or
        ``prefix_cache_bytes`` > 0: a :class:`~vxc.runtime.prefix_cache.PrefixCache` of that budget."""
        if chunk < 1:
            raise SchedulerError(f"chunk must be at least 1, not {chunk}")
        if prefix_cache is None and prefix_cache_bytes > 0:
            from .prefix_cache import PrefixCache

            prefix_cache = PrefixCache(prefix_cache_bytes)
        self.engine = engine
        self.chunk = chunk
        self.max_queue = max_queue
        self.cache = prefix_cache
        self.free: list[int] = list(range(engine.sequences))
        self.active: list[Request] = []  # in slots, in admission order
        self.waiting: deque[Request] = deque()
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.steps = 0
        self.decoded_rows = 0
        self.prefilled_tokens = 0
        # seconds spent in prefill chunks and in batched decode steps (the engine calls alone), and those steps
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_steps = 0
        # tensor parallelism (vxc.runtime.lockstep): the ranks' schedulers kept in step. On rank 0 a submitted request
        # is staged (and a cancel recorded) until the next step tells every rank at once.
        self.sync = None
        self.staged: list[Request] = []

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: Iterable[int], *, max_new_tokens: int, sampler: Sampler | None = None,
               stop_ids: Iterable[int] = (), on_token=None, on_finish=None, keep_logits: bool = False,
               logprobs: int | None = None, prompt_logprobs: bool = False) -> Request:
        """Queue a request (checked first: nothing is queued for a request that cannot run). ``logprobs`` and
        ``prompt_logprobs``: see :class:`Request`."""
        prompt = [int(t) for t in prompt]
        e = self.engine
        if not prompt:
            raise SchedulerError("a request needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < e.vocab]
        if bad:
            raise SchedulerError(f"token ids outside the vocabulary 0..{e.vocab - 1}: {bad[:5]}")
        if len(prompt) > e.max_context:
            raise SchedulerError(f"the prompt has {len(prompt)} tokens; the context holds {e.max_context}")
        if max_new_tokens < 0:
            raise SchedulerError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
        if logprobs is not None and not 0 <= logprobs <= e.vocab:
            raise SchedulerError(f"logprobs must be 0..{e.vocab} (the vocabulary), not {logprobs}")
        if prompt_logprobs and logprobs is None:
            raise SchedulerError("prompt_logprobs needs logprobs (how many of the most likely ids to keep)")
        sampler = sampler or Sampler(vocab=e.vocab)
        if sampler.vocab is None:
            sampler.vocab = e.vocab
        req = Request(prompt, max_new_tokens, sampler, frozenset(stop_ids), on_token, on_finish, keep_logits=keep_logits,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if self.sync is not None:
            self.sync.leading(req)  # rank 0's choices and stop decisions, shared with the other ranks
        with self.lock:
            queued = len(self.waiting) + len(self.staged)
            if queued >= self.max_queue:
                raise QueueFull(f"{queued} requests are already waiting for one of {e.sequences} slots")
            req.id = next(self._ids)
            (self.staged if self.sync is not None else self.waiting).append(req)
        return req

    def cancel(self, req: Request) -> None:
        """End ``req`` (its slot is freed at the start of the next step; a waiting request just leaves)."""
        if self.sync is not None and self.sync.defer(req):
            return  # rank 0: every rank cancels it at the start of the next step
        with self.lock:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                self._finish(req, "cancelled")

    @property
    def idle(self) -> bool:
        with self.lock:
            return not self.active and not self.waiting and not self.staged

    def stats(self) -> dict:
        with self.lock:
            # active: requests in slots still running (one that has just ended keeps its slot until the next step's
            # start, but a client holding its answer must not see it counted)
            running = sum(1 for r in self.active if r.finish_reason is None)
            return {"slots": self.engine.sequences, "active": running, "waiting": len(self.waiting),
                    "steps": self.steps, "decoded_rows": self.decoded_rows, "prefilled_tokens": self.prefilled_tokens,
                    "decode_steps": self.decode_steps, "decode_seconds": self.decode_seconds,
                    "prefill_seconds": self.prefill_seconds}

    # ------------------------------------------------------------------ the loop

    def chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """The prefill chunks of positions ``start..end``: ending at each multiple of ``chunk`` and at ``end``."""
        out, p = [], start
        while p < end:
            q = min(end, (p // self.chunk + 1) * self.chunk)
            out.append((p, q))
            p = q
        return out

    @torch.no_grad()
    def step(self) -> bool:
        """One iteration (see the module doc). Returns whether any request is still in flight."""
        if self.sync is not None:
            self.sync.exchange(self)  # the requests submitted and cancelled since the last step, on every rank
        self._retire()
        self._admit()
        try:
            self._prefill_one()
            self._decode()
        except Exception as e:  # a failing step fails the requests in it, not the scheduler
            for r in list(self.active):
                if r.finish_reason is None:
                    r.error = e
                    self._finish(r, "error")
            self._retire()
        self.steps += 1
        return not self.idle

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.step():
            pass

    def _retire(self) -> None:
        with self.lock:
            keep = []
            for r in self.active:
                if r.cancelled and r.finish_reason is None:
                    self._finish(r, "cancelled")
                if r.finish_reason is None:
                    keep.append(r)
                else:
                    self.free.append(r.slot)
            self.active = keep
            self.free.sort()

    def _admit(self) -> None:
        whole = []  # requests whose whole prompt was restored, with its last token's logits
        with self.lock:
            while self.free and self.waiting:
                r = self.waiting.popleft()
                r.slot = self.free.pop(0)
                self.active.append(r)
                admitted = r
                self.engine.state.zero_(admitted.slot)
                r.pos = 0
                if self.cache is not None and not r.prompt_logprobs:
                    r.pos = r.cached = self.cache.restore(self.engine.state, r.slot, r.prompt)
                    if r.pos == len(r.prompt):
                        whole.append((r, self.cache.take_logits(r.slot)))
        for r, logits in whole:  # (outside the lock: choosing calls the request's callbacks)
            self._chose(r, logits)

    def _prefill_one(self) -> None:
        # the oldest request whose next chunk holds more than one token (a one-token chunk goes with the batch)
        for req in self.active:
            if req.prefilling:
                start, end = self.chunks(req.pos, len(req.prompt))[0]
                if end - start > 1:
                    break
        else:
            return
        e = self.engine
        e.bind_slot(req.slot)
        e.full_threads()
        ids = torch.tensor(req.prompt[start:end], dtype=torch.int64, device=e.device)
        last = end == len(req.prompt)
        t0 = time.perf_counter()
        # the head on the last position only (a chunk before the prompt's last gives a row nobody reads): over a
        # 151936-token vocabulary the head of every position was a fifth of a chunk's arithmetic. A request that
        # wants its prompt's log-probabilities: the head on every position
        logits = (e.prefill_graph if req.prompt_logprobs else e.prefill_last_graph)(ids, start)
        self.prefill_seconds += time.perf_counter() - t0
        req.pos = end
        self.prefilled_tokens += end - start
        if req.prompt_logprobs and req.logprobs is not None:
            for j in range(end - start - (1 if last else 0)):  # row j predicts prompt[start + j + 1]
                req.prompt_token_logprobs.append(self._logprobs(logits[j], req.prompt[start + j + 1], req.logprobs))
        if self.cache is not None:
            # (the logits a later request with this whole prompt would choose from: only those of the last-position
            # head, which a cold run of that request computes bit for bit; the all-position head's last row is
            # another product shape)
            keep = logits[-1] if last and not req.prompt_logprobs else None
            self.cache.store(e.state, req.slot, req.prompt[:end], keep)
        if last:
            self._chose(req, logits[-1])

    def _decode(self) -> None:
        rows: list[Request] = []
        tokens: list[int] = []
        for r in self.active:
            if r.finish_reason is not None:
                continue
            if r.prefilling:
                start, end = self.chunks(r.pos, len(r.prompt))[0]
                if end - start == 1:  # a one-token chunk: a row of the batched step (see the module doc)
                    rows.append(r)
                    tokens.append(r.prompt[r.pos])
                continue
            if r.next_token is not None:
                if r.pos + 1 > self.engine.max_context:
                    self._finish(r, "context")
                    continue
                rows.append(r)
                tokens.append(r.next_token)
        if rows:
            self._feed(rows, tokens)

    def _feed(self, rows: list[Request], tokens: list[int]) -> None:
        t0 = time.perf_counter()
        # the step's own buffer (no copy): every row's token is chosen from it before the next step
        logits = self.engine.decode_batch(tokens, [r.pos for r in rows], [r.slot for r in rows], fresh=False)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_steps += 1
        for i, r in enumerate(rows):
            r.pos += 1
            if r.pos <= len(r.prompt):  # a prompt token
                self.prefilled_tokens += 1
                if self.cache is not None:
                    self.cache.store(self.engine.state, r.slot, r.prompt[:r.pos],
                                     logits[i] if r.pos == len(r.prompt) else None)
                if r.pos < len(r.prompt):
                    if r.prompt_logprobs and r.logprobs is not None:
                        r.prompt_token_logprobs.append(self._logprobs(logits[i], r.prompt[r.pos], r.logprobs))
                    continue
            else:
                self.decoded_rows += 1
            self._chose(r, logits[i])

    def _chose(self, r: Request, logits: torch.Tensor) -> None:
        """The logits after ``r``'s last fed token: choose the next token (unless the request is complete)."""
        if len(r.generated) >= r.max_new_tokens:
            self._finish(r, "length")
            return
        if r.keep_logits:
            r.logits.append(logits.detach().clone())
        lp = self._log_softmax(logits) if r.logprobs is not None else None
        tok = r.sampler(logits)
        if lp is not None:
            r.token_logprobs.append(self._logprobs(None, tok, r.logprobs, lp))
        r.generated.append(tok)
        r.next_token = tok
        if tok in r.stop_ids:
            self._finish(r, "eos")
        elif r.on_token is not None and r.on_token(r, tok):
            self._finish(r, "stop")
        elif len(r.generated) >= r.max_new_tokens:
            self._finish(r, "length")
        elif r.pos + 1 > self.engine.max_context:
            self._finish(r, "context")

    def _log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[: self.engine.vocab].float(), -1)

    def _logprobs(self, logits, tok: int, k: int, lp: torch.Tensor | None = None) -> tuple:
        """(the log-probability of ``tok``, [(id, log-probability)] of the ``k`` most likely ids, most likely
        first) under ``logits`` (or the log-softmax ``lp`` already taken of them)."""
        if lp is None:
            lp = self._log_softmax(logits)
        top = []
        if k:
            v, i = torch.topk(lp, k)
            top = list(zip(i.tolist(), v.tolist()))
        return float(lp[tok]), top

    def _finish(self, r: Request, reason: str) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        r.next_token = None
        if r.on_finish is not None:
            try:
                r.on_finish(r)
            except Exception:  # a callback's failure must not take the scheduler down
                pass
        r.done.set()
