"""Load test: many more clients than lanes against a served model with a small queue.

  PYTHONPATH=. python3 scripts/load_test.py --model smollm2 --parallel 4 --queue 8 --clients 32 --requests 500

Starts scripts/serve.py in a subprocess, takes each prompt's greedy token_sha256 alone, then has --clients
threads send --requests greedy requests (streamed and not, chat and completion) as fast as answers come. Every
answer must be a 200 whose hash equals the one taken alone, or a 429 with Retry-After (the client waits and
sends again); anything else (another status, a dropped connection, a stream without [DONE]) counts as lost.
The server's RSS is sampled after the reference pass and after every 50 answers. Exit status 1 on any loss or
hash mismatch.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three rivers in Europe."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "What is 17 times 3?"}]}),
    ("/v1/completions", {"prompt": "def fibonacci(n):\n    "}),
    ("/v1/completions", {"prompt": "The capital of France is"}),
    ("/v1/completions", {"prompt": "Once upon a time, in a small village,"}),
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a checkpoint folder or a packaged model name")
    ap.add_argument("--parallel", type=int, default=4, help="lanes")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--queue", type=int, default=8, help="the server's queue; more waiting requests get 429")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (8x the lanes by default)")
    ap.add_argument("--requests", type=int, default=500, help="answered requests to send in all")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--output", default=None, help="write the report as JSON here")
    return ap.parse_args(argv)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def send(port: int, path: str, body: dict, stream: bool) -> tuple[int, str | None, str | None]:
    """(status, token_sha256 of a 200, Retry-After of a 429)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        data = {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body
        conn.request("POST", path, json.dumps(data), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        if resp.status != 200:
            return resp.status, None, resp.headers.get("Retry-After")
        if not stream:
            return 200, json.loads(raw)["token_sha256"], None
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return -1, None, None  # a stream cut short
        usage = [json.loads(e) for e in events[:-1] if '"usage"' in e]
        return 200, (usage[-1]["token_sha256"] if usage else None), None
    finally:
        conn.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = Path(__file__).resolve().parent / "serve.py"
    cmd = [sys.executable, str(serve), "--model", args.model, "--parallel", str(args.parallel), "--context",
           str(args.context), "--queue", str(args.queue), "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 900
        while True:
            assert server.poll() is None and time.time() < deadline, "the server did not start"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        bodies = [(path, {**body, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
                  for path, body in PROMPTS]
        reference = []
        for path, body in bodies:  # alone, one at a time (this also compiles)
            status, sha, _ = send(port, path, body, stream=False)
            assert status == 200, f"reference request failed with HTTP {status}"
            reference.append(sha)
        rss = [rss_kib(server.pid)]
        lock = threading.Lock()
        counts = {"ok": 0, "429": 0, "429_without_retry_after": 0, "lost": 0, "mismatch": 0, "streams": 0}
        issued = iter(range(args.requests))

        def client(_):
            while True:
                with lock:
                    i = next(issued, None)
                if i is None:
                    return
                path, body = bodies[i % len(bodies)]
                stream = i % 2 == 1
                while True:
                    try:
                        status, sha, retry = send(port, path, body, stream)
                    except OSError:
                        status, sha, retry = -1, None, None
                    with lock:
                        if status == 429:
                            counts["429"] += 1
                            if retry is None:
                                counts["429_without_retry_after"] += 1
                        elif status == 200:
                            counts["ok"] += 1
                            counts["streams"] += stream
                            counts["mismatch"] += sha != reference[i % len(bodies)]
                            if counts["ok"] % 50 == 0:
                                rss.append(rss_kib(server.pid))
                        else:
                            counts["lost"] += 1
                    if status != 429:
                        break
                    time.sleep(min(float(retry or 1), 1.0))  # as the server asks

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        elapsed = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = {"command": " ".join(sys.argv), **counts, "seconds": round(elapsed, 1),
              "answers_per_s": round(counts["ok"] / elapsed, 2), "rss_kib": rss,
              "rss_growth_kib": rss[-1] - rss[1] if len(rss) > 1 else 0}
    print(f"| clients | lanes | queue | 200 | 429 | lost | hash mismatches | s | RSS after ref -> end (MiB) |\n"
          f"| {args.clients} | {args.parallel} | {args.queue} | {counts['ok']} | {counts['429']} | {counts['lost']} | "
          f"{counts['mismatch']} | {elapsed:.1f} | {rss[0] / 1024:.1f} -> {rss[-1] / 1024:.1f} |")
    print("RSS every 50 answers (MiB):", " ".join(f"{r / 1024:.1f}" for r in rss))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    bad = counts["lost"] or counts["mismatch"] or counts["429_without_retry_after"] or counts["ok"] < args.requests
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
