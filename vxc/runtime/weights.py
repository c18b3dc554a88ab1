"""Weights: the safetensors files an IR names, opened by mmap.

Before any tensor is used, each file's size and header digest are checked
against the IR. Operand views (slice, gather, reshape, transpose, banks,
encodings) are applied at load time. On CPU a tensor that needs no view and no
dtype change is read with file I/O into private memory (``resident``), backed
by 2 MiB pages where it spans at least one (a decode step streams every weight
byte, and 4 KiB pages of a file mapping cost it ~10 % in TLB misses);
ggml-encoded blocks stay zero-copy views of the mapping (their packed copies
replace their pages, ``drop_pages``).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import weakref
from pathlib import Path

import torch

from ..ir.diagnostics import VxcError
from ..ir.module import Module, Operand

TORCH_DTYPES = {
    "f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool,
    "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2,
}


class WeightError(VxcError):
    pass


# the address ranges of the live read-only private file mappings (MappedFile), for drop_pages
_MAPPED: dict[int, tuple[int, int]] = {}
_PAGE = 4096
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise(addr: int, length: int, advice: int) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(addr, length, advice) == 0


def hugepage_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` for a resident weight: from 2 MiB on, 2 MiB-aligned and
    advised ``MADV_HUGEPAGE`` before its first touch (Linux), so transparent huge pages back it where the kernel
    allows them (``/sys/kernel/mm/transparent_hugepage/enabled`` ``madvise`` or ``always``; elsewhere the advice
    is refused and the memory is plain). The alignment slack (< 2 MiB of address space) is never touched, so it
    is never resident."""
    import sys

    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = (-buf.data_ptr()) % HUGE_PAGE
    view = buf[off:off + nbytes]
    _madvise(view.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return view


POOL_CHUNK = 32 << 20  # bytes per shared chunk of resident_empty's small allocations
_POOL_ALIGN = 64
_pool_lock = threading.Lock()
_pool: dict = {"chunk": None, "off": 0, "old": []}  # old: [weak reference to a full chunk's root, its offset, used]


def resident_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor for memory that lives as long as the model (a weight read into memory, a
    packed copy): from 2 MiB on its own ``hugepage_empty``; smaller ones are carved (64-byte aligned) from a
    shared ``POOL_CHUNK`` that is itself a ``hugepage_empty``, so a model's many small matrices (a 4-bit
    1024 x 3072 layer packs to 1.7 MB) sit in 2 MiB pages too (a 0.6B-parameter q4_0 decode: ~100 -> ~109 tok/s,
    interleaved A/B). A chunk is freed when the last tensor carved from it is: never use it for scratch."""
    if nbytes >= HUGE_PAGE:
        return hugepage_empty(nbytes)
    need = max(1, (nbytes + _POOL_ALIGN - 1) // _POOL_ALIGN * _POOL_ALIGN)
    with _pool_lock:
        if _pool["chunk"] is None or _pool["off"] + need > POOL_CHUNK:
            # a tensor that fits in the rest of the last touched huge page of an earlier chunk still alive goes
            # there (that page is resident whole); those chunks are held weakly, the newest one strongly. Each
            # chunk left behind otherwise kept its last page partly empty: a 0.6B-shape q4_0 file's packed copies
            # took 9.3 MiB more RSS than their bytes ((RSS after load - pre-load - state) / file 1.074 -> 1.057,
            # peak 1.105-1.125 -> 1.088-1.090; a Q4_K_M file, Gemma 3 270M, SmolLM2 135M and the 780M SSM level)
            for ent in list(_pool["old"]):
                root = ent[0]()
                if root is None:
                    _pool["old"].remove(ent)
                elif need <= -ent[2] % HUGE_PAGE:
                    off = ent[1] + ent[2]
                    ent[2] += need
                    return root[off:off + nbytes]
            if _pool["chunk"] is not None:
                c = _pool["chunk"]
                root = c._base if c._base is not None else c
                _pool["old"].append([weakref.ref(root), c.data_ptr() - root.data_ptr(), _pool["off"]])
            _pool["chunk"], _pool["off"] = hugepage_empty(POOL_CHUNK), 0
        off = _pool["off"]
        _pool["off"] = off + need
        return _pool["chunk"][off:off + nbytes]


def in_file_mapping(t: torch.Tensor) -> bool:
    """Whether ``t`` lies wholly inside a live weights file's private mapping (a zero-copy view of the file)."""
    if t.numel() == 0:
        return False
    a = t.data_ptr()
    b = a + t.numel() * t.element_size()
    return any(lo <= a and b <= hi for lo, hi in list(_MAPPED.values()))


def drop_pages(t: torch.Tensor) -> int:
    """Release the resident pages under ``t`` when it is a view of a weights file's mapping (never written:
    ``madvise(MADV_DONTNEED)`` drops them, a later read faults them in again from the file); anything else is
    left alone. For a matrix whose only reader now is a packed copy (``quant``'s int8 kernels): its bytes stop
    counting twice. Returns the bytes released."""
    import sys

    if not sys.platform.startswith("linux") or t.numel() == 0:
        return 0
    if not in_file_mapping(t):
        return 0
    a = t.data_ptr()
    b = a + t.numel() * t.element_size()
    lo, hi = (a + _PAGE - 1) // _PAGE * _PAGE, b // _PAGE * _PAGE  # whole pages inside the tensor only
    if hi <= lo:
        return 0
    return hi - lo if _madvise(lo, hi - lo, 4) else 0  # 4: MADV_DONTNEED


class MappedFile:
    """One weights file (safetensors, or GGUF: ``format`` as the IR records it), mapped privately; tensors are
    looked up by key in its header."""

    def __init__(self, path: Path, size: int, digest: str, sym: str, format: str = "safetensors"):
        if not path.is_file():
            raise WeightError(f"weights file @{sym} {path} does not exist (use --model-dir to point at the checkpoint)")
        actual = path.stat().st_size
        if actual != size:
            raise WeightError(f"weights file {path}: size {actual} bytes, the IR recorded {size}; refusing to run on a different checkpoint")
        if format == "gguf":
            from ..ir.gguf_container import GGUFError, read, slim

            try:
                c = read(path, with_metadata=False)
            except GGUFError as e:
                raise WeightError(str(e)) from None
            # the engine reads only the tensor table from here on: the header's vocabulary arrays (read back on
            # demand) need not be resident while the weights are packed, the load's peak
            slim()
            got, self.data_start = c.header_sha256, c.data_start
            self.entries = {e.name: ((e.start, e.end), TORCH_DTYPES[e.dtype], list(e.shape)) for e in c.entries.values()}
        elif format == "safetensors":
            from ..ir.module import SAFETENSORS_DTYPES

            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                blob = f.read(n)
            got, self.data_start = hashlib.sha256(blob).hexdigest(), 8 + n
            header = json.loads(blob) if got == digest else {}
            self.entries = {k: (tuple(e["data_offsets"]), TORCH_DTYPES[SAFETENSORS_DTYPES[e["dtype"]]], e["shape"])
                            for k, e in header.items() if k != "__metadata__"}
        else:
            raise WeightError(f"weights file @{sym} {path}: unknown file format {format!r}")
        if got != digest:
            raise WeightError(f"weights file {path}: header sha256 differs from the IR's; refusing to run on a different checkpoint")
        self.path = path
        self.bytes_sliced = 0  # bytes read by read_slice (tensor parallelism's parts)
        self.bytes = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # private mmap, paged lazily
        _MAPPED[id(self)] = (self.bytes.data_ptr(), self.bytes.data_ptr() + size)
        weakref.finalize(self, _MAPPED.pop, id(self), None)

    def _entry(self, key: str):
        e = self.entries.get(key)
        if e is None:
            raise WeightError(f"tensor {key!r} is not in this file")
        return e

    def tensor(self, key: str) -> torch.Tensor:
        """A zero-copy view of the mapping."""
        (a, b), dt, shape = self._entry(key)
        raw = self.bytes[self.data_start + a:self.data_start + b]
        return raw.view(dt).reshape(shape) if b > a else torch.empty(shape, dtype=dt)

    def read_slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``[start, stop)`` of dim ``dim`` of a stored tensor, read with plain file I/O: only those bytes (one
        contiguous run per index of the dims before ``dim``), into a private copy (tensor parallelism: a rank
        reads its part of an operand, never the whole)."""
        (a, b), dt, shape = self._entry(key)
        if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
            raise WeightError(f"tensor {key!r} {list(shape)}: no slice [{start}:{stop}] of dim {dim}")
        item = torch.empty((), dtype=dt).element_size()
        inner = math.prod(shape[dim + 1:]) * item
        outer = math.prod(shape[:dim])
        run, stride = (stop - start) * inner, shape[dim] * inner
        part = [*shape[:dim], stop - start, *shape[dim + 1:]]
        buf = torch.empty(outer * run, dtype=torch.uint8)
        if run:
            view = memoryview(buf.numpy())
            with open(self.path, "rb") as f:
                for i in range(outer):
                    f.seek(self.data_start + a + i * stride + start * inner)
                    if f.readinto(view[i * run:(i + 1) * run]) != run:
                        raise WeightError(f"{self.path}: tensor {key!r} is cut short")
        self.bytes_sliced += outer * run
        return buf.view(dt).reshape(part) if run else torch.empty(part, dtype=dt)

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A private copy read with plain file I/O (used when the tensor is converted or stacked anyway, so the
        mapping's pages never become resident and peak memory stays at the copy's size); into ``out`` (a
        contiguous tensor of the entry's dtype and shape) when given."""
        (a, b), dt, shape = self._entry(key)
        if out is not None and (out.dtype != dt or list(out.shape) != list(shape) or not out.is_contiguous()):
            raise WeightError(f"tensor {key!r} is {dt}{list(shape)}, not {out.dtype}{list(out.shape)}")
        buf = hugepage_empty(b - a) if out is None else out.view(-1).view(torch.uint8)
        if b > a:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + a)
                if f.readinto(memoryview(buf.numpy())) != b - a:
                    raise WeightError(f"{self.path}: tensor {key!r} is cut short")
        if out is not None:
            return out
        return buf.view(dt).reshape(shape) if b > a else torch.empty(shape, dtype=dt)


class Weights:
    def __init__(self, m: Module, model_dir: Path):
        self.module = m
        self.files = {f.sym: MappedFile(model_dir / f.path, f.size, f.header_sha256, f.sym, f.format) for f in m.files}
        self.tensors = m.tensor_table()
        self.bytes_sliced = 0  # bytes of expert-bank parts (tensor parallelism); file parts count in the files
        self._resident: dict[str, torch.Tensor] = {}  # stored tensors read into memory, by symbol (tied operands share)

    def sliced_bytes(self) -> int:
        """Bytes read for tensor-parallel parts (tests check they are the parts' bytes, not the whole tensors')."""
        return self.bytes_sliced + sum(f.bytes_sliced for f in self.files.values())

    def stored(self, sym: str, copy: bool = False, resident: bool = False) -> torch.Tensor:
        """A stored tensor: a zero-copy view of the mapping; a private copy (``copy``); or (``resident``) the one
        private copy all operands reading ``sym`` share, in 2 MiB pages from ``HUGE_PAGE`` bytes on. Small ones
        (norms, biases) are copied too: the page cache may hold a file in large folios, and a fault on one page of
        the mapping can map the whole folio — touching a 4 KiB norm at every step kept ~1 MB of the neighbouring
        packed matrix's pages resident (~145 MB over a 0.4 GB q4_k_m file)."""
        from .views import check_bank

        t = self.tensors[sym]
        if not t.is_bank:
            f = self.files[t.file]
            if resident and not copy:
                got = self._resident.get(sym)
                if got is None:
                    (a, b), dt, shape = f._entry(t.key)
                    got = resident_empty(b - a).view(dt).reshape(shape) if b > a else f.tensor(t.key)
                    got = self._resident[sym] = f.read(t.key, out=got) if b > a else got
                return got
            return f.read(t.key) if copy else f.tensor(t.key)
        # a bank is stacked into one [experts, ...] tensor, a copy either way: each expert is read with file
        # I/O straight into its slot, so the mapping's pages never become resident next to the copy
        keys = list(t.keys())
        views = [self.files[f].tensor(k) for f, k in keys]  # (views of the mapping: shapes, dtypes, no reads)
        check_bank(views)
        n = len(keys) * views[0].numel() * views[0].element_size()
        bank = hugepage_empty(n).view(views[0].dtype).reshape(len(keys), *views[0].shape)
        for i, (f, k) in enumerate(keys):
            self.files[f].read(k, out=bank[i])
        return bank

    def sliced(self, sym: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``[start, stop)`` of dim ``dim`` of a stored tensor (of a bank: dim 0 picks experts), reading only it."""
        t = self.tensors[sym]
        if not t.is_bank:
            return self.files[t.file].read_slice(t.key, dim, start, stop)
        keys = list(t.keys())
        if dim == 0:  # whole experts: each read alone
            parts = [self.files[f].read(k) for f, k in keys[start:stop]]
            self.bytes_sliced += sum(x.numel() * x.element_size() for x in parts)
        else:  # (counted by the files)
            parts = [self.files[f].read_slice(k, dim - 1, start, stop) for f, k in keys]
        return torch.stack(parts) if parts else torch.empty((0, *t.shape))

    def _rows(self, sym: str, dim: int, rows: torch.Tensor) -> torch.Tensor:
        """Indices ``rows`` (in order) of dim ``dim`` of a stored tensor, reading only the distinct ones, one run of
        consecutive indices at a time."""
        distinct = torch.unique(rows)  # sorted
        cuts = [0, *((distinct[1:] - distinct[:-1]) != 1).nonzero().flatten().add(1).tolist(), len(distinct)]
        runs = [(int(distinct[a]), int(distinct[b - 1]) + 1) for a, b in zip(cuts, cuts[1:]) if b > a]
        x = torch.cat([self.sliced(sym, dim, a, b) for a, b in runs], dim)
        pick = torch.searchsorted(distinct, rows)
        return x if torch.equal(pick, torch.arange(len(distinct))) else x.index_select(dim, pick)

    def operand(self, o: Operand, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
        from .views import apply_view, decode_mxfp4

        part = o.shard if o.shard is not None and o.shard.dim is not None else None
        if o.parts:
            return self._concat(o, part, dtype, device)
        stored = self.tensors[o.sources[0]].stored_shape
        rows = (_rows_through(stored, o.transforms, part.dim) if part is not None and o.encoding is None else None)
        merged = (_merged_spans(stored, o.transforms, part) if part is not None and o.encoding is None and rows is None
                  else None)
        if merged is not None:
            # a reshape whose first dim merges the stored tensor's leading dims (a gated norm's weight stored
            # [groups, channels / groups], used [channels]): ranges on whole leading blocks are ranges of stored dim 0
            d, spans = merged
            x = torch.cat([self.sliced(o.sources[0], d, a, b) for a, b in spans], d).reshape(o.shape)
            if dtype is not None and x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            return x.to(device).contiguous()
        if rows is not None:
            # tensor parallelism: this rank's part of a plain operand, read alone (never the whole tensor): the
            # stored indices its ranges reach through the view's slices and gathers of the cut dim, read in
            # contiguous runs, then picked in order; the rest of the view (a reshape of later dims, an elementwise
            # one) applies after
            x = self._rows(o.sources[0], part.dim, torch.cat([rows[a:b] for a, b in part.spans()]))
            x = apply_view(x, [_local_transform(t, part.dim, x.shape[part.dim]) for t in o.transforms
                               if not _indexes(t, part.dim)])
            if tuple(x.shape) != tuple(o.shape):
                raise WeightError(f"operand %{o.sym}: its part reads {list(x.shape)}, the IR declares {list(o.shape)}")
            if dtype is not None and x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            return x.to(device).contiguous()
        if o.encoding is None:
            src = self.tensors[o.sources[0]]
            converts = dtype is not None and src.dtype != _ir_dtype(dtype) and src.dtype.startswith(("f", "bf"))
            x = self.stored(o.sources[0], copy=converts or str(device) != "cpu", resident=str(device) == "cpu")
        elif o.encoding == "mxfp4":
            if part is not None and part.dim == 0 and not o.transforms:
                # tensor parallelism: this rank's experts (dim 0 of the blocks and of the scales alike), read alone
                parts = {n: self.sliced(s, 0, part.start, part.stop) for n, s in zip(o.part_names, o.sources)}
                part = None
            else:
                parts = dict(zip(o.part_names, (self.stored(s) for s in o.sources)))
            x = decode_mxfp4(parts["blocks"], parts["scales"], dtype or torch.bfloat16)
        elif _is_ggml(o.encoding):
            from .ggml_blocks import dequantize

            # decoded to fp32 (ggml's own precision), then to the compute dtype below; under tensor parallelism
            # only this rank's blocks (its part, cut already)
            if part is not None and not o.transforms:
                x = dequantize(o.encoding, self._encoded_part(o, part), torch.float32)
                part = None
            else:
                x = dequantize(o.encoding, self.stored(o.sources[0]), torch.float32)
        else:
            raise WeightError(f"operand %{o.sym}: encoding {o.encoding} has no decoder")
        x = apply_view(x, o.transforms)
        if part is not None:  # a part of an operand under views: the views need the whole stored tensor
            x = torch.cat([x.narrow(part.dim, a, b - a) for a, b in part.spans()], part.dim)
        if tuple(x.shape) != tuple(o.shape):
            raise WeightError(f"operand %{o.sym}: view gives {list(x.shape)}, the IR declares {list(o.shape)}")
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            x = _converted(x, dtype) if str(device) == "cpu" else x.to(dtype)
        x = x.to(device)
        return x if x.is_contiguous() else x.contiguous()

    def _concat(self, o: Operand, part, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
        """A ``concat`` operand: each part read through its own view (an encoded part decoded), the parts joined,
        the operand's transforms applied; under tensor parallelism this rank's part cut from the whole."""
        from dataclasses import replace

        from ..ir.views import operand_shape
        from .views import apply_view

        xs = [self.operand(replace(p, shape=operand_shape(p, self.tensors), shard=None), dtype, "cpu") for p in o.parts]
        if len({x.dtype for x in xs}) > 1:
            xs = [x.float() for x in xs]
        x = apply_view(torch.cat(xs, o.concat_dim), o.transforms)
        del xs
        if part is not None:
            x = torch.cat([x.narrow(part.dim, a, b - a) for a, b in part.spans()], part.dim)
        if tuple(x.shape) != tuple(o.shape):
            raise WeightError(f"operand %{o.sym}: its concatenated parts give {list(x.shape)}, the IR declares {list(o.shape)}")
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            x = x.to(dtype)
        return x.to(device).contiguous()

    def encoded(self, o: Operand, device: torch.device | str) -> torch.Tensor:
        """The stored blocks of a ggml-encoded operand, as stored (u8 [..., rows, row_bytes]; a zero-copy view of
        the mapping on CPU), for the kernels that read the encoding. Under views selecting rows (``selects_rows``:
        the q / gate halves of a fused projection), the selected rows' blocks, copied once into resident memory."""
        from ..ir.views import selects_rows
        from .views import apply_view

        if not _is_ggml(o.encoding or "") or (o.transforms and not selects_rows(o.transforms, len(o.shape))):
            raise WeightError(f"operand %{o.sym}: not a ggml-encoded operand without views, or with views that "
                              f"select rows")
        if o.transforms:
            if o.shard is not None and o.shard.dim is not None:  # (the shard pass refuses encoded views: not reached)
                raise WeightError(f"operand %{o.sym}: a part of an encoded operand under views")
            src = self.stored(o.sources[0])
            x = apply_view(src, o.transforms)
            if str(device) != "cpu":
                return x.contiguous().to(device)
            out = resident_empty(x.numel()).reshape(x.shape).copy_(x)
            drop_pages(src)  # the mapping's pages it read: the copy is what stays resident
            return out
        part = o.shard if o.shard is not None and o.shard.dim is not None else None
        if part is not None:  # tensor parallelism: this rank's blocks (experts, rows or whole blocks of a row) alone
            return self._encoded_part(o, part).to(device)
        x = self.stored(o.sources[0], copy=str(device) != "cpu")
        return x.to(device) if str(device) != "cpu" else x

    def _encoded_part(self, o: Operand, part) -> torch.Tensor:
        """This rank's stored blocks of a ggml-encoded operand (u8 ``[..., rows, row_bytes]``), read alone: a cut of
        an outer dim (experts, rows) is the same cut of the stored bytes; a cut of the row is its whole blocks
        (the shard pass admits only ranges on block boundaries)."""
        from ..ir.ggml import ENCODINGS, row_bytes

        e = ENCODINGS[o.encoding]
        spans = part.spans()
        if part.dim == len(o.shape) - 1:
            if any(a % e.block_size or b % e.block_size for a, b in spans):
                raise WeightError(f"operand %{o.sym}: columns {spans} are not whole {e.block_size}-value blocks")
            spans = [(a // e.block_size * e.type_size, b // e.block_size * e.type_size) for a, b in spans]
        x = torch.cat([self.sliced(o.sources[0], part.dim, a, b) for a, b in spans], part.dim)
        want = (*o.shape[:-1], row_bytes(o.encoding, o.shape[-1]))
        if tuple(x.shape) != want:
            raise WeightError(f"operand %{o.sym}: its part reads {list(x.shape)} bytes, the IR declares {list(o.shape)} "
                              f"({list(want)} bytes of {o.encoding})")
        return x

    def nbytes(self) -> int:
        return sum(math.prod(t.stored_shape) for t in self.tensors.values())


def _converted(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` into resident memory (``resident_empty``: 2 MiB pages)."""
    out = resident_empty(x.numel() * torch.empty((), dtype=dtype).element_size()).view(dtype).reshape(x.shape)
    return out.copy_(x)


def _indexes(t, dim: int) -> bool:
    """Whether a transform picks indices of dim ``dim`` (a slice or gather of it)."""
    return t.kind in ("slice", "gather") and t.dim == dim


def _rows_through(stored: tuple[int, ...], transforms, dim: int) -> torch.Tensor | None:
    """The stored index along ``dim`` of each index of the view's ``dim``, when cutting the view's ``dim`` is picking
    indices of the stored tensor's: every transform a slice or gather of ``dim``, elementwise, or a reshape keeping
    dims ``0..dim`` as they are. None for any other view (a transpose, a reshape merging the cut dim ...)."""
    from dataclasses import replace

    from ..ir.views import reshape_target, view_shape
    from .views import apply_transform

    if dim >= len(stored):
        return None
    shape, rows = tuple(stored), torch.arange(stored[dim])
    for t in transforms:
        if t.kind == "log_neg":
            continue
        if _indexes(t, dim):
            rows = apply_transform(rows, replace(t, dim=0))  # the same view of the index vector
            shape = view_shape(shape, [t])
        elif t.kind == "reshape" and tuple(reshape_target(shape, t.shape)[:dim + 1]) == shape[:dim + 1]:
            shape = tuple(reshape_target(shape, t.shape))
        else:
            return None
    return rows


def _merged_spans(stored: tuple[int, ...], transforms, part) -> tuple[int, list[tuple[int, int]]] | None:
    """``(d, ranges of stored dim d)`` holding ``part`` (dim 0 of the view) when the view is one reshape whose dim 0
    merges the stored leading dims, and every range covers whole blocks of the merged inner dims; d is the first of
    them longer than 1 (a vector stored ``[1, 1, H, 1]``: d = 2); else None."""
    if part.dim != 0 or len(transforms) != 1 or transforms[0].kind != "reshape" or len(stored) < 2:
        return None
    from ..ir.views import reshape_target

    target = tuple(reshape_target(tuple(stored), transforms[0].shape))
    k, inner = 1, 1
    while k < len(stored) and inner * stored[k] <= target[0] // stored[0]:
        inner *= stored[k]
        k += 1
    if stored[0] * inner != target[0] or tuple(target[1:]) != tuple(stored[k:]):
        return None
    d = 0
    while d + 1 < k and stored[d] == 1:  # leading unit dims: the cut falls in the first longer one
        d += 1
        inner //= stored[d]
    if any(a % inner or b % inner for a, b in part.spans()):
        return None
    return d, [(a // inner, b // inner) for a, b in part.spans()]


def _local_transform(t, dim: int, size: int):
    from dataclasses import replace

    return t if t.kind != "reshape" else replace(t, shape=(*t.shape[:dim], size, *t.shape[dim + 1:]))


def _is_ggml(encoding: str) -> bool:
    from ..ir.ggml import is_block_encoded

    return is_block_encoded(encoding)


def _ir_dtype(dt: torch.dtype) -> str:
    for name, t in TORCH_DTYPES.items():
        if t == dt:
            return name
    return str(dt)
