"""Generation as a chat tool's user meets it: stop tokens from the model's files, --stop strings, why generation
ended, special tokens in the text, the chat template (token-identical with transformers' apply_chat_template),
``vxc chat`` continuing its state between turns, streaming that never repeats or garbles text, and the smaller
CLI behaviours (empty prompt, --dtype, --max-context default, load / warm-up times, the context-full message).

The expected values come from transformers, the tokenizers library and the miniature's own greedy run with
--ignore-eos (a stop test then names a token that run produced and checks generation ends exactly there)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.runtime import generation_support as G
from tests.runtime.conftest import REPO, child_env, read_json_line

PROMPT_IDS = [5, 40, 71, 72, 0, 33, 84, 70, 77, 77]  # ordinary characters of the ChatML miniature's vocabulary


def _toks(ids) -> str:
    return ",".join(map(str, ids))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """(model dir, .vxir, tokenizers.Tokenizer) of the ChatML miniature."""
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("chatml")
    tok = G.chatml_tokenizer()
    mdir = G.build_chat_model(root / "chat", tok)
    ir = root / "chat.vxir"
    lower_to_file(mdir, ir)
    return mdir, ir, tok


@pytest.fixture(scope="module")
def hf_tok(chatml):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(chatml[0]))


def _hf_ids(hf_tok, messages) -> list[int]:
    r = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(r["input_ids"] if hasattr(r, "keys") else r)


@pytest.fixture(scope="module")
def free_run(chatml, vxc_inproc):
    """The miniature's greedy continuation of PROMPT_IDS with no stop of any kind."""
    mdir, ir, tok = chatml
    r = vxc_inproc("exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16, "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    res = read_json_line(r.stdout)
    assert res["finish_reason"] == "length" and len(res["generated_ids"]) == 16 and res["stop_ids"] == []
    return res


def _copy(mdir, dst):
    shutil.copytree(mdir, dst)
    return dst


# ---------------------------------------------------------------- stop tokens


@pytest.mark.parametrize("form", ["int", "list"])
def test_stops_at_generation_config_eos(chatml, free_run, vxc_inproc, tmp_path, form):
    mdir, ir, tok = chatml
    gen = free_run["generated_ids"]
    target = gen[5]
    d = _copy(mdir, tmp_path / "m")
    G.set_generation_eos(d, target if form == "int" else [10**6, target])  # an id past the vocabulary is dropped
    im_end = tok.token_to_id("<|im_end|>")  # tokenizer_config.json's eos_token: a stop id too
    k = next(i for i, t in enumerate(gen) if t in (target, im_end))
    r = vxc_inproc("exec", ir, "--model-dir", d, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16, "--json")
    assert r.exit_code == 0, r.output
    res = read_json_line(r.stdout)
    assert res["generated_ids"] == gen[: k + 1]  # the stop token is returned, last
    assert res["finish_reason"] == "eos"
    assert set(res["stop_ids"]) == {target, im_end}
    assert res["generated_text"] == tok.decode(gen[:k], skip_special_tokens=False)  # ... but not in the text
    assert res["position"] == len(PROMPT_IDS) + k  # it was chosen, never fed
    # streamed: the same text, the stop token not printed
    s = vxc_inproc("exec", ir, "--model-dir", d, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16)
    assert s.exit_code == 0 and s.stdout == res["generated_text"] + "\n"
    assert "ended by eos" in s.stderr


def test_stops_at_tokenizer_config_eos_token(chatml, free_run, vxc_inproc, tmp_path):
    mdir, ir, tok = chatml
    gen = free_run["generated_ids"]
    target = gen[4]
    d = _copy(mdir, tmp_path / "m")
    G.set_generation_eos(d, None)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = {"content": tok.id_to_token(target), "special": False}  # the AddedToken spelling
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    k = gen.index(target)
    res = read_json_line(vxc_inproc("exec", ir, "--model-dir", d, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16,
                                    "--json").stdout)
    assert res["stop_ids"] == [target] and res["finish_reason"] == "eos" and res["generated_ids"] == gen[: k + 1]


def test_stop_strings(chatml, free_run, vxc_inproc):
    mdir, ir, tok = chatml
    gen = free_run["generated_ids"]
    text = tok.decode(gen, skip_special_tokens=False)
    assert free_run["generated_text"] == text  # special tokens are decoded into the text
    first, later = text[6:8], text[11:14]
    assert text.find(first) < text.find(later)
    want = text[: text.find(first)]
    args = ("exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16, "--ignore-eos", "--stop", later,
            "--stop", first)
    res = read_json_line(vxc_inproc(*args, "--json").stdout)
    assert res["finish_reason"] == "stop" and res["generated_text"] == want
    assert len(res["generated_ids"]) < 16
    s = vxc_inproc(*args)
    assert s.exit_code == 0 and s.stdout == want + "\n"  # the stop string itself is never printed
    # a stop string generation never produces: it runs to --max-new-tokens, printing everything
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 16, "--ignore-eos",
                                    "--stop", text[-2:] + "\x01", "--json").stdout)
    assert res["finish_reason"] == "length" and res["generated_text"] == text
    r = vxc_inproc("exec", ir, "--tokens", "1,2", "--stop", "")
    assert r.exit_code == 1 and "empty stop string" in r.stderr


def test_context_full_ends_generation_on_its_own_line(chatml, free_run, vxc_inproc):
    mdir, ir, tok = chatml
    gen = free_run["generated_ids"]
    n = len(PROMPT_IDS) + 3
    args = ["exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 10, "--ignore-eos", "--max-context", n]
    res = read_json_line(vxc_inproc(*args, "--json").stdout)
    # positions 0..n-1 hold the prompt and three generated tokens; the fourth is chosen and cannot be fed
    assert res["finish_reason"] == "context" and res["generated_ids"] == gen[:4] and res["position"] == n
    code = "import sys; from vxc.cli import main; sys.argv = ['vxc'] + sys.argv[1:]; main()"
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout
    streamed = tok.decode(gen[:4], skip_special_tokens=False)
    assert streamed + "\ncontext full: position %d of --max-context %d" % (n, n) in p.stdout


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("system", [None, "Answer in one word."])
def test_chat_template_is_token_identical_with_transformers(chatml, hf_tok, system):
    from vxc.chat import Chat

    mdir, ir, tok = chatml
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Hi {there}"}]
    want = _hf_ids(hf_tok, messages)
    got = Chat(mdir, None, tok, system).start("Hi {there}")
    assert got == want
    assert tok.decode(got, skip_special_tokens=False).startswith("<|endoftext|><|im_start|>system\n" + (system or "You are"))


def test_chat_template_helpers_as_transformers():
    """raise_exception, strftime_now and the non-escaping tojson, as transformers renders them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from vxc.chat import ChatError, render

    tpl = ("{% for m in messages %}{{ m | tojson }}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
           "{% endif %}{% endfor %}{{ strftime_now('%Y') }}{{ bos_token }}")
    msgs = [{"role": "user", "content": "<a & 'b'> é"}]
    ref = render_jinja_template([msgs], chat_template=tpl, add_generation_prompt=True, bos_token="<s>")
    ref = ref[0][0] if isinstance(ref, tuple) else ref
    assert render(tpl, msgs, special={"bos_token": "<s>"}) == ref
    with pytest.raises(ChatError, match="no bad"):
        render(tpl, [{"role": "bad", "content": ""}])


def test_exec_chat_equals_its_rendered_tokens(chatml, hf_tok, vxc_inproc):
    mdir, ir, tok = chatml
    ids = _hf_ids(hf_tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    c = vxc_inproc("exec", ir, "--chat", "--system", "Be brief.", "--prompt", "Hello", "--max-new-tokens", 8,
                   "--ignore-eos", "--json")
    assert c.exit_code == 0, c.output
    t = vxc_inproc("exec", ir, "--tokens", _toks(ids), "--max-new-tokens", 8, "--ignore-eos", "--json")
    rc, rt = read_json_line(c.stdout), read_json_line(t.stdout)
    assert rc["prompt_tokens"] == len(ids) and rc["generated_ids"] == rt["generated_ids"]
    s = vxc_inproc("exec", ir, "--chat", "--system", "Be brief.", "--prompt", "Hello", "--max-new-tokens", 8, "--ignore-eos")
    assert s.stdout == rc["generated_text"] + "\n"  # the answer, not the rendered template


def test_chat_without_a_template_is_a_clear_error(chatml, vxc_inproc, tmp_path):
    mdir, ir, tok = chatml
    d = _copy(mdir, tmp_path / "m")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    del tc["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    r = vxc_inproc("exec", ir, "--model-dir", d, "--chat", "--prompt", "Hello", "--max-new-tokens", 2)
    assert r.exit_code == 1 and "no chat template" in r.stderr and "Traceback" not in r.output
    r = vxc_inproc("exec", ir, "--system", "x", "--prompt", "Hello")
    assert r.exit_code == 1 and "--system" in r.stderr and "--chat" in r.stderr
    r = _chat(ir, "Hello\n", "--model-dir", d)
    assert r.exit_code == 1 and "no chat template" in r.output


def _chat(ir, text, *args):
    from vxc.cli import app

    return CliRunner().invoke(app, ["chat", str(ir), *map(str, args)], input=text)


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_interactive_chat_prefills_only_the_new_turn(chatml, hf_tok, vxc_inproc, tmp_path, ending):
    mdir, ir, tok = chatml
    u1, u2 = "Hello there", "And then?"
    d = _copy(mdir, tmp_path / "m")
    if ending == "eos":  # turn 1 ends at a token its free run produces: the stop token is fed with turn 2's text
        free = read_json_line(vxc_inproc("exec", ir, "--chat", "--prompt", u1, "--max-new-tokens", 6, "--ignore-eos",
                                         "--json").stdout)["generated_ids"]
        G.set_generation_eos(d, [free[3]])
    flags = ["--max-new-tokens", 6, "--model-dir", d] + (["--ignore-eos"] if ending == "length" else [])
    r = _chat(ir, f"{u1}\n{u2}\n", *flags, "--json")
    assert r.exit_code == 0, r.output
    t1, t2 = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert t1["finish_reason"] == ending
    ids1 = _hf_ids(hf_tok, [{"role": "user", "content": u1}])
    assert t1["prefill_tokens"] == len(ids1)
    full2 = _hf_ids(hf_tok, [{"role": "user", "content": u1}, {"role": "assistant", "content": t1["generated_text"]},
                             {"role": "user", "content": u2}])
    fed = len(ids1) + len(t1["generated_ids"]) - 1  # the answer's last token was chosen, not fed
    assert full2[:fed] == ids1 + t1["generated_ids"][:-1]  # (this vocabulary re-encodes any text to its ids)
    assert t2["continued"] is True and t2["prefill_tokens"] == len(full2) - fed < len(full2)
    assert t2["position"] == len(full2) + len(t2["generated_ids"]) - 1
    # the second answer equals a one-shot run over the whole rendered history
    one = read_json_line(vxc_inproc("exec", ir, "--tokens", _toks(full2), *flags, "--json").stdout)
    assert t2["generated_ids"] == one["generated_ids"] and t2["finish_reason"] == one["finish_reason"]
    # streamed: the two answers, each on its line
    s = _chat(ir, f"{u1}\n{u2}\n", *flags)
    assert s.exit_code == 0 and s.stdout == t1["generated_text"] + "\n" + t2["generated_text"] + "\n"


# ---------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def bpe():
    return G.cjk_bpe_tokenizer()


def _stream(tok, ids, stop=()):
    from vxc.runtime.tokenizer import Detokenizer

    d = Detokenizer(tok, stop)
    chunks = [d.push(t) for t in ids] + [d.finish()]
    return chunks, d


TEXTS = ["Tokyo in Japanese is 東京. Osaka in Japanese is 大阪.", "北京是中国的首都。", "🎉🚀 party 🍣 寿司 👨‍👩‍👧 👍🏽",
         "東京は日本の首都です。"]


def test_streamed_text_is_the_text_for_split_characters(bpe):
    split = [t for t in TEXTS for i in bpe.encode(t).ids if "\ufffd" in bpe.decode([i])]
    assert split, "the tokenizer must split some characters across tokens for this test to mean anything"
    for text in TEXTS:
        ids = bpe.encode(text).ids
        chunks, d = _stream(bpe, ids)
        assert "".join(chunks) == text == d.text
        assert not any("\ufffd" in c for c in chunks)  # only whole characters are ever emitted


def test_streamed_text_equals_the_final_decode_for_any_ids(bpe):
    import random

    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(bpe.get_vocab_size()) for _ in range(rng.randrange(1, 24))]
        chunks, d = _stream(bpe, ids)
        assert "".join(chunks) == bpe.decode(ids, skip_special_tokens=False)


def test_stop_string_across_split_characters(bpe):
    ids = bpe.encode("東京は日本の首都です。").ids
    chunks, d = _stream(bpe, ids, stop=["首都"])
    assert "".join(chunks) == "東京は日本の" and d.stopped == "首都"
    chunks, d = _stream(bpe, bpe.encode("abc 首").ids, stop=["首都"])  # a prefix that never completes is printed
    assert "".join(chunks) == "abc 首" and d.stopped is None
    assert "首" not in "".join(chunks[:-1])  # ... only once it cannot become the stop string


def _byte_fallback_tokenizer():
    """A SentencePiece-style vocabulary as Llama / Gemma tokenizer.json files describe one: metaspace words, the
    256 <0xNN> byte tokens for everything else, decoded by Replace(▁ → space), ByteFallback, Fuse, Strip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["\u2581", "a", "b", "c", "d", "e", "\u2581the", "\u2581a", "\u2581state", "\u6771", "\u4eac", ".", ","]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _prefix_oracle(tok, ids, stop):
    """The streamed text by definition: the first prefix of the ids whose decode holds a stop string ends the
    text where the earliest one there begins; else the decode of every id."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=False)
        hits = [i for st in stop if (i := text.find(st)) >= 0]
        if hits:
            return text[:min(hits)]
    return tok.decode(ids, skip_special_tokens=False)


def test_windowed_detokenizer_equals_the_whole_decode(bpe, chatml):
    """Long random id sequences (characters split across tokens, invalid byte runs, special tokens) through
    byte-level and byte-fallback vocabularies: the streamed text is the decode of all ids, cut at the first stop
    string as decoding every prefix finds it; and a push decodes a window of a few ids, not the whole answer."""
    import random

    rng = random.Random(11)
    sp = _byte_fallback_tokenizer()
    assert sp.decode(sp.encode("the state \u6771\u4eac\u00e9").ids) == "the state \u6771\u4eac\u00e9"
    pieces = ["the", " state", "\u6771\u4eac", "\u00e9", "\U0001f389", ".", " a", "b", ",", "x", "\n", " "]
    for tok in (bpe, chatml[2], sp):
        V = tok.get_vocab_size()
        for trial in range(12):
            if tok is sp:  # ids of text: tokenizers' ByteFallback turns every byte of an invalid run into U+FFFD,
                # valid ones too, so a decode of random byte tokens rewrites its own earlier text
                ids = tok.encode("".join(rng.choice(pieces) for _ in range(rng.randrange(30, 200)))).ids
            else:
                ids = [rng.randrange(V) for _ in range(rng.randrange(50, 400))]
            chunks, d = _stream(tok, ids)
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=False) == d.text
            full = d.text
            if len(full) < 20:
                continue
            stop = []
            for _ in range(rng.randrange(1, 4)):  # substrings of the text, and one that never occurs
                a = rng.randrange(len(full) - 4)
                stop.append(full[a:a + rng.randrange(1, 5)])
            stop.append("\x00never")
            chunks, d = _stream(tok, ids, stop)
            assert "".join(chunks) == _prefix_oracle(tok, ids, stop), (tok.get_vocab_size(), trial, stop)

    class Counting:
        def __init__(self, tok):
            self.tok, self.most = tok, 0

        def decode(self, ids, **kw):
            self.most = max(self.most, len(ids))
            return self.tok.decode(ids, **kw)

    from vxc.runtime.tokenizer import Detokenizer

    c = Counting(bpe)
    d = Detokenizer(c, ["\x00never"])
    text = "Tokyo in Japanese is 東京. Osaka in Japanese is 大阪. " * 60
    ids = bpe.encode(text).ids
    assert len(ids) > 1500
    assert "".join(d.push(t) for t in ids) + d.finish() == text
    assert c.most <= 8  # the window, not the answer


def test_special_tokens_are_decoded_into_the_text(chatml):
    tok = chatml[2]
    ids = tok.encode("ab<|im_end|>\n<|im_start|>c").ids
    assert len(ids) == 6
    chunks, d = _stream(tok, ids)
    assert d.text == "ab<|im_end|>\n<|im_start|>c" and "".join(chunks) == d.text


def test_exec_streams_cjk_without_repeats(bpe, vxc_inproc, tmp_path):
    from vxc.driver import lower_to_file

    mdir = G.build_chat_model(tmp_path / "bpe", bpe, template=None, eos_token=None)
    ir = tmp_path / "bpe.vxir"
    lower_to_file(mdir, ir)
    prompt = "Tokyo in Japanese is 東京. Osaka in Japanese is"
    # sampled (seeded): random weights then put the pieces of some multi-byte character next to each other
    args = ("exec", ir, "--prompt", prompt, "--max-new-tokens", 48, "--ignore-eos", "--temperature", 1.0, "--seed", 0)
    res = read_json_line(vxc_inproc(*args, "--json").stdout)
    ids = res["generated_ids"]
    final = bpe.decode(ids, skip_special_tokens=False)
    # a character completed by a later token: some prefix of the ids decodes to text the final text does not begin with
    assert any(not final.startswith(bpe.decode(ids[:i])) for i in range(1, len(ids)))
    assert res["generated_text"] == final
    s = vxc_inproc(*args)
    assert s.exit_code == 0 and s.stdout == prompt + final + "\n"


# ---------------------------------------------------------------- smaller behaviours


def test_empty_prompt_is_named(chatml, vxc_inproc):
    ir = chatml[1]
    r = vxc_inproc("exec", ir, "--prompt", "")
    assert r.exit_code == 1 and "--prompt is empty" in r.stderr and "resume-state" not in r.stderr


def test_dtype_lists_every_accepted_dtype(chatml, vxc_inproc):
    ir = chatml[1]
    r = vxc_inproc("exec", ir, "--tokens", "1,2", "--dtype", "fp64")
    assert r.exit_code == 1 and "fp32 | bf16 | fp16" in r.stderr
    h = vxc_inproc("exec", "--help")
    assert "fp32 | bf16 | fp16" in h.stdout
    assert "(fp32 )" not in h.stdout and "positions x vocab" in h.stdout  # --logits-out's help
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", "1,2", "--dtype", "fp16", "--max-new-tokens", 2, "--json").stdout)
    assert res["dtype"] == "fp16" and len(res["generated_ids"]) == 2


def test_max_context_defaults_to_the_models_positions_capped_by_the_budget(chatml, vxc_inproc, monkeypatch):
    import vxc.exec_cmd

    ir = chatml[1]
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", "1,2", "--max-new-tokens", 1, "--json").stdout)
    assert res["max_context"] == 256 and "max_position_embeddings" in res["max_context_source"]  # the config's 256
    s = vxc_inproc("exec", ir, "--tokens", "1,2", "--max-new-tokens", 1)
    assert "--max-context 256 (config.json max_position_embeddings)" in s.stderr
    # per position: 2 layers x (K + V) x 2 KV heads x head_dim 12 x 4 bytes
    per = 2 * 2 * 2 * 12 * 4
    monkeypatch.setattr(vxc.exec_cmd, "STATE_BUDGET", per * 100 + per // 2)
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", "1,2", "--max-new-tokens", 1, "--json").stdout)
    assert res["max_context"] == 100 and "capped at 100 by the state budget" in res["max_context_source"]
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", "1,2", "--max-new-tokens", 1, "--max-context", 300,
                                    "--json").stdout)
    assert res["max_context"] == 300 and res["max_context_source"] == "as given"


def test_load_and_warm_up_are_reported_apart_from_throughput(chatml, vxc_inproc):
    ir = chatml[1]
    res = read_json_line(vxc_inproc("exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 4, "--json").stdout)
    for k in ("load_seconds", "warmup_seconds", "prefill_seconds", "decode_seconds"):
        assert isinstance(res[k], float) and res[k] >= 0, k
    assert res["prefill_tokens_per_s"] == pytest.approx(len(PROMPT_IDS) / res["prefill_seconds"])
    s = vxc_inproc("exec", ir, "--tokens", _toks(PROMPT_IDS), "--max-new-tokens", 4)
    assert "warm-up" in s.stderr and "load" in s.stderr and "tok/s" in s.stderr


def test_gguf_stop_ids_and_context_length_come_from_its_metadata(vxc_inproc, tmp_path):
    """A GGUF file's tokenizer.ggml.eos_token_id (the writer's 2) and llama.context_length (512)."""
    from tests.gguf_support import MINI_LLAMA, write_llama_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", encodings={}, seed=3)
    ir = tmp_path / "m.vxir"
    assert vxc_inproc("lower", path, "-o", ir).exit_code == 0
    r = vxc_inproc("exec", ir, "--tokens", "5,6,7", "--max-new-tokens", 3, "--json")
    assert r.exit_code == 0, r.output
    res = read_json_line(r.stdout)
    assert res["stop_ids"] == [2]
    assert res["max_context"] == MINI_LLAMA["context"] == 512 and "context_length" in res["max_context_source"]


# ---------------------------------------------------------------- structured output on the command line


def test_exec_json_schema(chatml, vxc_inproc, tmp_path):
    """``vxc exec --json-schema FILE``: sampled answers are JSON the schema accepts (checked by hand), ending once
    the JSON is complete; the same seeds without it are not; a bad schema file, or one llguidance refuses, is a
    clear error before or instead of generating."""
    _, ir, _ = chatml
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    for seed in (1, 2, 3):
        args = ("exec", ir, "--prompt", "Answer: ", "--max-new-tokens", 80, "--temperature", 1.0, "--seed", seed, "--json")
        free = read_json_line(vxc_inproc(*args).stdout)["generated_text"]
        r = vxc_inproc(*args, "--json-schema", f)
        assert r.exit_code == 0, r.output
        res = read_json_line(r.stdout)
        v = json.loads(res["generated_text"])
        assert set(v) == {"n", "ok"} and type(v["n"]) is int and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool)
        assert res["finish_reason"] in ("stop", "eos")
        try:
            json.loads(free)
            assert False, f"the unconstrained run wrote JSON: {free!r}"
        except ValueError:
            pass
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = vxc_inproc("exec", ir, "--prompt", "x", "--json-schema", bad)
    assert r.exit_code == 1 and "--json-schema" in r.stderr and "not a readable JSON file" in r.stderr
    bad.write_text(json.dumps({"type": "frob"}))
    r = vxc_inproc("exec", ir, "--prompt", "x", "--json-schema", bad)
    assert r.exit_code == 1 and "frob" in r.stderr
