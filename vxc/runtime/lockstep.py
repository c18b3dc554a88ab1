"""Tensor-parallel serving: the schedulers of N ranks kept in step (``vxc serve --tp N``).

Rank 0's :class:`~vxc.runtime.scheduler.Scheduler` is driven by the server: requests arrive and are cancelled from
its HTTP side. The other ranks have no clients; each runs :func:`follow`. Every step of every rank's scheduler
begins with :meth:`Lockstep.exchange`: rank 0 broadcasts the requests submitted since its last step (prompt,
max_new_tokens, stop ids, whether a stop callback decides) and the ones cancelled, and every rank queues and
cancels them alike — so all ranks admit the same requests into the same slots, prefill the same chunks and run
the same batched steps, and their collectives line up. On rank 0 a request submitted or cancelled between two
steps waits for the next one (``Scheduler.staged``, :meth:`Lockstep.defer`): nothing changes a rank's queue
except an exchange.

A token is rank 0's choice (``tp.Agreed``: broadcast), and so is a stop callback's decision (the detokenizer's
stop strings live on rank 0); the others follow. While idle, rank 0 steps at least once a second (the others wait
inside the exchange's broadcast: a heartbeat well inside the process group's timeout); :meth:`Lockstep.close`
tells them to stop.
"""

from __future__ import annotations

import threading

from .tp import Agreed, broadcast_object


class Stopped(Exception):
    """Rank 0 closed the group's serving (raised from a follower's step)."""


def _flag(value: bool) -> bool:
    """Rank 0's ``value`` on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(bool(value))], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return bool(t[0])


class Lockstep:
    HEARTBEAT_S = 1.0  # rank 0 steps at least this often while idle

    def __init__(self, rank: int):
        self.rank = rank
        self._lock = threading.Lock()
        self._cancels: list[int] = []

    # ------------------------------------------------------------------ rank 0

    def leading(self, req) -> None:
        """Rank 0: ``req``'s choices and its stop callback's decisions are broadcast as they are made."""
        if self.rank != 0:
            return
        req.sampler = Agreed(req.sampler)
        if req.on_token is not None:
            inner = req.on_token
            req.on_token = lambda r, tok: _flag(inner(r, tok))

    def defer(self, req) -> bool:
        """Rank 0: record a cancel for the next exchange (True); other ranks cancel as told (False)."""
        if self.rank != 0:
            return False
        with self._lock:
            self._cancels.append(req.id)
        return True

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (their step raises :class:`Stopped`)."""
        broadcast_object({"submit": [], "cancel": [], "stop": True})

    # ------------------------------------------------------------------ every rank

    def exchange(self, sch) -> None:
        from .sampling import Sampler
        from .scheduler import Request

        if self.rank == 0:
            with sch.lock:
                new, sch.staged = sch.staged, []
            with self._lock:
                cancels, self._cancels = self._cancels, []
            broadcast_object({"submit": [(r.id, r.prompt, r.max_new_tokens, sorted(r.stop_ids), r.on_token is not None,
                                          r.keep_logits, r.prompt_logprobs) for r in new], "cancel": cancels,
                              "stop": False})
        else:
            msg = broadcast_object(None)
            if msg["stop"]:
                raise Stopped()
            new = []
            for rid, prompt, n, stops, decides, keep, prompt_rows in msg["submit"]:
                # prompt_rows: rank 0 prefills this request with the head on every position (its prompt's
                # log-probabilities) and restores nothing from its prefix cache: so does every rank (the same
                # collectives; the values are rank 0's to report)
                req = Request(prompt, n, Agreed(Sampler(vocab=sch.engine.vocab)), frozenset(stops),
                              (lambda r, tok: _flag(False)) if decides else None, None, keep_logits=keep,
                              prompt_logprobs=prompt_rows)
                req.id = rid
                new.append(req)
            cancels = msg["cancel"]
        with sch.lock:
            sch.waiting.extend(new)
            gone = set(cancels)
            for r in list(sch.waiting) + list(sch.active):
                if r.id in gone:
                    r.cancelled = True
                    if r in sch.waiting:
                        sch.waiting.remove(r)
                        sch._finish(r, "cancelled")


def follow(sch, rank: int) -> None:
    """A rank other than 0: step ``sch`` as rank 0 says until it closes."""
    sch.sync = Lockstep(rank)
    while True:
        try:
            sch.step()
        except Stopped:
            return
