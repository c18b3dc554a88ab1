"""GGUF files as llama.cpp's own converter writes them: ``convert_hf_to_gguf.py`` of a llama.cpp tree (not a vxc
dependency, not in CI; the tree is ``$VXC_LLAMA_CPP``, by default the one vendored in the llama-cpp-python source
package unpacked under /tmp).

Importable (the benchmarks and ``tests/gguf_convert_check.py`` use it):

- :func:`convert_hf_to_gguf` converts a Hugging Face model directory with the tree's converter, run in a child
  process through a wrapper that leaves llama.cpp's files untouched: a BPE tokenizer whose pre-tokenizer hash is
  not in the converter's table (any freshly trained one) is written as ``tokenizer.ggml.pre = gpt-2`` instead of
  the converter's ``NotImplementedError``; and a directory without a ``tokenizer.model`` reaches the converter's
  "no sentencepiece model" fallback even when the ``sentencepiece`` package is not installed (the converter
  imports it before it looks for the file).
- :func:`write_bpe_tokenizer` writes a small byte-level BPE tokenizer (``tokenizer.json`` +
  ``tokenizer_config.json``, trained on a fixed text with the ``tokenizers`` package) into a model directory, so
  the converter has a vocabulary to write (it refuses a llama/qwen directory without one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_LLAMA_CPP = "/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# run in the child: argv = [tree, converter args...]
_WRAPPER = r"""
import runpy, sys
tree = sys.argv[1]
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[2:]
sys.path[0:0] = [tree, tree + "/gguf-py"]  # sys.path[0] is the tree: the converter finds models/ggml-vocab-* there
from conversion import base

_known = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return _known(self, tokenizer)
    except NotImplementedError:  # a pre-tokenizer hash the table lacks (a freshly trained tokenizer)
        base.logger.warning("vxc wrapper: unknown BPE pre-tokenizer hash, written as 'gpt-2'")
        return "gpt-2"


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
_sentencepiece = base.TextModel._create_vocab_sentencepiece


def _create_vocab_sentencepiece(self):
    # the converter imports sentencepiece before it looks for tokenizer.model: without the package installed, a
    # directory holding only a tokenizer.json must still reach that check (and then the BPE path)
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _sentencepiece(self)


base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ConvertError(RuntimeError):
    """The converter failed (its output's tail is the message)."""


def llama_cpp_tree() -> Path:
    """The llama.cpp tree: ``$VXC_LLAMA_CPP`` or :data:`DEFAULT_LLAMA_CPP`."""
    return Path(os.environ.get("VXC_LLAMA_CPP") or DEFAULT_LLAMA_CPP)


def converter_available() -> bool:
    t = llama_cpp_tree()
    return (t / "convert_hf_to_gguf.py").is_file() and (t / "gguf-py").is_dir()


def convert_hf_to_gguf(hf_dir: str | Path, out_path: str | Path, outtype: str = "f32", *,
                       timeout: float = 1800, extra_args: list[str] | None = None) -> Path:
    """Convert the Hugging Face model directory ``hf_dir`` to the GGUF file ``out_path`` with llama.cpp's
    ``convert_hf_to_gguf.py --outtype OUTTYPE`` (``f32``, ``f16``, ``bf16``, ``q8_0``); returns ``out_path``.

    The converter runs in a child process (its vendored ``gguf-py`` first on the path, as when it is run as a
    script) through a wrapper mapping an unknown BPE pre-tokenizer hash to ``gpt-2``. Raises
    :class:`ConvertError` with the converter's output when it fails, FileNotFoundError when the tree is absent."""
    tree = llama_cpp_tree()
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py under {tree} (set VXC_LLAMA_CPP to a llama.cpp tree)")
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _WRAPPER, str(tree), str(Path(hf_dir)), "--outtype", outtype,
           "--outfile", str(out_path), *(extra_args or [])]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0 or not out_path.is_file():
        tail = (r.stdout + r.stderr)[-4000:]
        raise ConvertError(f"convert_hf_to_gguf.py {hf_dir} --outtype {outtype} failed (exit {r.returncode}):\n{tail}")
    return out_path


# a fixed training text: words, digits, punctuation, spaces and a few non-ASCII letters
_TEXT = (
    "The quick brown fox jumps over the lazy dog. 12 345 6789 -- it's 3.14, isn't it? "
    "Compilers lower models into operators; every tensor plays a role.  Mamba2 keeps a state; "
    "attention keeps rows of keys and values. Köln, Zürich, naïve café, 東京. "
    "def f(x):\n    return x * 2\n\n"
)


def write_bpe_tokenizer(out_dir: str | Path, vocab_size: int, *, specials: tuple[str, ...] = ("<|endoftext|>",),
                        bos: str | None = None, eos: str | None = "<|endoftext|>") -> Path:
    """A byte-level BPE ``tokenizer.json`` (GPT-2 style: ByteLevel pre-tokenizer and decoder, no prefix space) of
    at most ``vocab_size`` tokens (at least the 256 byte symbols + ``specials``), trained on a fixed text, plus a
    ``tokenizer_config.json``; returns ``out_dir``. Its pre-tokenizer hash is in no converter table."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < 256 byte symbols + {len(specials)} special tokens")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "add_prefix_space": False,
           "clean_up_tokenization_spaces": False}
    if bos:
        cfg["bos_token"] = bos
    if eos:
        cfg["eos_token"] = eos
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return out_dir


__all__ = ["ConvertError", "DEFAULT_LLAMA_CPP", "OUTTYPES", "convert_hf_to_gguf", "converter_available",
           "llama_cpp_tree", "write_bpe_tokenizer"]
