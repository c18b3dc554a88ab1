"""Check tests/gguf_support.write_mamba2_gguf, write_qwen3next_gguf and tests/gguf_kimi.write_kimi_gguf against
llama.cpp's own converter, key by key and byte by byte.

Not a CI test (it needs a llama.cpp tree: ``$VXC_LLAMA_CPP`` or tests/gguf_convert.DEFAULT_LLAMA_CPP): run it
where a tree is present, after a change to the writer or to a new llama.cpp::

    python -m tests.gguf_convert_check            # exit 0: every outtype identical; 1: the differences, listed

For each ``--outtype`` (f32, bf16, q8_0) it converts one random Mamba2ForCausalLM, one Qwen3NextForCausalLM
miniature (``--no-mtp``: it has no MTP layers) and one hub-dialect Kimi-Linear checkpoint with ``convert_hf_to_gguf.py`` (through tests/gguf_convert's
wrapper) and writes the same models with the writers, then compares every metadata key and value (the ``general.*`` keys the converter derives
from the directory name and its own version are listed, not compared) and every tensor's name, type, shape and
bytes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# the converter writes these from the directory name / its own build: not properties of the model
_INCIDENTAL = ("general.name", "general.basename", "general.size_label", "general.finetune", "general.version",
               "general.file_type_name")


def _fields(path: Path) -> tuple[dict, dict]:
    import gguf

    r = gguf.GGUFReader(str(path))
    kv = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        kv[k] = f.contents()
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape), bytes(t.data.tobytes()))
               for t in r.tensors}
    return kv, tensors


def compare(ours: Path, theirs: Path) -> list[str]:
    a_kv, a_t = _fields(ours)
    b_kv, b_t = _fields(theirs)
    out = []
    for k in sorted(set(a_kv) | set(b_kv)):
        if k.startswith(_INCIDENTAL):
            continue
        if k not in a_kv:
            out.append(f"key {k}: only the converter writes it ({b_kv[k]!r:.80})")
        elif k not in b_kv:
            out.append(f"key {k}: only the test writer writes it ({a_kv[k]!r:.80})")
        elif a_kv[k] != b_kv[k]:
            out.append(f"key {k}: {a_kv[k]!r:.80} != converter {b_kv[k]!r:.80}")
    for n in sorted(set(a_t) | set(b_t)):
        if n not in a_t or n not in b_t:
            out.append(f"tensor {n}: only in {'the converter' if n in b_t else 'the test writer'}")
            continue
        (ta, sa, da), (tb, sb, db) = a_t[n], b_t[n]
        if (ta, sa) != (tb, sb):
            out.append(f"tensor {n}: {ta}{list(sa)} != converter {tb}{list(sb)}")
        elif da != db:
            diff = sum(x != y for x, y in zip(da, db))
            out.append(f"tensor {n} ({ta}): {diff} of {len(da)} bytes differ")
    return out


def main() -> int:
    from tests import gguf_kimi as K
    from tests import gguf_support as S
    from tests.gguf_convert import convert_hf_to_gguf, converter_available, llama_cpp_tree

    if not converter_available():
        print(f"no llama.cpp tree at {llama_cpp_tree()} (set VXC_LLAMA_CPP)", file=sys.stderr)
        return 2
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        cases = (("mamba2", S.write_mamba2_hf_dir, S.write_mamba2_gguf, []),
                 ("qwen3next", S.write_qwen3next_hf_dir, S.write_qwen3next_gguf, ["--no-mtp"]),
                 ("kimi-linear", K.write_kimi_hf_dir, lambda p, _m, hf, o: K.write_kimi_gguf(p, hf, o), []))
        for arch, make, write, args in cases:
            model = make(root / arch, seed=21)
            for outtype in ("f32", "bf16", "q8_0"):
                theirs = convert_hf_to_gguf(root / arch, root / f"conv-{arch}-{outtype}.gguf", outtype, extra_args=args)
                ours = write(root / f"ours-{arch}-{outtype}.gguf", model, root / arch, outtype)
                diffs = compare(ours, theirs)
                n = len(_fields(theirs)[1])
                print(f"{arch} --outtype {outtype}: {n} tensors, {'identical' if not diffs else f'{len(diffs)} differences'}")
                for line in diffs:
                    print("   ", line)
                bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
