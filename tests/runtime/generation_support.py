"""Tokenizers and model directories for the generation tests, built from public facts with the ``tokenizers``
library and transformers (never from vxc):

- ``chatml_tokenizer()``: one token per printable ASCII character and newline (a byte-level vocabulary with no
  merges, so any id sequence re-encodes to itself) plus ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``;
- ``cjk_bpe_tokenizer()``: a byte-level BPE trained on a small corpus of English, Japanese, Chinese and emoji with
  so few merges that most multi-byte characters are split across tokens;
- ``build_chat_model(dir, tok)``: a llama miniature (tests/builders.py geometry, the tokenizer's vocabulary) with
  the tokenizer, a ChatML ``tokenizer_config.json`` that transformers' ``AutoTokenizer`` loads, and a
  ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests import builders as B

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# SmolLM2-Instruct's ChatML template, with a bos_token, a system default, a raise_exception branch and block tags on
# their own lines (trim_blocks / lstrip_blocks matter)
CHATML = """{{- bos_token -}}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' -}}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' -}}
{% endif %}
"""


def chatml_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte spellings; pick those of the ASCII we keep
    from tokenizers.pre_tokenizers import ByteLevel

    spell = {}
    for b in [10] + list(range(32, 127)):
        pieces = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(bytes([b]).decode())
        spell[b] = pieces[0][0]
    assert set(spell.values()) <= set(alphabet)
    vocab = {s: i for i, s in enumerate(spell.values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


CORPUS = [
    "Tokyo in Japanese is 東京. Osaka in Japanese is 大阪. Kyoto is 京都.",
    "東京は日本の首都です。大阪は食べ物で有名です。京都には多くの寺があります。",
    "北京是中国的首都。上海是一个大城市。我们喜欢吃饺子和面条。",
    "Party time 🎉🎉 rocket 🚀 sushi 🍣 heart ❤️ thumbs 👍🏽 family 👨‍👩‍👧",
    "The quick brown fox jumps over the lazy dog. The state of the art.",
] * 3


def cjk_bpe_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_chat_model(out_dir: Path, tok, *, seed: int = 21, template: str | None = CHATML, eos_token: str | None = "<|im_end|>",
                     max_positions: int = 256) -> Path:
    """A llama miniature whose vocabulary is ``tok``'s, with the tokenizer files beside it."""
    out_dir = Path(out_dir)
    V = tok.get_vocab_size()
    ov = dict(B.MINI_HF["llama"], vocab_size=V, max_position_embeddings=max_positions)
    im_end = tok.token_to_id("<|im_end|>")
    ov.update(bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=im_end if im_end is not None else V - 1,
              pad_token_id=0)
    B.build_hf(out_dir, "llama", ov, seed=seed)
    tok.save(str(out_dir / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "model_max_length": max_positions,
          "clean_up_tokenization_spaces": False}
    if eos_token is not None:
        tc["eos_token"] = eos_token
    if template is not None:
        tc["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return out_dir


def set_generation_eos(model_dir: Path, eos) -> None:
    p = Path(model_dir) / "generation_config.json"
    g = json.loads(p.read_text())
    g["eos_token_id"] = eos
    p.write_text(json.dumps(g, indent=1))
