"""``vxc serve`` under arbitrary request bodies (issue 14: bad requests get a 400, the server keeps serving).

Hypothesis draws bodies for both generation endpoints and /tokenize: every known field with values of every JSON
type (valid ones often: small max_tokens, prompts of text and ids, n, logprobs, echo, stop, penalties, logit_bias,
response_format) plus unknown fields. Every answer must be a 200 with OpenAI's result shape, or a 4xx with
OpenAI's error shape naming a message — never a 500, never a dropped connection — and after every example the
server still answers a plain request and has nothing left in flight.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime import generation_support as G
from tests.runtime.test_serve_openai import serve_model

CONTEXT = 192

JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
                       | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


TEXT = st.lists(st.sampled_from(list("abc 東京\n") + ["<|im_end|>"]), max_size=8).map("".join)
IDS = st.lists(st.integers(0, 110), max_size=6)
TEXT1 = st.lists(st.sampled_from(list("abc 東京\n") + ["<|im_end|>"]), min_size=1, max_size=8).map("".join)
IDS1 = st.lists(st.integers(0, 98), min_size=1, max_size=6)
FORMAT = st.sampled_from([{"type": "text"}, {"type": "json_object"},
                          {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": 9}}}])
COMMON = {
    "max_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 120).map(str), st.floats(-100, 100), max_size=3),
    "response_format": FORMAT,
    "model": st.just("m"),
    "user": st.text(max_size=4),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": TEXT}), max_size=2))})
COMPLETION = dict(COMMON, prompt=st.one_of(TEXT1, IDS1, st.lists(TEXT1, min_size=1, max_size=2),
                                          st.lists(IDS1, min_size=1, max_size=2), TEXT, IDS),
                  echo=st.booleans(), logprobs=st.integers(0, 5))
CHAT = dict(COMMON, messages=st.lists(MESSAGE, max_size=3), logprobs=st.booleans(), top_logprobs=st.integers(0, 5),
            max_completion_tokens=st.integers(0, 4))
TOKENIZE = {"prompt": TEXT, "messages": st.lists(MESSAGE, max_size=2), "add_special_tokens": st.booleans(),
            "add_generation_prompt": st.booleans()}


def _body(fields, required=()):
    """A body of valid values for some of ``fields`` (``required`` always), and one time in three one field (or an
    unknown one) set to any JSON value."""
    optional = sorted(set(fields) - set(required))
    keys = st.lists(st.sampled_from(optional), unique=True, max_size=len(optional))
    base = keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in list(required) + ks}))
    corrupt = st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(sorted(fields) + ["frobnicate", "tools",
                                                                                          "best_of", "suffix"]), JSONISH))
    return st.tuples(base, corrupt).map(lambda bc: bc[0] if bc[1] is None else {**bc[0], bc[1][0]: bc[1][1]})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vxc.driver import lower_to_file

    root = tmp_path_factory.mktemp("fuzz")
    tok = G.chatml_tokenizer()
    mdir = G.build_chat_model(root / "m", tok, max_positions=CONTEXT)
    ir = root / "m.vxir"
    lower_to_file(mdir, ir)
    s = serve_model(mdir, ir, tok, max_context=CONTEXT, sequences=2, stop_ids=[tok.token_to_id("<|im_end|>")],
                    chunk=8, max_queue=8)
    yield s
    s.close()


def _check(server, path, body):
    r = server.client.post(path, json=body)
    assert r.status_code != 500 and r.status_code < 500, (path, body, r.text)
    if r.status_code != 200:
        assert r.status_code in (400, 404), (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body, r.text[-300:])
        for e in events[:-1]:
            obj = json.loads(e)
            assert "error" not in obj, (body, obj)  # a failure inside a stream is an engine failure: a defect here
    elif path == "/tokenize":
        d = r.json()
        assert d["count"] == len(d["tokens"])
    else:
        d = r.json()
        n = (body.get("n") or 1) * (len(body["prompt"]) if path == "/v1/completions" and isinstance(body["prompt"], list)
                                    and body["prompt"] and not isinstance(body["prompt"][0], int) else 1)
        assert [c["index"] for c in d["choices"]] == list(range(n)), (body, d)
        assert d["usage"]["total_tokens"] == d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"]


SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(body=_body(COMPLETION, ["prompt"]))
def test_completions_fuzz(server, body):
    _check(server, "/v1/completions", body)


@SETTINGS
@given(body=_body(CHAT, ["messages"]))
def test_chat_fuzz(server, body):
    _check(server, "/v1/chat/completions", body)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_body(TOKENIZE))
def test_tokenize_fuzz(server, body):
    _check(server, "/tokenize", body)


def test_still_serving_after_the_fuzz(server):
    r = server.client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    h = server.wait(lambda h: h["active"] == 0 and h["waiting"] == 0, what="nothing left in flight")
    assert h["step_failures"] == 0
