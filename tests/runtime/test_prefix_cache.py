"""Exact prefix reuse (issue #14 §3): vxc.runtime.prefix_cache.PrefixCache behind the Scheduler.

The invariant, on every executable family (the runtime miniatures of parity_table.FAMILIES and the family
miniatures under tests/families, built by their own builders): a request served from the cache gives logits
bit-identical (torch.equal) to a cold run on a fresh engine and scheduler without the cache that prefills the
same chunks — the cached prefix in the chunks the request that stored it ran them, then the suffix — and its
greedy continuation is identical; its first logits are within the floor of a one-shot prefill of the whole
prompt (1e-5 · max|logit|, VINDEX3.md's bound where no family floor is at hand). The cold run is
:class:`Recompute`: a stand-in cache whose restore runs the prefix on the slot instead of copying anything.

On three representative families (softmax K/V rows; Mamba2 + conv + attention; sliding-window rings) the
scenario matrix: two requests sharing a prefix side by side (the second adopting the first's nodes, a third
hit while both decode, batched with them), eviction by other traffic (the match falls back), a prompt longer
than the budget allows snapshots for (interior snapshots dropped, rows kept: descendants still restore
exactly, and a match falls back past the dropped ones), bf16 compute (every region held at its declared dtype:
fp32 recurrent matrices stay fp32). Every store is checked against the budget and the bytes reported against
the sum of the tensors held, counted here. A control shows each region category's restore matters.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.families import deepseek_v3_support as DS
from tests.families import gpt_oss_support as GO
from tests.families import kimi_linear_support as KL
from tests.families import latent_support as LS
from tests.families import qwen3_moe_support as QM
from tests.families import qwen3_next_support as QN
from tests.families import test_falcon_h1 as FH
from tests.families import test_gemma3 as G3
from tests.families import test_granitemoehybrid as GR
from tests.families import test_lfm2 as LF
from tests.families import test_nemotron_h as NH
from tests.runtime import parity_table as P
from vxc.runtime.prefix_cache import LOGITS, PrefixCache
from vxc.runtime.scheduler import Scheduler
from vxc.runtime.session import Session

K, CONTEXT = 8, 64


def _lowered(build):
    """A builder of a model directory -> (model dir, .vxir) under root."""
    def go(root: Path, name: str):
        from vxc.driver import lower_to_file

        mdir = build(root / name)
        ir = root / f"{name}.vxir"
        lower_to_file(mdir, ir)
        return mdir, ir
    return go


BUILDERS = {name: (lambda root, name, f=f: P.build(f, root)) for name, f in P.FAMILIES.items()}
BUILDERS.update({
    "gemma3": lambda root, name: P.build(G3.UNTIED, root),  # sliding-window rings (window 7) and one full layer
    "lfm2": lambda root, name: P.build(LF.TIED, root),
    "nemotron_h": lambda root, name: P.build(NH.MAIN, root),
    "granitemoehybrid": lambda root, name: P.build(GR.MAIN, root),
    "falcon_h1": lambda root, name: P.build(FH.NORMED, root),
    "gpt_oss": lambda root, name: P.build(GO.FUSED, root),  # sliding window with sinks
    "qwen3_moe": lambda root, name: P.build(QM.FAMILY, root),
    "qwen3_next": _lowered(lambda d: QN.build(d, QN.MOE, seed=4)),
    "kimi_linear": _lowered(lambda d: LS.build(d, "kimi_linear", KL.MOE, seed=12)),
    "deepseek_v3": _lowered(lambda d: LS.build(d, "deepseek_v3", DS.MOE, seed=22)),
})
MATRIX = ("llama", "nemotron_h", "gemma3")  # softmax K/V rows; Mamba2 (fp32 SSM) + conv + attention; rings


class Models:
    def __init__(self, root: Path):
        self.root, self._ir = root, {}

    def ir(self, name: str) -> Path:
        if name not in self._ir:
            self._ir[name] = BUILDERS[name](self.root, name)[1]
        return self._ir[name]

    def engine(self, name: str, *, sequences: int = 2, dtype=torch.float32, kv_dtype=None):
        """A fresh engine (zeroed state)."""
        return P.engine_for(self.ir(name), max_context=CONTEXT, dtype=dtype, sequences=sequences, replay=False,
                            kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return Models(tmp_path_factory.mktemp("prefix-cache"))


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


class Checked(PrefixCache):
    """The cache, checked after every hook call: bytes within the budget, and equal to the sum of the tensors
    held (counted here, node by node), snapshots equal to the nodes holding one."""

    def held(self) -> tuple[int, int]:
        total = snaps = 0
        for n in self.nodes():
            total += sum(t.numel() * t.element_size() for t in n.rows.values())
            if n.snap is not None:
                snaps += 1
                total += sum(t.numel() * t.element_size() for t in n.snap.values())
        return total, snaps

    def check(self):
        total, snaps = self.held()
        s = self.stats()
        assert total <= self.budget, (total, self.budget)
        assert s["bytes"] == total and s["snapshots"] == snaps, (s, total, snaps)
        self.peak = max(getattr(self, "peak", 0), total)

    def restore(self, state, slot, prompt):
        m = super().restore(state, slot, prompt)
        self.check()
        return m

    def store(self, state, slot, toks, logits=None):
        super().store(state, slot, toks, logits)
        self.check()


class Recompute:
    """The cold run's stand-in for a cache: for a prompt in ``plans`` (prompt, m, the prompt length of the
    request that stored the snapshot at m), restore runs ``prompt[:m]`` on the (zeroed) slot in the chunks that
    request ran it — at multiples of K, the chunk ending at its prompt end through prefill_last, a one-token
    chunk through the batched step alone, as the scheduler does — and returns m. It copies nothing."""

    def __init__(self, engine, *plans):
        self.engine, self.plans = engine, {tuple(p): (m, end) for p, m, end in plans}

    @torch.no_grad()
    def restore(self, state, slot, prompt):
        if tuple(prompt) not in self.plans:
            return 0
        m, end = self.plans[tuple(prompt)]
        e = self.engine
        for a in range(0, m, K):
            b = min(a + K, m)
            if b - a == 1:
                e.decode_batch([prompt[a]], [a], [slot])
            else:
                e.bind_slot(slot)
                (e.prefill_last_graph if b == end else e.prefill_graph)(torch.tensor(prompt[a:b]), a)
        return m

    def store(self, state, slot, toks, logits=None):
        pass


def run(sched: Scheduler, prompt: list[int], new: int):
    r = sched.submit(prompt, max_new_tokens=new, keep_logits=True)
    sched.run()
    assert r.finish_reason == "length" and len(r.logits) == new, (r.finish_reason, r.error)
    return r


def assert_same(hit, cold):
    assert hit.generated == cold.generated, (hit.generated, cold.generated)
    assert len(hit.logits) == len(cold.logits) > 0
    for i, (a, b) in enumerate(zip(hit.logits, cold.logits)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


# ---------------------------------------------------------------- the invariant on every family


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_hit_equals_cold_chunked_run(models, name):
    """A (20 tokens, cold: snapshots at 8, 16, 20), then B = A + 6 (hit at A's prompt end, 20), C = A[:13] + 4
    (the match ends inside the block 8..16: falls back to 8; its last chunk 16..17 one token), D = A (the whole
    prompt cached with the logits of its last token: restored at 20, nothing prefilled, its first token chosen
    from A's logits)."""
    t0 = time.perf_counter()
    eng = models.engine(name)
    v = eng.vocab
    A = tokens(v, 20, 1)
    B, C, D = A + tokens(v, 6, 2), A[:13] + tokens(v, 4, 3), list(A)
    cache = Checked(1 << 26)
    s = Scheduler(eng, chunk=K, prefix_cache=cache)
    ra = run(s, A, 3)
    before = s.prefilled_tokens
    hits = [run(s, p, 6) for p in (B, C, D)]
    assert [r.cached for r in hits] == [20, 8, 20]
    assert s.prefilled_tokens - before == 6 + 9 + 0  # only the suffixes were fed
    assert torch.equal(hits[2].logits[0], ra.logits[0])  # D's first token: from the logits A's prompt gave
    st = cache.stats()
    assert (st["hits"], st["misses"], st["hit_tokens"], st["conflicts"]) == (3, 1, 48, 0), st
    # nodes: A 8/16/20 (20 with its logits), B 24/26 (26 with its), C 16'/17 (other tokens; 17 with its); D
    # stores nothing
    assert st["nodes"] == st["snapshots"] == len(list(cache.nodes())) == 7, st

    cold_eng = models.engine(name)
    cold = Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (B, 20, 20), (C, 8, 20)))  # D: all cold
    for hit, p in zip(hits, (B, C, D)):
        assert_same(hit, run(cold, p, 6))

    # the first logits (B's suffix prefill) within the floor of a one-shot prefill of the whole prompt
    one = Session(models.engine(name, sequences=1)).prefill(B, last_only=True)[-1]
    diff = (one.float() - hits[0].logits[0].float()).abs().max().item()
    big = one.float().abs().max().item()
    assert big > 0.5 and diff <= 1e-5 * big, (diff, big)
    print(f"\n{name}: one-shot vs hit {diff:.2e} (max|logit| {big:.2f}), {st['bytes']} bytes in 7 nodes, "
          f"{time.perf_counter() - t0:.2f} s")


# ---------------------------------------------------------------- the scenario matrix


@pytest.mark.parametrize("name", MATRIX)
def test_shared_prefix_side_by_side(models, name):
    """A and A2 = A[:16] + 4 admitted together (both cold: A2's stores meet A's nodes at 8 and 16, compare
    equal and adopt them — no duplicate node); while both decode, B = A[:16] + 7 hits at 16 and decodes
    batched with them. Every request's logits bit-identical to the same schedule run cold."""
    v = models.engine(name).vocab
    A = tokens(v, 20, 11)
    A2, B = A[:16] + tokens(v, 4, 12), A[:16] + tokens(v, 7, 13)

    def schedule(sched):
        ra = sched.submit(A, max_new_tokens=10, keep_logits=True)
        ra2 = sched.submit(A2, max_new_tokens=10, keep_logits=True)
        n = 0
        while ra.prefilling or ra2.prefilling:
            sched.step()
            n += 1
        assert not ra.finish_reason and not ra2.finish_reason
        rb = sched.submit(B, max_new_tokens=6, keep_logits=True)
        sched.run()
        return ra, ra2, rb, n

    cache = Checked(1 << 26)
    hot = schedule(Scheduler(models.engine(name, sequences=3), chunk=K, prefix_cache=cache))
    assert hot[2].cached == 16
    st = cache.stats()
    assert (st["hits"], st["misses"], st["conflicts"]) == (1, 2, 0), st
    by_pos = sorted(n.pos for n in cache.nodes())
    assert by_pos == [8, 16, 20, 20, 23], by_pos  # A's 8 and 16 once; A's and A2's tails; B's 16..23
    cold_eng = models.engine(name, sequences=3)
    cold = schedule(Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (B, 16, 20))))
    assert hot[3] == cold[3]
    for h, c in zip(hot[:3], cold[:3]):
        assert_same(h, c)


@pytest.mark.parametrize("name", MATRIX)
def test_eviction_by_other_traffic(models, name):
    """Budget 1.5x what A's three nodes take: an unrelated prompt X of the same length evicts A's least
    recently used leaves (20, then 16); B = A + 6 then falls back to A's surviving snapshot at 8 and is
    bit-identical to the cold run of that split. Bytes stay within the budget at every store."""
    v = models.engine(name).vocab
    A, X = tokens(v, 20, 21), tokens(v, 20, 22)
    B = A + tokens(v, 6, 23)
    probe = Checked(1 << 26)
    run(Scheduler(models.engine(name), chunk=K, prefix_cache=probe), A, 1)
    a_bytes = probe.stats()["bytes"]
    cache = Checked(a_bytes * 3 // 2)
    s = Scheduler(models.engine(name), chunk=K, prefix_cache=cache)
    run(s, A, 2)
    run(s, X, 2)
    st = cache.stats()
    assert st["evictions"] >= 2 and cache.peak <= cache.budget, st
    hit = run(s, B, 6)
    assert hit.cached == 8
    cold_eng = models.engine(name)
    assert_same(hit, run(Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (B, 8, 20))), B, 6))


@pytest.mark.parametrize("name", ["nemotron_h", "gemma3"])
def test_interior_snapshots_dropped_rows_kept(models, name):
    """A 30-token prompt L under a budget holding its rows but only two snapshots: each store past that drops
    the least recently used snapshot of its own path (16, then 24) and keeps the rows, which the deeper nodes
    need. Then (each on its own copy of that tree) L + 5 restores at 30 through the snapshot-less nodes, and
    L[:27] + 3, whose match ends at 24 (snapshot dropped) and passes 16 (dropped), falls back to 8; both
    bit-identical to their cold runs."""
    v = models.engine(name).vocab
    L = tokens(v, 30, 31)
    M, N = L + tokens(v, 5, 32), L[:27] + tokens(v, 3, 33)
    probe = Checked(1 << 26)
    run(Scheduler(models.engine(name), chunk=K, prefix_cache=probe), L, 1)
    nodes = list(probe.nodes())
    rows = sum(t.numel() * t.element_size() for n in nodes for t in n.rows.values())
    snap = max(sum(t.numel() * t.element_size() for t in n.snap.values()) for n in nodes)
    assert snap > 6 * rows / 30  # a snapshot outweighs the rows of a 6-token tail: 30's store must drop one
    for prompt, m in ((M, 30), (N, 8)):
        cache = Checked(rows + 2 * snap)
        s = Scheduler(models.engine(name), chunk=K, prefix_cache=cache)
        run(s, L, 2)
        assert sorted(n.pos for n in cache.nodes()) == [8, 16, 24, 30]
        assert sorted(n.pos for n in cache.nodes() if n.snap is not None) == [8, 30]
        assert cache.stats()["evictions"] == 2
        hit = run(s, prompt, 5)
        assert hit.cached == m
        cold_eng = models.engine(name)
        cold = Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (prompt, m, 30)))
        assert_same(hit, run(cold, prompt, 5))


def _held_types_and_hit_equals_cold(models, name, seed, **engine_kw):
    """A (20 tokens), then B = A + 5 hitting A's snapshot at 20, on an engine made with ``engine_kw``: every tensor
    the cache holds has its slot region's dtype, and the hit is bit-identical to the cold run on a second such
    engine. Returns the dtypes held, by region kind."""
    eng = models.engine(name, **engine_kw)
    v = eng.vocab
    A = tokens(v, 20, seed)
    B = A + tokens(v, 5, seed + 1)
    cache = Checked(1 << 26)
    s = Scheduler(eng, chunk=K, prefix_cache=cache)
    run(s, A, 2)
    hit = run(s, B, 5)
    assert hit.cached == 20
    slot_dt = {rid: b.dtype for rid, b in eng.state.slots.items()}
    seen: dict = {}
    for n in cache.nodes():
        for rid, t in list(n.rows.items()) + list((n.snap or {}).items()):
            if rid == LOGITS:  # a prompt end's logits: as the step computed them
                assert t.dtype == eng.dtype and t.shape == (eng.padded_vocab,), (t.dtype, t.shape)
                continue
            assert t.dtype == slot_dt[rid], (rid, t.dtype, slot_dt[rid])
            seen.setdefault(eng.state.layout[rid], set()).add(t.dtype)
    cold_eng = models.engine(name, **engine_kw)
    assert_same(hit, run(Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (B, 20, 20))), B, 5))
    return seen


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2attn-native"])
def test_declared_dtypes_kept_under_bf16(models, name):
    """Under bf16 compute every held tensor has its region's dtype (the fp32 recurrent matrices fp32, conv
    histories and K/V rows bf16), and a hit is bit-identical to the cold bf16 run (a round trip through a
    narrower type would not be)."""
    seen = _held_types_and_hit_equals_cold(models, name, 41, dtype=torch.bfloat16)
    assert seen["recurrent"] == {torch.float32} and seen["kv_rows"] == seen["conv_history"] == {torch.bfloat16}, seen


@pytest.mark.parametrize("name", ["nemotron_h", "gemma3", "deepseek_v3"])
def test_narrow_kv_cache_kept_and_hit_equals_cold(models, name):
    """fp32 compute with an f16 KV / latent cache (--kv-dtype fp16): the held rows are f16 as the slot's region is
    (never widened or narrowed again), the fp32 recurrent matrices and conv histories keep fp32, and a hit is
    bit-identical to the cold run on the same cache type."""
    seen = _held_types_and_hit_equals_cold(models, name, 51, kv_dtype=torch.float16)
    assert seen.get("kv_rows", set()) | seen.get("latent_rows", set()) == {torch.float16}, seen
    assert all(seen.get(k, {torch.float32}) == {torch.float32} for k in ("recurrent", "conv_history")), seen


# ---------------------------------------------------------------- controls and wiring


class Forgetting(PrefixCache):
    """A defective cache for the control: after restoring, it zeroes one category of regions again."""

    def __init__(self, budget, forget):
        super().__init__(budget)
        self.forget = forget

    def restore(self, state, slot, prompt):
        m = super().restore(state, slot, prompt)
        for rid, b in state.slots.items():
            cat = "ring" if state.ring[rid] else state.layout[rid]
            if cat == self.forget:
                b[slot].zero_()
        return m


@pytest.mark.parametrize("name,cats", [("nemotron_h", ("kv_rows", "recurrent", "conv_history")),
                                       ("gemma3", ("ring", "kv_rows")), ("deepseek_v3", ("latent_rows",))])
def test_control_every_region_category_matters(models, name, cats):
    """The comparison with the cold run catches a restore that leaves out any one category of regions (K/V rows,
    latent rows, rings, recurrent matrices, conv histories): the hit's first logits then differ."""
    v = models.engine(name).vocab
    A = tokens(v, 20, 51)
    B = A + tokens(v, 4, 52)
    cold_eng = models.engine(name)
    want = run(Scheduler(cold_eng, chunk=K, prefix_cache=Recompute(cold_eng, (B, 20, 20))), B, 1).logits[0]
    assert {("ring" if cold_eng.state.ring[r] else k) for r, k in cold_eng.state.layout.items()} == set(cats)
    for cat in cats:
        s = Scheduler(models.engine(name), chunk=K, prefix_cache=Forgetting(1 << 26, cat))
        run(s, A, 1)
        hit = run(s, B, 1)
        assert hit.cached == 20
        assert not torch.equal(hit.logits[0], want), cat


def test_scheduler_prefix_cache_bytes(models):
    eng = models.engine("llama")
    s = Scheduler(eng, chunk=K, prefix_cache_bytes=12345)
    assert isinstance(s.cache, PrefixCache) and s.cache.stats()["budget"] == 12345
    assert Scheduler(eng, chunk=K).cache is None and Scheduler(eng, chunk=K, prefix_cache_bytes=0).cache is None
    # a budget below one node's rows stores nothing and restores nothing, and the request still runs
    s = Scheduler(eng, chunk=K, prefix_cache_bytes=16)
    A = tokens(eng.vocab, 12, 61)
    run(s, A, 2)
    r = run(s, A + [5, 6], 2)
    st = s.cache.stats()
    assert r.cached == 0 and (st["bytes"], st["nodes"], st["hits"], st["misses"]) == (0, 0, 0, 2), st
    # clear() drops every node: the same prompt then misses
    s = Scheduler(eng, chunk=K, prefix_cache_bytes=1 << 20)
    run(s, A, 1)
    assert s.cache.stats()["nodes"] == 2
    s.cache.clear()
    assert (s.cache.stats()["bytes"], s.cache.stats()["nodes"], list(s.cache.nodes())) == (0, 0, [])
    assert run(s, A + [5, 6], 1).cached == 0
    assert run(s, A + [5, 7], 1).cached == 8  # A + [5, 6] stored 8 and 14 (diverging at 13)
    # one cache, one engine's regions
    other = models.engine("mamba2-hf")
    with pytest.raises(ValueError, match="one engine"):
        s.cache.restore(other.state, 0, A)


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2attn-native"])
def test_a_prompt_shorter_than_a_chunk_is_served_whole(models, name):
    """A recurrent state has no row to reuse part of, and one token of a prompt had to remain to be fed: the same
    prompt again, shorter than one chunk, used to find no snapshot before its end and prefilled it all. Kept with
    its last token's logits, the prompt-end snapshot serves it whole: nothing prefilled, the first token chosen
    from the same logits, the continuation the cold run's; a strict prefix of it still misses."""
    eng = models.engine(name)
    A = tokens(eng.vocab, K - 3, 61)
    s = Scheduler(eng, chunk=K, prefix_cache=Checked(1 << 26))
    first = run(s, A, 4)
    before = s.prefilled_tokens
    again = run(s, A, 4)
    assert (first.cached, again.cached, s.prefilled_tokens - before) == (0, len(A), 0)
    assert torch.equal(again.logits[0], first.logits[0])
    assert_same(again, run(Scheduler(models.engine(name), chunk=K), A, 4))
    assert run(s, A[:-1], 1).cached == 0
    st = s.cache.stats()
    assert (st["hits"], st["misses"], st["hit_tokens"]) == (1, 2, len(A)), st
