"""The OpenAI-compatible server over real HTTP on 127.0.0.1: a tiny random llama speaking SmolLM2's tokenizer."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

QUEUE = 3


@pytest.fixture(scope="module")
def served():
    """(base url, Server) for a tiny model with 4 lanes, run by uvicorn in a background thread."""
    from tests.server_helpers import serving, tiny_llm
    from tfjax.server import create_app

    app = create_app(tiny_llm(), name="tiny", queue=QUEUE, max_tokens=16)
    with serving(app) as url:
        yield url, app.state.server


def post(url: str, path: str, body, timeout: float = 120):
    """(status, JSON body, headers) of one POST; `body` bytes go out as they are."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"null"), resp.headers
    conn.close()
    return out


def get(url: str, path: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


def open_stream(url: str, path: str, body: dict):
    """A streaming POST: (connection, response) to read SSE lines from."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"stream_options": {"include_usage": True}, **body, "stream": True}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def events(resp):
    """Parsed SSE data events until [DONE]."""
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            return
        yield json.loads(line[6:])


def stream_text(url: str, path: str, body: dict) -> tuple[str, dict]:
    """(concatenated text, the final usage event) of a streamed request."""
    conn, resp = open_stream(url, path, body)
    text, last = [], None
    for ev in events(resp):
        assert "error" not in ev, ev
        for c in ev["choices"]:
            text.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
        if ev.get("usage"):
            last = ev
    conn.close()
    return "".join(text), last


CHAT = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12, "ignore_eos": True}
REQUESTS = [
    ("/v1/completions", {"prompt": "def add(a, b):\n    return", "max_tokens": 20, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_k": 20,
                         "top_p": 0.95, "seed": 3, "ignore_eos": True}),
    ("/v1/chat/completions", {**CHAT, "temperature": 0}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 18, "temperature": 0.8, "min_p": 0.05, "seed": 11}),
]


def test_openai_client_streams_and_non_streams_a_chat_completion(served):
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say hello."}]
    extra = {"ignore_eos": True, "seed": 5}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.7,
                                           extra_body=extra)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    assert len(whole.model_extra["token_sha256"]) == 64 and whole.model_extra["tokens_per_round"] >= 1
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.7,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage.usage.completion_tokens == 10
    assert usage.model_extra["token_sha256"] == whole.model_extra["token_sha256"]
    assert client.models.list().data[0].id == "tiny"


def post_patiently(url: str, path: str, body) -> dict:
    """The reply body, waiting out 429s as their Retry-After says (a burst can meet lanes not yet freed)."""
    for _ in range(50):
        status, out, headers = post(url, path, body)
        if status != 429:
            assert status == 200, out
            return out
        time.sleep(min(float(headers.get("Retry-After", 1)), 1.0))
    raise AssertionError("still 429 after 50 tries")


def test_concurrent_requests_equal_alone_and_plain_equals_drafted(served):
    url, _ = served
    alone = [post_patiently(url, path, body) for path, body in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: post_patiently(url, *r), REQUESTS))
        plain = list(pool.map(lambda r: post_patiently(url, r[0], {**r[1], "draft": False}), REQUESTS))
    for a, b, c in zip(alone, together, plain, strict=True):
        assert a["token_sha256"] == b["token_sha256"] == c["token_sha256"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] > 0
        assert c["draft"] is False and c["rounds"] == c["usage"]["completion_tokens"] - 1  # one token a round
    assert max(a["tokens_per_round"] for a in alone) > 1.0, "no request was drafted: the check would be empty"
    assert len({a["token_sha256"] for a in alone}) == len(alone)


def test_streamed_text_is_the_reply_also_with_stop_strings(served):
    url, _ = served
    body = {"prompt": "The list goes on and on:", "max_tokens": 24, "temperature": 1.0, "seed": 2, "ignore_eos": True}
    full = post(url, "/v1/completions", body)[1]["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    for extra in ({}, {"stop": [stop, "never-appears"]}):
        whole = post(url, "/v1/completions", {**body, **extra})[1]
        text, last = stream_text(url, "/v1/completions", {**body, **extra})
        assert text == whole["choices"][0]["text"]
        assert last["token_sha256"] == whole["token_sha256"]
    assert stop not in whole["choices"][0]["text"] and whole["choices"][0]["finish_reason"] == "stop"
    assert full.startswith(whole["choices"][0]["text"])


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({"messages": "hello"}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4o"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400,
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"10": 101}}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400, "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, 400, "invalid_value"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty_x": 1}, 400, "unknown_parameter"),
    ({"max_tokens": 4}, 400, "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "word " * 300}]}, 400, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 250}, 400, "context_length_exceeded"),
]


def test_each_bad_input_gets_its_status_and_code_and_the_server_keeps_serving(served):
    url, server = served
    for body, status, code in BAD:
        got, reply, _ = post(url, "/v1/chat/completions", body)
        assert (got, reply["error"]["code"]) == (status, code), (body, reply)
        assert reply["error"]["message"]
    got, reply, _ = post(url, "/v1/completions", {"prompt": ["a", "b"]})
    assert (got, reply["error"]["code"]) == (400, "unsupported_parameter")

    # A full queue: with the engine paused, a request for each free lane and QUEUE more wait, the next is turned away
    # (a burst the size of the idle lanes is never refused).
    server.worker.pause()
    n = QUEUE + server.worker.free_lanes()
    assert n > QUEUE
    with ThreadPoolExecutor(n) as pool:
        try:
            waiting = [pool.submit(post, url, "/v1/completions", {"prompt": f"q{i}", "max_tokens": 3})
                       for i in range(n)]
            deadline = time.time() + 30
            while server.worker.queued() < n:
                assert time.time() < deadline
                time.sleep(0.01)
            got, reply, headers = post(url, "/v1/completions", {"prompt": "one too many", "max_tokens": 3})
        finally:
            server.worker.resume()
        assert (got, reply["error"]["code"]) == (429, "queue_full") and int(headers["Retry-After"]) >= 1
        assert all(f.result()[0] == 200 for f in waiting)
    got, reply, _ = post(url, "/v1/chat/completions", CHAT)
    assert got == 200 and reply["usage"]["completion_tokens"] == CHAT["max_tokens"]


def test_a_failing_request_changes_no_other_lane_and_the_server_keeps_serving(served):
    from tfjax.engine import Request

    url, server = served
    alone = [post(url, path, body)[1]["token_sha256"] for path, body in REQUESTS[:2]]
    failed = threading.Event()
    calls = []

    def explode(tokens):
        calls.append(tokens)
        if len(calls) == 3:
            raise RuntimeError("boom")

    results = []
    bad = Request(server.llm.encode("a doomed request"), max_tokens=40, ignore_eos=True, on_tokens=explode,
                  on_finish=lambda r: (results.append(r), failed.set()))
    with ThreadPoolExecutor(2) as pool:  # the doomed request plus two stay within the queue's 3
        server.worker.submit(bad)
        together = list(pool.map(lambda r: post(url, *r)[1]["token_sha256"], REQUESTS[:2]))
    assert failed.wait(30) and results[0].finish_reason == "error" and "boom" in results[0].error
    assert together == alone
    assert get(url, "/health")[0] == 200


def wait_idle(server, seconds: float = 30) -> None:
    """Until the shared server has no request left from an earlier test (a slow machine frees lanes later)."""
    deadline = time.time() + seconds
    while server.engine.busy:
        assert time.time() < deadline, "requests kept their lanes past the deadline"
        time.sleep(0.05)


def test_a_disconnect_mid_stream_frees_the_lane_within_one_round(served):
    url, server = served
    wait_idle(server)  # the four streams below must find four free lanes
    long = {"prompt": "keep going", "max_tokens": 200, "temperature": 0.9, "ignore_eos": True}
    streams = []
    for i in range(4):  # each stream holds a lane (its first text) before the next arrives: never a queue of them
        streams.append(open_stream(url, "/v1/completions", {**long, "seed": i}))
        next(ev for ev in events(streams[-1][1]) if ev["choices"] and ev["choices"][0]["text"])
    assert len(server.engine.scheduler.running) == 4
    before = len(server.worker.cancel_log)
    conn, resp = streams[0]
    resp.close()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    got, reply, _ = post(url, "/v1/completions", {"prompt": "next", "max_tokens": 2, "ignore_eos": True})
    assert got == 200 and reply["usage"]["completion_tokens"] == 2
    assert len(server.engine.scheduler.running) >= 2, "the other streams should still be running"
    _, asked, freed = server.worker.cancel_log[before]
    assert freed - asked <= 1
    for conn, _ in streams[1:]:
        conn.close()
    wait_idle(server)  # closed streams give their lanes back


def test_models_health_metrics_tokenize_and_detokenize(served):
    url, _ = served
    status, body = get(url, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == 256
    status, body = get(url, "/health")
    assert status == 200 and json.loads(body)["lanes"] == 4
    status, tok, _ = post(url, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0
    status, detok, _ = post(url, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello world"
    status, chat_tok, _ = post(url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat_tok["count"] > tok["count"]
    assert post(url, "/detokenize", {"tokens": [-1]})[0] == 400
    post(url, "/v1/completions", {"prompt": "count me", "max_tokens": 3})
    status, text = get(url, "/metrics")
    assert status == 200
    for name in ("requests_total", "generation_tokens_total", "tokens_per_round", "queue_depth", "lanes_busy"):
        assert f"# TYPE tfjax_{name} " in text and f"\ntfjax_{name}" in text
    assert float(text.split("\ntfjax_generation_tokens_total ")[1].split()[0]) >= 3


def test_bench_concurrent_runs_a_small_matrix_and_writes_every_field(served, tmp_path):
    url, _ = served
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_concurrent.py"
    out, again = tmp_path / "bench.json", tmp_path / "again.json"
    cmd = [sys.executable, str(script), "--url", url, "--levels", "1,2", "--tokens", "6", "--reps", "1", "--alone",
           "--serial", "--top-k", "0", "--top-p", "1", "--output", str(out)]  # no sorting: quick on CPU
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert {(c["cell"], c["mode"], c["level"]) for c in cells} == {
        (cell, mode, level) for cell in ("code", "chat") for mode in ("greedy", "sampled") for level in (1, 2)}
    for c in cells:
        for field in ("per_stream_tok_s", "aggregate_tok_s", "tokens_per_round", "ttft_s", "prefill_tok_s",
                      "alone_equal", "alone_total", "serial_equal", "serial_total", "token_sha256"):
            assert field in c, field
        assert c["alone_equal"] == c["alone_total"] == c["level"] and c["serial_equal"] == c["serial_total"]
    assert Path(report["plot"]).is_file() and "| code, greedy |" in run.stdout
    run = subprocess.run([*cmd[:-1], str(again), "--levels", "1", "--baseline", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    for c in json.loads(again.read_text())["cells"]:
        assert c["baseline"]["hashes_equal"] == c["baseline"]["hashes_total"] == 1


def test_logprobs_penalties_and_a_json_schema_come_back_in_openai_shapes(served):
    url, _ = served
    msgs = [{"role": "user", "content": "hello"}]
    got, reply, _ = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "logprobs": True,
                                                        "top_logprobs": 2, "presence_penalty": 0.5,
                                                        "logit_bias": {"42": -100}})
    assert got == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 and bytes(c["bytes"]) for c in content)
    got, reply, _ = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 5, "logprobs": 3})
    lp = reply["choices"][0]["logprobs"]
    assert got == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) == 3 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": schema}}
    got, reply, _ = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 40, "response_format": fmt})
    assert got == 200 and reply["choices"][0]["finish_reason"] == "stop", reply
    value = json.loads(reply["choices"][0]["message"]["content"])
    assert value["a"] in ("x", "y") and isinstance(value["b"], bool)
