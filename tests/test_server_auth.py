"""The API key and CORS, in-process through httpx's ASGI transport (its own module: the app runs its own engine
thread over the shared tiny model, which no other app may step at the same time)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from tests.server_helpers import in_process, tiny_llm  # noqa: E402

GREEDY = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 6, "temperature": 0,
          "ignore_eos": True}


def test_the_api_key_guards_every_endpoint_but_health_and_cors_preflight_passes(monkeypatch):
    from tfjax.server import create_app

    monkeypatch.setenv("TFJAX_API_KEY", "sekrit")
    app = create_app(tiny_llm(), name="tiny", allowed_origins=["http://app.example"])

    async def go():
        async with in_process(app) as client:
            assert (await client.get("/health")).status_code == 200
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                                 ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                                 ("GET", "/nope")):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                    r = await client.request(method, path, headers=headers, json={})
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
            ok = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200
            reply = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer sekrit"}, json=GREEDY)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6
            pre = await client.options("/v1/chat/completions", headers={
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
            other = await client.get("/health", headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in other.headers
            metrics = (await client.get("/metrics", headers={"Authorization": "Bearer sekrit"})).text
            assert 'tfjax_requests_total{outcome="rejected_invalid_api_key"} 6.0' in metrics  # 2 paths x 3 tries

    asyncio.run(go())
