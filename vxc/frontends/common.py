"""What every frontend shares: config and safetensors-header reading, the
builder that turns classified tensors into IR tables, and frontend errors.

Reads only JSON: config.json, safetensors headers, the shard index. Never
imports torch and never touches tensor data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ir.diagnostics import VxcError
from ..ir.module import (
    SAFETENSORS_DTYPES, BankPart, Fact, FileEntry, IndexEntry, Layer, Module, Op, Operand, Source,
    Tensor, Transform,
)
from ..ir.roles import Role
from ..ir.views import ViewError, view_shape

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024
MAX_CONFIG_INT = 2**31 - 1  # no dimension, count, id or position of a model is larger
MAX_LAYERS = 1 << 14  # far past any model (the largest have ~128); a layer count is iterated, so it is bounded first


def _short(v: int) -> str:
    t = str(v)
    return t if len(t) <= 24 else f"{t[:8]}...({len(t)} digits)"


class FrontendError(VxcError):
    """The model directory cannot be lowered: one clear message."""


@dataclass
class Stored:
    file: str  # file symbol
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    files: list[FileEntry]
    tensors: dict[str, Stored]  # key -> stored tensor
    index: IndexEntry | None = None


def read_config(model_dir: Path) -> tuple[dict[str, Any], str]:
    if not model_dir.exists():
        raise FrontendError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        try:
            with open(model_dir, "rb") as f:
                head = f.read(4)
        except OSError:
            head = None
        if head is None:
            raise FrontendError(f"{model_dir} is not a directory")
        # a file: the one other input vxc lowers is a GGUF file, known by its magic (registry: is_gguf)
        raise FrontendError(f"{model_dir} is not a directory (a model directory: config.json and safetensors) nor a "
                            f"GGUF file (one starts with the bytes b'GGUF'; this file starts {head!r})")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FrontendError(f"{model_dir}: no config.json")
    raw = path.read_bytes()
    try:
        cfg = json.loads(raw)  # accepts bare Infinity / NaN, as some dialects write them
    except (ValueError, UnicodeDecodeError) as e:
        raise FrontendError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise FrontendError(f"{path}: expected a JSON object")
    return _decode_floats(cfg), hashlib.sha256(raw).hexdigest()


def _decode_floats(obj: Any) -> Any:
    """transformers writes non-finite floats as {"__float__": "Infinity"}."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(obj["__float__"].replace("Infinity", "inf"))
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _read_header(path: Path, rel: str) -> tuple[dict[str, Any], int, str]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FrontendError(f"{rel}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise FrontendError(f"{rel}: truncated or corrupt safetensors header (declares {n} header bytes, file has {size})")
            blob = f.read(n)
    except OSError as e:
        raise FrontendError(f"{rel}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(blob)
    except (ValueError, UnicodeDecodeError):
        raise FrontendError(f"{rel}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise FrontendError(f"{rel}: safetensors header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise FrontendError(f"{rel}: safetensors header __metadata__ must map strings to strings")
            continue
        dtype, shape, offsets = _header_entry(rel, key, entry)
        a, b = offsets
        if not (a <= b <= data_len):
            raise FrontendError(f"{rel}: tensor {key!r} lies outside the file (offsets {a}..{b}, data region {data_len} bytes): truncated file")
        nbytes = math.prod(shape) * _ITEMSIZE[SAFETENSORS_DTYPES[dtype]]
        if b - a != nbytes:
            raise FrontendError(f"{rel}: tensor {key!r} {dtype}{list(shape)} needs {nbytes} bytes, header gives {b - a}")
        spans.append((a, b, key))
    # as the safetensors library does: the tensors tile the data region exactly, in offset order -- no two share
    # a byte (an overlap would alias two weights) and no byte lies between or after them
    end, prev = 0, None
    for a, b, key in sorted(spans):
        if a != end:
            what = (f"overlaps {prev!r} (which ends at byte {end})" if a < end
                    else f"leaves a gap of {a - end} bytes after {prev!r}" if prev else f"leaves {a} bytes unused before it")
            raise FrontendError(f"{rel}: tensor {key!r} at data offsets {a}..{b} {what}: invalid offsets (the safetensors format requires the tensors to tile the data region)")
        end, prev = b, key
    if end != data_len:
        raise FrontendError(f"{rel}: the tensors end at data byte {end} but the data region holds {data_len} bytes: invalid offsets (trailing bytes)")
    return header, size, hashlib.sha256(blob).hexdigest()


def _header_entry(rel: str, key: str, entry: Any) -> tuple[str, list[int], tuple[int, int]]:
    """One header entry's fields, type-checked: a safetensors header problem is named against its file."""
    def bad(why: str):
        return FrontendError(f"{rel}: safetensors header entry {key!r}: {why}")

    if not isinstance(entry, dict):
        raise bad("not a JSON object")
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in entry]
    if missing:
        raise bad(f"no {', '.join(missing)} field")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in SAFETENSORS_DTYPES:
        raise FrontendError(f"{rel}: tensor {key!r} has unsupported dtype {dtype}")
    _int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    if not isinstance(shape, list) or not all(_int(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if len(shape) > 16 or math.prod(shape) > 1 << 48:
        raise bad(f"shape {shape} is too large to be stored")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(v) for v in offsets):
        raise bad(f"data_offsets {offsets!r} is not a pair of non-negative integers")
    return dtype, shape, (offsets[0], offsets[1])


from ..ir.module import DTYPES as _ITEMSIZE  # noqa: E402


def _inside(model_dir: Path, rel: str) -> Path:
    """``rel`` as a path under ``model_dir``, judged lexically: the entry itself must lie in the directory, while
    the file there may be a symlink to one elsewhere (the Hugging Face cache links snapshots/<rev>/NAME to
    ../../blobs/<sha>)."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
        raise FrontendError(f"{INDEX_NAME} names {rel!r}, a path outside the model directory")
    return model_dir / norm


def read_checkpoint(model_dir: Path) -> Checkpoint:
    index_path = model_dir / INDEX_NAME
    index = None
    if index_path.is_file():
        raw = index_path.read_bytes()
        try:
            wm = json.loads(raw)["weight_map"]
            assert isinstance(wm, dict)
        except Exception:
            raise FrontendError(f"{INDEX_NAME}: not a valid index (no weight_map object)") from None
        index = IndexEntry(INDEX_NAME, len(raw), hashlib.sha256(raw).hexdigest())
        names = sorted(set(wm.values()), key=natural_key)
        for n in names:
            if not _inside(model_dir, n).is_file():
                raise FrontendError(f"{INDEX_NAME} names shard {n!r}, which does not exist")
    else:
        names = sorted((p.name for p in model_dir.glob("*.safetensors")), key=natural_key)
        wm = None
        if not names:
            raise FrontendError(f"{model_dir}: no *.safetensors file and no {INDEX_NAME}")
    files, tensors = [], {}
    for i, name in enumerate(names):
        sym = f"w{i}"
        header, size, digest = _read_header(_inside(model_dir, name), name)
        files.append(FileEntry(sym, name, size, digest))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if wm is not None and wm.get(key) != name:
                raise FrontendError(f"{name}: tensor {key!r} is not mapped to this shard by {INDEX_NAME}")
            if key in tensors:
                raise FrontendError(f"tensor {key!r} is stored twice")
            tensors[key] = Stored(sym, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]))
    if wm is not None:
        missing = sorted(set(wm) - set(tensors), key=natural_key)
        if missing:
            raise FrontendError(f"{INDEX_NAME} maps {len(missing)} tensor(s) that no shard holds, e.g. {missing[0]!r}")
    return Checkpoint(files, tensors, index)


def natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


class Builder:
    """Collects the tables of one module while a frontend classifies tensors."""

    def __init__(self, model_dir: Path, frontend: str, dialect: str, config_sha: str, relative_to: Path | None,
                 ckpt: Checkpoint | None = None):
        self.model_dir = model_dir
        self.ckpt = ckpt if ckpt is not None else read_checkpoint(model_dir)  # given: a container read elsewhere (GGUF)
        rel = os.path.relpath(model_dir.resolve(), (relative_to or Path.cwd()).resolve())
        self.source = Source(frontend, dialect, rel, config_sha)
        self.facts: list[Fact] = []
        self._tsym: dict[str, str] = {}
        self.tensors: list[Tensor] = []
        for i, key in enumerate(sorted(self.ckpt.tensors, key=natural_key)):
            st = self.ckpt.tensors[key]
            sym = f"t{i}"
            self._tsym[key] = sym
            self.tensors.append(Tensor(sym, st.dtype, st.shape, key, file=st.file))
        self.operands: list[Operand] = []
        self._osyms: set[str] = set()
        self._banked: set[str] = set()  # keys folded into a bank entry
        self._banks: list[Tensor] = []

    def has(self, key: str) -> bool:
        return key in self.ckpt.tensors

    def shape(self, key: str) -> tuple[int, ...] | None:
        st = self.ckpt.tensors.get(key)
        return st.shape if st else None

    def fact(self, name: str, value: Any, evidence: str) -> None:
        self.facts.append(Fact(name, value, evidence))

    def _sym(self, layer: int | None, role: Role) -> str:
        base = f"l{layer}.{role}" if layer is not None else str(role)
        sym, n = base, 1
        while sym in self._osyms:
            sym, n = f"{base}.{n}", n + 1
        self._osyms.add(sym)
        return sym

    def bind(self, key: str, role: Role, layer: int | None = None, transforms: list[Transform] | None = None) -> bool:
        """Bind the stored tensor ``key`` (through a view) to ``role``; absent keys bind nothing."""
        st = self.ckpt.tensors.get(key)
        if st is None:
            return False
        xs = list(transforms or [])
        try:
            shape = view_shape(st.shape, xs)
        except ViewError:
            shape, xs = st.shape, []  # the bind pass reports the broken contract on the stored shape
        self.operands.append(Operand(self._sym(layer, role), st.dtype, shape, [self._tsym[key]], role, layer, transforms=xs))
        return True

    def bind_reshaped(self, key: str, role: Role, layer: int | None, shape: tuple[int, ...]) -> bool:
        """Bind with a reshape view when the stored shape differs (e.g. conv [C,1,k] → [C,k])."""
        st = self.ckpt.tensors.get(key)
        if st is None:
            return False
        xs = [] if st.shape == shape or math.prod(st.shape) != math.prod(shape) else [Transform("reshape", shape=shape)]
        return self.bind(key, role, layer, xs)

    def bank(self, template: str, experts: int) -> str | None:
        """Fold per-expert keys ``template.format(e=0..experts-1)`` into one bank tensor entry.

        Returns the bank's tensor symbol, or None when any expert's key is missing or the
        experts disagree in dtype/shape (then the keys stay individual, and closure names them).
        """
        keys = [template.replace("{e}", str(e)) for e in range(experts)]
        st = [self.ckpt.tensors.get(k) for k in keys]
        if any(x is None for x in st) or len({(x.dtype, x.shape) for x in st}) != 1:
            return None
        parts: list[BankPart] = []
        for e, x in enumerate(st):
            if parts and parts[-1].file == x.file and parts[-1].last == e - 1:
                parts[-1].last = e
            else:
                parts.append(BankPart(x.file, e, e))
        sym = f"b{len(self._banks)}"
        self._banks.append(Tensor(sym, st[0].dtype, st[0].shape, template, experts=experts, parts=parts))
        self._banked.update(keys)
        self._tsym[template] = sym
        return sym

    def bind_bank(self, template: str, experts: int, role: Role, layer: int | None,
                  transforms: list[Transform] | None = None) -> bool:
        """Bind a role for all experts at once to a templated family of per-expert keys."""
        sym = self._tsym.get(template) or self.bank(template, experts)
        if sym is None:
            return False
        t = next(b for b in self._banks if b.sym == sym)
        xs = list(transforms or [])
        try:
            shape = view_shape(t.stored_shape, xs)
        except ViewError:
            shape, xs = t.stored_shape, []
        self.operands.append(Operand(self._sym(layer, role), t.dtype, shape, [sym], role, layer, transforms=xs))
        return True

    def bind_encoded(self, encoding: str, parts: dict[str, str], role: Role, layer: int | None,
                     transforms: list[Transform] | None = None, dtype: str = "bf16") -> bool:
        """Bind a role to an encoded operand made of several stored tensors (e.g. mxfp4 blocks + scales)."""
        from ..ir.views import encoded_shape

        syms, shapes = [], {}
        for name, key in parts.items():
            if key not in self._tsym:
                return False
            syms.append(self._tsym[key])
            shapes[name] = self.ckpt.tensors[key].shape if key in self.ckpt.tensors else None
        xs = list(transforms or [])
        try:
            shape = view_shape(encoded_shape(encoding, shapes), xs)
        except (ViewError, TypeError, KeyError):
            shape, xs = self.ckpt.tensors[next(iter(parts.values()))].shape, []
        # dtype: the precision the encoded weights decode to (mxfp4: bf16; ggml blocks: f32)
        self.operands.append(Operand(self._sym(layer, role), dtype, shape, syms, role, layer, encoding=encoding,
                                     part_names=list(parts), transforms=xs))
        return True

    def bind_concat(self, parts: list[tuple[str, str | None, list[Transform]]], dim: int, role: Role, layer: int | None,
                    transforms: list[Transform] | None = None) -> bool:
        """Bind a role to the concatenation along ``dim`` of several stored tensors, each ``(key, encoding or None,
        its transforms)``, then ``transforms`` (``concat DIM (…)``). Binds nothing when a key is absent (closure
        then names the unbound role and the unclaimed tensors)."""
        from ..ir.views import concat_shape, encoded_shape

        ops, shapes = [], []
        if any(self.ckpt.tensors.get(key) is None or key not in self._tsym for key, _, _ in parts):
            return False
        sym = self._sym(layer, role)
        for i, (key, encoding, xs) in enumerate(parts):
            st = self.ckpt.tensors[key]
            base = st.shape if encoding is None else encoded_shape(encoding, {"blocks": st.shape})
            try:
                shape = view_shape(base, list(xs))
            except ViewError:
                shape = base
            shapes.append(shape)
            ops.append(Operand(f"{sym}#{i}", "f32" if encoding else st.dtype, shape, [self._tsym[key]], role,
                               layer, encoding=encoding, part_names=["blocks"] if encoding else [], transforms=list(xs)))
        xs = list(transforms or [])
        try:
            shape = view_shape(concat_shape(shapes, dim), xs)
        except ViewError:  # the bind pass reports it
            shape = shapes[0]
        dtypes = {o.dtype for o in ops}
        self.operands.append(Operand(sym, dtypes.pop() if len(dtypes) == 1 else "f32", shape,
                                     [s for o in ops for s in o.sources], role, layer, transforms=xs, concat_dim=dim,
                                     parts=[Operand(o.sym, o.dtype, (), o.sources, role, layer, encoding=o.encoding,
                                                    part_names=o.part_names, transforms=o.transforms) for o in ops]))
        return True

    def module(self, name: str, compute: str, embedding: Op, layers: list[Layer], final_norm: Op, head: Op) -> Module:
        tensors = [t for t in self.tensors if t.key not in self._banked] + self._banks
        return Module(
            name=name, source=self.source, compute=compute, files=self.ckpt.files, tensors=tensors,
            operands=self.operands, embedding=embedding, layers=layers, final_norm=final_norm, head=head,
            facts=self.facts, index=self.ckpt.index,
        )


def op(kind: str, attrs: dict[str, Any], defaults: set[str] | None = None, role: Role | None = None) -> Op:
    return Op(kind, attrs, set(defaults or ()), role=role)


class ConfigError(FrontendError):
    """A config value is missing, or of the wrong type or form: a named refusal that names the key."""


_KINDS: dict[type, str] = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                           list: "a list", dict: "a JSON object"}


class Attrs:
    """The one way a frontend reads config.json: required keys, typed reads, family defaults.

    Keys may be dotted (``"linear_attn_config.head_dim"``: a key of a nested object; a non-object on
    the way reads as absent). Several keys in one call are alternative spellings of one fact (a
    dialect's name and another's): the first one set (not null) is read. ``kind`` (int, float, bool,
    str, list, dict, or ``list[int]`` / ``list[float]`` checking each item) checks the value's type — a
    float read returns ``float(value)``, a bool read takes 0 / 1 as false / true, every other read the
    value itself — and ``min`` a lower bound; either failure is a :class:`ConfigError` naming the key.
    Values filled from a default are recorded in ``filled`` (under the first key) so the frontend marks
    the attribute ``(default)``.
    """

    def __init__(self, cfg: dict[str, Any], where: str, defaults: dict[str, Any] | None = None, prefix: str = ""):
        self.cfg, self.where, self.prefix = cfg, where, prefix  # prefix: how messages name a nested object's keys
        self.defaults = defaults or {}
        self.filled: set[str] = set()  # keys whose value was filled from a default

    def _lookup(self, key: str) -> tuple[bool, Any]:
        """(present, value) — present even when the value is null."""
        node: Any = self.cfg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def __contains__(self, key: str) -> bool:
        """The config spells ``key`` (even as null)."""
        return self._lookup(key)[0]

    def raw(self, key: str) -> Any:
        """The value as written (None when absent or null), unchecked: for dialect markers and presence tests."""
        return self._lookup(key)[1]

    def which(self, *keys: str) -> str | None:
        """The first of ``keys`` the config sets (not null)."""
        return next((k for k in keys if self._lookup(k)[1] is not None), None)

    def check(self, key: str, value: Any, kind: Any = None, min: int | float | None = None, max: int | None = None) -> Any:
        """``value`` (read from ``key``) checked against ``kind``, ``min`` and ``max`` (``list[int]``: each item
        too). Every integer is at most :data:`MAX_CONFIG_INT` in magnitude: no size, count or id of a model is
        larger, and a bound read from input must be refused before anything is sized or iterated by it."""
        if getattr(kind, "__origin__", None) is list:
            (item,) = kind.__args__
            return [self.check(f"{key}[{j}]", x, item, min, max) for j, x in enumerate(self.check(key, value, list))]
        if kind is bool and type(value) is int and value in (0, 1):
            value = bool(value)  # a flag written 0 / 1
        if kind is not None:
            ok = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
            if not ok:
                raise ConfigError(f"{self.where}: cannot read this config: {self.prefix}{key}={value!r} is not {_KINDS[kind]}")
            if kind is float:
                value = float(value)
        if min is not None and value < min:
            raise ConfigError(f"{self.where}: cannot read this config: {self.prefix}{key}={value!r} must be >= {min}")
        if kind is int:
            limit = MAX_CONFIG_INT if max is None else max
            if abs(value) > limit:
                raise ConfigError(f"{self.where}: cannot read this config: {self.prefix}{key}={_short(value)} is out of range "
                                  f"(at most {limit})")
        return value

    def layers(self, *keys: str) -> int:
        """The layer count: a required integer in 0..MAX_LAYERS (checked before any layer is built)."""
        return self.need(*keys, kind=int, min=0, max=MAX_LAYERS)

    def opt(self, *keys: str, kind: Any = None, min: int | float | None = None) -> Any:
        """The first of ``keys`` set, checked; None when none is set (and nothing is recorded)."""
        k = self.which(*keys)
        return None if k is None else self.check(k, self.raw(k), kind, min)

    def need(self, *keys: str, kind: Any = None, min: int | float | None = None, max: int | None = None) -> Any:
        """The first of ``keys`` set, checked; refuses when none is set."""
        k = self.which(*keys)
        if k is None:
            raise ConfigError(f"{self.where}: config.json lacks required key {' / '.join(repr(self.prefix + k) for k in keys)}")
        return self.check(k, self.raw(k), kind, min, max)

    def get(self, *keys: str, default: Any, kind: Any = None, min: int | float | None = None) -> tuple[Any, bool]:
        """(value, filled_by_default) for the first of ``keys`` set; a fill is recorded under ``keys[0]``."""
        k = self.which(*keys)
        if k is None:
            self.filled.add(keys[0])
            return default, True
        return self.check(k, self.raw(k), kind, min), False

    def take(self, key: str, kind: Any = None, min: int | float | None = None) -> Any:
        """The config value, or the family default for ``key`` (from ``defaults``) — recorded in ``filled``."""
        return self.get(key, default=self.defaults[key], kind=kind, min=min)[0]


def compute_dtype(A: Attrs, b: Builder, embedding_key: str | None) -> str:
    """The config's dtype (either spelling), else the embedding's stored dtype, else f32."""
    name = A.raw("dtype") or A.raw("torch_dtype")
    table = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
    if isinstance(name, str) and name in table:
        return table[name]
    if embedding_key and b.has(embedding_key):
        return b.ckpt.tensors[embedding_key].dtype
    return "f32"


def pad_to(n: int, multiple: int) -> int:
    return n if multiple <= 1 else (n + multiple - 1) // multiple * multiple


__all__ = [
    "Attrs", "BankPart", "Builder", "Checkpoint", "ConfigError", "FrontendError", "compute_dtype", "op", "pad_to",
    "read_checkpoint", "read_config", "natural_key",
]
