"""transformers ``llama``: ``attention_bias`` switches all of q/k/v/o biases."""

from .registry import by_model_type
from .softmax_decoder import Family, lower_decoder

LLAMA = Family("llama", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=False)


@by_model_type("llama")
def lower_llama(model_dir, cfg, sha, relative_to):
    return lower_decoder(LLAMA, model_dir, cfg, sha, relative_to)
