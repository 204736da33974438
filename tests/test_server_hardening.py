"""Issue 30's cases against the app: limits, one error path, API key, CORS, model names, stream_options, metrics;
and issue 29's server fields: max_completion_tokens, chat_template_kwargs, n > 1 and tool calls."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.server_helpers import connect, is_openai_error, request, serving, sse_events, tiny_llm  # noqa: E402

MSG = [{"role": "user", "content": "Name three rivers."}]
GREEDY = {"messages": MSG, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served():
    """(url, Server) for an app with a 6 MiB body limit and two model names, on uvicorn."""
    from tfjax.server import create_app

    app = create_app(tiny_llm(), name="tiny", queue=8, max_tokens=8, max_body_mb=6,
                     served_model_names=("tiny", "tiny-alias"))
    with serving(app) as url:
        yield url, app.state.server


def test_a_5_mib_prompt_is_refused_early_while_health_keeps_answering(served):
    url, server = served
    assert server.max_token_bytes is not None  # SmolLM2: byte-level BPE without a normalizer
    body = json.dumps({"messages": [{"role": "user", "content": "wörds and more " * 350_000}]}, ensure_ascii=False).encode()
    assert 5 * 2**20 < len(body) < 6 * 2**20
    out, lat = {}, []

    def big():
        out["reply"] = request(connect(url), "POST", "/v1/chat/completions", body)

    t = threading.Thread(target=big)
    t.start()
    conn = connect(url, timeout=30)
    while t.is_alive():
        t0 = time.perf_counter()
        status, health, _ = request(conn, "GET", "/health")
        lat.append(time.perf_counter() - t0)
        assert status == 200 and health["status"] == "ok"
    t.join()
    status, reply, _ = out["reply"]
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded" and "at least" in \
        reply["error"]["message"]
    print(f"/health during a 5 MiB request: {len(lat)} answers, max {max(lat) * 1e3:.1f} ms")
    assert max(lat) < 1.0, lat  # it was 8 s when the prompt was tokenized on the event loop


def test_a_body_over_the_limit_is_413_with_connection_close(served):
    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    declared = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n{\"prompt\": \"" % (7 * 2**20))
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + b"100000\r\n" + b"x" * 2**20 + b"\r\n")
    rest = b"100000\r\n" + b"x" * 2**20 + b"\r\n"
    for head, tail in ((declared, b""), (chunked, rest * 5 + b"a\r\n0123456789\r\n0\r\n\r\n")):
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # refused from the header / counted
            sock.sendall(head + tail)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head_text, _, body = raw.partition(b"\r\n\r\n")
        assert head_text.startswith(b"HTTP/1.1 413") and b"connection: close" in head_text.lower(), head_text
        reply = json.loads(body)
        assert reply["error"]["code"] == "request_too_large" and is_openai_error(reply)


def test_the_early_length_bound_never_exceeds_the_token_count():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tfjax.server.app import max_token_bytes

    tok = tiny_llm().tokenizer
    most = max_token_bytes(tok)
    special = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", " " * 40, "\n" * 30, "0123456789"])

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.text(max_size=40) | special, max_size=12).map("".join))
    def check(text):
        if not text.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == text:
            return
        ids = tok.backend.encode_batch([text], add_special_tokens=False)[0].ids
        assert -(-len(text.encode()) // most) <= len(ids)

    check()


HOSTILE = [
    b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
    b'{"\\ud800": 1, "messages": [{"role": "user", "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "x\\udfff"}], "stream": true}',
    b"[" * 50_000,
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": "x"}], "seed": 100000000000000000000000000000}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_k": 99999999999999}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"model": "../../etc/passwd", "messages": [{"role": "user", "content": "x"}], "stream": true}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
    b'"parameters": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}}]}",
    b'{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "'
    + b'{\\"a\\": ' * 3000 + b"1" + b"}" * 3000 + b'"}}]}]}',
    b'{"messages": [{"role": ' + b"[" * 900 + b"]" * 900 + b', "content": "x"}]}',
]


def test_hostile_bodies_are_4xx_json_and_the_keep_alive_connection_survives(served):
    url, _ = served
    conn = connect(url)
    for body in HOSTILE:
        status, reply, headers = request(conn, "POST", "/v1/chat/completions", body)
        assert 400 <= status < 500 and is_openai_error(reply), (body[:80], status, reply)
        status, reply, headers = request(conn, "POST", "/tokenize", body)  # may count what it cannot serve
        assert status == 200 or (400 <= status < 500 and is_openai_error(reply)), (body[:80], status, reply)
    status, reply, _ = request(conn, "POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": MSG})
    assert status == 404 and reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    status, reply, _ = request(conn, "POST", "/v1/chat/completions", GREEDY)  # the same connection still works
    assert status == 200 and reply["usage"]["completion_tokens"] == 6


def test_routing_errors_are_json(served):
    url, _ = served
    status, reply, _ = request(connect(url), "GET", "/nope")
    assert status == 404 and is_openai_error(reply)
    status, reply, headers = request(connect(url), "GET", "/v1/chat/completions")
    assert status == 405 and is_openai_error(reply) and "POST" in headers["Allow"]


def test_a_server_fault_is_a_logged_500_json_with_a_request_id_and_a_failed_stream_ends_with_done(served,
                                                                                                  monkeypatch, caplog):
    url, server = served

    def boom(*a, **k):
        raise RuntimeError("a bug")

    with monkeypatch.context() as m:
        m.setattr(server, "_build", boom)
        status, reply, headers = request(connect(url), "POST", "/v1/chat/completions", GREEDY)
    assert status == 500 and reply["error"]["type"] == "server_error" and headers["Connection"] == "close"
    rid = headers["x-request-id"]
    assert rid in reply["error"]["message"] and any(rid in r.getMessage() for r in caplog.records)

    with monkeypatch.context() as m:  # fails after the headers went out
        m.setattr(server, "_delta", boom)
        conn = connect(url)
        conn.request("POST", "/v1/chat/completions", json.dumps({**GREEDY, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = sse_events(resp.read().decode())
    assert events[-1] == "[DONE]" and is_openai_error(events[-2]) and events[-2]["error"]["code"] == "stream_failed"
    status, reply, _ = request(connect(url), "POST", "/v1/chat/completions", GREEDY)
    assert status == 200


def test_served_model_names_are_aliases_echoed_back(served):
    url, _ = served
    names = [m["id"] for m in request(connect(url), "GET", "/v1/models")[1]["data"]]
    assert names == ["tiny", "tiny-alias"]
    a = request(connect(url), "POST", "/v1/chat/completions", {**GREEDY, "model": "tiny-alias"})[1]
    b = request(connect(url), "POST", "/v1/chat/completions", {**GREEDY, "model": "tiny"})[1]
    assert (a["model"], b["model"]) == ("tiny-alias", "tiny") and a["token_sha256"] == b["token_sha256"]


def test_the_usage_chunk_comes_only_when_stream_options_ask(served):
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kw = {"model": "tiny", "messages": MSG, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.choices and c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == text
    assert chunks[-1].model_extra["token_sha256"] == whole.model_extra["token_sha256"]


def test_max_completion_tokens_wins_over_max_tokens(served):
    url, _ = served
    body = {"messages": MSG, "max_tokens": 7, "max_completion_tokens": 3, "ignore_eos": True}
    assert request(connect(url), "POST", "/v1/chat/completions", body)[1]["usage"]["completion_tokens"] == 3


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
    url, server = served
    monkeypatch.setattr(server.tokenizer, "chat_template",
                        "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}{{ extra or '' }}")
    counts = {}
    for name, kwargs in (("default", {}), ("off", {"enable_thinking": False}),
                         ("extra", {"enable_thinking": False, "extra": " and more words here"})):
        status, reply, _ = request(connect(url), "POST", "/tokenize", {"messages": MSG, "chat_template_kwargs": kwargs})
        assert status == 200, reply
        counts[name] = reply["count"]
    assert counts["default"] > counts["off"] < counts["extra"]
    status, reply, _ = request(connect(url), "POST", "/v1/chat/completions",
                               {**GREEDY, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and reply["usage"]["prompt_tokens"] == counts["off"]


def test_a_template_that_knows_tools_gets_them_and_tool_choice_none_leaves_them_out(served, monkeypatch):
    url, server = served
    monkeypatch.setattr(server.tokenizer, "chat_template",
                        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    monkeypatch.setattr(server, "template_knows_tools", True)
    tools = [{"type": "function", "function": {"name": "lookup_the_weather_in_a_city"}}]
    counts = {}
    for choice in ("auto", "none", "required"):
        body = {"messages": MSG, "tools": tools, "tool_choice": choice}
        status, reply, _ = request(connect(url), "POST", "/v1/chat/completions", {**GREEDY, **body})
        assert status == 200, reply
        counts[choice] = reply["usage"]["prompt_tokens"]
    plain = request(connect(url), "POST", "/tokenize", {"messages": MSG})[1]["count"]
    assert counts["none"] == plain < counts["auto"] < counts["required"]  # required adds its instruction


def test_n_choices_are_keyed_streams_each_equal_to_its_own_seeded_request(served):
    url, _ = served
    conn = connect(url)
    sampled = {"messages": MSG, "max_tokens": 8, "temperature": 0.9, "seed": 40, "ignore_eos": True}
    whole = request(conn, "POST", "/v1/chat/completions", {**sampled, "n": 3})[1]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and whole["usage"]["completion_tokens"] == 24
    for i, c in enumerate(whole["choices"]):
        alone = request(conn, "POST", "/v1/chat/completions", {**sampled, "seed": 40 + i, "draft": False})[1]
        assert c["token_sha256"] == alone["token_sha256"] and c["message"]["content"] == \
            alone["choices"][0]["message"]["content"]
    assert len({c["token_sha256"] for c in whole["choices"]}) == 3
    greedy = request(conn, "POST", "/v1/chat/completions", {**GREEDY, "n": 2})[1]
    assert greedy["choices"][0]["token_sha256"] == greedy["choices"][1]["token_sha256"]

    conn.request("POST", "/v1/chat/completions", json.dumps({**sampled, "n": 3, "stream": True}),
                 {"Content-Type": "application/json"})
    events = sse_events(conn.getresponse().read().decode())
    texts, finished = ["", "", ""], {}
    for ev in events[:-1]:
        (c,) = ev["choices"]
        texts[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finished[c["index"]] = ev["token_sha256"]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finished == {i: c["token_sha256"] for i, c in enumerate(whole["choices"])}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_TEXT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_tool_calls_parse_through_the_openai_client_streamed_and_whole(served, monkeypatch):
    """The tiny random model cannot write a call, so its reply text is replaced at the detokenizer: the app's path
    from text to `tool_calls` (whole, streamed in pieces, finish_reason) is what runs."""
    from openai import OpenAI

    from tfjax.server import app as app_module

    url, _ = served
    pieces = iter([])

    def delta(self, tokens, lp=None):
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.pieces = iter([CALL_TEXT[i : i + 5] for i in range(0, len(CALL_TEXT), 5)])
        return "".join(next(self.pieces, "") for _ in tokens)

    def final(self, result):
        rest = "".join(self.pieces) if hasattr(self, "pieces") else CALL_TEXT
        return CALL_TEXT, rest

    monkeypatch.setattr(app_module.Stream, "delta", delta)
    monkeypatch.setattr(app_module.Stream, "final", final)
    del pieces
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
          "max_tokens": 30, "extra_body": {"ignore_eos": True, "stop": ["never-said"]}}
    whole = client.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert whole.choices[0].message.content == "Checking."
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta_ = chunk.choices[0].delta
        content += delta_.content or ""
        for c in delta_.tool_calls or []:
            calls[c.index] = (c.function.name, c.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and calls == {0: ("get_weather", call.function.arguments)}
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL_TEXT
    history = [*kw["messages"], whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
    again = client.chat.completions.create(**{**kw, "messages": history, "tool_choice": "required"})
    assert again.choices[0].message.tool_calls


def test_metrics_parse_and_count_every_outcome_cancelled_streams_included(served):
    from prometheus_client.parser import text_string_to_metric_families

    url, server = served

    def samples() -> dict:
        text = request(connect(url), "GET", "/metrics")[1]
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = samples()
    request(connect(url), "POST", "/v1/chat/completions", GREEDY)
    request(connect(url), "POST", "/v1/chat/completions", {**GREEDY, "temperature": 9})
    long = {"prompt": "on and on", "max_tokens": 200, "temperature": 0.9, "ignore_eos": True, "stream": True}
    for i in range(3):  # each stream gets its first text, then the client goes away
        conn = connect(url)
        conn.request("POST", "/v1/completions", json.dumps({**long, "seed": i}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:  # up to the first event with text
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    deadline = time.time() + 30
    while server.engine.busy:
        assert time.time() < deadline
        time.sleep(0.05)
    after = samples()

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("tfjax_requests_total", (("outcome", "ok"),)) == 1
    assert grew("tfjax_requests_total", (("outcome", "rejected_invalid_value"),)) == 1
    assert grew("tfjax_requests_total", (("outcome", "cancelled"),)) == 3
    assert grew("tfjax_generation_tokens_total") >= 6 and grew("tfjax_time_to_first_token_seconds_count") >= 4
    assert grew("tfjax_inter_token_latency_seconds_count") >= 5 and grew("tfjax_tokens_per_round_count") == 1
    for name in ("tfjax_queue_depth", "tfjax_lanes_busy", "tfjax_lanes_total", "tfjax_rounds_total"):
        assert (name, ()) in after, name
