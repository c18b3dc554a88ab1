"""The compiler boundary: below the frontends nothing may name a model family,
a config key or a checkpoint tensor spelling — not in a string literal, and not
in a comment or docstring either (a comment naming ``q_proj`` is where the
dispatch on it starts). Operator kinds and role names (``mamba2``, ``Mamba2D``,
``softmax``) are vocabulary of the IR and allowed.

The check reads the source with ``tokenize``: every STRING token (f-strings
included; on Python 3.12+ also their literal parts) and every COMMENT token.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from tests.conftest import REPO

BELOW_FRONTENDS = ("vxc/ir", "vxc/passes", "vxc/codegen", "vxc/runtime")

# Checkpoint tensor-name fragments and config keys (substring match).
FRAGMENTS = (
    # tensor spellings
    "q_proj", "k_proj", "v_proj", "o_proj", "self_attn", "linear_attn", "mixer.", "backbone.",
    "in_proj_qkvz", "kv_a_proj", "block_sparse_moe", "input_layernorm", "post_attention_layernorm",
    "embed_tokens", "lm_head", "model.layers", "norm_f", "gate_proj", "up_proj", "down_proj",
    "conv1d.weight", "in_proj.weight", "out_proj.weight", "embeddings.weight", "mlp.experts", "e_score_correction_bias",
    # config keys
    "model_type", "ssm_cfg", "attn_cfg", "attn_layer_idx", "attention_layers_idx", "num_attention_heads",
    "num_key_value_heads", "hidden_size", "intermediate_size", "rope_theta", "rope_parameters", "rope_scaling",
    "tie_word_embeddings", "tie_embeddings", "rms_norm_eps", "layer_norm_epsilon", "torch_dtype",
    "num_hidden_layers", "pad_vocab_size_multiple", "mamba2_num_heads", "full_attn_layers",
    # lfm2's spellings
    "feed_forward", "operator_norm", "embedding_norm", "q_layernorm", "k_layernorm", "full_attn_idxs",
    "conv_L_cache", "block_ff_dim",
    # falcon_h1's spellings
    "pre_ff_layernorm", "final_layernorm", "mamba.", "ssm_multipliers", "mlp_multipliers", "key_multiplier",
    "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
    "embedding_multiplier", "lm_head_multiplier", "mamba_d_ssm", "mamba_rms_norm", "projectors_bias", "mup_vector",
    # granitemoehybrid's spellings
    "shared_mlp", "input_linear", "output_linear", "router.layer", "gate_up_proj", "residual_multiplier",
    "attention_multiplier", "logits_scaling", "position_embedding_type", "shared_intermediate_size",
    "num_local_experts", "layers_block_type",
)

# Family / dialect names: forbidden as a whole string literal (``"llama"``), or as a
# word inside one (``f"... llama ..."``); ``"llama3"`` (a rope scaling type) is another word.
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_next", "kimi_linear", "deepseek_v3", "gpt_oss", "mamba2attn",
            "mamba_ssm", "Mamba2ForCausalLM", "LlamaForCausalLM", "transformers", "lfm2", "Lfm2ForCausalLM",
            "nemotron_h", "NemotronHForCausalLM", "falcon_h1", "FalconH1ForCausalLM", "granitemoehybrid",
            "GraniteMoeHybridForCausalLM")


def _string_value(tok: str):
    try:
        v = ast.literal_eval(tok)
        return v if isinstance(v, str) else None
    except (ValueError, SyntaxError):
        return tok  # f-strings and the like: check the raw text


def _words(s: str) -> set[str]:
    out, cur = set(), []
    for ch in s:
        if ch.isalnum() or ch == "_":
            cur.append(ch)
        else:
            if cur:
                out.add("".join(cur))
            cur = []
    if cur:
        out.add("".join(cur))
    return out


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every forbidden fragment in the string literals and comments of ``source``."""
    found = []
    kinds = {tokenize.STRING, tokenize.COMMENT}
    for name in ("FSTRING_MIDDLE", "TSTRING_MIDDLE"):
        if hasattr(tokenize, name):
            kinds.add(getattr(tokenize, name))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in kinds:
            continue
        text = tok.string
        where = f"{filename}:{tok.start[0]}"
        for frag in FRAGMENTS:
            if frag in text:
                found.append(f"{where}: {frag!r} in {text.strip()[:70]!r}")
        value = _string_value(text) if tok.type == tokenize.STRING else text
        if value is not None:
            words = _words(value)
            for fam in FAMILIES:
                if value == fam or fam in words:
                    found.append(f"{where}: family name {fam!r} in {text.strip()[:70]!r}")
    return found


def _sources() -> list[Path]:
    files = []
    for d in BELOW_FRONTENDS:
        files += sorted((REPO / d).rglob("*.py"))
    return files


def test_there_is_something_to_check():
    files = {p.relative_to(REPO).parts[1] for p in _sources()}
    assert {"ir", "passes"} <= files
    assert len(_sources()) >= 10


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_family_knowledge_below_the_frontends(path):
    assert violations(path.read_text(), str(path.relative_to(REPO))) == []


# ---------------------------------------------------------------- the checker itself


def test_checker_catches_planted_violations():
    planted = '''
"""Binds the q_proj of a layer."""
import x
KEY = "backbone.layers.{i}.mixer.D"      # a tensor spelling
if cfg["model_type"] == "llama":          # dispatch on a family
    pass
name = f"model.layers.{i}.self_attn"      # an f-string
fam = 'qwen3_next'
# handles kimi_linear specially
msg = "lowered by mamba_ssm today"
'''
    v = "\n".join(violations(planted))
    for expect in ("'q_proj'", "'backbone.'", "'mixer.'", "'model_type'", "family name 'llama'", "'model.layers'",
                   "'self_attn'", "family name 'qwen3_next'", "family name 'kimi_linear'", "family name 'mamba_ssm'"):
        assert expect in v, (expect, v)
    assert violations(planted).__len__() >= 10


def test_checker_allows_generic_vocabulary():
    clean = '''
"""The mamba2 operator binds Mamba2D; softmax binds AttnQ. A mixer and an FFN."""
KIND = "mamba2"
ROLE = "Mamba2D"
rope = ("default", "linear", "llama3", "yarn")   # rope scaling types, not families
x = q_proj_weight = 1                             # identifiers are not checked
hidden = "hidden"
'''
    assert violations(clean) == []


def test_checker_catches_a_planted_file(tmp_path):
    """The same walk as the real test, on a tree with one bad file planted in it."""
    bad = tmp_path / "vxc" / "passes" / "sneaky.py"
    bad.parent.mkdir(parents=True)
    bad.write_text('def f(t):\n    return t.key.endswith("mixer.A_log")\n')
    (tmp_path / "vxc" / "passes" / "fine.py").write_text('KIND = "conv_qkv"\n')
    hits = [v for p in sorted((tmp_path / "vxc").rglob("*.py")) for v in violations(p.read_text(), p.name)]
    assert hits and all(h.startswith("sneaky.py:2:") for h in hits)
