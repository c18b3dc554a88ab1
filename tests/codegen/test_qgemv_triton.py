"""``vxc::qgemv``'s Triton implementation (``kernels/quant.py``): q8_0, q4_0, q4_1 read straight from their
blocks. Under the CPU interpreter (the case re-runs itself in a fresh process with TRITON_INTERPRET=1 when
triton was imported without it): the kernel against the fp32 twin and an fp64 oracle from gguf-py's decoding
at the kernel floor, then a GGUF miniature of those formats run end to end with every kernel on the Triton
backend, at the floor of transformers loading the same file, with the Triton qgemv counted (and no qgemv twin)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tests import references as R
from tests.codegen.test_qgemv import make_blocks, oracle
from tests.triton_support import triton_case as triton_case_for
from vxc.codegen import kernels
from vxc.codegen.kernels import quant
from vxc.codegen.kernels.triton_common import INTERPRETED

triton_case = triton_case_for(torch.cuda.is_available() or INTERPRETED)
ENCODINGS = ("q8_0", "q4_0", "q4_1")
# every tensor in a 32-value format (what the Triton decoder covers)
FILE_ENCODINGS = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
                  "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_0", "output": "Q4_1"}
CFG = {"vocab": 96, "d": 64, "ffn": 128, "layers": 1, "heads": 4, "kv_heads": 2, "head_dim": 16, "eps": 1e-5,
       "theta": 10000.0, "context": 128}


@triton_case
def test_triton_qgemv_at_the_floor():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ENCODINGS:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        for rows, nblk, B in ((37, 1, 1), (70, 3, 3), (5, 5, 17)):  # rows past one 32-row program, B > 16
            b = make_blocks(name, rows, nblk, rng)
            x = torch.from_numpy(rng.standard_normal((B, nblk * 32)).astype(np.float32))
            blocks = torch.from_numpy(b)
            got = quant.qgemv_triton(name, blocks.to(dev), x.to(dev)).cpu()
            R.assert_kernel_at_floor(got, quant.qgemv_twin(name, blocks, x), oracle(name, b, x), f"{name} {rows}x{nblk} B={B}")
    with pytest.raises(kernels.NotCovered):
        quant.qgemv_triton("q4_k", torch.zeros(1, 144, dtype=torch.uint8), torch.zeros(1, 256))


@triton_case
def test_gguf_miniature_end_to_end_on_triton(tmp_path, monkeypatch, vxc_sub):
    from tests.gguf_support import write_llama_gguf
    from tests.runtime import parity_table as P

    monkeypatch.setenv("VXC_ENCODED", "1")
    write_llama_gguf(tmp_path / "m.gguf", CFG, encodings=FILE_ENCODINGS, seed=5)
    r = vxc_sub("lower", tmp_path / "m.gguf", "-o", tmp_path / "m.vxir")
    assert r.exit_code == 0, r.stderr
    import transformers

    f = P.Family("gguf-triton", build=None, reference="hf", vocab=CFG["vocab"], padded_vocab=CFG["vocab"],
                 prompt_len=24, split=18)
    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    ref.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ref.m64 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).double().eval()
    impls = kernels.KERNELS["qgemv"].impls
    calls = {"triton": 0, "torch": 0}
    for k in calls:
        fn = impls[k]
        monkeypatch.setitem(impls, k, lambda *a, _fn=fn, _k=k: (calls.__setitem__(_k, calls[_k] + 1), _fn(*a))[1])
    with kernels.backend("triton"):
        p = P.measure(f, tmp_path, tmp_path / "m.vxir", ref, n_new=6)
    assert calls["triton"] > 0 and calls["torch"] == 0, calls
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.greedy_match, (p.greedy_vxc, p.greedy_ref)
