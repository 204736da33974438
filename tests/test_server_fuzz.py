"""Property-based fuzzing of every endpoint (hypothesis, a fixed example budget): random JSON shapes and values,
near-valid requests with one field gone wrong, lone surrogates, deep nesting, huge numbers and bodies at the
limit, sent in-process through httpx's ASGI transport and over a real socket to uvicorn. Never a 5xx, every
refusal in OpenAI's error shape, every stream ends with [DONE], and afterwards a fixed greedy request has the
token_sha256 it had before."""

from __future__ import annotations

import asyncio
import collections
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.server_helpers import connect, is_openai_error, request, serving, sse_events, tiny_llm  # noqa: E402

LIMIT_MB = 0.25
LIMIT = int(LIMIT_MB * 2**20)
FIXED = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 6, "temperature": 0,
         "ignore_eos": True}
POSTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
GETS = ("/v1/models", "/health", "/metrics")
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "n", "stream", "stream_options", "tools", "tool_choice", "chat_template_kwargs",
          "draft", "ignore_eos", "logprobs", "presence_penalty", "response_format", "user", "tokens", "echo")

# Text with lone surrogates, controls and astral characters as well as letters.
texts = st.text(st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cs", "So"]), max_size=20)
numbers = (st.integers() | st.integers(min_value=-(10**40), max_value=10**40) | st.floats()
           | st.sampled_from([0, 1, -1, 2, 2.5, 1e308, -1e-308, 2**31, 2**63, 0.5]))
scalars = st.none() | st.booleans() | numbers | texts
keys = st.sampled_from(FIELDS) | texts
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4),
                           max_leaves=12)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | texts
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={
    "content": texts | json_values, "tool_calls": json_values, "tool_call_id": texts | json_values}), max_size=3)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | texts, "function": st.fixed_dictionaries(
    {"name": texts}, optional={"parameters": json_values, "description": texts | numbers})}), max_size=2)
plausible = {
    "messages": messages, "prompt": texts | st.lists(st.integers(-5, 60000), max_size=5), "tools": tools,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | scalars}),
    "n": st.integers(-2, 3), "stream": st.booleans(), "temperature": st.floats(-1, 3), "model": st.just("tiny"),
    "chat_template_kwargs": st.dictionaries(keys, json_values, max_size=3),
    "tokens": st.lists(st.integers(-5, 60000), max_size=5) | json_values,
}


BASES = {"/v1/chat/completions": lambda t: {"messages": [{"role": "user", "content": t}], "max_tokens": 3},
         "/v1/completions": lambda t: {"prompt": t, "max_tokens": 3}, "/tokenize": lambda t: {"prompt": t},
         "/detokenize": lambda t: {"tokens": [1, 2, 3]}}


@st.composite
def near_valid(draw, path: str) -> dict:
    """A valid short request for `path` with a few fields set to plausible or random values."""
    body = BASES[path](draw(texts))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(plausible.get(name, json_values) | json_values)
    return body


def cheap(body):
    """Keep generation short: a random but valid length or n would make CPU examples slow, not more telling."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int) and 4 < body[name] < 10**6:
                body[name] = 4
        if isinstance(body.get("n"), int) and 2 < body["n"] < 10**4:
            body["n"] = 2
    return body


def raw_bodies():
    """Bodies no dict can make: broken JSON, deep nesting, huge literals, bad UTF-8, sizes at the limit."""
    deep = st.sampled_from([10, 1000, 5000, 50_000]).flatmap(
        lambda k: st.sampled_from([b"[" * k, b"[" * k + b"]" * k, b'{"a":' * k + b"1" + b"}" * k,
                                   b'{"messages": ' + b"[" * k + b"]" * k + b"}"]))
    huge = st.integers(300, 6000).map(lambda k: b'{"max_tokens": 1' + b"0" * k + b', "prompt": "x"}')
    edge = st.sampled_from([-1, 0, 1]).map(lambda d: b'{"prompt": "' + b"x" * (LIMIT - 14 + d) + b'"}')
    junk = st.binary(max_size=64) | st.sampled_from([b"", b"{", b'{"prompt": "\xff\xfe"}', b"null", b"1e999",
                                                     b'{"prompt": "a", "prompt": 5}', b'{"temperature": NaN}',
                                                     b'"\\ud800"', b'{"prompt": "\\udc00\\ud800"}'])
    return deep | huge | edge | junk


def encoded(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(cheap(body)).encode()


def bodies(path: str):
    return near_valid(path).map(encoded) | json_values.map(encoded) | raw_bodies()


posts = st.sampled_from(POSTS).flatmap(lambda p: st.tuples(st.just("POST"), st.just(p), bodies(p)))
others = st.tuples(st.sampled_from(["GET", "PUT", "DELETE", "POST"]),
                   st.sampled_from([*GETS, "/nope", "/v1/../etc/passwd", "/v1/chat/completions/x"]),
                   json_values.map(encoded))
calls = posts | posts | others


def check(status: int, headers, raw: bytes, what, seen: collections.Counter) -> None:
    """Never a 5xx; JSON errors in OpenAI's shape; a stream always ends with [DONE]."""
    assert status < 500, (what, status, raw[:300])
    seen[status] += 1
    kind = headers.get("content-type", "")
    if status >= 400:
        assert is_openai_error(json.loads(raw)), (what, raw[:300])
    elif kind.startswith("text/event-stream"):
        events = sse_events(raw.decode())
        assert events and events[-1] == "[DONE]", (what, raw[-300:])
        assert not any(isinstance(e, dict) and "error" in e for e in events), (what, raw[-300:])
    elif kind.startswith("application/json"):
        json.loads(raw)


@pytest.fixture(scope="module")
def served():
    """(url, app) for one app with a 0.25 MiB body limit: uvicorn runs it (and its engine thread); the in-process
    client drives the same app object through the ASGI transport."""
    from tfjax.server import create_app

    app = create_app(tiny_llm(), name="tiny", queue=8, max_tokens=4, max_body_mb=LIMIT_MB)
    with serving(app) as url:
        before = request(connect(url), "POST", "/v1/chat/completions", FIXED)[1]["token_sha256"]
        yield url, app
        status, reply, _ = request(connect(url), "POST", "/v1/chat/completions", FIXED)
        assert status == 200 and reply["token_sha256"] == before, "the fuzzing changed a greedy reply"


@pytest.mark.slow  # the two fuzz runs take ~80 s: `pytest -m slow tests/test_server_fuzz.py`
def test_in_process_fuzz_never_gets_a_5xx_and_errors_have_openai_shape(served):
    url, app = served
    loop, seen = asyncio.new_event_loop(), collections.Counter()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tfjax", timeout=120)

    @settings(max_examples=250, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(call=calls)
    def fuzz(call):
        method, path, body = call
        resp = loop.run_until_complete(client.request(method, path, content=body,
                                                      headers={"Content-Type": "application/json"}))
        check(resp.status_code, resp.headers, resp.content, (method, path, body[:200]), seen)

    try:
        fuzz()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    print("in-process statuses:", dict(seen))
    assert {200, 400, 404, 405, 413} <= set(seen), seen  # the examples reached every kind of answer
    assert request(connect(url), "GET", "/health")[0] == 200


@pytest.mark.slow
def test_socket_fuzz_never_gets_a_5xx_and_the_server_keeps_its_replies(served):
    url, _ = served
    seen = collections.Counter()

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(call=posts)
    def fuzz(call):
        _, path, body = call
        conn = connect(url)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            check(resp.status, resp.headers, resp.read(), (path, body[:200]), seen)
        finally:
            conn.close()

    fuzz()
    print("socket statuses:", dict(seen))
    assert {200, 400, 413} <= set(seen), seen
