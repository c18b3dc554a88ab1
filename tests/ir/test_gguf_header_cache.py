"""GGUF headers kept on disk (vxc/ir/gguf_container.py): a header whose parse was slow (a large vocabulary) is
written to the cache directory after gguf-py parsed it and read back by the next process, but only while the
file's header bytes are the ones it was made from; a changed, corrupt or disabled entry falls back to the parse."""

from __future__ import annotations

import pytest

from tests.gguf_support import MINI_LLAMA, write_llama_gguf
from vxc.ir import gguf_container as G


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A miniature file, the header cache in tmp_path, every parse slow enough to be kept."""
    monkeypatch.setenv("VXC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VXC_GGUF_CACHE", raising=False)
    monkeypatch.setattr(G, "HEADER_CACHE_SECONDS", 0.0)
    G.forget()
    path = write_llama_gguf(tmp_path / "m.gguf", MINI_LLAMA, seed=3)
    yield path
    G.forget()


def _parses(monkeypatch) -> list:
    """Count gguf-py parses from now on."""
    import gguf

    calls = []
    real = gguf.GGUFReader

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return calls


def _same(a: G.Container, b: G.Container) -> None:
    assert (a.size, a.data_start, a.header_sha256) == (b.size, b.data_start, b.header_sha256)
    assert a.entries == b.entries
    assert a.metadata.keys() == b.metadata.keys()
    for k in a.metadata:
        assert a.metadata[k] == b.metadata[k] and type(a.metadata[k]) is type(b.metadata[k]), k


def test_a_slow_header_is_read_back_from_disk_unparsed(cached, monkeypatch):
    first = G.read(cached)
    entries = list((cached.parent / "cache" / "gguf-headers").glob("*.json"))
    assert len(entries) == 1
    G.forget()  # a new process: nothing remembered in memory
    parses = _parses(monkeypatch)
    again = G.read(cached)
    assert parses == []  # read back, not parsed
    _same(first, again)


def test_a_changed_header_is_parsed_again(cached, monkeypatch):
    first = G.read(cached)
    raw = bytearray(cached.read_bytes())
    i = raw.index(b"llama.block_count") + len(b"llama.block_count") + 4  # the key, its value type, the u32 value
    assert raw[i] == MINI_LLAMA["layers"]
    raw[i] += 1  # same size, one header byte changed
    cached.write_bytes(bytes(raw))
    G.forget()
    parses = _parses(monkeypatch)
    again = G.read(cached)
    assert len(parses) == 1  # the kept entry no longer matches the header: parsed
    assert again.metadata["llama.block_count"] == first.metadata["llama.block_count"] + 1
    assert again.header_sha256 != first.header_sha256


def test_a_corrupt_or_disabled_entry_falls_back_to_the_parse(cached, monkeypatch):
    first = G.read(cached)
    (entry,) = (cached.parent / "cache" / "gguf-headers").glob("*.json")
    entry.write_text('{"version": 1, "fields": [')  # cut short
    G.forget()
    parses = _parses(monkeypatch)
    _same(first, G.read(cached))
    assert len(parses) == 1
    G.forget()
    entry.unlink()
    monkeypatch.setenv("VXC_GGUF_CACHE", "0")
    _same(first, G.read(cached))
    assert len(parses) == 2 and not entry.exists()  # parsed, and nothing written


def test_copies_of_a_file_share_one_entry(cached, tmp_path, monkeypatch):
    """Entries are named by content (size and first bytes), not path: a copy of a file in another folder (a test
    suite unpacking a model afresh each run) reads the entry its original made, and adds none."""
    import shutil

    first = G.read(cached)
    folder = cached.parent / "cache" / "gguf-headers"
    assert len(list(folder.glob("*.json"))) == 1
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(cached, copy)
    G.forget()
    parses = _parses(monkeypatch)
    again = G.read(copy)
    assert parses == []  # read back, not parsed
    assert len(list(folder.glob("*.json"))) == 1
    assert again.header_sha256 == first.header_sha256 and again.entries == first.entries


def test_a_fast_header_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VXC_CACHE_DIR", str(tmp_path / "cache"))
    G.forget()
    path = write_llama_gguf(tmp_path / "m.gguf", MINI_LLAMA, seed=3)
    G.read(path)  # a miniature parses in milliseconds: below HEADER_CACHE_SECONDS
    assert not (tmp_path / "cache" / "gguf-headers").exists()
    G.forget()


# ------------------------------------------------------------------------------------- slim(): the vocabulary arrays
# dropped once the engine reads only the tensor table, read back from the file when asked for again


@pytest.fixture
def slim_file(tmp_path, monkeypatch):
    """A miniature file (300 tokens) with the bulk threshold below its vocabulary, the disk cache off."""
    monkeypatch.setenv("VXC_GGUF_CACHE", "0")
    monkeypatch.setattr(G, "SLIM_MIN", 100)
    G.forget()
    path = write_llama_gguf(tmp_path / "m.gguf", MINI_LLAMA, seed=5)
    yield path
    G.forget()


def test_slim_drops_the_vocabulary_arrays_and_reads_them_back_once(slim_file, monkeypatch):
    snap = G.reader(slim_file)
    tokens = list(snap.fields["tokenizer.ggml.tokens"].contents())
    arch = snap.fields["general.architecture"].contents()
    assert len(tokens) == MINI_LLAMA["vocab"]
    bulky = [k for k, f in snap.fields.items() if G._bulky(f.contents())]
    assert "tokenizer.ggml.tokens" in bulky
    assert G.slim() == len(bulky)
    assert all(snap.fields[k]._value is None for k in bulky)  # dropped, not just hidden
    assert snap.fields["general.architecture"]._value == arch  # small values stay
    assert G.slim() == 0  # nothing left to drop
    parses = _parses(monkeypatch)
    assert snap.fields["tokenizer.ggml.tokens"].contents() == tokens  # read back from the file
    assert len(parses) == 1
    for k in bulky:  # every dropped field came back with that one parse
        snap.fields[k].contents()
    assert len(parses) == 1
    assert G.reader(slim_file) is snap  # still the remembered header


def test_a_value_dropped_from_a_file_that_changed_since_is_refused(slim_file):
    import os

    snap = G.reader(slim_file)
    field = snap.fields["tokenizer.ggml.tokens"]
    G.slim()
    st = slim_file.stat()
    os.utime(slim_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: perhaps another file now
    with pytest.raises(G.GGUFError, match="changed since its header was read"):
        field.contents()


def test_loading_the_weights_leaves_the_header_slim(slim_file):
    """The engine's weight file (runtime.weights.MappedFile) slims the remembered header before any weight is
    packed; the tokenizer built before it and the header's small fields are unaffected."""
    from vxc.runtime.weights import MappedFile

    snap = G.reader(slim_file)
    c = G.read(slim_file)  # a lowering's read: its metadata holds the arrays too
    assert any(G._bulky(v) for v in c.metadata.values())
    mf = MappedFile(slim_file, slim_file.stat().st_size, c.header_sha256, "w0", "gguf")
    assert mf.entries
    assert all(f._value is None or not G._bulky(f._value) for f in snap.fields.values())
    assert not any(G._bulky(v) for k in list(G._CACHE) for v in G._CACHE[k].metadata.values())
    again = G.read(slim_file)  # parsed again on demand: the same metadata
    assert again.metadata == c.metadata
