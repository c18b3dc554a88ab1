"""Sessions: ``prefill(tokens) → logits``, ``step(token) → logits``, generation,
and continuation state saved to / restored from safetensors (only the
declared regions, the position and, when sampling, the sampler's RNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file

from ..ir.diagnostics import VxcError
from .engine import Engine
from .sampling import Sampler


class SessionError(VxcError):
    pass


class Session:
    def __init__(self, engine: Engine):
        self.engine = engine
        # the state buffers belong to the engine and outlive a session: a new
        # session starts at position 0, so it starts from zeroed state too
        # (prefill continues from whatever the buffers hold)
        self.reset()

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
        padded_vocab] for the last token alone (the head runs on that position only)."""
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.engine.device)
        if ids.numel() == 0:
            raise SessionError("prefill needs at least one token")
        self._room(ids.numel())
        bad = [int(t) for t in ids if not (0 <= int(t) < self.engine.padded_vocab)]
        if bad:
            raise SessionError(f"token ids outside the vocabulary 0..{self.engine.padded_vocab - 1}: {bad[:5]}")
        # one token runs the fixed-shape decode graph, so a resumed single-token
        # continuation is bit-identical to an uninterrupted step
        if ids.numel() == 1:
            logits = self.engine.decode(int(ids[0]), self.pos)
        else:
            logits = (self.engine.prefill_last_graph if last_only else self.engine.prefill_graph)(ids, self.pos)
        self.pos += ids.numel()
        return logits

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Logits [padded_vocab] (compute dtype) after one more token (the fixed-shape decode graph)."""
        self._room(1)
        if not (0 <= token < self.engine.padded_vocab):
            raise SessionError(f"token id {token} outside the vocabulary")
        logits = self.engine.decode(token, self.pos)
        self.pos += 1
        return logits[0]

    def generate(self, prompt: list[int], max_new_tokens: int, sampler: Sampler,
                 on_token: Callable[[int], None] | None = None, logits: torch.Tensor | None = None) -> list[int]:
        """Prefill ``prompt`` (unless ``logits`` of the last position are given) and generate."""
        last = self.prefill(prompt, last_only=True)[-1] if logits is None else logits
        out: list[int] = []
        for i in range(max_new_tokens):
            tok = sampler(last)
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if i + 1 < max_new_tokens:
                last = self.step(tok)
        return out

    # ------------------------------------------------------------ continuation state

    def save_state(self, path: Path, sampler: Sampler | None = None) -> None:
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
        save_file(tensors, str(path), metadata={"format": "vxc-state", "regions": json.dumps(shapes, sort_keys=True)})

    def load_state(self, path: Path, sampler: Sampler | None = None) -> None:
        st = self.engine.state
        try:
            data = load_file(str(path))
        except Exception as e:
            raise SessionError(f"{path}: not a readable state file ({e})") from None
        want = set(st.buffers) | {"position"}
        missing = sorted(want - set(data))
        extra = sorted(set(data) - want - {"rng_state"})
        if missing or extra:
            raise SessionError(f"{path}: state regions do not match this model (missing {missing[:4]}, unexpected {extra[:4]})")
        pos = int(data["position"][0])
        if pos > st.max_context:
            raise SessionError(f"{path}: position {pos} exceeds --max-context {st.max_context}")
        st.zero_()
        for rid, buf in st.buffers.items():
            src = data[rid]
            dst = (buf[:, :pos] if st.layout[rid] == "kv_rows" else buf[:pos]) if st.growing[rid] else buf
            if tuple(src.shape) != tuple(dst.shape):
                raise SessionError(f"{path}: region {rid} has shape {list(src.shape)}, this model needs {list(dst.shape)}")
            dst.copy_(src.to(dst.dtype))
        self.pos = pos
        if sampler is not None and "rng_state" in data:
            sampler.set_state(data["rng_state"])
