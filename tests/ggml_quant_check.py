"""Check vxc's ggml block encoders (vxc.runtime.ggml_blocks.quantize) and ``vxc quantize --scheme q4_k_m / q5_k_m /
q3_k_m / q2_k`` against a llama.cpp build, byte by byte.

Not a CI test (it needs a built llama.cpp tree: ``$VXC_LLAMA_CPP`` or tests/gguf_convert.DEFAULT_LLAMA_CPP, with
``build/bin/llama-quantize`` and ``build/bin/libggml-base.so``): run it where one is present, after a change to
an encoder or to a new llama.cpp::

    python -m tests.ggml_quant_check      # exit 0: identical everywhere; 1: the differences, listed; 2: no build

gguf-py has no k-quant encoder, so for q2_k .. q6_k this is the reference check (CI holds the bytes of one input
as a digest: tests/runtime/test_ggml_blocks.py). Three parts:

1. encoders: ``ggml_quantize_chunk`` of libggml-base.so (ctypes; without an importance matrix, i.e.
   quantize_row_q2_K_ref .. quantize_row_q6_K_ref for the k-quants) against ``quantize`` on the inputs of
   tests/runtime/test_ggml_blocks.py (outliers, signed zeros, constants, ties, tiny and huge scales), its hashed
   input, and random tensors over magnitudes 1e-44 .. 1e25 (sparse, outliers, quarter-steps);
2. ``llama-quantize --pure f32.gguf out.gguf TYPE`` (every type of FORMATS) on an f32 llama GGUF: every
   tensor it encodes against ``quantize`` of the same f32 values;
3. ``llama-quantize f32.gguf out.gguf Q4_K_M`` (and ``Q5_K_M``, ``Q3_K_M``, ``Q2_K``) against ``vxc lower
   f32.gguf`` + ``vxc quantize --scheme q4_k_m`` (``q5_k_m``, ``q3_k_m``, ``q2_k``) on four files (8 layers; a
   tied head; an FFN width of 288, whose down rows are not whole 256-value blocks; 16 layers with 8 query heads
   per 2 KV heads, so that Q3_K_M's ``i < n/16`` down layer and Q2_K's ``n_gqa() >= 4`` value rule are taken):
   for every tensor the format chosen, and the bytes (vxc's operand view of the tensor, e.g. the Q/K rows
   un-permuted, applied to llama.cpp's blocks).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

FORMATS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q4_1", "iq4_nl", "iq4_xs")
MIXES = ("q4_k_m", "q5_k_m", "q3_k_m", "q2_k", "iq4_nl", "iq4_xs")


def _build() -> Path:
    from tests.gguf_convert import llama_cpp_tree

    return llama_cpp_tree() / "build" / "bin"


class Ggml:
    """libggml-base.so's ``ggml_quantize_chunk`` (what llama-quantize calls per chunk of rows)."""

    def __init__(self, lib: Path):
        self.lib = ctypes.CDLL(str(lib))
        f = self.lib.ggml_quantize_chunk
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p]

    def quantize(self, name: str, x: np.ndarray) -> np.ndarray:
        from vxc.ir.ggml import ENCODINGS, row_bytes

        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        rows, cols = x.shape
        out = np.zeros((rows, row_bytes(name, cols)), dtype=np.uint8)
        n = self.lib.ggml_quantize_chunk(ENCODINGS[name].ggml_type, x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        assert n == out.size, (name, n, out.size)
        return out


def _inputs() -> dict[str, np.ndarray]:
    from tests.runtime.test_ggml_blocks import inputs, kquant_input

    rng = np.random.default_rng(12)
    out = {f"test:{k}": v.reshape(-1, v.shape[-1]) for k, v in inputs(rng, (4, 3), 512).items()}
    out["hashed"] = kquant_input()
    for trial in range(60):
        x = rng.standard_normal((32, 1024)).astype(np.float64)
        if trial % 2:
            x *= np.repeat(10.0 ** rng.uniform(-44, 25, (32, 4)), 256, axis=1)
        if trial % 3 == 0:
            x *= rng.random(x.shape) < 0.3
        if trial % 5 == 0:
            x[:, ::rng.integers(3, 50)] *= 1e4
        if trial % 7 == 0:
            x = np.round(x * 4) / 4
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)
        x[~np.isfinite(x)] = 1.0
        out[f"random:{trial}"] = x
    return out


def check_encoders(ggml: Ggml) -> tuple[list[str], list[str], int]:
    """(differences, notes, blocks compared). A 32-value block where ggml and gguf-py part and vxc is gguf-py's
    (vxc's rule for those formats) is a note: ggml's all-zero q4_0 block stores d = -0.0, and where an f16 d is
    so small that ``1/d`` overflows ggml's cast of the infinite value to int8 (undefined in C; 0 on x86) gives
    code 0 where gguf-py clips to the top code."""
    import gguf

    from vxc.ir.ggml import ENCODINGS
    from vxc.runtime.ggml_blocks import quantize

    problems, notes, blocks = [], [], 0
    for kind, x in _inputs().items():
        for name in FORMATS:
            want = ggml.quantize(name, x)
            got = quantize(name, torch.from_numpy(x)).numpy()
            ts = ENCODINGS[name].type_size
            g, w = got.reshape(-1, ts), want.reshape(-1, ts)
            bad = (g != w).any(axis=1)
            blocks += bad.size
            if not bad.any():
                continue
            if ENCODINGS[name].block_size == 32:
                with np.errstate(all="ignore"):
                    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType[name.upper()]).reshape(-1, ts)
                theirs = bad & (g == ref).all(axis=1)
                if theirs.any():
                    zero = (x.reshape(-1, 32)[theirs] == 0).all(axis=1)
                    notes.append(f"encoder {name} on {kind}: {int(theirs.sum())} blocks are gguf-py's, not ggml's "
                                 f"({int(zero.sum())} all-zero)")
                bad &= ~theirs
            if bad.any():
                problems.append(f"encoder {name} on {kind}: {int(bad.sum())} of {bad.size} blocks differ "
                                f"(first: block {int(np.argmax(bad))})")
    return problems, notes, blocks


def _gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    import gguf

    return {t.name: (t.tensor_type.name.lower(), np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def _llama_quantize(bin_dir: Path, src: Path, dst: Path, ftype: str, pure: bool) -> None:
    cmd = [str(bin_dir / "llama-quantize"), *(["--pure"] if pure else []), str(src), str(dst), ftype, "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not dst.is_file():
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def check_pure(bin_dir: Path, f32: Path, tmp: Path) -> tuple[list[str], int]:
    from vxc.runtime.ggml_blocks import quantize

    src = _gguf_tensors(f32)
    problems, n = [], 0
    for name in FORMATS:
        out = tmp / f"pure_{name}.gguf"
        _llama_quantize(bin_dir, f32, out, name.upper(), pure=True)
        for key, (fmt, blocks) in _gguf_tensors(out).items():
            if fmt == "f32":
                continue
            n += 1
            if fmt != name:
                problems.append(f"--pure {name.upper()}: {key} written as {fmt}")
                continue
            got = quantize(name, torch.from_numpy(np.ascontiguousarray(src[key][1]))).numpy()
            if not np.array_equal(got, blocks):
                problems.append(f"--pure {name.upper()}: {key}: bytes differ")
    return problems, n


def check_mix(bin_dir: Path, f32: Path, tmp: Path, scheme: str = "q4_k_m") -> tuple[list[str], int]:
    """vxc's ``scheme`` mix (MIXES) and bytes against llama-quantize's on the same f32 GGUF."""
    from safetensors.torch import load_file

    from vxc.driver import load
    from vxc.ir.parser import parse_file
    from vxc.quantize import quantize_to_file
    from vxc.runtime.views import apply_view

    T = scheme.upper()
    theirs = tmp / f"{f32.stem}_{scheme}.gguf"
    _llama_quantize(bin_dir, f32, theirs, T, pure=False)
    llama = _gguf_tensors(theirs)
    lowered = load(f32).module  # the GGUF frontend's operands: source key (the GGUF tensor) and view
    out = tmp / f"{f32.stem}_vxc_{scheme}" / "q.vxir"
    quantize_to_file(f32, out, scheme, [])
    q = parse_file(out)
    st = load_file(str(out.with_suffix(".safetensors")))
    keys = {t.sym: t.key for t in lowered.tensors}
    ops = lowered.operand_table()
    problems, n = [], 0
    seen = set()
    for o in q.operands:
        src = ops[o.sym]
        name = keys[src.sources[0]]
        seen.add(name)
        fmt, blocks = llama[name]
        if o.encoding is None:
            if fmt != "f32":
                problems.append(f"{f32.name} {T}: {name} (%{o.sym}): llama.cpp {fmt}, vxc keeps it")
            continue
        n += 1
        if fmt != o.encoding:
            problems.append(f"{f32.name} {T}: {name} (%{o.sym}): llama.cpp {fmt}, vxc {o.encoding}")
            continue
        want = apply_view(torch.from_numpy(np.ascontiguousarray(blocks)), src.transforms)
        if not torch.equal(want.contiguous(), st[o.sym]):
            problems.append(f"{f32.name} {T}: {name} (%{o.sym}, {fmt}): bytes differ")
    for name in sorted(set(llama) - seen):
        problems.append(f"{f32.name} {T}: {name} ({llama[name][0]}) is no vxc operand")
    return problems, n


def main() -> int:
    from tests.gguf_support import MINI_LLAMA, write_llama_gguf

    bin_dir = _build()
    lib, tool = bin_dir / "libggml-base.so", bin_dir / "llama-quantize"
    if not (lib.is_file() and tool.is_file()):
        print(f"no llama.cpp build at {bin_dir} (libggml-base.so and llama-quantize; set VXC_LLAMA_CPP)")
        return 2
    problems: list[str] = []
    p, notes, blocks = check_encoders(Ggml(lib))
    print(f"encoders vs ggml_quantize_chunk: {blocks} blocks of {', '.join(FORMATS)}, {len(p)} inputs differ "
          f"({len(notes)} with blocks where vxc follows gguf-py's 32-value rule)")
    for line in notes:
        print("  note: " + line)
    problems += p
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        files = {
            "f32_8layers": dict(MINI_LLAMA, layers=8),
            "f32_tied": dict(MINI_LLAMA, layers=3),
            "f32_ffn288": dict(MINI_LLAMA, layers=4, ffn=288),
            "f32_16layers_gqa4": dict(MINI_LLAMA, layers=16, heads=8, kv_heads=2, head_dim=32),
        }
        paths = {k: write_llama_gguf(tmp / f"{k}.gguf", cfg, encodings={}, seed=7, tied=k.endswith("tied"))
                 for k, cfg in files.items()}
        p, n = check_pure(bin_dir, paths["f32_8layers"], tmp)
        print(f"llama-quantize --pure {'/'.join(f.upper() for f in FORMATS)}: {n} tensors, {len(p)} differ")
        problems += p
        for scheme in MIXES:
            for k, path in paths.items():
                p, n = check_mix(bin_dir, path, tmp, scheme)
                print(f"llama-quantize {scheme.upper()} vs vxc quantize --scheme {scheme} ({k}): {n} encoded tensors, "
                      f"{len(p)} differ")
                problems += p
    for line in problems:
        print("  " + line)
    print("identical" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
