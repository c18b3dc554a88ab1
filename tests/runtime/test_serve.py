"""``vxc serve`` (issue #14 §2): the OpenAI-compatible server over the Scheduler, exercised through HTTP on loopback.

The miniature is vxc's demo witness (Mamba2 + conv-QKV attention, a character tokenizer, so a prompt's token
count is its length in characters) with a chat template written beside it. Every expected value is computed
apart from the server: greedy continuations by a single-sequence :class:`Session` on an engine of its own, token
counts from the tokenizer file, the rendered chat prompt spelled out by hand. The servers run in this process
(uvicorn in a thread); one test starts ``vxc serve`` as a user would.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch
import pytest

from tests.runtime.conftest import REPO, child_env

CONTEXT = 128
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = ["The state of ", "Hello", "x", "A longer prompt that spans several prefill chunks of sixteen.", "12345 + 6"]
EOS_PROMPT = "Once upon a time"


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """(model dir, .vxir, tokenizer, solo) — ``solo(ids, n, stop_ids)`` is the greedy continuation of a
    single-sequence session on an engine of its own: (generated ids, finish reason)."""
    from tokenizers import Tokenizer

    from vxc.demo import build_demo
    from vxc.driver import lower_to_file
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    root = tmp_path_factory.mktemp("serve")
    mdir = build_demo(root / "mini")
    (mdir / "chat_template.jinja").write_text(TEMPLATE)
    ir = root / "mini.vxir"
    lower_to_file(mdir, ir)
    tok = Tokenizer.from_file(str(mdir / "tokenizer.json"))
    session = Session(Engine(parse_file(ir), mdir, max_context=CONTEXT))

    def solo(ids, n, stop_ids=()):
        session.reset()
        out = session.generate(list(ids), n, Sampler(vocab=session.engine.vocab), stop_ids=stop_ids)
        return out, session.finish_reason

    return mdir, ir, tok, solo


@pytest.fixture(scope="module")
def eos_id(mini):
    """A token the free greedy run of EOS_PROMPT first produces at index k >= 3: the main server's EOS id."""
    _, _, tok, solo = mini
    gen, _ = solo(tok.encode(EOS_PROMPT).ids, 12)
    k = next(i for i in range(3, len(gen)) if gen[i] not in gen[:i])
    return gen[k]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() - t0 < 20, "the server did not start"
            time.sleep(0.01)
        self.client = httpx.Client(base_url=self.url, timeout=30)

    @property
    def served(self):
        return self.app.state.served

    def health(self) -> dict:
        return self.client.get("/health").json()

    def wait(self, cond, timeout=5.0, what="") -> dict:
        t0 = time.monotonic()
        while True:
            h = self.health()
            if cond(h):
                return h
            assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}: {h}"
            time.sleep(0.01)

    def close(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(mini, eos_id):
    from vxc.ir.parser import parse_file
    from vxc.model_files import chat_template
    from vxc.runtime.engine import Engine
    from vxc.serve import create_app

    mdir, ir, tok, _ = mini
    engine = Engine(parse_file(ir), mdir, max_context=CONTEXT, sequences=4)
    app = create_app(engine, tokenizer=tok, model_name="mini", stop_ids=[eos_id],
                     chat_template=chat_template(mdir), chunk=16, max_queue=8)
    s = Server(app)
    yield s
    s.close()
    assert not s.served.worker._thread.is_alive()  # the lifespan stopped the engine's thread


def _sse(lines) -> list:
    """The data events of an SSE body: parsed JSON objects, and "[DONE]"."""
    out = []
    for ln in lines:
        if ln.startswith("data: "):
            d = ln[len("data: "):]
            out.append(d if d == "[DONE]" else json.loads(d))
        else:
            assert ln == "", ln  # nothing but data lines and the blank lines that end events
    return out


def _stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return _sse(list(r.iter_lines()))


def _expect(tok, solo, ids, n, eos):
    """(text, finish_reason as OpenAI spells it, completion tokens) of the solo run."""
    gen, reason = solo(ids, n, [eos])
    shown = gen[:-1] if reason == "eos" else gen
    return tok.decode(shown, skip_special_tokens=False), {"eos": "stop", "length": "length", "context": "length"}[reason], len(gen)


# ---------------------------------------------------------------------------------------------------- completions


def test_completion_equals_solo_run(server, mini, eos_id):
    _, _, tok, solo = mini
    reasons = set()
    for prompt in PROMPTS + [EOS_PROMPT]:
        r = server.client.post("/v1/completions", json={"model": "mini", "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        d = r.json()
        ids = tok.encode(prompt).ids
        assert len(ids) == len(prompt)  # the character tokenizer: the count is independent of vxc
        text, reason, n = _expect(tok, solo, ids, 12, eos_id)
        assert d["object"] == "text_completion" and d["model"] == "mini" and d["id"].startswith("cmpl-")
        assert [c["index"] for c in d["choices"]] == [0]
        assert d["choices"][0]["text"] == text and d["choices"][0]["finish_reason"] == reason
        assert d["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        reasons.add(reason)
    assert reasons == {"stop", "length"}  # the EOS prompt ended on the EOS id, the others by max_tokens
    # token ids as the prompt, and the OpenAI default of 16 new tokens
    ids = tok.encode(PROMPTS[1]).ids
    d = server.client.post("/v1/completions", json={"prompt": ids, "temperature": 0}).json()
    text, reason, n = _expect(tok, solo, ids, 16, eos_id)
    assert (reason, n) == ("length", 16)
    assert d["choices"][0]["text"] == text and d["usage"]["completion_tokens"] == 16


def test_streamed_completion_equals_solo_run(server, mini, eos_id):
    _, _, tok, solo = mini
    for prompt, n in ((PROMPTS[3], 20), (EOS_PROMPT, 12)):
        ev = _stream(server.client, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                        "stream_options": {"include_usage": True}})
        text, reason, count = _expect(tok, solo, tok.encode(prompt).ids, n, eos_id)
        assert ev[-1] == "[DONE]"
        usage, final, pieces = ev[-2], ev[-3], ev[:-3]
        assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": count,
                                                             "total_tokens": len(prompt) + count}
        assert final["choices"][0]["finish_reason"] == reason and final["choices"][0]["text"] == ""
        assert all(e["object"] == "text_completion" and e["choices"][0]["finish_reason"] is None and e["usage"] is None
                   for e in pieces)
        assert len({e["id"] for e in ev[:-1]}) == 1
        assert "".join(e["choices"][0]["text"] for e in pieces) == text
        assert len(pieces) >= len(text) - 1  # streamed as generated, not in one piece at the end
    # without include_usage no chunk carries a usage key
    ev = _stream(server.client, "/v1/completions", {"prompt": "ab", "max_tokens": 3, "temperature": 0})
    assert ev[-1] == "[DONE]" and all("usage" not in e for e in ev[:-1]) and ev[-2]["choices"][0]["finish_reason"]


def test_stop_strings(server, mini, eos_id):
    _, _, tok, solo = mini
    prompt = PROMPTS[1]
    full, reason, _ = _expect(tok, solo, tok.encode(prompt).ids, 24, eos_id)
    assert reason == "length" and len(full) >= 12
    stop = full[7:9]
    assert full.find(stop) >= 1
    want = full[: full.find(stop)]
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["\x01never", stop]}
    d = server.client.post("/v1/completions", json=body).json()
    assert d["choices"][0] == {"index": 0, "text": want, "logprobs": None, "finish_reason": "stop"}
    assert d["usage"]["completion_tokens"] < 24
    ev = _stream(server.client, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == want  # no piece of the stop string was sent
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"
    # a single string; one never produced runs to max_tokens with the whole text
    d = server.client.post("/v1/completions", json=dict(body, stop="\x01never")).json()
    assert d["choices"][0]["text"] == full and d["choices"][0]["finish_reason"] == "length"


def test_sampling_parameters(server):
    body = {"prompt": "Hello", "max_tokens": 10, "temperature": 1.3, "top_k": 40, "top_p": 0.95, "seed": 7}
    a = server.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = server.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    c = [server.client.post("/v1/completions", json=dict(body, seed=s)).json()["choices"][0]["text"] for s in (8, 9, 10)]
    greedy = server.client.post("/v1/completions", json=dict(body, temperature=0)).json()["choices"][0]["text"]
    assert a == b  # a seed makes sampling reproducible
    assert len({a, *c, greedy}) > 2  # ... and the seed and temperature are used


# ---------------------------------------------------------------------------------------------------- chat


def test_chat_completion_renders_the_template(server, mini, eos_id):
    _, _, tok, solo = mini
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    rendered = "<system>Be brief.<user>What is 2+2?<assistant>"  # TEMPLATE, spelled out
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert len(ids) == len(rendered)
    text, reason, n = _expect(tok, solo, ids, 10, eos_id)
    d = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0}).json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-")
    assert d["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert d["choices"][0]["finish_reason"] == reason
    assert d["usage"] == {"prompt_tokens": len(rendered), "completion_tokens": n, "total_tokens": len(rendered) + n}
    ev = _stream(server.client, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 10, "temperature": 0})
    assert ev[0]["object"] == "chat.completion.chunk" and ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[-1] == "[DONE]" and ev[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
    assert "".join(e["choices"][0]["delta"]["content"] for e in ev[1:-2]) == text
    # without max_tokens a chat answer runs until the context is full
    d = server.client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0}).json()
    gen, r = mini[3](ids, CONTEXT, [eos_id])
    assert d["usage"]["completion_tokens"] == len(gen)
    assert d["choices"][0]["finish_reason"] == ("stop" if r == "eos" else "length")


def test_chat_without_a_template_is_a_400(mini):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.serve import create_app

    mdir, ir, tok, _ = mini
    app = create_app(Engine(parse_file(ir), mdir, max_context=32), tokenizer=tok, model_name="m",
                     chat_template_error="no chat_template.jinja")
    s = Server(app)
    try:
        r = s.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------------- errors

LONG = "y" * (CONTEXT + 1)
BAD = [  # (body, param the error names)
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stop": ["a", 3]}, "stop"),
    ({"prompt": 42}, "prompt"),
    ({}, "prompt"),
    ({"prompt": LONG}, "prompt"),
    ({"prompt": [1] * (CONTEXT + 1)}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": ["hi", "ho"], "n": 5}, "n"),  # 10 choices: more than the server's queue of 8
    ({"prompt": ["hi", ""]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [[1, 2], [3, 100000]]}, "prompt"),
    ({"prompt": ["hi", 3]}, "prompt"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -1}, "top_k"),
    ({"prompt": "hi", "seed": -3}, "seed"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "echo": 1}, "echo"),
]
CHAT_BAD = [
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
]
RAW_BAD = [b'{"prompt": "caf\xe9"}', b'{"prompt": ', b'["hi"]', b'{"prompt": "hi", "temperature": NaN}']


def _is_400(r, param=None):
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_completion_request_is_a_400(server, body, param):
    _is_400(server.client.post("/v1/completions", json=body), param)


@pytest.mark.parametrize("body,param", CHAT_BAD, ids=[p + str(i) for i, (_, p) in enumerate(CHAT_BAD)])
def test_bad_chat_request_is_a_400(server, body, param):
    _is_400(server.client.post("/v1/chat/completions", json=body), param)


@pytest.mark.parametrize("raw", RAW_BAD, ids=["utf8", "truncated", "array", "nan"])
def test_bad_body_is_a_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _is_400(server.client.post(path, content=raw, headers={"content-type": "application/json"}))


def test_unknown_model_and_path_are_404(server):
    r = server.client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = server.client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_models_and_health(server):
    # one request of its own first: the step count below must not depend on the tests that ran before this one
    r = server.client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    m = server.client.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["mini"]
    # (the answer can arrive before the step that finished it is counted: the count follows within the step)
    h = server.wait(lambda h: h["scheduler"]["steps"] > 0, what="the request's steps counted")
    assert (h["status"], h["slots"], h["active"], h["waiting"], h["max_context"]) == ("ok", 4, 0, 0, CONTEXT)
    assert h["prefix_cache"] is None


# ---------------------------------------------------------------------------------------------------- load


class CountingCache:
    """A prefix cache that never hits (restore gives 0 cached tokens) and counts its calls: /health shows stats()."""

    def __init__(self):
        self.restores = self.stores = 0

    def restore(self, state, slot, prompt):
        self.restores += 1
        return 0

    def store(self, state, slot, prompt, logits=None):
        self.stores += 1

    def stats(self):
        return {"restores": self.restores, "stores": self.stores}


def test_full_queue_is_a_429(mini, monkeypatch):
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.serve import create_app

    mdir, ir, tok, solo = mini
    engine = Engine(parse_file(ir), mdir, max_context=64, sequences=1)
    gate = threading.Event()
    real = engine.decode_batch

    def slow(*a, **k):  # every decode step waits for the gate: requests are as slow as the test wants
        assert gate.wait(20)
        return real(*a, **k)

    monkeypatch.setattr(engine, "decode_batch", slow)
    cache = CountingCache()
    s = Server(create_app(engine, tokenizer=tok, model_name="m", max_queue=1, prefix_cache=cache))
    results = {}
    try:
        def post(name, prompt):
            results[name] = s.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})

        a = threading.Thread(target=post, args=("a", "first"))
        a.start()
        s.wait(lambda h: h["active"] == 1, what="the first request in the slot")
        b = threading.Thread(target=post, args=("b", "second"))
        b.start()
        h = s.wait(lambda h: h["waiting"] == 1, what="the second request queued")
        assert h["active"] == 1 and h["max_queue"] == 1
        r = s.client.post("/v1/completions", json={"prompt": "third", "max_tokens": 5})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        gate.set()
        a.join(20)
        b.join(20)
        for name, prompt in (("a", "first"), ("b", "second")):  # the queued requests were served, correctly
            assert results[name].status_code == 200
            gen, _ = solo(tok.encode(prompt).ids, 5)
            assert results[name].json()["choices"][0]["text"] == tok.decode(gen)
        h = s.health()
        assert h["prefix_cache"] == {"restores": 2, "stores": cache.stores} and cache.stores > 0
        assert s.client.post("/v1/completions", json={"prompt": "third", "max_tokens": 2}).status_code == 200
    finally:
        gate.set()
        s.close()


def test_disconnect_cancels_and_frees_the_slot(server, monkeypatch):
    sch = server.served.scheduler
    engine = sch.engine
    real_decode, real_submit = engine.decode_batch, sch.submit
    reqs = []

    def slow(*a, **k):  # ~25 ms a step: a full answer of 100 tokens would take 2.5 s
        time.sleep(0.025)
        return real_decode(*a, **k)

    def submit(*a, **k):
        reqs.append(real_submit(*a, **k))
        return reqs[-1]

    monkeypatch.setattr(engine, "decode_batch", slow)
    monkeypatch.setattr(sch, "submit", submit)
    body = {"prompt": "Tell me everything.", "max_tokens": 100, "temperature": 0, "stream": True}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        got = 0
        for ln in r.iter_lines():
            got += ln.startswith("data: ")
            if got == 3:
                break
    t0 = time.monotonic()  # the connection is closed: the request must end now, not after 100 tokens
    server.wait(lambda h: h["active"] == 0 and h["waiting"] == 0, timeout=1.0, what="the slot freed")
    assert time.monotonic() - t0 < 1.0
    assert reqs[0].finish_reason == "cancelled" and 3 <= len(reqs[0].generated) < 50
    # not streamed: a client that gives up (here: a read timeout) cancels its request too
    with pytest.raises(httpx.ReadTimeout):
        server.client.post("/v1/completions", json=dict(body, stream=False), timeout=0.3)
    server.wait(lambda h: h["active"] == 0, timeout=1.5, what="the slot freed")
    assert reqs[1].finish_reason == "cancelled" and len(reqs[1].generated) < 50


def test_concurrent_streams_each_equal_their_solo_run(server, mini, eos_id, monkeypatch):
    _, _, tok, solo = mini
    engine = server.served.engine
    real = engine.decode_batch
    rows = []

    def counting(tokens, *a, **k):
        rows.append(len(tokens))
        return real(tokens, *a, **k)

    monkeypatch.setattr(engine, "decode_batch", counting)
    prompts = [p + str(i) for i, p in enumerate(PROMPTS + [EOS_PROMPT, "more", "q"])]  # 8 requests on 4 slots
    out = {}

    def client(i):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            ev = _stream(c, "/v1/completions", {"prompt": prompts[i], "max_tokens": 14, "temperature": 0})
            out[i] = ("".join(e["choices"][0]["text"] for e in ev[:-2]), ev[-2]["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, p in enumerate(prompts):
        text, reason, _ = _expect(tok, solo, tok.encode(p).ids, 14, eos_id)
        assert out[i] == (text, reason), i
    assert max(rows) >= 2  # requests were decoded together in one batched step
    assert server.health()["active"] == 0 and server.health()["kv_dtype"] == "float32"


def test_a_failing_request_is_a_500_and_the_server_goes_on(server, mini, eos_id, monkeypatch):
    _, _, tok, solo = mini
    engine = server.served.engine
    real = engine.decode_batch
    fail = {"n": 2}

    def flaky(*a, **k):
        if fail["n"] > 0:
            fail["n"] -= 1
            raise RuntimeError("injected failure")
        return real(*a, **k)

    monkeypatch.setattr(engine, "decode_batch", flaky)
    r = server.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected failure" in err["message"]
    ev = _stream(server.client, "/v1/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert ev[-1] == "[DONE]" and "injected failure" in ev[-2]["error"]["message"]
    assert all(e["choices"][0]["finish_reason"] is None for e in ev[:-2])  # no normal end was claimed
    assert fail["n"] == 0
    r = server.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    text, reason, _ = _expect(tok, solo, tok.encode("Hello").ids, 8, eos_id)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    assert server.health()["active"] == 0


# ---------------------------------------------------------------------------------------------------- the command


def test_vxc_serve_command(mini, eos_id, tmp_path, vxc_inproc):
    import shutil

    mdir, ir, tok, solo = mini
    d = shutil.copytree(mdir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))  # found as `vxc exec` finds it
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "vxc.cli", "serve", str(ir), "--model-dir", str(d), "--port", str(port),
                          "--sequences", "2", "--max-context", "64", "--chunk", "8"],
                         env=dict(child_env(), VXC_API_KEY="k3y"), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    auth = {"Authorization": "Bearer k3y"}  # (--api-key from the environment: VXC_API_KEY)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, p.communicate()
            try:
                h = httpx.get(url + "/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert time.monotonic() - t0 < 60, "vxc serve did not come up"
                time.sleep(0.1)
        assert (h["slots"], h["max_context"], h["model"]) == (2, 64, "mini")
        body = {"prompt": EOS_PROMPT, "max_tokens": 12, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30)
        text, reason, n = _expect(tok, solo, tok.encode(EOS_PROMPT).ids, 12, eos_id)
        assert reason == "stop" and r.json()["choices"][0] == {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        assert r.json()["usage"]["completion_tokens"] == n
        # the engine is built and stepped in one thread (its OpenMP team the process's only one: vxc.serve._serve)
        threads = httpx.get(url + "/health", timeout=5).json()["engine_threads"]
        assert threads["built"] == threads["stepped"] and threads["built"].startswith("vxc-engine"), threads
    finally:
        p.terminate()
        _, err = p.communicate(timeout=20)
    assert f"on http://127.0.0.1:{port}" in err and "2 slot(s)" in err and "Traceback" not in err
    assert "API key required" in err
    # bad input: a clear error and a non-zero exit
    r = vxc_inproc("serve", tmp_path / "missing.vxir")
    assert r.exit_code == 1 and "no such IR file" in r.stderr
    r = vxc_inproc("serve", ir, "--max-queue", "0")
    assert r.exit_code == 2 and "--max-queue" in r.output
    r = vxc_inproc("serve", ir, "--dtype", "fp64")
    assert r.exit_code == 1 and "--dtype fp64" in r.stderr


def test_shared_system_prompt_hits_the_prefix_cache(mini, eos_id):
    """With a prefix cache, requests sharing a system prompt restore its state instead of prefilling it again: /health
    counts the hits and the restored tokens, and every output is still the solo run's (greedy identical)."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.prefix_cache import PrefixCache
    from vxc.serve import create_app

    mdir, ir, tok, solo = mini
    system = "You are a terse assistant. Answer in one line. "  # 47 characters: two chunks of 16 and a part
    engine = Engine(parse_file(ir), mdir, max_context=CONTEXT, sequences=2)
    app = create_app(engine, tokenizer=tok, model_name="mini", stop_ids=[eos_id], chat_template=None, chunk=16,
                     max_queue=8, prefix_cache=PrefixCache(1 << 20))
    s = Server(app)
    try:
        questions = ["Hi?", "What is 2+2?", "Okay?"]  # first characters differ: the shared prefix is the system prompt
        assert len(system) == 47
        for i, q in enumerate(questions):
            r = s.client.post("/v1/completions", json={"prompt": system + q, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            text, _, _ = _expect(tok, solo, tok.encode(system + q).ids, 8, eos_id)
            assert r.json()["choices"][0]["text"] == text
        pc = s.health()["prefix_cache"]
        # the first request misses; the next two restore the system prompt's state at its last chunk end (32)
        assert pc["misses"] == 1 and pc["hits"] == 2, pc
        assert pc["hit_tokens"] == 2 * 32, pc
        assert 0 < pc["bytes"] <= pc["budget"] == 1 << 20, pc
        assert s.health()["scheduler"]["prefilled_tokens"] == sum(len(system + q) for q in questions) - 2 * 32
    finally:
        s.close()


def test_serve_tensor_parallel(mini, eos_id, tmp_path, server):
    """``vxc serve --tp 2``: this process serves as rank 0, a spawned rank follows its scheduler step for step
    (vxc.runtime.lockstep). Concurrent greedy requests (slots shared, chunked prefill beside batched steps) give
    the solo runs' text; a stop string decided on rank 0 ends the request on both ranks; a client that disconnects
    mid-stream frees its slot; a seeded sampled request repeats itself; SIGTERM ends both processes."""
    import concurrent.futures as cf
    import shutil
    import signal

    mdir, ir, tok, solo = mini
    d = shutil.copytree(mdir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "vxc.cli", "serve", str(ir), "--model-dir", str(d), "--port", str(port),
                          "--sequences", "2", "--max-context", str(CONTEXT), "--chunk", "8", "--tp", "2"],
                         env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, p.communicate()
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() - t0 < 120, "vxc serve --tp 2 did not come up"
                time.sleep(0.2)

        def complete(body):
            r = httpx.post(url + "/v1/completions", json={"max_tokens": 12, "temperature": 0, **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        prompts = PROMPTS + [EOS_PROMPT]
        with cf.ThreadPoolExecutor(len(prompts)) as ex:  # more requests than the 2 slots: they queue
            got = list(ex.map(lambda s: complete({"prompt": s}), prompts))
        for prompt, c in zip(prompts, got):
            text, reason, _ = _expect(tok, solo, tok.encode(prompt).ids, 12, eos_id)
            assert (c["text"], c["finish_reason"]) == (text, reason), prompt
        # a stop string: the text ends before its first occurrence (rank 0's detokenizer decides, rank 1 follows)
        full = got[0]["text"]
        cut = full[3:5]
        c = complete({"prompt": prompts[0], "stop": [cut]})
        assert c["text"] == full[:full.index(cut)] and c["finish_reason"] == "stop"
        # a client that leaves mid-stream: its slot is freed on both ranks, the next requests still match
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": prompts[1], "max_tokens": 40, "temperature": 0,
                                                                   "stream": True}, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 2:
                    break
        assert complete({"prompt": prompts[1]})["text"] == got[1]["text"]
        sampled = [complete({"prompt": prompts[2], "temperature": 0.9, "seed": 11})["text"] for _ in range(2)]
        assert sampled[0] == sampled[1]
        # the prompt's log-probabilities: every rank prefills that request with the head on every position (the
        # same collectives), and they are the one-process server's within 1e-4; n choices, penalised
        body = {"prompt": prompts[3], "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
        c = complete(body)
        one = server.client.post("/v1/completions", json=body).json()["choices"][0]
        assert c["text"] == one["text"] and c["text"].startswith(prompts[3])
        a, b = c["logprobs"]["token_logprobs"], one["logprobs"]["token_logprobs"]
        assert a[0] is None and len(a) == len(b) == len(prompts[3]) + 3
        assert max(abs(x - y) for x, y in zip(a[1:], b[1:])) < 1e-4
        body = {"prompt": prompts[0], "n": 2, "max_tokens": 8, "temperature": 0.8, "seed": 4, "frequency_penalty": 1.0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert [x["text"] for x in r["choices"]] == [x["text"] for x in server.client.post("/v1/completions", json=body).json()["choices"]]
        h = httpx.get(url + "/health", timeout=5).json()
        assert h["scheduler"]["active"] == 0 and h["step_failures"] == 0
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert "--tp 2 (this process rank 0)" in err and "Traceback" not in err


def test_chat_tensor_parallel(mini):
    """``vxc chat --tp 2``: this process reads the turns as rank 0 (a spawned rank gets each, broadcast); the turns'
    tokens equal ``vxc chat``'s on one process, with a stop string that cuts an answer (the next turn then prefills
    the whole conversation again, on both ranks)."""
    mdir, ir, tok, _ = mini
    turns = "hello there\nwhat now\nand then\n"

    def chat(*extra):
        p = subprocess.run([sys.executable, "-m", "vxc.cli", "chat", str(ir), "--json", "--max-new-tokens", "10",
                            "--max-context", str(CONTEXT), "--stop", "b:", *extra], input=turns, env=child_env(),
                           cwd=REPO, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        return [json.loads(line) for line in p.stdout.splitlines()]

    one, two = chat(), chat("--tp", "2")
    assert len(one) == len(two) == 3
    assert [t["generated_ids"] for t in two] == [t["generated_ids"] for t in one]
    assert [t["finish_reason"] for t in two] == [t["finish_reason"] for t in one]
    assert len({t["generated_text"] for t in one}) == 3


def test_f16_kv_cache_server_equals_its_solo_runs(mini):
    """``load_app(kv_dtype="fp16")`` (``vxc serve --kv-dtype fp16``): /health names the cache type and concurrent
    greedy completions equal single-sequence runs on an engine with the same f16 cache."""
    from vxc.ir.parser import parse_file
    from vxc.runtime.engine import Engine
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session
    from vxc.serve import load_app

    mdir, ir, tok, _ = mini
    session = Session(Engine(parse_file(ir), mdir, max_context=CONTEXT, kv_dtype=torch.float16))
    app, _ = load_app(ir, max_context=CONTEXT, sequences=3, chunk=16, kv_dtype="fp16")
    s = Server(app)
    try:
        assert s.health()["kv_dtype"] == "float16"
        out = {}

        def ask(i, p):
            out[i] = s.client.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "temperature": 0})

        threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS[:3])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for i, p in enumerate(PROMPTS[:3]):
            assert out[i].status_code == 200, out[i].text
            session.reset()
            gen = session.generate(tok.encode(p).ids, 10, Sampler(vocab=session.engine.vocab), stop_ids=s.served.stop_ids)
            body = out[i].json()["choices"][0]
            assert body["text"] == tok.decode(gen[:-1] if session.finish_reason == "eos" else gen,
                                              skip_special_tokens=False), i
    finally:
        s.close()
