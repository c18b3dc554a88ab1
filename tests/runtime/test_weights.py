"""Weights: expert banks read straight into their stacked slots, and the file-I/O reads' refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import builders as B
from vxc.frontends import lower
from vxc.runtime.weights import MappedFile, WeightError, Weights

MINI = dict(vocab_size=61, hidden_size=24, intermediate_size=40, moe_intermediate_size=14, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, num_experts=5, num_experts_per_tok=2,
            decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)


def test_banks_equal_the_stacked_checkpoint_tensors(tmp_path):
    mdir = B.build_hf(tmp_path / "m", "qwen3_moe", MINI, seed=3)
    m = lower(mdir)
    w = Weights(m, mdir)
    stored = {}
    for f in mdir.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    banks = [t for t in m.tensor_table().values() if t.is_bank]
    assert banks, "the miniature stores its experts as per-expert keys"
    for t in banks:
        got = w.stored(t.sym)
        want = torch.stack([stored[k] for _, k in t.keys()])
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def test_read_into_refuses_a_mismatched_buffer_and_a_short_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(path))
    import hashlib
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    mf = MappedFile(path, len(raw), hashlib.sha256(raw[8:8 + n]).hexdigest(), "w0")
    out = torch.empty(3, 4)
    assert torch.equal(mf.read("a", out=out), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    with pytest.raises(WeightError, match="not torch.float64"):
        mf.read("a", out=torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(WeightError, match="not torch.float32\\[4, 3\\]"):
        mf.read("a", out=torch.empty(4, 3))
    path.write_bytes(raw[:-8])  # the file shrinks after it was opened
    with pytest.raises(WeightError, match="cut short"):
        mf.read("a")
