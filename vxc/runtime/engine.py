"""The engine: IR → verified plan → fused groups → two fx graphs (prefill over
a sequence, a fixed-shape single-token decode step) over one set of weights,
static state buffers and rotary tables."""

from __future__ import annotations

from pathlib import Path

import torch

from ..codegen.fxgen import buffer_name, build_graph_module
from ..codegen.lower import VARIANTS, Lowered, RopeRef, StateRef, Weight, lower_plan
from ..ir.diagnostics import VxcError
from ..ir.module import Module
from ..passes.context import Context
from ..passes.manager import DEFAULT_PIPELINE, TP_PIPELINE, PassManager, parse_pipeline
from ..passes.plan import split_region_id
from ..codegen import kernels
from ..codegen.kernels import quant
from .replay import BatchReplay, DecodeReplay
from .rope import tables
from .state import StateBuffers, StateProvider
from .weights import Weights

# the tokens a prompt's prefill runs at once (Session.prefill; ggml's default micro-batch is 512): 256 keeps the
# transient activations of a long prompt bounded at the same prefill speed (the 0.6B softmax-decoder benchmark
# shape, q4_0 with int8 activations, 2 threads: pp512 in one piece 387 tok/s, chunks of 128 393, of 64 349)
PREFILL_CHUNK = 256
# ... and 128 where the plan's matmuls run the packed int8_block32 products (a cost per row of x, whatever the
# chunk): there a 128-token chunk prefills as fast or faster and halves the activations at the prefill's peak
# RSS. Intel Xeon, 2 threads, interleaved in one process, chunks of 256 vs 128, pp512 / pp1024 tok/s: the 0.6B
# softmax-decoder shape q4_0 399 / 349 vs 408 / 322, q4_k_m 366 / 317 vs 365 / 340, the 780M SSM shape q4_0 202 /
# 196 vs 249 / 244; (peak RSS - pre-load - state) / file 1.17-1.18 -> 1.12-1.14 (the 0.6B q4_0 file), a real 135M
# Q4_1 file 1.39 -> 1.33. The torch GEMMs of bf16 / dense fp32 weights want the larger chunk (the 0.6B shape in
# bf16: pp512 729 vs 563; in f32: 223 vs 209).
PREFILL_CHUNK_PACKED = 128

DTYPES = {"fp32": torch.float32, "f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16}


class Engine:
    def __init__(self, module: Module, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 max_context: int = 2048, provider: StateProvider | None = None, compile_decode: bool = False,
                 replay: bool = True, sequences: int = 1, tp: int = 1, rank: int = 0,
                 prefill_chunk: int | None = None, kv_dtype: torch.dtype | None = None):
        self.tp, self.rank = tp, rank
        if prefill_chunk is not None and prefill_chunk < 0:
            raise EngineError(f"prefill_chunk must be >= 0 (0: a prompt in one piece), not {prefill_chunk}")
        import threading

        self.built_in = threading.current_thread().name  # (vxc serve steps the engine in the thread that built it)
        if tp == 1:
            ctx = PassManager(parse_pipeline(DEFAULT_PIPELINE), emit=lambda s: None).run(Context(module, model_dir=Path(model_dir)))
        else:  # tensor parallel: this rank's part of the model (the shard pass rewrites a copy of the module)
            import copy

            module = copy.deepcopy(module)
            ctx = PassManager(parse_pipeline(TP_PIPELINE), emit=lambda s: None).run(
                Context(module, model_dir=Path(model_dir), tp=tp, rank=rank))
        self.module, self.plan = ctx.module, ctx.plan
        self.dtype, self.device, self.max_context = dtype, torch.device(device), max_context
        self.weights = Weights(module, Path(model_dir))
        # ggml block-encoded weights stay resident as stored (zero-copy views of the mapping), read by the encoded
        # kernel forms, in fp32 and bf16 sessions (bf16: each form sums in fp32 and rounds its output once); an fp16
        # session decodes every encoded weight at load
        self.encoded_weights = dtype in (torch.float32, torch.bfloat16) and encoded_resident()
        compute = "bf16" if dtype == torch.bfloat16 else "fp32"
        self.lowered = {v: lower_plan(self.plan, v, self.encoded_weights, compute) for v in VARIANTS}
        root = torch.nn.Module()
        provider = provider or StateProvider()
        # the growing row regions' element type where it is not the compute dtype (None: it is)
        self.kv_dtype = kv_dtype if kv_dtype != dtype else None
        _check_memory(provider, self.plan, self.lowered, dtype, max_context, self.device, sequences, self.kv_dtype)
        self.sequences = sequences
        self.state: StateBuffers = provider.allocate(self.plan, dtype, max_context, self.device, sequences, self.kv_dtype)
        operands = module.operand_table()
        packed = _packed_products(self.lowered.values())
        # Session.prefill runs a longer prompt as chunks of this many tokens (None: by the plan's matmuls)
        self.prefill_chunk = prefill_chunk if prefill_chunk is not None else PREFILL_CHUNK_PACKED if packed else PREFILL_CHUNK
        for lw in self.lowered.values():
            for ref in _refs(lw):
                name = buffer_name(ref)
                if hasattr(root, name):
                    continue
                if isinstance(ref, Weight) and ref.encoded:
                    o = operands[ref.sym]
                    blocks = self.weights.encoded(o, self.device)
                    root.register_buffer(name, blocks, persistent=False)
                    if ref.sym in packed:  # its packed copy made now, not amid the first prefill
                        quant.prepack(o.encoding, blocks)
                elif isinstance(ref, Weight):
                    root.register_buffer(name, self.weights.operand(operands[ref.sym], dtype, self.device), persistent=False)
                elif isinstance(ref, StateRef):
                    root.register_buffer(name, self.state.buffers[ref.id], persistent=False)
            for key, attrs in lw.ropes.items():
                cos, sin = tables(attrs, max_context, self.device)
                for which, t in (("cos", cos), ("sin", sin)):
                    name = buffer_name(RopeRef(key, which))
                    if not hasattr(root, name):
                        root.register_buffer(name, t, persistent=False)
        self.root = root
        # the batched decode step reads the state of every slot: a root with the same weights and rotary tables,
        # and the whole [S, ...] region buffers
        self._batch_root = None
        self._batch_graph = None
        self.bound_slot = 0
        # the prefill graphs are built on first use (``prefill_graph``, ``prefill_last_graph``): a generating session
        # never runs the one that returns every position's logits (~1.3 MB of fx nodes and code for a 30-layer model)
        self._prefill_graphs: dict[str, torch.nn.Module] = {}
        self.decode_graph = build_graph_module(self.lowered["decode"], root)
        self.decode_fn = torch.compile(self.decode_graph, dynamic=True) if compile_decode else self.decode_graph
        # the decode step reads its token from one static buffer, so a captured step can be replayed
        self.decode_ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        use_replay = replay and self.device.type == "cpu" and not compile_decode
        self.replay = DecodeReplay(self.decode_graph, self.decode_ids) if use_replay else None
        self.batch_replays: dict[int, BatchReplay] = {}  # batched steps, by their number of rows (with self.replay)
        # each weight buffer's encoding (or dtype), by address: the labels of a replayed step's profile
        self.weight_kinds = _weight_kinds(self.lowered.values(), root, operands)
        self.profiling = False
        self.prefill_profile = None  # a PrefillProfile while profiling (start_profile)
        if self.replay is not None:
            self.replay.weights = self.weight_kinds
        emb = self.plan.nodes["embedding"]["op"].attrs
        self.vocab, self.padded_vocab = emb["vocab"], emb["padded_vocab"]

    @property
    def batch_graph(self):
        """The batched decode step (:mod:`vxc.codegen.batch`), built on first use."""
        if self._batch_graph is None:
            broot = torch.nn.Module()
            for name, b in self.root.named_buffers():
                if not name.startswith("s_"):
                    broot.register_buffer(name, b, persistent=False)
            for rid, full in self.state.slots.items():
                name = buffer_name(StateRef(*split_region_id(rid)))
                broot.register_buffer(name, full, persistent=False)
            self._batch_root = broot
            self._batch_graph = build_graph_batch(self.lowered["prefill"], broot)
        return self._batch_graph

    def decode_batch(self, tokens: list[int], positions: list[int], slots: list[int], fresh: bool = True) -> torch.Tensor:
        """Logits ``[B, padded_vocab]`` (compute dtype): token ``tokens[b]`` at position ``positions[b]`` of the
        sequence in slot ``slots[b]``, for B sequences in one step (the weights read once for all B rows). With
        ``fresh=False`` a replayed step returns the replay's own output buffer, valid until the next step (a caller
        that reads it at once saves the copy: 4.9 MB a step for 8 rows of a 151936-token vocabulary)."""
        if len(set(slots)) != len(slots):
            raise EngineError(f"a batched step takes each slot at most once: {slots}")
        if list(slots) == [0] and self.replay is not None and kernels.get_backend() in ("auto", "native"):
            # one sequence in slot 0: the single-sequence decode step (its native replay once captured) — the same
            # kernels on the same buffers as the batched graph's one row, without the graph's per-call overhead
            return self.decode(int(tokens[0]), int(positions[0]), fresh)
        self.full_threads()
        if self.replay is not None and kernels.get_backend() in ("auto", "native"):
            # the captured batched step of this many rows (any slots, any positions: it reads them from its buffers)
            B = len(slots)
            r = self.batch_replays.get(B)
            if r is None:
                r = self.batch_replays[B] = BatchReplay(lambda *a: self.batch_graph(*a), B)
                r.weights = self.weight_kinds
                if self.profiling:
                    r.start_profile()
            return r([int(t) for t in tokens], [int(p) for p in positions], [int(s) for s in slots], fresh)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return self.batch_graph(ids, list(positions), pos_t, list(slots), slots_t)

    @property
    def prefill_graph(self) -> torch.nn.Module:
        """The prefill of T tokens returning every position's logits (built on first use)."""
        return self._prefill("prefill")

    @property
    def prefill_last_graph(self) -> torch.nn.Module:
        """The prefill of T tokens returning the last position's logits (built on first use)."""
        return self._prefill("prefill_last")

    def _prefill(self, variant: str) -> torch.nn.Module:
        gm = self._prefill_graphs.get(variant)
        if gm is None:
            gm = self._prefill_graphs[variant] = build_graph_module(self.lowered[variant], self.root)
            if self.bound_slot != 0:
                self._point(gm, self.bound_slot)
        if self.prefill_profile is not None:
            from .prefill_profile import ProfiledGraph

            return ProfiledGraph(gm, self.prefill_profile)
        return gm

    def _point(self, gm: torch.nn.Module, slot: int) -> None:
        for rid, v in self.state.slot(slot).items():
            name = buffer_name(StateRef(*split_region_id(rid)))
            if hasattr(gm, name):
                setattr(gm, name, v)

    def bind_slot(self, slot: int) -> None:
        """Point the prefill graphs at the state of ``slot`` (the decode graph and its replay stay on slot 0:
        single-token work of other slots goes through :meth:`decode_batch`)."""
        if slot == self.bound_slot:
            return
        for gm in self._prefill_graphs.values():
            self._point(gm, slot)
        self.bound_slot = slot

    def full_threads(self) -> None:
        """Give the native parallel regions of work outside a replayed step (prefill, batched steps) the thread count
        in force before any governor changed it: a governor (this engine's or another's — the OpenMP runtime is one
        per process) leaves its count in force after its step, and a prefill must not run at a count chosen for
        someone else's step under load."""
        from .replay import release_threads

        release_threads()

    def decode(self, token: int, pos: int, fresh: bool = True) -> torch.Tensor:
        """Logits ``[1, padded_vocab]`` (compute dtype) of ``token`` at position ``pos``: the fixed-shape
        decode graph, or its native replay once captured (CPU, native kernels, not --compile); ``fresh`` as in
        :meth:`decode_batch`."""
        self.decode_ids[0] = token
        if self.replay is not None and kernels.get_backend() in ("auto", "native"):
            return self.replay(pos, fresh)
        return self.decode_fn(self.decode_ids, pos)

    def thread_report(self) -> str | None:
        """What the replayed steps' thread governor settled on (None: not replaying, or not governed)."""
        g = self.replay.governor if self.replay is not None else None
        return g.report() if g is not None else None

    def start_profile(self) -> None:
        """Time the replayed decode steps (single and batched) call by call from now on (``decode_profile``), and the
        prefill graphs op by op (``prefill_profile.summary()``)."""
        from .prefill_profile import PrefillProfile

        self.profiling = True
        if self.prefill_profile is None:
            self.prefill_profile = PrefillProfile(self.weight_kinds)
        for r in [self.replay, *self.batch_replays.values()]:
            if r is not None:
                r.start_profile()

    def decode_profile(self) -> dict | None:
        """The single-sequence replayed steps' profile (``StepProfile.summary``; None: none was taken), and under
        ``"batched"`` each batched replay's, by its number of rows."""
        if self.replay is None or self.replay.profile is None:
            out = None
        else:
            out = self.replay.profile.summary()
        batched = {B: r.profile.summary() for B, r in sorted(self.batch_replays.items()) if r.profile is not None}
        if batched:
            out = dict(out or {"steps": 0})
            out["batched"] = batched
        return out

    def replay_status(self) -> str:
        if self.replay is None:
            return "off"
        if self.replay.ready:
            return f"replaying {len(self.replay.program)} native calls per step"
        return f"refused: {self.replay.refused}" if self.replay.refused else "capturing"

    def weight_bytes(self) -> int:
        seen, n = set(), 0
        for name, b in self.root.named_buffers():
            if name.startswith(("w_", "wq_")) and b.data_ptr() not in seen:  # (wq_: ggml blocks kept resident)
                seen.add(b.data_ptr())
                n += b.numel() * b.element_size()
        return n


def encoded_resident() -> bool:
    """ggml-encoded weights stay resident as stored blocks (zero-copy views of the file's mapping) under fp32 and
    bf16 compute, read by the native block GEMV (``vxc::qgemv``: each weight decoded in registers to the fp32 value
    ``gguf.quants.dequantize`` gives it, at the fp32 floor of the reference; a bf16 session's products take bf16 x
    and round their fp32 sums once). ``VXC_ENCODED=0`` decodes them at load instead (copies in the session dtype:
    ~2-7x the memory)."""
    import os

    return os.environ.get("VXC_ENCODED", "1") != "0"


class EngineError(VxcError):
    pass


def available_bytes(device: torch.device) -> int | None:
    """Memory this process can still take on ``device``: CUDA's free memory; on CPU, the kernel's MemAvailable
    (capped by an address-space limit, when one is set). None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmSize:"):
                    left = soft - int(line.split()[1]) * 1024
                    avail = left if avail is None else min(avail, left)
    except (OSError, ValueError, ImportError):
        pass
    return avail


def build_graph_batch(lw: Lowered, root: torch.nn.Module):
    from ..codegen.batch import build_batch_graph_module

    return build_batch_graph_module(lw, root, buffer_name)


def _check_memory(provider: StateProvider, plan, lowered, dtype, max_context: int, device: torch.device,
                  sequences: int = 1, kv_dtype: torch.dtype | None = None) -> None:
    """The buffers sized by --max-context (state regions, rotary tables) must fit before any is allocated."""
    from .rope import inv_freq

    fixed = provider.nbytes(plan, dtype, 0, sequences, kv_dtype)
    per_state = provider.nbytes(plan, dtype, 1, sequences, kv_dtype) - fixed
    freqs = {key: inv_freq(attrs)[0].numel() for lw in lowered.values() for key, attrs in lw.ropes.items()}
    per_rope = sum(4 * 3 * n + 8 for n in freqs.values())  # cos + sin tables and the frequencies they are made from
    need = fixed + (per_state + per_rope) * max_context
    avail = available_bytes(device)
    if avail is not None and need > avail:
        fits = max((avail - fixed) // max(per_state + per_rope, 1), 0)
        raise EngineError(f"--max-context {max_context}: the state and rotary tables need {_gib(need)} ({_gib(fixed)} fixed + "
                          f"{per_state + per_rope:,} bytes per position), {_gib(avail)} is available on {device}; "
                          f"at most --max-context {fits:,} fits")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


# the encoded products that read their weights through int8_block32 activations — on the packed layout where the
# build has one (quant.qgemv_native); qmoe_experts' banks are read by rows (vxc_qmoe), a gather by rows too
_PACKED_FORMS = ("qlinear", "qswiglu", "qmoe_shared")


def _packed_products(lowered) -> set[str]:
    """The operands some call multiplies with int8_block32 activations (the ones worth a packed copy at load; an
    embedding table only gathered is not, a tied head's is)."""
    out: set[str] = set()
    for lw in lowered:
        for c in lw.calls:
            if c.kernel in _PACKED_FORMS and "int8_block32" in c.args:
                out.update(a.sym for a in c.args if isinstance(a, Weight) and a.encoded)
    return out


def _weight_kinds(lowered, root: torch.nn.Module, operands) -> dict[int, str]:
    """Each weight buffer's address -> its encoding (with the activation precision its products take, when
    declared) or its dtype: what a replayed step's profile names the weight a kernel read by."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    out: dict[int, str] = {}
    for lw in lowered:
        for ref in _refs(lw):
            if not isinstance(ref, Weight):
                continue
            buf = getattr(root, buffer_name(ref), None)
            if buf is None or buf.data_ptr() in out:
                continue
            o = operands.get(ref.sym)
            if ref.encoded and o is not None and o.encoding:
                out[buf.data_ptr()] = o.encoding + (f" ({o.activations} x)" if o.activations else "")
                pk = quant._PACKED.get(buf)  # the packed copy made at load, which the int8_block32 products read
                if pk is not None:
                    out[pk.data_ptr()] = o.encoding + (f" ({o.activations} x, packed)" if o.activations else " (packed)")
            else:
                out[buf.data_ptr()] = names.get(buf.dtype, str(buf.dtype).replace("torch.", ""))
    return out


def _refs(lw: Lowered):
    for c in lw.calls:
        for a in c.args:
            if isinstance(a, (Weight, StateRef)):
                yield StateRef(a.op_id, a.region) if isinstance(a, StateRef) else a
