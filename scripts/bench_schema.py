"""Throughput of SmolLM2 replies with a JSON schema, as any JSON object, with penalties, and plain (median of 3,
compile excluded).

`python scripts/bench_schema.py [--plain-only] [--server]`: --plain-only runs only the plain case, so the same
command under another checkout (PYTHONPATH=/work/main) says whether the processors' code costs plain rounds
anything. --server sends each run's replies as concurrent chat requests to the OpenAI server (uvicorn in this
process, 127.0.0.1) and adds a tool_choice case (a named function, so the reply is a constrained call).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tfjax import api

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "city": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}, "adult": {"type": "boolean"}},
          "required": ["name", "city", "age", "adult"]}
MESSAGES = [{"role": "user", "content": "Describe a person who lives in Paris as JSON with name, city, age, adult."}]
TOOL = {"type": "function", "function": {"name": "add_person", "description": "Store a person.", "parameters": PERSON}}


def serve(llm, max_tokens: int):
    """The OpenAI app on uvicorn at a free 127.0.0.1 port in a thread: (host, port)."""
    import uvicorn

    from tfjax.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(llm, name="bench", max_tokens=max_tokens, queue=256),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return "127.0.0.1", port


def post(where, body: dict) -> dict:
    conn = http.client.HTTPConnection(*where, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {out}")
    return out


def over_http(where, n: int, max_tokens: int, kw: dict):
    """`n` concurrent requests; (replies' token counts, tokens per round) like generate_many's."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **kw}
    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(lambda _: post(where, body), range(n)))
    return [r["usage"]["completion_tokens"] for r in replies], [r["tokens_per_round"] for r in replies]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plain-only", action="store_true", help="time only the unconstrained reply")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    ap.add_argument("--model", default="smollm2", help="a packaged name, folder or hub id of a SmolLM2 checkpoint")
    ap.add_argument("--lanes", type=int, default=2, help="lanes of the engine, and replies per run (default 2)")
    ap.add_argument("--server", action="store_true", help="through the OpenAI server over HTTP, plus a tool case")
    args = ap.parse_args()
    llm = api.load(args.model, lanes=args.lanes, width=6, context=512, copy_match=3)
    cases = {"plain": {}}
    if not args.plain_only:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        cases["penalties+bias"] = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={28: -5.0})
        cases["json_schema"] = dict(response_format=fmt)
        cases["json_object"] = dict(response_format={"type": "json_object"})
        if args.server:
            cases["tool_choice named"] = dict(tools=[TOOL], tool_choice={"type": "function",
                                                                         "function": {"name": "add_person"}})
        cases["json_schema+logprobs"] = dict(response_format=fmt, logprobs=True, top_logprobs=5)
    where = serve(llm, args.max_tokens) if args.server else None

    def run(max_tokens: int, kw: dict):
        if where is not None:
            if "logit_bias" in kw:
                kw = {**kw, "logit_bias": {str(k): v for k, v in kw["logit_bias"].items()}}
            return over_http(where, args.lanes, max_tokens, kw)
        gens = llm.generate_many([MESSAGES] * args.lanes, max_tokens=max_tokens, **kw)
        return [len(g.token_ids) for g in gens], [g.tokens_per_round for g in gens]

    for name, kw in cases.items():
        run(8, kw)  # compile
        rates, tpr = [], []
        for _ in range(3):
            t = time.perf_counter()
            counts, rounds = run(args.max_tokens, kw)
            wall = time.perf_counter() - t
            rates.append(sum(counts) / wall)
            tpr.append(statistics.mean(rounds))
        print(f"{name:22s} {statistics.median(rates):7.1f} tok/s (spread {max(rates) - min(rates):.1f}), "
              f"{statistics.mean(tpr):.2f} tokens/round, {counts[0]} tokens/reply", flush=True)


if __name__ == "__main__":
    main()
