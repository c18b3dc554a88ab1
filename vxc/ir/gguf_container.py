"""The GGUF container, as the IR's ``file @wN "x.gguf" format gguf`` means it: read with the ``gguf`` package
(metadata, tensor infos, byte offsets; the file is memory-mapped, never read whole).

A GGUF tensor is recorded in the IR the way a safetensors tensor is: a stored dtype and shape (in torch's
order, outermost first) at byte offsets of the data region. Float and integer tensors keep their element
type; a ggml block-quantised tensor is stored as ``u8 [..., rows, row_bytes]`` (its rows are whole blocks),
and the operand that reads it declares the encoding (``q4_1(blocks $t)``), which decodes to
``[..., rows, row_bytes / type_size * block_size]``.

The header digest is the sha256 of every byte before the data region (magic, metadata, tensor infos,
alignment padding): the runtime refuses a file whose digest differs from the one the IR recorded."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .diagnostics import VxcError

# ggml element types that are plain arrays -> the IR's dtype names
PLAIN = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64", "I8": "i8", "I16": "i16", "I32": "i32", "I64": "i64"}


class GGUFError(VxcError):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    ggml_type: str  # e.g. "Q4_1", "F32"
    dtype: str  # the IR's stored dtype: "u8" for block-quantised types
    shape: tuple[int, ...]  # stored shape, torch order
    encoding: str | None  # "q4_1" … for block-quantised types
    start: int  # byte offsets in the data region
    end: int


@dataclass
class Container:
    path: Path
    size: int
    data_start: int
    header_sha256: str
    metadata: dict[str, Any]
    entries: dict[str, Entry]


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _value(field) -> Any:
    v = field.contents()
    return v


_CACHE: dict[tuple, Container] = {}
_CACHE_SIZE = 4
_READERS: dict[tuple, "Snapshot"] = {}


class _Field:
    """A metadata field's value, read once (or the error reading it raised, raised again on every read). A value
    :func:`slim` dropped (``_source``: the snapshot's key and the snapshot) is read back from the file on use."""

    __slots__ = ("_value", "_error", "_source")

    def __init__(self, field):
        self._value, self._error, self._source = None, None, None
        try:
            self._value = field.contents()
        except Exception as e:  # a string field that is not UTF-8, a truncated array: the caller names it
            self._error = e

    def contents(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._source is not None:
            _restore(*self._source)
        return self._value


@dataclass
class Snapshot:
    """What a ``gguf.GGUFReader`` read from a file's header, kept as plain values: every metadata field's contents,
    the tensor infos and the data offset. The reader itself is dropped: for a 262144-token vocabulary it holds
    ~720 MB of per-element numpy views, which must not stay resident beside the model."""

    fields: dict[str, _Field]
    tensors: list[SimpleNamespace]
    data_offset: int


def reader(path: Path) -> Snapshot:
    """The header of ``path`` as :class:`Snapshot`, one per file per process (path, size, modification time): the
    gguf package parses every metadata array element by element (a 262144-token vocabulary: ~10 s), and the
    container, the tokenizer and the model's stop ids / chat template / context length all read the same header.
    A header whose parse took ``HEADER_CACHE_SECONDS`` or more is also kept on disk (:func:`_stored_snapshot`), so
    the next process — the ``vxc exec`` after a ``vxc lower`` — reads it back in a fraction of a second.
    Read-only. Raises what GGUFReader raises (OSError; ValueError / struct.error / numpy errors on a corrupt file)."""
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    snap = _READERS.get(key)
    if snap is None:
        snap = _load_snapshot(Path(path), st.st_size)
        if len(_READERS) >= 2:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = snap
    return snap


def _load_snapshot(path: Path, size: int) -> Snapshot:
    """The header of ``path``: the copy kept on disk when it still matches, else parsed (and kept when slow)."""
    from gguf import GGUFReader

    snap = _stored_snapshot(path, size)
    if snap is None:
        t0 = time.perf_counter()
        r = GGUFReader(str(path), "r")
        tensors = [SimpleNamespace(name=t.name, tensor_type=t.tensor_type, shape=[int(x) for x in t.shape],
                                   data_offset=int(t.data_offset), n_bytes=int(t.n_bytes)) for t in r.tensors]
        snap = Snapshot({k: _Field(f) for k, f in r.fields.items()}, tensors, int(r.data_offset))
        del r
        if time.perf_counter() - t0 >= HEADER_CACHE_SECONDS:
            _store_snapshot(path, size, snap)
    return snap


# A metadata array longer than this (a vocabulary's tokens, merges, scores, token types) is what :func:`slim` drops.
SLIM_MIN = 1024


def _bulky(v: Any) -> bool:
    return not isinstance(v, (str, bytes)) and hasattr(v, "__len__") and len(v) > SLIM_MIN


def slim() -> int:
    """Drop the large metadata arrays of the remembered headers (a vocabulary's token, merge, score and type lists:
    for a 151936-token vocabulary ~11 MB of Python objects, ~14 MB of RSS) once a model's tokenizer is built and
    only its tensor table is still read: the engine calls it before packing its weights, so they are not resident
    beside the packed copies at the load's peak. Unlike :func:`forget`, what stays remembered stays usable: a dropped
    value is read back from the file when next asked for (every dropped field of that header at once), after checking
    that the file is still the one it was read from; remembered :func:`read` results that carry such arrays are
    forgotten (a later read parses them again). Returns the number of values dropped."""
    n = 0
    for key, snap in list(_READERS.items()):
        for f in snap.fields.values():
            if f._error is None and f._source is None and _bulky(f._value):
                f._value, f._source = None, (key, snap)
                n += 1
    for k in [k for k, c in _CACHE.items() if any(_bulky(v) for v in c.metadata.values())]:
        del _CACHE[k]
        n += 1
    if n:
        _hand_back_heap()
    return n


def _restore(key: tuple, snap: Snapshot) -> None:
    """Read the values :func:`slim` dropped from ``snap`` back from its file (key: resolved path, size, mtime)."""
    path, size, mtime = key
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read its header again ({e.strerror})") from None
    if (st.st_size, st.st_mtime_ns) != (size, mtime):
        raise GGUFError(f"{path}: changed since its header was read (size or modification time differ); "
                        f"load the model again")
    again = _load_snapshot(Path(path), size)
    for name, f in snap.fields.items():
        if f._source is not None:
            g = again.fields.get(name)
            if g is None:
                raise GGUFError(f"{path}: metadata {name!r} is gone from the header read again")
            f._value, f._error, f._source = g._value, g._error, None


# ------------------------------------------------------------------------------------- headers kept on disk
# A slow header (a large vocabulary's token / score / type arrays) is written, after GGUFReader parsed it, as JSON
# into the cache directory (vxc.cache): every field's value, the tensor infos, the data offset — and the sha256 of
# the file's header bytes (everything before the data region), checked against the file at every read, so an entry
# of a file that changed in any header byte is never used. Entries are named by the file's content — its size and
# its first HEADER_KEY_BYTES — not its path: copies of one file share an entry (a test suite that unpacks the same
# model into a fresh temporary folder each run no longer adds an entry per run, evicting the user's), and a file
# whose header changed gets a new one. At most HEADER_CACHE_ENTRIES of them (the oldest removed). VXC_GGUF_CACHE=0
# turns it off. Losing or corrupting an entry only costs the parse.

HEADER_CACHE_SECONDS = 1.0  # parses faster than this are not worth an entry
HEADER_CACHE_ENTRIES = 16
HEADER_KEY_BYTES = 1 << 16
_HEADER_CACHE_VERSION = 1


def _header_cache_path(path: Path) -> Path | None:
    if os.environ.get("VXC_GGUF_CACHE", "1") == "0":
        return None
    from ..cache import cache_dir

    h = hashlib.sha256(f"{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEADER_KEY_BYTES))
    return cache_dir() / "gguf-headers" / f"{h.hexdigest()[:32]}.json"


def _header_digest(path: Path, data_offset: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(data_offset)).hexdigest()


def _stored_snapshot(path: Path, size: int) -> Snapshot | None:
    """The snapshot kept for ``path`` if its size and header bytes are the ones it was made from; else None."""
    import json

    from gguf import GGMLQuantizationType

    try:
        cp = _header_cache_path(path)
    except OSError:  # unreadable: the parse names it
        return None
    if cp is None or not cp.is_file():
        return None
    try:
        d = json.loads(cp.read_text())
        if d.get("version") != _HEADER_CACHE_VERSION or d["size"] != size:
            return None
        if _header_digest(path, int(d["data_offset"])) != d["header_sha256"]:
            return None
        fields = {}
        for k, v in d["fields"].items():
            f = _Field.__new__(_Field)
            f._value, f._error, f._source = v, None, None
            fields[k] = f
        tensors = [SimpleNamespace(name=n, tensor_type=GGMLQuantizationType[t], shape=list(sh), data_offset=int(o),
                                   n_bytes=int(nb)) for n, t, sh, o, nb in d["tensors"]]
        return Snapshot(fields, tensors, int(d["data_offset"]))
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or foreign: parse the file instead
        return None


def _store_snapshot(path: Path, size: int, snap: Snapshot) -> None:
    """Keep ``snap`` on disk for :func:`_stored_snapshot` (atomically; any failure leaves no entry)."""
    import json
    import tempfile

    try:
        cp = _header_cache_path(path)
    except OSError:
        return
    if cp is None or any(f._error is not None for f in snap.fields.values()):
        return
    try:
        d = {"version": _HEADER_CACHE_VERSION, "path": str(path.resolve()), "size": size,
             "data_offset": snap.data_offset, "header_sha256": _header_digest(path, snap.data_offset),
             "fields": {k: f._value for k, f in snap.fields.items()},
             "tensors": [[t.name, t.tensor_type.name, t.shape, t.data_offset, t.n_bytes] for t in snap.tensors]}
        cp.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cp.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(d, f)
            os.replace(tmp, cp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        entries = sorted(cp.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-HEADER_CACHE_ENTRIES]:
            old.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError):  # an unwritable cache directory, a value JSON cannot hold: no entry
        return


def forget() -> None:
    """Drop the remembered headers (:func:`reader`, :func:`read`) once a model is loaded: a 262144-token vocabulary's
    token, score and type lists are ~180 MB of Python objects, which need not stay beside the weights. The freed
    heap is handed back to the OS where the C library can (glibc's ``malloc_trim``)."""
    if not (_READERS or _CACHE):
        return
    _READERS.clear()
    _CACHE.clear()
    _hand_back_heap()


def _hand_back_heap() -> None:
    """Collect the dropped objects and hand the freed heap back to the OS where the C library can (glibc)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def read(path: Path, rel: str | None = None, with_metadata: bool = True) -> Container:
    """:func:`parse`, remembered per process for the same file (path, size, modification time): the gguf
    package parses every metadata array element by element (a 262144-token vocabulary: ~10 s), and lowering,
    loading and a second engine over the same file would each pay it. The result is shared: read-only."""
    try:
        st = Path(path).stat()
    except OSError:
        return parse(path, rel, with_metadata)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, with_metadata)
    hit = _CACHE.get(key) or (None if with_metadata else _CACHE.get(key[:-1] + (True,)))
    if hit is None:
        hit = parse(path, rel, with_metadata)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = hit
    return hit


def parse(path: Path, rel: str | None = None, with_metadata: bool = True) -> Container:
    """Parse a GGUF file's header and check its tensor table against the file: every tensor inside the data
    region, no two sharing a byte, every type one vxc decodes (the rest refused together, by name)."""
    from gguf import GGML_QUANT_SIZES

    from .ggml import ENCODINGS

    rel = rel or str(path)
    try:
        size = path.stat().st_size
        reader = _reader(path)
    except OSError as e:
        raise GGUFError(f"{rel}: cannot read: {e.strerror}") from None
    except Exception as e:  # the gguf package raises ValueError / struct.error / numpy errors on a corrupt file
        why = (f"it has GGUF's magic, but its header is cut short or corrupt ({size} bytes)" if is_gguf(path)
               else "no GGUF magic")
        raise GGUFError(f"{rel}: not a readable GGUF file: {why} ({type(e).__name__}: {str(e)[:200]})") from None
    data_start = int(reader.data_offset)
    if not 0 < data_start <= size:
        raise GGUFError(f"{rel}: data region starts at byte {data_start}, past the end of the file ({size} bytes)")
    entries: dict[str, Entry] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        tname = t.tensor_type.name
        ne = [int(x) for x in t.shape]  # ggml order: ne[0] is the contiguous (innermost) dimension
        start = int(t.data_offset) - data_start
        end = start + int(t.n_bytes)
        if t.name in entries:
            raise GGUFError(f"{rel}: tensor {t.name!r} is listed twice")
        if tname in PLAIN:
            dtype, enc, shape = PLAIN[tname], None, tuple(reversed(ne))
        elif tname.lower() in ENCODINGS:
            enc = tname.lower()
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            if ne[0] % block:
                raise GGUFError(f"{rel}: tensor {t.name!r} {tname}: row length {ne[0]} is not a multiple of the block size {block}")
            dtype, shape = "u8", tuple(reversed(ne[1:])) + (ne[0] // block * type_size,)
        else:
            unknown.append(f"  {t.name}: ggml type {tname}")
            continue
        entries[t.name] = Entry(t.name, tname, dtype, shape, enc, start, end)
    if unknown:
        known = ", ".join(sorted(PLAIN) + sorted(e.upper() for e in ENCODINGS))
        raise GGUFError(f"{rel}: {len(unknown)} tensor(s) of a type vxc does not decode (it decodes {known}):\n" + "\n".join(unknown))
    end, prev = 0, None
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start < end:
            raise GGUFError(f"{rel}: tensor {e.name!r} at data bytes {e.start}..{e.end} overlaps {prev!r} (which ends at {end})")
        if data_start + e.end > size:
            raise GGUFError(f"{rel}: tensor {e.name!r} lies outside the file (data bytes {e.start}..{e.end}, "
                            f"file {size} bytes): truncated file")
        end, prev = e.end, e.name
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(data_start)).hexdigest()
    metadata = {}
    if with_metadata:
        for k, field in reader.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                metadata[k] = _value(field)
            except Exception as e:
                raise GGUFError(f"{rel}: metadata {k!r} is unreadable ({e})") from None
    return Container(path, size, data_start, digest, metadata, entries)


_reader = reader  # ``parse`` has a local named ``reader``
