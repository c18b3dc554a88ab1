"""One rank of the tensor-parallel checks (tests/runtime/test_tp.py): everything a rank measures in one process
group, so one spawn per rank count covers logits, decode, greedy, save/resume and bytes."""

from __future__ import annotations

import os
from pathlib import Path

import torch

N_GREEDY = 32
SPLIT = 7


def prompt() -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 100, (12,), generator=g).tolist()


def measure(engine, agree) -> dict:
    """What a rank (or the TP=1 reference, ``agree`` = identity) computes on the miniature."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ids = prompt()
    s = Session(engine)
    full = s.prefill(ids).clone()
    s.reset()
    rows = [s.prefill(ids[:SPLIT]).clone()] + [s.step(t)[None].clone() for t in ids[SPLIT:]]
    stepped = torch.cat(rows)
    s.reset()
    greedy = s.generate(ids, N_GREEDY, agree(Sampler(0.0, 0, 1.0, 0, vocab=engine.vocab)))
    return {"full": full, "stepped": stepped, "greedy": greedy}


def save_resume(engine, agree, path: Path) -> dict:
    """Prefill a prefix, save the state, continue 8 greedy tokens; then reset, resume from the file and continue
    again: both continuations (and the first logits after each) are returned."""
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    ids = prompt()
    s = Session(engine)
    s.prefill(ids[:SPLIT])
    s.save_state(path)
    first = s.step(ids[SPLIT]).clone()
    cont = s.generate([], 8, agree(Sampler(0.0, 0, 1.0, 0, vocab=engine.vocab)), logits=first)
    s.reset()
    s.load_state(path)
    first2 = s.step(ids[SPLIT]).clone()
    cont2 = s.generate([], 8, agree(Sampler(0.0, 0, 1.0, 0, vocab=engine.vocab)), logits=first2)
    return {"first": first, "cont": cont, "first_resumed": first2, "cont_resumed": cont2}


def rank_main(rank: int, n: int, ir: str, mdir: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.tp import Agreed, rank_path

    engine = Engine(parse_file(Path(ir)), Path(mdir), max_context=64, tp=n, rank=rank)
    res = {"rank": rank}
    res.update(measure(engine, Agreed))
    res.update(save_resume(engine, Agreed, rank_path(Path(out) / f"state-tp{n}.safetensors", rank)))
    parts = {o.sym: (o.shard.dim, o.shard.start, o.shard.stop, list(o.shape)) for o in engine.module.operands
             if o.shard is not None and o.shard.dim is not None}
    res["spans"] = {o.sym: [list(x) for x in o.shard.spans()] for o in engine.module.operands
                    if o.shard is not None and o.shard.dim is not None}
    res.update(weight_bytes=engine.weight_bytes(), state_bytes=engine.state.nbytes(),
               sliced_bytes=engine.weights.sliced_bytes(), parts=parts,
               kv_shapes={rid: list(b.shape) for rid, b in engine.state.buffers.items()},
               reduces=sum(1 for c in engine.lowered["decode"].calls if c.kernel == "all_reduce"),
               graph_reduces=sum(1 for nd in engine.decode_graph.graph.nodes if "all_reduce" in str(nd.target)))
    torch.save(res, Path(out) / f"tp{n}-rank{rank}.pt")


def rank_many(rank: int, n: int, jobs: list[tuple[str, str, str]]) -> None:
    """``rank_main`` for several miniatures ``(ir, model dir, out dir)`` in one process group (one spawn per rank
    count for a whole test module)."""
    for ir, mdir, out in jobs:
        rank_main(rank, n, ir, mdir, out)


def tolerance(ref: dict) -> float:
    """The floor the TP checks hold to: VINDEX3 "Numerical floor" with TP=1 vxc as the reference, its own fp32
    error measured as full-prefill vs prefill-then-step logits: max(2 × that, 1e-5 × max|logit|)."""
    floor = (ref["full"] - ref["stepped"]).abs().max().item()
    return max(2 * floor, 1e-5 * ref["full"].abs().max().item())
