"""transformers ``qwen2``: q/k/v always carry a bias, o_proj never does."""

from .registry import by_model_type
from .softmax_decoder import Family, lower_decoder

QWEN2 = Family("qwen2", qkv_bias=True, o_bias=False, qk_norm=False)


@by_model_type("qwen2")
def lower_qwen2(model_dir, cfg, sha, relative_to):
    return lower_decoder(QWEN2, model_dir, cfg, sha, relative_to)
