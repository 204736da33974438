"""Concurrent streams against the OpenAI-compatible server: speed per cell and level, with hash checks.

  PYTHONPATH=. python3 scripts/bench_concurrent.py --model smollm2 --levels 1,4 --tokens 96 --reps 3 --alone --serial
  PYTHONPATH=. python3 scripts/bench_concurrent.py --url http://127.0.0.1:8000 --output run.json --baseline old.json

Cells: code (a completion that copies from its prompt) and chat, each greedy (temperature 0) and sampled
(each --temperatures value > 0, with --top-k 20 and --top-p 0.95), plus one cell per --prompts file. At level
N, N streams run at once, stream i with prompt variant i and seed --seed + i; every request sets
ignore_eos so each produces --tokens tokens. Per stream: decode tok/s after the first token, time to
first token, prefill tok/s (prompt tokens over that time). --alone reruns each stream's request by
itself and --serial with "draft": false; the table counts equal token_sha256. --baseline compares speed
and hashes with an earlier --output.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

CODE = [
    ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
     "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
     "        self.items.append(item)\n\n    def pop(self):\n"),
    ("import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
     "def save(path, data):\n"),
    ("def fibonacci(n):\n    # return the n-th Fibonacci number\n"),
]
CHAT = [
    "Write three short tips for learning to cook.",
    "Explain in a few sentences why the sky is blue.",
    "Give me a packing list for a weekend hike.",
    "Describe how a bicycle gear works to a child.",
]


def cells(prompt_files: list[str]) -> list[tuple[str, str, list]]:
    """(cell name, endpoint, prompt variants)."""
    out = [("code", "/v1/completions", CODE), ("chat", "/v1/chat/completions", CHAT)]
    for f in prompt_files:
        out.append((Path(f).stem, "/v1/completions", [Path(f).read_text()]))
    return out


def body_for(path: str, prompt: str, tokens: int, temperature: float, seed: int, sampled: dict) -> dict:
    body = {"max_tokens": tokens, "temperature": temperature, "seed": seed, "ignore_eos": True}
    if temperature > 0:
        body.update(sampled)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def stream(url: str, path: str, body: dict, timeout: float = 3600) -> dict:
    """One streamed request, timed: start, first text, end, usage, token_sha256, tokens per round."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read().decode()[:300]}")
    first, last = None, None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"{path}: {event['error']}")
        for choice in event.get("choices", []):
            if first is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                first = time.perf_counter()
        if event.get("usage"):
            last = event
    end = time.perf_counter()
    conn.close()
    if last is None:
        raise RuntimeError(f"{path}: the stream ended without a usage event")
    first = first or end
    n = last["usage"]["completion_tokens"]
    return {"start": t0, "first": first, "end": end, "completion_tokens": n,
            "prompt_tokens": last["usage"]["prompt_tokens"], "token_sha256": last["token_sha256"],
            "tokens_per_round": last["tokens_per_round"], "ttft_s": first - t0,
            "decode_tok_s": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "prefill_tok_s": last["usage"]["prompt_tokens"] / max(first - t0, 1e-9)}


def run_level(url: str, requests: list[tuple[str, dict]]) -> list[dict]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stream(url, *r), requests))


def measure(url: str, cell: str, path: str, variants: list, mode: str, temperature: float, level: int,
            args) -> dict:
    requests = [(path, body_for(path, variants[i % len(variants)], args.tokens, temperature, args.seed + i,
                                args.sampled))
                for i in range(level)]
    reps = [run_level(url, requests) for _ in range(args.reps)]
    streams = [s for rep in reps for s in rep]
    hashes = [s["token_sha256"] for s in reps[0]]
    row = {
        "cell": cell, "mode": mode, "temperature": temperature, "level": level, "reps": args.reps,
        "per_stream_tok_s": statistics.median(s["decode_tok_s"] for s in streams),
        "aggregate_tok_s": statistics.median(
            sum(s["completion_tokens"] for s in rep) / (max(s["end"] for s in rep) - min(s["start"] for s in rep))
            for rep in reps),
        "tokens_per_round": statistics.mean(s["tokens_per_round"] for s in streams),
        "ttft_s": statistics.median(s["ttft_s"] for s in streams),
        "prefill_tok_s": statistics.median(s["prefill_tok_s"] for s in streams),
        "completion_tokens": [s["completion_tokens"] for s in reps[0]],
        "prompt_tokens": [s["prompt_tokens"] for s in reps[0]],
        "token_sha256": hashes,
        "reps_equal": sum(all(r[i]["token_sha256"] == h for r in reps) for i, h in enumerate(hashes)),
        "alone_equal": None, "alone_total": 0, "serial_equal": None, "serial_total": 0,
    }
    if args.alone:
        alone = [stream(url, *r)["token_sha256"] for r in requests]
        row["alone_equal"], row["alone_total"] = sum(a == h for a, h in zip(alone, hashes, strict=True)), level
    if args.serial:
        plain = [stream(url, p, {**b, "draft": False})["token_sha256"] for p, b in requests]
        row["serial_equal"], row["serial_total"] = sum(a == h for a, h in zip(plain, hashes, strict=True)), level
    return row


def compare(rows: list[dict], baseline: dict) -> None:
    """Attach speed change and hash equality against an earlier run's matching cell."""
    old = {(c["cell"], c["mode"], c["level"]): c for c in baseline["cells"]}
    for row in rows:
        b = old.get((row["cell"], row["mode"], row["level"]))
        if b is None:
            continue
        row["baseline"] = {
            "per_stream_tok_s": b["per_stream_tok_s"],
            "change": row["per_stream_tok_s"] / b["per_stream_tok_s"] - 1 if b["per_stream_tok_s"] else None,
            "hashes_equal": sum(a == h for a, h in zip(row["token_sha256"], b["token_sha256"], strict=False)),
            "hashes_total": min(len(row["token_sha256"]), len(b["token_sha256"])),
        }


def _count(equal, total) -> str:
    return "-" if equal is None else f"{equal}/{total}"


def table(rows: list[dict]) -> str:
    with_base = any("baseline" in r for r in rows)
    head = ["cell", "streams", "per-stream tok/s", "aggregate tok/s", "tok/round", "TTFT s", "prefill tok/s",
            "alone equal", "serial equal"]
    if with_base:
        head += ["baseline tok/s", "change", "hashes = baseline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cols = [f"{r['cell']}, {r['mode']}", str(r["level"]), f"{r['per_stream_tok_s']:.1f}",
                f"{r['aggregate_tok_s']:.1f}", f"{r['tokens_per_round']:.2f}", f"{r['ttft_s']:.2f}",
                f"{r['prefill_tok_s']:.0f}", _count(r["alone_equal"], r["alone_total"]),
                _count(r["serial_equal"], r["serial_total"])]
        if with_base:
            b = r.get("baseline")
            cols += ["-", "-", "-"] if b is None else [
                f"{b['per_stream_tok_s']:.1f}", "-" if b["change"] is None else f"{b['change']:+.1%}",
                f"{b['hashes_equal']}/{b['hashes_total']}"]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars: per-stream tok/s for each cell, one bar per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(f"{r['cell']}\n{r['mode']}" for r in rows))
    levels = sorted({r["level"] for r in rows})
    width = 0.8 / len(levels)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    for j, level in enumerate(levels):
        values = {f"{r['cell']}\n{r['mode']}": r["per_stream_tok_s"] for r in rows if r["level"] == level}
        xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [values.get(n, 0) for n in names], width, label=f"{level} stream{'s' if level > 1 else ''}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("per-stream decode tok/s (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def get_json(url: str, path: str) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}")
    return json.loads(body)


def start_server(args, lanes: int) -> tuple[subprocess.Popen, str]:
    """scripts/serve.py on a free local port; waits for /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(Path(__file__).with_name("serve.py")), "--model", args.model, "--port", str(port),
           "--parallel", str(lanes), "--context", str(args.context), "--drafter", args.drafter,
           "--log-level", "warning", *(["--no-draft"] if args.no_draft else [])]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 1800
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            get_json(url, "/health")
            return proc, url
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("the server did not come up") from None
            time.sleep(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server")
    src.add_argument("--model", help="start scripts/serve.py with this model (lanes = the highest level)")
    ap.add_argument("--levels", default="1,4", help="concurrent streams, comma separated")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--alone", action="store_true", help="check each stream equals its request run alone")
    ap.add_argument("--serial", action="store_true", help='check each stream equals "draft": false run alone')
    ap.add_argument("--prompts", nargs="*", default=[], help="text files, one prompt each, one extra cell each")
    ap.add_argument("--temperatures", default="0,1.0", help="0 is the greedy cell, others sampled cells")
    ap.add_argument("--top-k", type=int, default=20, help="for sampled cells")
    ap.add_argument("--top-p", type=float, default=0.95, help="for sampled cells")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output", help="write the results as JSON")
    ap.add_argument("--plot", help="PNG path (default: next to --output, else bench_concurrent.png)")
    ap.add_argument("--baseline", help="an earlier --output to compare speed and hashes with")
    ap.add_argument("--context", type=int, default=2048, help="with --model")
    ap.add_argument("--drafter", default="none", help="with --model: none, dflash2 or a folder")
    ap.add_argument("--no-draft", action="store_true", help="with --model: start the server with --no-draft")
    args = ap.parse_args(argv)
    args.sampled = {"top_k": args.top_k, "top_p": args.top_p}
    levels = [int(x) for x in args.levels.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    proc = None
    url = args.url
    if args.model:
        proc, url = start_server(args, max(levels))
    try:
        health = get_json(url, "/health")
        matrix = [(cell, path, variants, "greedy" if t == 0 else ("sampled" if len(temperatures) <= 2 else f"T={t}"), t)
                  for cell, path, variants in cells(args.prompts) for t in temperatures]
        for _, path, variants, _, t in matrix:  # compile and warm every path before timing
            stream(url, path, body_for(path, variants[0], min(args.tokens, 8), t, args.seed, args.sampled))
        rows = [measure(url, cell, path, variants, mode, t, level, args)
                for cell, path, variants, mode, t in matrix for level in levels]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    if args.baseline:
        compare(rows, json.loads(Path(args.baseline).read_text()))
    png = Path(args.plot) if args.plot else (Path(args.output).with_suffix(".png") if args.output
                                             else Path("bench_concurrent.png"))
    drafts = "drafts on" if health.get("drafts") else "drafts off"
    plot(rows, png, f"{health.get('model')}, {drafts}, {args.tokens} tokens")
    report = {"meta": {"url": url, "server": health, "levels": levels, "tokens": args.tokens, "reps": args.reps,
                       "temperatures": temperatures, "seed": args.seed, "prompts": args.prompts,
                       "sampled": args.sampled, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
              "plot": str(png), "cells": rows}
    print(f"{health.get('model')}: {health.get('lanes')} lanes, width {health.get('width')}, {drafts}, "
          f"drafter {health.get('drafter')}, {args.tokens} tokens, {args.reps} reps")
    print(table(rows))
    print(f"plot: {png}")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
