"""``vxc serve``'s wider OpenAI surface: log-probabilities (completions ``logprobs`` / ``echo``, chat ``logprobs`` /
``top_logprobs``), ``n`` choices and several prompts in one request, ``presence_penalty`` / ``frequency_penalty`` /
``logit_bias``, and chat content given as text parts.

The model is a llama miniature whose vocabulary is a byte-level BPE trained with so few merges that most CJK
characters and emoji are split across tokens (tests/runtime/generation_support.py). Expected values come from
outside the server: log-probabilities from transformers' own forward of the same checkpoint (log-softmax of its
fp32 logits, at the VINDEX3.md numerical floor), token ids from transformers' greedy loop, penalised choices from
OpenAI's formula applied in this file to a single-sequence :class:`Session`'s logits, n-choice samples from the
same request sent alone with the seed each choice documents.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import references as R
from tests.runtime import generation_support as G
from tests.runtime.test_serve import Server, _stream

CONTEXT = 256
PROMPT = "東京は日本の"  # split across byte tokens: pieces that end inside a character
PROMPT2 = "The quick brown"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, .vxir, tokenizer, transformers fp32 model, fp64 model)."""
    import transformers

    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("openai")
    tok = G.cjk_bpe_tokenizer()
    mdir = G.build_chat_model(root / "m", tok, seed=5, max_positions=CONTEXT)
    ir = root / "m.vxir"
    lower_to_file(mdir, ir)
    m32 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    m64 = transformers.AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).double().eval()
    return mdir, ir, tok, m32, m64


def serve_model(mdir, ir, tok, *, max_context: int, sequences: int, stop_ids, **kw) -> Server:
    """``create_app`` over an engine of ``ir`` with the model directory's chat template, served on loopback."""
    from vxc.ir.parser import parse_file
    from vxc.model_files import chat_template
    from vxc.runtime.engine import Engine
    from vxc.serve import create_app

    engine = Engine(parse_file(ir), mdir, max_context=max_context, sequences=sequences)
    return Server(create_app(engine, tokenizer=tok, model_name="m", stop_ids=stop_ids,
                             chat_template=chat_template(mdir), **kw))


@pytest.fixture(scope="module")
def server(model):
    from vxc.runtime.prefix_cache import PrefixCache

    mdir, ir, tok, _, _ = model
    # no EOS id: every greedy run here goes to max_tokens, so texts and token counts are the reference's
    s = serve_model(mdir, ir, tok, max_context=CONTEXT, sequences=4, stop_ids=[], chunk=4, max_queue=16,
                    prefix_cache=PrefixCache(64 << 20))
    yield s
    s.close()


@pytest.fixture(scope="module")
def session(model):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.session import Session

    mdir, ir, _, _, _ = model
    return Session(Engine(parse_file(ir), mdir, max_context=CONTEXT))


def _hf_greedy(m32, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(R.hf_logits(m32, out)[-1].argmax()))
    return out[len(ids):]


def _reference(model, ids: list[int]):
    """(log-softmax [T, V] of transformers' fp32 logits over ``ids``, the log-probability tolerance): twice the
    logits' floor tolerance (a log-softmax moves by at most twice the largest change of its logits)."""
    _, _, _, m32, m64 = model
    r32 = R.hf_logits(m32, ids)
    r64 = R.hf_logits(m64, ids)
    step = R.hf_prefill_then_step(m32, ids, max(1, len(ids) // 2))
    tol = R.floor_and_tolerance(r32, r64, step)["tol"]
    return torch.log_softmax(r64.double(), -1), 2 * tol


def _top_values(lp_row: torch.Tensor, k: int) -> list[float]:
    return lp_row.topk(k).values.tolist()


def _shown_bytes(shown: str) -> bytes:
    """A token as an entry shows it: its text, or ``bytes:\\xNN...`` (OpenAI's spelling of a token that is not
    whole characters)."""
    if shown.startswith("bytes:"):
        hexes = shown[len("bytes:"):].split("\\x")
        assert hexes[0] == "" and all(len(h) == 2 for h in hexes[1:]), shown
        return bytes(int(h, 16) for h in hexes[1:])
    return shown.encode("utf-8")


def _tokens_spell(L: dict, text: str) -> int:
    """The entries' tokens spell ``text`` byte for byte (random weights choose byte sequences that are not UTF-8:
    decoded as the tokenizer does, with U+FFFD); each whole-character token sits at its ``text_offset``. Returns
    how many were shown as bytes."""
    joined = b"".join(_shown_bytes(t) for t in L["tokens"])
    assert joined.decode("utf-8", errors="replace") == text
    offs = L["text_offset"] + [len(text)]
    assert offs == sorted(offs)
    split = 0
    for i, t in enumerate(L["tokens"]):
        if t.startswith("bytes:"):
            split += 1
        else:
            assert text[offs[i]:offs[i + 1]] == t, (i, t, offs[i])
    return split


# ---------------------------------------------------------------------------------------------------- log-probabilities


def test_completion_logprobs_match_transformers(server, model):
    _, _, tok, m32, _ = model
    ids = tok.encode(PROMPT).ids
    gen = _hf_greedy(m32, ids, 10)
    lp, tol = _reference(model, ids + gen)
    d = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                    "logprobs": 3}).json()
    c = d["choices"][0]
    assert c["text"] == tok.decode(gen) and d["usage"]["completion_tokens"] == 10
    L = c["logprobs"]
    assert set(L) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(L["tokens"]) == len(L["token_logprobs"]) == len(L["top_logprobs"]) == len(L["text_offset"]) == 10
    # each chosen token's log-probability and the three largest at its position, against transformers
    for i, t in enumerate(gen):
        row = lp[len(ids) - 1 + i]
        assert abs(L["token_logprobs"][i] - float(row[t])) <= tol, (i, L["token_logprobs"][i], float(row[t]), tol)
        top = L["top_logprobs"][i]
        assert L["tokens"][i] in top and top[L["tokens"][i]] == L["token_logprobs"][i]
        want = _top_values(row, 3)
        got = sorted(set(top.values()), reverse=True)[:3]
        # keys are texts: ids whose texts coincide (two pieces of one character: both "") share a key
        assert len(got) <= 3 and all(any(abs(g - w) <= tol for w in want) for g in got), (i, got, want)
        assert abs(max(top.values()) - want[0]) <= tol  # greedy: the chosen one is the most likely
    _tokens_spell(L, c["text"])


def test_echo_gives_the_prompts_logprobs(server, model):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 — the prompt's text and every
    prompt token's log-probability (the first one's is null); over chunks of 4 and the one-token chunk at the end
    (a row of the batched step), against transformers. A second time it is the same, though the prefix cache
    then holds the whole prompt (a request asking for prompt log-probabilities prefills it anyway)."""
    _, _, tok, _, _ = model
    text = PROMPT + "です。大阪は"
    ids = tok.encode(text).ids
    assert len(ids) % 4 == 1 and len(ids) > 9  # the last prompt token alone in its chunk
    lp, tol = _reference(model, ids)
    body = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    first = server.client.post("/v1/completions", json=body).json()
    for d in (first, server.client.post("/v1/completions", json=body).json()):
        c = d["choices"][0]
        assert c["text"] == text and c["finish_reason"] == "length"
        assert d["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        L = c["logprobs"]
        assert L["token_logprobs"][0] is None and L["top_logprobs"][0] is None
        assert len(L["token_logprobs"]) == len(ids)
        for p in range(1, len(ids)):
            assert abs(L["token_logprobs"][p] - float(lp[p - 1, ids[p]])) <= tol, (p, tol)
            assert abs(max(L["top_logprobs"][p].values()) - float(lp[p - 1].max())) <= tol
        assert _tokens_spell(L, text) >= 2  # this prompt splits characters across tokens
    assert first["choices"][0]["logprobs"] == d["choices"][0]["logprobs"]
    # with a completion after it: the prompt's entries, then the completion's; the text is the prompt's + the answer
    d = server.client.post("/v1/completions", json=dict(body, max_tokens=4)).json()
    c = d["choices"][0]
    assert c["text"].startswith(text) and len(c["logprobs"]["tokens"]) == len(ids) + 4
    assert c["logprobs"]["token_logprobs"][: len(ids)] == first["choices"][0]["logprobs"]["token_logprobs"]
    _tokens_spell(c["logprobs"], c["text"])
    # echo without logprobs: the text only; token ids as the prompt echo their decoded text
    d = server.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True}).json()
    assert d["choices"][0]["text"].startswith(text) and d["choices"][0]["logprobs"] is None


def test_loglikelihood_payload(server, model):
    """The payload lm-evaluation-harness's local-completions sends for loglikelihood requests (a batch of token-id
    prompts, echo, logprobs 1, max_tokens 1, a seed): a continuation's log-likelihood is the sum of its tokens'
    entries, and it is greedy when each of its tokens is its position's most likely."""
    _, _, tok, _, _ = model
    ctx, cont = tok.encode("東京は").ids, tok.encode("日本の").ids
    other = tok.encode("The quick").ids
    payload = {"model": "m", "prompt": [ctx + cont, other], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    d = server.client.post("/v1/completions", json=payload).json()
    assert [c["index"] for c in d["choices"]] == [0, 1]
    lp, tol = _reference(model, ctx + cont)
    L = d["choices"][0]["logprobs"]
    assert len(L["token_logprobs"]) == len(ctx + cont) + 1
    got = sum(L["token_logprobs"][len(ctx):len(ctx) + len(cont)])
    want = sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert abs(got - want) <= len(cont) * tol
    greedy = all(L["top_logprobs"][len(ctx) + i][L["tokens"][len(ctx) + i]] == max(L["top_logprobs"][len(ctx) + i].values())
                 for i in range(len(cont)))
    assert greedy == all(int(lp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))
    assert len(d["choices"][1]["logprobs"]["tokens"]) == len(other) + 1


def test_streamed_logprobs_equal_the_whole_answer(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = server.client.post("/v1/completions", json=body).json()["choices"][0]
    ev = _stream(server.client, "/v1/completions", body)
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"
    parts = [e["choices"][0]["logprobs"] for e in ev[:-2] if e["choices"][0]["logprobs"]]
    joined = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == whole["logprobs"]
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == whole["text"]
    # echo, streamed: the prompt's text and log-probabilities come first
    ev = _stream(server.client, "/v1/completions", dict(body, echo=True, max_tokens=3))
    first = ev[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None


def test_chat_logprobs(server, model):
    _, _, tok, m32, _ = model
    messages = [{"role": "user", "content": [{"type": "text", "text": "大阪"}, {"type": "text", "text": "は"}]}]
    rendered = ("<|endoftext|><|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                "<|im_start|>user\n大阪は<|im_end|>\n<|im_start|>assistant\n")  # CHATML, spelled out
    ids = tok.encode(rendered, add_special_tokens=False).ids
    gen = _hf_greedy(m32, ids, 8)
    lp, tol = _reference(model, ids + gen)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    d = server.client.post("/v1/chat/completions", json=body).json()
    c = d["choices"][0]
    assert d["usage"]["prompt_tokens"] == len(ids)
    content = c["logprobs"]["content"]
    assert c["message"]["content"] == tok.decode(gen, skip_special_tokens=False) and len(content) == 8
    for i, (t, e) in enumerate(zip(gen, content)):
        row = lp[len(ids) - 1 + i]
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert abs(e["logprob"] - float(row[t])) <= tol
        assert e["bytes"] == list(_shown_bytes(e["token"]))
        assert len(e["top_logprobs"]) == 2
        for a, w in zip(e["top_logprobs"], _top_values(row, 2)):
            assert abs(a["logprob"] - w) <= tol and a["bytes"] == list(_shown_bytes(a["token"]))
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="replace") == c["message"]["content"]
    # logprobs without top_logprobs: no alternatives; streamed: the same entries
    d = server.client.post("/v1/chat/completions", json=dict(body, top_logprobs=None)).json()
    assert all(e["top_logprobs"] == [] for e in d["choices"][0]["logprobs"]["content"])
    ev = _stream(server.client, "/v1/chat/completions", body)
    streamed = [x for e in ev[1:-1] if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    # "developer" is OpenAI's newer name for "system"
    dev = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    sysm = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    a = server.client.post("/v1/chat/completions", json={"messages": dev, "max_tokens": 5, "temperature": 0}).json()
    b = server.client.post("/v1/chat/completions", json={"messages": sysm, "max_tokens": 5, "temperature": 0}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]


# ---------------------------------------------------------------------------------------------------- n and several prompts


def test_n_choices_and_several_prompts(server):
    body = {"max_tokens": 6, "temperature": 1.2, "seed": 11}
    d = server.client.post("/v1/completions", json=dict(body, prompt=[PROMPT, PROMPT2], n=3)).json()
    assert [c["index"] for c in d["choices"]] == list(range(6))
    # choice j of prompt i is the request of that prompt alone with seed 11 + j
    for i, p in enumerate((PROMPT, PROMPT2)):
        for j in range(3):
            alone = server.client.post("/v1/completions", json=dict(body, prompt=p, seed=11 + j)).json()
            assert d["choices"][i * 3 + j]["text"] == alone["choices"][0]["text"], (i, j)
    assert len({c["text"] for c in d["choices"][:3]}) > 1  # the choices differ from each other
    tok_counts = [len(server.served.tok.encode(p).ids) for p in (PROMPT, PROMPT2)]
    assert d["usage"]["prompt_tokens"] == sum(tok_counts)  # each prompt once, not once per choice
    assert d["usage"]["completion_tokens"] == 6 * 6
    # streamed: every choice's chunks carry its index, each ends once; the texts are the same
    ev = _stream(server.client, "/v1/completions", dict(body, prompt=[PROMPT, PROMPT2], n=3,
                                                        stream_options={"include_usage": True}))
    assert ev[-1] == "[DONE]" and ev[-2]["usage"] == d["usage"]
    texts = {k: "" for k in range(6)}
    ends = []
    for e in ev[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            ends.append(c["index"])
    assert sorted(ends) == list(range(6)) and [texts[k] for k in range(6)] == [c["text"] for c in d["choices"]]
    # chat: n choices of one conversation, each with its role chunk
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2}
    dc = server.client.post("/v1/chat/completions", json=chat).json()
    assert [c["index"] for c in dc["choices"]] == [0, 1]
    ev = _stream(server.client, "/v1/chat/completions", chat)
    roles = [e["choices"][0]["index"] for e in ev[:-1] if e["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    for k in (0, 1):
        got = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"][0]["index"] == k)
        assert got == dc["choices"][k]["message"]["content"]
    # token-id prompts, several
    ids = [server.served.tok.encode(p).ids for p in (PROMPT, PROMPT2)]
    d2 = server.client.post("/v1/completions", json=dict(body, prompt=ids, n=1)).json()
    # (without n, each prompt's one choice draws from seed 11: choices 0 and 3 above)
    assert [c["text"] for c in d2["choices"]] == [d["choices"][0]["text"], d["choices"][3]["text"]]


# ---------------------------------------------------------------------------------------------------- penalties and bias


def _penalised_greedy(session, ids, n, presence=0.0, frequency=0.0, bias=None):
    """OpenAI's definition applied here: logit[j] += bias[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] the
    times j was chosen so far; greedy choice; logits from a single-sequence session."""
    session.reset()
    V = session.engine.vocab
    logits = session.prefill(ids, last_only=True)[-1]
    counts = torch.zeros(V, dtype=torch.float64)
    out = []
    for _ in range(n):
        x = logits[:V].double().clone()
        for j, b in (bias or {}).items():
            x[j] += b
        x -= counts * frequency + (counts > 0).double() * presence
        t = int(x.argmax())
        out.append(t)
        counts[t] += 1
        logits = session.step(t)
    return out


@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (1.2, 0.0), (-0.5, 2.0)])
def test_penalties_follow_openais_formula(server, session, model, presence, frequency):
    _, _, tok, _, _ = model
    ids = tok.encode(PROMPT2).ids
    want = _penalised_greedy(session, ids, 16, presence, frequency)
    plain = _penalised_greedy(session, ids, 16)
    assert want != plain  # the penalties change this continuation (else the test could not fail)
    d = server.client.post("/v1/completions", json={"prompt": PROMPT2, "max_tokens": 16, "temperature": 0,
                                                    "presence_penalty": presence, "frequency_penalty": frequency,
                                                    "logprobs": 0}).json()
    c = d["choices"][0]
    assert c["text"] == tok.decode(want)
    # the log-probabilities reported are the model's own, before the penalties
    session.reset()
    rows = session.prefill(ids + want[:-1], last_only=False)[len(ids) - 1:]
    lp = torch.log_softmax(rows[:, : session.engine.vocab].double(), -1)
    for i, t in enumerate(want):
        assert abs(c["logprobs"]["token_logprobs"][i] - float(lp[i, t])) < 1e-4


def test_logit_bias(server, session, model):
    _, _, tok, _, _ = model
    ids = tok.encode(PROMPT2).ids
    plain = _penalised_greedy(session, ids, 8)
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    want = _penalised_greedy(session, ids, 8, bias=banned)
    assert want[0] != plain[0] and plain[0] not in want and plain[1] not in want
    d = server.client.post("/v1/completions", json={"prompt": PROMPT2, "max_tokens": 8, "temperature": 0,
                                                    "logit_bias": {str(k): v for k, v in banned.items()}}).json()
    assert d["choices"][0]["text"] == tok.decode(want)
    # a bias of +100 on one id: sampling at any temperature chooses it every time
    forced = tok.encode("京").ids[0]
    d = server.client.post("/v1/completions", json={"prompt": PROMPT2, "max_tokens": 5, "temperature": 1.0, "seed": 2,
                                                    "logit_bias": {str(forced): 100}}).json()
    assert d["choices"][0]["text"] == tok.decode([forced] * 5)


# ---------------------------------------------------------------------------------------------------- the parts below the server


def test_sampler_penalties_and_bias_on_known_logits():
    """Hand-worked sequences (logits 0, 1, 2, 3): frequency 0.6 → 3, 3 (3 − 0.6 = 2.4 > 2), 2 (3 − 1.2 = 1.8 < 2),
    3 (2 − 0.6 = 1.4 < 1.8), 2 (3 − 1.8 = 1.2 < 1.4), 3; presence 0.5 → 3 always (2.5 > 2); presence 1.5 → 3,
    2 (1.5 < 2), 3 (2 − 1.5 = 0.5 < 1.5), 3; a bias of +5 on id 0 → 0."""
    from vxc.runtime.sampling import Sampler

    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    keep = x.clone()

    def run(s, n):
        return [s(x) for _ in range(n)]

    assert run(Sampler(vocab=4, frequency_penalty=0.6), 6) == [3, 3, 2, 3, 2, 3]
    assert run(Sampler(vocab=4, presence_penalty=0.5), 4) == [3, 3, 3, 3]
    assert run(Sampler(vocab=4, presence_penalty=1.5), 4) == [3, 2, 3, 3]
    assert run(Sampler(vocab=4, logit_bias={0: 5.0}), 2) == [0, 0]
    assert run(Sampler(vocab=4), 3) == [3, 3, 3]
    assert torch.equal(x, keep)  # the logits given are never written


def test_scheduler_prompt_logprobs_over_chunks(model, session):
    """The scheduler's prompt log-probabilities (prefill chunks of 4, a one-token last chunk through the batched
    step) against a single-sequence session's prefill of the whole prompt, and none kept without being asked."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.scheduler import Scheduler, SchedulerError

    mdir, ir, tok, _, _ = model
    sch = Scheduler(Engine(parse_file(ir), mdir, max_context=CONTEXT, sequences=2), chunk=4)
    ids = tok.encode(PROMPT + "です。大阪").ids
    a = sch.submit(ids, max_new_tokens=2, logprobs=3, prompt_logprobs=True)
    b = sch.submit(ids, max_new_tokens=2)
    sch.run()
    session.reset()
    rows = session.prefill(ids + a.generated[:1])
    lp = torch.log_softmax(rows[:, : session.engine.vocab].double(), -1)
    assert len(a.prompt_token_logprobs) == len(ids) - 1 and b.prompt_token_logprobs == [] and b.token_logprobs == []
    for p, (v, top) in enumerate(a.prompt_token_logprobs, start=1):
        assert abs(v - float(lp[p - 1, ids[p]])) < 1e-4
        assert all(abs(g - w) < 1e-4 for (_, g), w in zip(top, lp[p - 1].topk(3).values.tolist()))
    v, top = a.token_logprobs[0]
    assert abs(v - float(lp[len(ids) - 1, a.generated[0]])) < 1e-4 and len(top) == 3
    assert a.generated == b.generated
    with pytest.raises(SchedulerError, match="prompt_logprobs needs logprobs"):
        sch.submit(ids, max_new_tokens=1, prompt_logprobs=True)

    class Recording:  # a prefix cache that never hits and records what it is asked to store
        def __init__(self):
            self.stored = []

        def restore(self, state, slot, prompt):
            return 0

        def store(self, state, slot, tokens, logits=None):
            self.stored.append((len(tokens), logits is not None))

    # a prompt's logits are stored with its last state only from the last-position head (what a cold run of the
    # same prompt computes); a request that asked for its prompt's log-probabilities ran the all-position head
    for asked, want in ((False, True), (True, False)):
        cache = Recording()
        one = Scheduler(Engine(parse_file(ir), mdir, max_context=CONTEXT, sequences=1), chunk=4, prefix_cache=cache)
        one.submit(ids[:12], max_new_tokens=1, **({"logprobs": 0, "prompt_logprobs": True} if asked else {}))
        one.run()
        assert cache.stored[-1] == (12, want) and all(not kept for _, kept in cache.stored[:-1]), cache.stored


def test_json_never_carries_infinities():
    from vxc.serve import _clean

    assert _clean(float("-inf")) == -9999.0 and _clean(float("nan")) is None and _clean(-1.5) == -1.5
    json.dumps([_clean(float("-inf"))], allow_nan=False)


def test_token_bytes_follow_the_tokenizers_decoder(model):
    """TokenBytes spells a byte-level vocabulary's tokens as the tokenizers library decodes them (every token whose
    bytes are whole characters), its alphabet is the library's, and a byte-fallback vocabulary's <0xNN> tokens
    are their byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from vxc.runtime.tokenizer import TokenBytes, _byte_level_alphabet

    assert set(_byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = model[2]
    tb = TokenBytes(tok)
    whole = split = 0
    for i in range(tok.get_vocab_size()):
        b = tb(i)
        assert b is not None, tok.id_to_token(i)
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            split += 1
            continue
        whole += 1
        assert tok.decode([i], skip_special_tokens=False) == text, i
    assert whole > 100 and split > 10
    sp = Tokenizer(models.BPE(vocab={"<unk>": 0, "<0xE6>": 1, "<0x9D>": 2, "<0xB1>": 3, "▁a": 4}, merges=[],
                              byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tb = TokenBytes(sp)
    assert [tb(i) for i in range(5)] == [None, b"\xe6", b"\x9d", b"\xb1", None]
    assert sp.decode([1, 2, 3]) == "東"  # the library's ByteFallback: the three bytes are one character


def test_tokenize_and_detokenize(server, model):
    """vLLM's /tokenize and /detokenize: a prompt's ids as the tokenizer encodes it (and as the completion counts
    them), chat messages' ids as the chat completion prefills them, the text of ids; bad input is a 400."""
    _, _, tok, _, _ = model
    r = server.client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r == {"count": len(tok.encode(PROMPT).ids), "max_model_len": CONTEXT, "tokens": tok.encode(PROMPT).ids}
    d = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert d["usage"]["prompt_tokens"] == r["count"]
    messages = [{"role": "user", "content": "大阪は"}]
    r = server.client.post("/tokenize", json={"messages": messages}).json()
    rendered = ("<|endoftext|><|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                "<|im_start|>user\n大阪は<|im_end|>\n<|im_start|>assistant\n")  # CHATML, spelled out
    assert r["tokens"] == tok.encode(rendered, add_special_tokens=False).ids
    d = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert d["usage"]["prompt_tokens"] == r["count"]
    r2 = server.client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert r2["count"] == r["count"] - len(tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids)
    assert server.client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": rendered}
    for path, body, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": 3}, "prompt"), ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "ab"}, "tokens"), ("/tokenize", {"prompt": "a", "x": 1}, "x")):
        e = server.client.post(path, json=body)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)
    assert server.client.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 404


# ---------------------------------------------------------------------------------------------------- structured output

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["code", "n", "ok", "city"],
          "properties": {"code": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "city": {"enum": ["東京", "大阪"]}}}


def _conforms(text: str) -> bool:
    """``text`` is one JSON document that SCHEMA accepts (checked here by hand, key by key)."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"code", "n", "ok", "city"} and isinstance(v["code"], str)
            and len(v["code"]) <= 4 and type(v["n"]) is int and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool)
            and v["city"] in ("東京", "大阪"))


@pytest.fixture(scope="module")
def eos_server(model):
    """The same model served with its EOS id (<|endoftext|>): structured output ends an answer with it."""
    mdir, ir, tok, _, _ = model
    s = serve_model(mdir, ir, tok, max_context=CONTEXT, sequences=4, stop_ids=[tok.token_to_id("<|endoftext|>")],
                    chunk=4, max_queue=16)
    yield s
    s.close()


def test_json_schema_response_format(eos_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    body = {"messages": [{"role": "user", "content": "東京"}], "max_tokens": 160, "temperature": 1.0, "seed": 5}
    free = [eos_server.client.post("/v1/chat/completions", json=dict(body, seed=k)).json()["choices"][0]["message"]["content"]
            for k in range(3)]
    assert not any(_conforms(t) for t in free)  # random weights alone write no such JSON (the test can fail)
    d = eos_server.client.post("/v1/chat/completions", json=dict(body, n=4, response_format=fmt)).json()
    for c in d["choices"]:
        assert _conforms(c["message"]["content"]), c
        assert c["finish_reason"] == "stop"
    # streamed: the same text as the same request not streamed (one choice both ways: a rerun of the same rows);
    # a completion request takes response_format too
    one = eos_server.client.post("/v1/chat/completions", json=dict(body, response_format=fmt)).json()
    ev = _stream(eos_server.client, "/v1/chat/completions", dict(body, response_format=fmt))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1])
    assert text == one["choices"][0]["message"]["content"] and _conforms(text)
    d = eos_server.client.post("/v1/completions", json={"prompt": "The record: ", "max_tokens": 160, "temperature": 0,
                                                        "response_format": fmt}).json()
    assert _conforms(d["choices"][0]["text"]), d
    # json_object: a JSON object
    d = eos_server.client.post("/v1/chat/completions", json=dict(body, response_format={"type": "json_object"},
                                                                 max_tokens=200)).json()
    c = d["choices"][0]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["message"]["content"]), dict)
    else:  # cut by max_tokens: what was written is the start of an object
        assert c["message"]["content"].lstrip().startswith("{")
    # text: no constraint
    d = eos_server.client.post("/v1/chat/completions", json=dict(body, seed=0, response_format={"type": "text"})).json()
    assert d["choices"][0]["message"]["content"] == free[0]


@pytest.mark.parametrize("fmt,why", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}, "cannot be used"),
    ({"type": "json_schema"}, "json_schema goes with type json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "json_schema goes with type json_schema"),
    ({"type": "xml"}, None),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, None),
])
def test_bad_response_format_is_a_400(eos_server, fmt, why):
    r = eos_server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 2, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("response_format")
    if why:
        assert why in err["message"]


def test_structured_output_needs_an_eos_id(server):
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                         "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "EOS id" in r.json()["error"]["message"]


def test_api_key(model):
    """create_app(api_key=...) / vxc serve --api-key: every endpoint but /health needs the bearer key (401,
    OpenAI's error shape, without it or with another); /health stays open for probes."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.serve import ServeError, create_app

    mdir, ir, tok, _, _ = model
    app = create_app(Engine(parse_file(ir), mdir, max_context=32), tokenizer=tok, model_name="m", api_key="s3cret")
    s = Server(app)
    try:
        body = {"prompt": "ab", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cret2"}):
            for path, method in (("/v1/completions", "post"), ("/v1/models", "get"), ("/tokenize", "post")):
                r = getattr(s.client, method)(path, headers=headers, **({"json": body} if method == "post" else {}))
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers, r.text)
        ok = {"Authorization": "Bearer s3cret"}
        assert s.client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert s.client.get("/v1/models", headers=ok).status_code == 200
        assert s.client.get("/health").status_code == 200
    finally:
        s.close()
    with pytest.raises(ServeError, match="empty"):
        create_app(Engine(parse_file(ir), mdir, max_context=32), tokenizer=tok, model_name="m", api_key="")


def _metrics(server) -> dict:
    """GET /metrics parsed by prometheus_client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = server.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics(server):
    """GET /metrics: the requests, prompt and completion tokens a batch of requests reports in its usage, by finish
    reason; time-to-first-token and latency histograms counting each choice; the scheduler's and the prefix
    cache's figures as /health shows them."""
    before = _metrics(server)

    def get(m, name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    for body in ({"prompt": PROMPT, "max_tokens": 5}, {"prompt": [PROMPT, PROMPT2], "max_tokens": 3, "n": 2},
                 {"prompt": PROMPT2, "max_tokens": 0, "echo": True, "logprobs": 1}):
        u = server.client.post("/v1/completions", json=dict(body, temperature=0)).json()["usage"]
        for k in usage:
            usage[k] += u[k]
    after = _metrics(server)
    choices = 1 + 4 + 1
    assert get(after, "vxc_requests_total", finish_reason="length") - get(before, "vxc_requests_total", finish_reason="length") == choices
    assert get(after, "vxc_request_completion_tokens_total") - get(before, "vxc_request_completion_tokens_total") == usage["completion_tokens"]
    # (usage counts a prompt once for its n choices; the per-request counter counts every choice's prompt)
    p1, p2 = (len(server.served.tok.encode(p).ids) for p in (PROMPT, PROMPT2))
    assert get(after, "vxc_request_prompt_tokens_total") - get(before, "vxc_request_prompt_tokens_total") == p1 + 2 * p1 + 2 * p2 + p2
    assert usage["prompt_tokens"] == p1 + p1 + p2 + p2
    assert get(after, "vxc_request_seconds_count") - get(before, "vxc_request_seconds_count") == choices
    # a max_tokens 0 request chooses no token: 5 first tokens
    assert get(after, "vxc_time_to_first_token_seconds_count") - get(before, "vxc_time_to_first_token_seconds_count") == 5
    h = server.health()
    assert get(after, "vxc_slots") == 4 and get(after, "vxc_requests_running") == 0
    assert get(after, "vxc_decode_steps_total") <= h["scheduler"]["decode_steps"] and get(after, "vxc_decode_steps_total") > 0
    assert get(after, "vxc_prefix_cache_budget") == 64 << 20 and ("vxc_prefix_cache_hits_total", ()) in after


def test_mixed_requests_side_by_side_equal_their_runs_alone(eos_server):
    """Continuous batching with every extra at once: requests with n choices, log-probabilities, a JSON schema,
    penalties and a logit bias sent concurrently (more choices than the 4 slots: some wait) each answer exactly
    what the same request answers alone — choices, texts and finish reasons identical, the token log-probabilities
    the same tokens within 1e-4 (a batched row is not promised bit-equality with a lone step on every CPU:
    tests/runtime/batch_check.py bounds the difference)."""
    import concurrent.futures as cf

    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    bodies = [
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2},
        {"prompt": PROMPT2, "max_tokens": 10, "temperature": 1.1, "seed": 4, "n": 3},
        {"prompt": "東京", "max_tokens": 160, "temperature": 1.0, "seed": 9, "response_format": fmt},
        {"prompt": PROMPT2, "max_tokens": 12, "temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"prompt": [PROMPT, PROMPT2], "max_tokens": 8, "temperature": 0, "logit_bias": {"5": -100, "7": 3}, "echo": True,
         "logprobs": 1},
    ]

    def post(b):
        r = eos_server.client.post("/v1/completions", json=b)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    alone = [post(b) for b in bodies]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        together = list(ex.map(post, bodies))
    for a, t in zip(alone, together):
        assert [(c["index"], c["text"], c["finish_reason"]) for c in t] == \
            [(c["index"], c["text"], c["finish_reason"]) for c in a]
        for ca, ct in zip(a, t):
            if ca["logprobs"] is None:
                assert ct["logprobs"] is None
                continue
            assert ct["logprobs"]["tokens"] == ca["logprobs"]["tokens"]
            pairs = [(x, y) for x, y in zip(ca["logprobs"]["token_logprobs"], ct["logprobs"]["token_logprobs"])]
            assert all((x is None and y is None) or abs(x - y) <= 1e-4 for x, y in pairs), pairs
    assert _conforms(alone[2][0]["text"])
    h = eos_server.wait(lambda h: h["active"] == 0 and h["waiting"] == 0, what="nothing in flight")
    assert h["step_failures"] == 0
