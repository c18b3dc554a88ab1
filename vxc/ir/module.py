"""Module objects of a VINDEX3 IR.

Plain dataclasses; the printer and parser convert them to and from text.
Locations (``loc``) are kept when parsed so diagnostics can point at a line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .roles import Placement, Role

SCHEMA = 6

# stored dtype name -> (IR spelling, bytes per element)
DTYPES: dict[str, int] = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "f8e4m3": 1, "f8e5m2": 1,
    "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1,
}
SAFETENSORS_DTYPES = {
    "F64": "f64", "F32": "f32", "BF16": "bf16", "F16": "f16", "F8_E4M3": "f8e4m3",
    "F8_E5M2": "f8e5m2", "I64": "i64", "I32": "i32", "I16": "i16", "I8": "i8",
    "U8": "u8", "BOOL": "bool",
}


@dataclass(frozen=True)
class Loc:
    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass
class Source:
    frontend: str
    dialect: str
    model_dir: str  # relative to the IR file's directory
    config_sha256: str


@dataclass
class Fact:
    """A fact the frontend settled, with its evidence (recorded, never read by passes)."""

    name: str
    value: Any
    evidence: str


@dataclass
class FileEntry:
    sym: str  # "w0"
    path: str  # relative to the model directory
    size: int
    header_sha256: str
    format: str = "safetensors"  # or "gguf" (vxc.ir.gguf_container)


@dataclass
class IndexEntry:
    path: str
    size: int
    sha256: str


@dataclass
class BankPart:
    file: str
    first: int
    last: int


@dataclass
class Tensor:
    """A stored tensor, or a templated bank of per-expert stored tensors."""

    sym: str
    dtype: str
    shape: tuple[int, ...]  # per-expert shape for banks
    key: str  # for banks: a template holding "{e}"
    file: str | None = None  # single tensor
    experts: int | None = None  # bank
    parts: list[BankPart] = field(default_factory=list)
    loc: Loc | None = None

    @property
    def is_bank(self) -> bool:
        return self.experts is not None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return ((self.experts,) + self.shape) if self.is_bank else self.shape

    def keys(self) -> list[tuple[str, str]]:
        """(file sym, key) of every stored tensor this entry covers."""
        if not self.is_bank:
            return [(self.file, self.key)]
        out = []
        for p in self.parts:
            for e in range(p.first, p.last + 1):
                out.append((p.file, self.key.replace("{e}", str(e))))
        return out


@dataclass
class Transform:
    kind: str  # "slice" | "gather" | "reshape" | "transpose" | "log_neg" (elementwise log(-x))
    dim: int = 0
    start: int = 0  # slice
    stop: int = 0  # slice
    groups: int = 0  # gather
    takes: list[tuple[int, int]] = field(default_factory=list)  # gather: [start, stop) inside each group
    shape: tuple[int, ...] = ()  # reshape
    dim2: int = 0  # transpose


@dataclass
class Shard:
    """One rank's part of an operand under tensor parallelism over ``parts`` ranks (set by the ``shard`` pass):
    ``[start, stop)`` of dim ``dim`` of the operand as declared — or, for a fused operand cut segment by segment,
    the ``ranges`` of that dim, concatenated in order; ``dim`` None: whole on every rank (replicated); ``once``:
    whole, and only rank 0 adds it (a row-parallel projection's bias)."""

    parts: int
    dim: int | None = None
    start: int = 0
    stop: int = 0
    once: bool = False
    ranges: tuple[tuple[int, int], ...] = ()  # more than one: the segments' parts (start/stop: the first's / last's)

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The ranges of ``dim`` this rank holds, in order."""
        return self.ranges or ((self.start, self.stop),)

    def text(self) -> str:
        if self.once:
            return "whole, added once (rank 0)"
        if self.dim is None:
            return "replicated"
        return f"shard dim {self.dim} of {self.parts} [" + ",".join(f"{a}:{b}" for a, b in self.spans()) + "]"


@dataclass
class Operand:
    sym: str
    dtype: str
    shape: tuple[int, ...]
    sources: list[str]  # tensor syms; several when encoded
    role: Role
    layer: int | None = None
    encoding: str | None = None  # e.g. "mxfp4", "q4_1" (vxc.ir.ggml)
    part_names: list[str] = field(default_factory=list)  # names of the encoded parts
    transforms: list[Transform] = field(default_factory=list)
    loc: Loc | None = None
    # the precision of the activations the products reading this (ggml-encoded) operand take: None is x as
    # given; "int8_block32" quantises each row per 32-value block to int8 (vxc.codegen.kernels.quant.ACTIVATIONS)
    activations: str | None = None
    # tensor parallelism: this rank's part of the operand (``shape`` is then the part's shape); None: not sharded
    shard: Shard | None = None
    # ``concat DIM (part, part, …)``: the operand is its parts' views concatenated along ``concat_dim``, then its
    # own ``transforms``; each part an Operand of its own (its sources, encoding and transforms; the same role
    # and layer), ``sources`` every part's tensors in order. A container that stores one logical matrix as
    # several tensors (a latent attention's key and value up-projections, the key one transposed) binds it so.
    concat_dim: int | None = None
    parts: list["Operand"] = field(default_factory=list)


@dataclass
class Op:
    """An operator instance: its kind and declared attributes."""

    kind: str
    attrs: dict[str, Any]
    defaults: set[str] = field(default_factory=set)  # attributes the frontend filled in
    role: Role | None = None  # norms: the role they bind
    loc: Loc | None = None


@dataclass
class Region:
    name: str
    kind: str
    shape: tuple[int, ...]
    precision: str  # "f32" | "compute"
    growth: str  # "fixed" | "per_token"
    window: int = 0
    loc: Loc | None = None

    def elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Layer:
    index: int
    residual: str  # "fp32" | "compute"
    placement: Placement
    norms: list[Op]
    mixer: Op | None  # None: an FFN-only layer (placement PreFfn)
    ffn: Op | None = None
    regions: list[Region] | None = None  # None until the state pass ran
    loc: Loc | None = None
    # placement Parallel: a second mixer beside ``mixer``, reading the same normed input; the two outputs are
    # summed (mixer's + this one's) before the residual add. None on every other placement.
    parallel: Op | None = None

    def mixers(self) -> list[Op]:
        return [*([self.mixer] if self.mixer else []), *([self.parallel] if self.parallel else [])]

    def ops(self) -> list[Op]:
        return [*self.norms, *self.mixers(), *([self.ffn] if self.ffn else [])]

    def main_kind(self) -> str:
        """The kind of the layer's mixer, or of its FFN when it has none (for messages and summaries)."""
        return (self.mixer or self.ffn).kind


@dataclass
class Module:
    name: str
    source: Source
    compute: str  # the checkpoint's compute dtype
    files: list[FileEntry]
    tensors: list[Tensor]
    operands: list[Operand]
    embedding: Op
    layers: list[Layer]
    final_norm: Op
    head: Op
    facts: list[Fact] = field(default_factory=list)
    index: IndexEntry | None = None
    schema: int = SCHEMA
    loc: Loc | None = None

    def model_ops(self) -> list[Op]:
        return [self.embedding, self.final_norm, self.head]

    def operand_table(self) -> dict[str, Operand]:
        return {o.sym: o for o in self.operands}

    def tensor_table(self) -> dict[str, Tensor]:
        return {t.sym: t for t in self.tensors}

    def bindings(self, layer: int | None) -> dict[Role, Operand]:
        """role → operand for one layer (None: model-level)."""
        return {o.role: o for o in self.operands if o.layer == layer}
