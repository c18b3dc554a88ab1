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
    res["replay"] = engine.replay_status()
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


# ------------------------------------------------------------------ a test module's miniatures, TP=1 and N ranks


def lower_minis(root: Path, builds: dict) -> dict[str, tuple[Path, Path, Path]]:
    """Each ``name -> build(model dir) -> model dir`` built under ``root`` and lowered: ``name -> (model dir, IR,
    an empty out dir)``."""
    from vxc.driver import lower_to_file

    out = {}
    for name, build in builds.items():
        mdir = build(root / name)
        ir = root / f"{name}.vxir"
        lower_to_file(mdir, ir)
        (root / f"out-{name}").mkdir()
        out[name] = (mdir, ir, root / f"out-{name}")
    return out


def run_tp1(minis: dict) -> dict:
    """``measure`` and ``save_resume`` of every miniature at TP=1 in this process."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine

    out = {}
    for name, (mdir, ir, od) in minis.items():
        e = Engine(parse_file(ir), mdir, max_context=64)
        res = measure(e, lambda s: s)
        res.update(save_resume(e, lambda s: s, od / "state-tp1.safetensors"))
        out[name] = res
    return out


def run_ranks(minis: dict, counts: tuple[int, ...]) -> dict:
    """One spawn per rank count running ``rank_many`` over every miniature: ``n -> name -> [rank results]``."""
    from vxc.runtime import tp as TP

    jobs = [(str(ir), str(mdir), str(od)) for mdir, ir, od in minis.values()]
    out = {}
    for n in counts:
        TP.spawn(rank_many, n, n, jobs)
        out[n] = {name: [torch.load(od / f"tp{n}-rank{r}.pt") for r in range(n)] for name, (_, _, od) in minis.items()}
    return out


def check_matches(ref: dict, results: list[dict]) -> None:
    """Every rank against TP=1 at ``tolerance``: logits of a prefill and of prefill-then-steps, decode == prefill,
    32 greedy tokens identical, the decode step replayed, the same bits on every rank, save on N ranks → resume
    identical."""
    tol = tolerance(ref)
    assert len(set(ref["greedy"])) >= 4  # not a degenerate repeat any model would match
    for res in results:
        r = res["rank"]
        assert (res["full"] - ref["full"]).abs().max().item() <= tol, r
        assert (res["stepped"] - ref["stepped"]).abs().max().item() <= tol, r
        assert (res["stepped"] - res["full"]).abs().max().item() <= tol, r  # decode == prefill on N ranks
        assert res["greedy"] == ref["greedy"], r
        assert res["replay"].startswith("replaying"), (r, res["replay"])  # the decode step, all-reduces included
        assert torch.equal(res["full"], results[0]["full"]), r  # the ranks hold the same bits
        assert torch.equal(res["first_resumed"], res["first"]), r
        assert res["cont_resumed"] == res["cont"] == ref["cont"], r


def check_described(ir: Path, n: int, results: list[dict]) -> None:
    """Each rank's parts read alone (bytes read == the parts' fp32 bytes) and its weight and state bytes as
    ``describe --tp`` says."""
    from vxc.driver import load
    from vxc.passes.surfaces import tp_ranks

    d = tp_ranks(lambda: load(ir), n, context=64)
    for res in results:
        part_bytes = sum(4 * torch.Size(shape).numel() for *_, shape in res["parts"].values())
        assert res["sliced_bytes"] == part_bytes > 0, res["rank"]
        mine = d["per_rank"][res["rank"]]
        assert mine["weight_bytes"] == res["weight_bytes"], res["rank"]
        assert mine["state"]["at_context_bytes"] == res["state_bytes"], res["rank"]
