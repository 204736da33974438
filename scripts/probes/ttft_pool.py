"""Where the prefix cache's per-request cost comes from: time to first token, alternated, of three engines on one model.

  PYTHONPATH=. python3 scripts/probes/ttft_pool.py --model FOLDER [--reps 15]

"on" is the cache as served (`--prefix-cache-gb`), "off" is no cache (the lanes' own pages only), and "big pool"
has the cache-on engine's page pool with the cache's bookkeeping turned off. on - big pool is what the
bookkeeping (hashing, matching, committing pages) costs a request; big pool - off is what the larger page pool costs.
Two prompts: a one-message one (never resumed) and a long one asked again (the cache resumes it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tfjax import api, checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefix-cache-gb", type=float, default=2.0)
    ap.add_argument("--long", type=int, default=600, help="tokens of the prompt asked again")
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    path = api.resolve(args.model)
    model = checkpoint.load(path, dtype=args.dtype)
    engines = {"on": api.LLM(path, model=model, lanes=1, prefix_cache_gb=args.prefix_cache_gb),
               "off": api.LLM(path, model=model, lanes=1, prefix_cache_gb=0.0),
               "big pool": api.LLM(path, model=model, lanes=1, prefix_cache_gb=args.prefix_cache_gb)}
    engines["big pool"].engine.prefix.enabled = False  # the same pages, handed out as a plain free list
    short = engines["off"].encode([{"role": "user", "content": "Which vegetables grow well in containers?"}])
    long = np.random.default_rng(0).integers(100, 5000, args.long).tolist()
    times = {(name, p): [] for name in engines for p in ("short", "long")}
    for rep in range(args.reps + 1):
        for name, llm in engines.items():
            for p, ids in (("short", short), ("long", long)):
                t = time.perf_counter()
                out = llm.generate(ids, max_tokens=1, ignore_eos=True)
                if rep:  # the first pass compiles
                    times[(name, p)].append(time.perf_counter() - t)
                    times.setdefault((name, p, "cached"), []).append(out.cached_tokens)
    print(f"TTFT ms, median (min-max) of {args.reps}, engines alternated; short prompt {len(short)} tokens, long "
          f"{len(long)}; pages: " + ", ".join(f"{n} {e.engine.runner.pages}" for n, e in engines.items()))
    print("| engine | short | long | long: cached tokens |")
    print("|---|---|---|---|")
    for name in engines:
        cells = []
        for p in ("short", "long"):
            xs = times[(name, p)]
            cells.append(f"{statistics.median(xs) * 1e3:.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})")
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(times[(name, 'long', 'cached')]):.0f} |")


if __name__ == "__main__":
    main()
