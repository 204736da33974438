"""Shared by the server tests: one tiny random llama speaking SmolLM2's tokenizer (loaded and compiled once per
process), the app run by uvicorn on 127.0.0.1 or in-process with its lifespan, and small HTTP helpers.

Only one app's engine thread may run over the shared model at a time: each module starts and stops its own.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import tempfile
import threading
import time
from pathlib import Path


@functools.cache
def tiny_llm():
    """A tiny random llama with SmolLM2's tokenizer: 4 lanes of width 4, context 256."""
    from tests.helpers import make_tiny_llama_with_tokenizer
    from tfjax import api, packaged

    folder = make_tiny_llama_with_tokenizer(Path(tempfile.mkdtemp(prefix="tfjax-server-")) / "tiny",
                                            packaged.ensure_converted("smollm2"))
    return api.load(folder, lanes=4, width=4, context=256)


@contextlib.contextmanager
def serving(app):
    """The app on uvicorn at a free 127.0.0.1 port, in a thread: yields its base url."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.asynccontextmanager
async def in_process(app, headers: dict | None = None):
    """An httpx.AsyncClient on the app through the ASGI transport, its lifespan (the engine thread) running."""
    import httpx

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tfjax", headers=headers,
                                     timeout=120) as client:
            yield client


def connect(url: str, timeout: float = 120) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None, headers: dict | None = None):
    """(status, parsed JSON body or text, headers) of one request on an open connection."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    try:
        out = json.loads(raw)
    except ValueError:
        out = raw.decode(errors="replace")
    return resp.status, out, resp.headers


def is_openai_error(body) -> bool:
    """OpenAI's error shape: {"error": {"message": str, "type": str, "param": ..., "code": ...}}."""
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("message"), str) and body["error"]["message"] != ""
            and isinstance(body["error"].get("type"), str) and {"param", "code"} <= set(body["error"]))


def sse_events(raw: str) -> list:
    """The data events of an SSE body, "[DONE]" included as a string."""
    out = []
    for line in raw.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out
