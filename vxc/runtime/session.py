"""Sessions: ``prefill(tokens) → logits``, ``step(token) → logits``, generation,
and continuation state saved to / restored from safetensors (only the
declared regions, the position and, when sampling, the sampler's RNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from ..ir.diagnostics import VxcError
from .engine import Engine
from .sampling import Sampler


class SessionError(VxcError):
    pass


STATE_FORMAT = "vxc-state"

_LIBC: list = []


def release_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere): a prefill's
    activations are freed when it ends, but the allocator keeps their pages, so a process decoding after a long
    prompt stayed that much larger (the 0.6B softmax-decoder shape, q4_0 with int8 activations, after a 512-token
    prefill: 33 MB). Microseconds when there is nothing to return."""
    if not _LIBC:
        import ctypes

        try:
            _LIBC.append(ctypes.CDLL(None).malloc_trim)
        except (OSError, AttributeError):  # not glibc
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](0)


class Session:
    def __init__(self, engine: Engine):
        self.engine = engine
        # the state buffers belong to the engine and outlive a session: a new
        # session starts at position 0, so it starts from zeroed state too
        # (prefill continues from whatever the buffers hold)
        self.reset()
        self.finish_reason: str | None = None

    def reset(self) -> None:
        self.engine.state.zero_()
        self.pos = 0

    def _room(self, n: int) -> None:
        if self.pos + n > self.engine.max_context:
            raise SessionError(f"context full: position {self.pos} + {n} tokens exceeds --max-context {self.engine.max_context}")

    @torch.no_grad()
    def prefill(self, tokens: Iterable[int], last_only: bool = False) -> torch.Tensor:
        """Logits [T, padded_vocab] in the compute dtype (as the references return them; ``--logits-out``
        widens to fp32) for ``tokens``, continuing from the current position; with ``last_only``, [1,
        padded_vocab] for the last token alone (the head runs on that position only).

        A prompt longer than the engine's ``prefill_chunk`` runs as consecutive chunks of that many tokens, each
        continuing from the state the previous one left (as a server's chunked prefill does): the activations of
        a step are bounded by the chunk, not the prompt (the 0.6B softmax-decoder benchmark shape, 2048 tokens: 241 -> 86 MB beyond the
        weights and state, at the same speed). The logits are those of the same chunks run one by one."""
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.engine.device)
        if ids.numel() == 0:
            raise SessionError("prefill needs at least one token")
        self._room(ids.numel())
        bad = [int(t) for t in ids if not (0 <= int(t) < self.engine.vocab)]
        if bad:  # the rows past the logical vocab are padding: no token has them
            raise SessionError(f"token ids outside the vocabulary 0..{self.engine.vocab - 1}: {bad[:5]}")
        C = self.engine.prefill_chunk or ids.numel()
        out = None
        for a in range(0, ids.numel(), C):
            part = ids[a:a + C]
            last = a + C >= ids.numel()
            logits = self._prefill_part(part, last_only)  # last_only: a chunk before the last gives one row, unused
            if last_only:
                out = logits if last else None
            else:
                if out is None:
                    out = logits.new_empty(ids.numel(), logits.shape[-1])
                out[a:a + part.numel()] = logits
        if ids.numel() > 1:
            release_heap()
        return out

    def _prefill_part(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        # one token runs the fixed-shape decode graph, so a resumed single-token
        # continuation is bit-identical to an uninterrupted step
        if ids.numel() == 1:
            logits = self.engine.decode(int(ids[0]), self.pos)
        else:
            self.engine.bind_slot(0)  # a session runs in slot 0 (a scheduler may have pointed the graphs elsewhere)
            self.engine.full_threads()
            logits = (self.engine.prefill_last_graph if last_only else self.engine.prefill_graph)(ids, self.pos)
        self.pos += ids.numel()
        return logits

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Logits [padded_vocab] (compute dtype) after one more token (the fixed-shape decode graph)."""
        self._room(1)
        if not (0 <= token < self.engine.vocab):
            raise SessionError(f"token id {token} outside the vocabulary 0..{self.engine.vocab - 1}")
        logits = self.engine.decode(token, self.pos)
        self.pos += 1
        return logits[0]

    def generate(self, prompt: list[int], max_new_tokens: int, sampler: Sampler,
                 on_token: Callable[[int], bool | None] | None = None, logits: torch.Tensor | None = None,
                 stop_ids: Iterable[int] = ()) -> list[int]:
        """Prefill ``prompt`` (unless ``logits`` of the last position are given) and generate up to
        ``max_new_tokens``. As always, the last token returned is chosen but not fed to the model (the position stays
        before it; a resumed run continues with it). Generation ends early when a token in ``stop_ids`` is chosen,
        when ``on_token`` returns True for a token, or when the context has no room for the next step. Why it
        ended is left in ``finish_reason``: ``"eos"``, ``"stop"``, ``"length"`` or ``"context"``."""
        last = self.prefill(prompt, last_only=True)[-1] if logits is None else logits
        stop_ids = frozenset(stop_ids)
        out: list[int] = []
        self.finish_reason = "length"
        for i in range(max_new_tokens):
            tok = sampler(last)
            out.append(tok)
            if tok in stop_ids:
                self.finish_reason = "eos"
                break
            if on_token is not None and on_token(tok):
                self.finish_reason = "stop"
                break
            if i + 1 < max_new_tokens:
                if self.pos + 1 > self.engine.max_context:
                    self.finish_reason = "context"
                    break
                last = self.step(tok)
        return out

    # ------------------------------------------------------------ continuation state

    def save_state(self, path: Path, sampler: Sampler | None = None) -> None:
        """Written to a temporary file beside ``path`` and renamed over it: a failure leaves ``path`` as it was."""
        from ..driver import save_safetensors_atomic

        st = self.engine.state
        tensors: dict[str, torch.Tensor] = {}
        for rid, buf in st.buffers.items():
            if st.growing[rid]:
                buf = buf[:, : self.pos] if st.layout[rid] == "kv_rows" else buf[: self.pos]
            tensors[rid] = buf.contiguous().cpu()
        tensors["position"] = torch.tensor([self.pos], dtype=torch.int64)
        if sampler is not None and not sampler.greedy:
            tensors["rng_state"] = sampler.get_state()
        shapes = {rid: list(b.shape) for rid, b in st.buffers.items()}
        meta = {"format": STATE_FORMAT, "regions": json.dumps(shapes, sort_keys=True)}
        if getattr(self.engine, "tp", 1) > 1:  # one rank's part of the state: only that rank of the same split may resume it
            meta["tp"] = f"rank {self.engine.rank} of {self.engine.tp}"
        save_safetensors_atomic(Path(path), tensors, meta)

    def load_state(self, path: Path, sampler: Sampler | None = None) -> None:
        """Everything is checked before the engine's state is touched: the file's format, the position (one
        int64 within --max-context), each region's shape and dtype (the declared precision is part of the
        contract: a region saved at another precision is refused, not converted) and the RNG state."""
        st = self.engine.state
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                data = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise SessionError(f"{path}: not a readable state file ({e})") from None
        if meta.get("format") != STATE_FORMAT:
            raise SessionError(f"{path}: not a vxc state file (metadata format={meta.get('format')!r}, expected {STATE_FORMAT!r})")
        part = f"rank {self.engine.rank} of {self.engine.tp}" if getattr(self.engine, "tp", 1) > 1 else None
        if meta.get("tp") != part:
            raise SessionError(f"{path}: saved by {'tensor-parallel ' + meta['tp'] if meta.get('tp') else 'one process'}, "
                               f"this is {'tensor-parallel ' + part if part else 'one process'}")
        want = set(st.buffers) | {"position"}
        missing = sorted(want - set(data))
        extra = sorted(set(data) - want - {"rng_state"})
        if missing or extra:
            raise SessionError(f"{path}: state regions do not match this model (missing {missing[:4]}, unexpected {extra[:4]})")
        p = data["position"]
        if p.dtype != torch.int64 or tuple(p.shape) != (1,):
            raise SessionError(f"{path}: position must be one int64, found {str(p.dtype).replace('torch.', '')}{list(p.shape)}")
        pos = int(p[0])
        if pos < 0:
            raise SessionError(f"{path}: position {pos} is negative")
        if pos > st.max_context:
            raise SessionError(f"{path}: position {pos} exceeds --max-context {st.max_context}")
        for rid, buf in st.buffers.items():
            src = data[rid]
            dst = (buf[:, :pos] if st.layout[rid] == "kv_rows" else buf[:pos]) if st.growing[rid] else buf
            if tuple(src.shape) != tuple(dst.shape):
                raise SessionError(f"{path}: region {rid} has shape {list(src.shape)}, this model needs {list(dst.shape)}")
            if src.dtype != dst.dtype:
                raise SessionError(f"{path}: region {rid} is stored as {str(src.dtype).replace('torch.', '')}, this model "
                                   f"holds it as {str(dst.dtype).replace('torch.', '')} (its declared precision at this --dtype); "
                                   f"refusing to convert it")
        rng = data.get("rng_state")
        if rng is not None and sampler is not None and not sampler.greedy:
            probe = torch.Generator()
            try:
                if rng.dtype != torch.uint8 or rng.dim() != 1:
                    raise RuntimeError(f"{str(rng.dtype).replace('torch.', '')}{list(rng.shape)}, not a uint8 vector")
                probe.set_state(rng)
            except RuntimeError as e:
                raise SessionError(f"{path}: rng_state is not a generator state ({e})") from None
        st.zero_()
        for rid, buf in st.buffers.items():
            dst = (buf[:, :pos] if st.layout[rid] == "kv_rows" else buf[:pos]) if st.growing[rid] else buf
            dst.copy_(data[rid])
        self.pos = pos
        if rng is not None and sampler is not None and not sampler.greedy:
            sampler.set_state(rng)
