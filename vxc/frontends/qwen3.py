"""transformers ``qwen3``: per-head q/k RMSNorm before rotary; ``attention_bias``
switches q/k/v/o biases; ``head_dim`` defaults to 128 (Qwen3Config)."""

from .registry import by_model_type
from .softmax_decoder import Family, lower_decoder

QWEN3 = Family("qwen3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, head_dim_default=128)


@by_model_type("qwen3")
def lower_qwen3(model_dir, cfg, sha, relative_to):
    return lower_decoder(QWEN3, model_dir, cfg, sha, relative_to)
