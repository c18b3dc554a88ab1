"""Weights: expert banks read straight into their stacked slots, and the file-I/O reads' refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import builders as B
from vxc.frontends import lower
from vxc.runtime import weights as weights_mod
from vxc.runtime.weights import MappedFile, WeightError, Weights

MINI = dict(vocab_size=61, hidden_size=24, intermediate_size=40, moe_intermediate_size=14, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, num_experts=5, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)


def _built(tmp_path, model_type: str, cfg: dict, seed: int):
    """A miniature checkpoint lowered: its module, its Weights and every stored tensor as safetensors reads it."""
    mdir = B.build_hf(tmp_path / "m", model_type, cfg, seed=seed)
    m = lower(mdir)
    stored = {}
    for f in mdir.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    return m, Weights(m, mdir), stored


def test_banks_equal_the_stacked_checkpoint_tensors(tmp_path):
    m, w, stored = _built(tmp_path, "qwen3_moe", MINI, 3)
    banks = [t for t in m.tensor_table().values() if t.is_bank]
    assert banks, "the miniature stores its experts as per-expert keys"
    for t in banks:
        got = w.stored(t.sym)
        want = torch.stack([stored[k] for _, k in t.keys()])
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def test_read_into_refuses_a_mismatched_buffer_and_a_short_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(path))
    import hashlib
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    mf = MappedFile(path, len(raw), hashlib.sha256(raw[8:8 + n]).hexdigest(), "w0")
    out = torch.empty(3, 4)
    assert torch.equal(mf.read("a", out=out), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    with pytest.raises(WeightError, match="not torch.float64"):
        mf.read("a", out=torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(WeightError, match="not torch.float32\\[4, 3\\]"):
        mf.read("a", out=torch.empty(4, 3))
    path.write_bytes(raw[:-8])  # the file shrinks after it was opened
    with pytest.raises(WeightError, match="cut short"):
        mf.read("a")


def _thp_mode() -> str:
    try:
        s = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return s[s.index("[") + 1:s.index("]")]


def _vma_flags(ptr: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding ``ptr`` (its counters as a dict)."""
    cur, out = None, {}
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            cur = lo <= ptr < hi
            continue
        if cur and head[0].endswith(":"):
            out[head[0][:-1]] = head[1]
    return out


def test_plain_operands_are_one_private_copy_in_huge_pages_from_2_mib(tmp_path):
    """A weight of >= 2 MiB used as stored (no view, no dtype change) on CPU is read once into 2 MiB-aligned
    memory advised for transparent huge pages, one copy for every operand and reader of that tensor; smaller ones
    are private copies in plain memory. The values are the checkpoint's either way."""
    import sys

    from vxc.runtime import weights as W

    cfg = dict(B.MINI_HF["llama"], vocab_size=8209, hidden_size=136, tie_word_embeddings=True)
    assert 8209 * 136 * 2 >= W.HUGE_PAGE  # the embedding qualifies (in bf16 too); the layers' matrices do not
    m, w, stored = _built(tmp_path, "llama", cfg, 5)
    tensors = m.tensor_table()
    (emb_sym,) = [s for s, t in tensors.items() if list(t.stored_shape) == [8209, 136]]
    users = [o for o in m.operands if o.sources == [emb_sym] and not o.transforms]
    assert users
    users = [users[0], users[-1]]  # (the tied head reads the embedding's operand: the same one twice)
    mapped = [(lo, hi) for lo, hi in W._MAPPED.values()]
    inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in mapped)  # noqa: E731
    got = [w.operand(o, torch.float32, "cpu") for o in users]
    want = stored[tensors[emb_sym].key]
    assert all(torch.equal(g, want) for g in got)
    assert got[0].data_ptr() == got[1].data_ptr(), "one resident copy per stored tensor"
    assert not inside(got[0]) and got[0].data_ptr() % W.HUGE_PAGE == 0
    if sys.platform.startswith("linux") and _thp_mode() != "never":
        assert _vma_flags(got[0].data_ptr()).get("THPeligible") == "1"
    small = [o for o in m.operands if o.encoding is None and not o.transforms and o.sources != [emb_sym]
             and tensors[o.sources[0]].dtype == "f32"]
    assert small
    for o in small:  # private copies too (a fault on the mapping can map a whole large folio around them)
        x = w.operand(o, torch.float32, "cpu")
        assert not inside(x) and torch.equal(x, stored[tensors[o.sources[0]].key])
    # a dtype change reads into resident memory too (bf16 here), the values rounded as torch rounds them
    h = w.operand(users[0], torch.bfloat16, "cpu")
    assert h.data_ptr() % W.HUGE_PAGE == 0 and torch.equal(h, want.to(torch.bfloat16))


def test_hugepage_empty_is_aligned_from_one_huge_page_on():
    from vxc.runtime.weights import HUGE_PAGE, hugepage_empty

    big = hugepage_empty(HUGE_PAGE + 12345)
    assert big.numel() == HUGE_PAGE + 12345 and big.dtype == torch.uint8 and big.data_ptr() % HUGE_PAGE == 0
    big.fill_(7)
    assert int(big.sum()) == 7 * (HUGE_PAGE + 12345)
    small = hugepage_empty(1000)
    assert small.numel() == 1000


def test_small_resident_allocations_share_a_huge_page_chunk():
    """``resident_empty`` below 2 MiB carves 64-byte-aligned, disjoint pieces from one 2 MiB-aligned chunk (so a
    model's small matrices sit in huge pages too); from 2 MiB on each gets its own aligned buffer."""
    from vxc.runtime import weights as W

    with W._pool_lock:
        W._pool["chunk"] = None  # a fresh chunk (earlier tests' pieces live in theirs)
    a, b, c = W.resident_empty(1000), W.resident_empty(3), W.resident_empty(70000)
    base = a.untyped_storage().data_ptr()
    assert base == b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr(), "one chunk"
    chunk = W._pool["chunk"]
    assert chunk.numel() == W.POOL_CHUNK and chunk.data_ptr() % W.HUGE_PAGE == 0 and a.data_ptr() == chunk.data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in (a, b, c))
    assert all(p % 64 == 0 for p, _ in spans) and all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert int(a.sum()) == 1000 and int(b.sum()) == 6 and int(c.sum()) == 210000
    big = W.resident_empty(W.HUGE_PAGE)
    assert big.data_ptr() % W.HUGE_PAGE == 0 and big.untyped_storage().data_ptr() != base


@pytest.mark.native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_an_embedding_gathered_from_the_file_mapping_does_not_stay_resident(tmp_path, monkeypatch):
    """``qembedding`` over a table read in place from a weights file's mapping releases the pages each gather
    faults in (whole page-cache folios: tens of KiB for a row of 272 bytes), so gathering every row of a 2.2 MB
    q8_0 table leaves (almost) nothing of the mapping resident, where without the release all of it stays; the
    rows decode bit for bit as gguf-py decodes them either way."""
    import hashlib
    import struct

    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from vxc.codegen.kernels import native as N
    from vxc.codegen.kernels import qdense

    if not N.available():
        pytest.skip(N.status())
    rows, cols = 8192, 256
    rng = np.random.default_rng(5)
    blocks = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType.Q8_0)
    path = tmp_path / "table.safetensors"
    save_file({"t": torch.from_numpy(blocks)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)).float()
    ids = torch.from_numpy(rng.permutation(rows)).to(torch.int64)
    resident = {}
    for drop in (True, False):
        if not drop:
            monkeypatch.setattr(qdense, "in_file_mapping", lambda t: False)
        mf = MappedFile(path, len(raw), hashlib.sha256(raw[8:8 + n]).hexdigest(), "w0")
        table = mf.tensor("t")
        assert table.shape == (rows, 272) and weights_mod.in_file_mapping(table)
        out = torch.cat([qdense.qembedding_native(ids[i:i + 64], "q8_0", table) for i in range(0, rows, 64)])
        assert torch.equal(out, want[ids])
        resident[drop] = int(_vma_flags(table.data_ptr())["Rss"])  # kB
        del table, mf
    table_kb = rows * 272 // 1024
    assert resident[False] >= table_kb // 2, resident  # without the release the gathers keep the table resident
    assert resident[True] <= 256, resident


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@pytest.mark.native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_one_long_gather_holds_few_pages_of_the_mapping_at_once(tmp_path):
    """One ``qembedding`` call over many random rows of a table in a file mapping releases the pages as it goes
    (after every row), not at its end: the process's peak RSS during a 4096-row gather from an 18 MB table grows by
    the output (4 MB) and a little, where releasing at the end held every touched page — about the whole table —
    at once (Gemma 3's 262144-row table, a 512-token prefill: ~80 MB)."""
    import hashlib
    import struct

    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from vxc.codegen.kernels import native as N
    from vxc.codegen.kernels import qdense

    if not N.available():
        pytest.skip(N.status())
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS: {e}")
    rows, cols, T = 65536, 256, 4096
    rng = np.random.default_rng(6)
    blocks = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType.Q8_0)
    path = tmp_path / "table.safetensors"
    save_file({"t": torch.from_numpy(blocks)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    want = torch.from_numpy(quants.dequantize(blocks[:1], GGMLQuantizationType.Q8_0)).float()  # (import warm-up)
    del raw, blocks
    ids = torch.from_numpy(rng.choice(rows, T, replace=False)).to(torch.int64)
    mf = MappedFile(path, path.stat().st_size, hashlib.sha256(path.read_bytes()[8:8 + n]).hexdigest(), "w0")
    table = mf.tensor("t")
    out = torch.empty(T, cols)  # the output's pages, touched before the peak is reset
    out.fill_(0)
    del out
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    got = qdense.qembedding_native(ids, "q8_0", table)
    grew = _status_kb("VmHWM") - before
    assert got.shape == (T, cols) and want.shape == (1, cols)
    table_kb = rows * 272 // 1024
    assert grew <= T * cols * 4 // 1024 + 4096, (grew, table_kb)


def test_resident_pool_fills_the_resident_rest_of_an_earlier_chunk(monkeypatch):
    """A small resident tensor that does not fit the newest pool chunk goes into the rest of an earlier chunk's last
    touched huge page when it fits there (that page is resident whole anyway), before a new chunk is made; earlier
    chunks are held weakly (they die with their last tensor), the newest strongly."""
    import gc
    import weakref

    from vxc.runtime import weights as W

    MiB = 1 << 20
    monkeypatch.setattr(W, "POOL_CHUNK", 8 * MiB)
    monkeypatch.setattr(W, "_pool", {"chunk": None, "off": 0, "old": []})
    first = [W.resident_empty(3 * MiB // 2) for _ in range(5)]  # 7.5 MiB of chunk 1: 0.5 MiB left in its 4th page
    second = [W.resident_empty(3 * MiB // 2) for _ in range(5)]  # chunk 2 (1.5 MiB no longer fits chunk 1)
    assert second[0].data_ptr() != first[0].data_ptr() + 15 * MiB // 2
    small = W.resident_empty(2 * MiB // 5)  # fits what is left of chunk 2
    assert small.data_ptr() == second[0].data_ptr() + 15 * MiB // 2
    tail = W.resident_empty(2 * MiB // 5)  # chunk 2 has 0.1 MiB left: into chunk 1's last page, no new chunk
    assert tail.data_ptr() == first[0].data_ptr() + 15 * MiB // 2
    assert len(W._pool["old"]) == 1
    ref = W._pool["old"][0][0]
    del first, tail
    gc.collect()
    assert ref() is None  # chunk 1 went with its last tensor
    again = W.resident_empty(2 * MiB // 5)  # no earlier chunk alive: a new chunk
    assert again.data_ptr() not in range(second[0].data_ptr(), second[0].data_ptr() + 8 * MiB)
    assert W._pool["old"][-1][0]() is not None and weakref.ref(again)() is not None
