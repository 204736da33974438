"""Is the CPU prompt path row-invariant? One prompt prefilled along many call partitions: every row size the runner
compiles at a chunk, at starts on and off the chunk grid, padded tails included; the KV pages (every layer, every
position) and the last row's logits are compared bit for bit with the chunk grid's prefill.

  PYTHONPATH=. python3 scripts/probes/prompt_rows.py --model smollm2 [--tokens 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tfjax import api


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    llm = api.load(args.model, lanes=1, context=args.tokens + 64, prefix_cache_gb=0.0, dtype=args.dtype)
    run = llm.engine.runner
    prompt = np.random.default_rng(0).integers(100, run.vocab - 100, args.tokens).astype(np.int32)

    def prefill(calls):
        return run.prefill_along(prompt, calls)

    def calls_of(sizes):
        out, s = [], 0
        for i in range(10**6):
            n = min(sizes[i % len(sizes)], args.tokens - s)
            out.append((s, n))
            s += n
            if s == args.tokens:
                return out

    c = run.chunk
    grid = calls_of([c])
    base = prefill(grid)
    partitions = {f"{n}-token calls": calls_of([n]) for n in range(8, c + 1, 8)}
    partitions.update({"16 then the grid's chunks (page offset)": calls_of([16] + [c] * 99),
                       "13, 51, 37, 64 (padded tails mid-page)": calls_of([13, 51, 37, 64]),
                       "61, then the chunks from 48 (a turn resumed)": [(0, 61)] + [
                           (s, min(c, args.tokens - s)) for s in range(48, args.tokens, c)]})
    bad = 0
    for name, calls in partitions.items():
        t = time.perf_counter()
        logits, kv = prefill(calls)
        rows = sum(int((a != b).reshape(args.tokens, -1).any(1).sum()) for a, b in zip(kv, base[1], strict=True))
        same = np.array_equal(logits, base[0]) and rows == 0
        bad += not same
        print(f"{name:48s} {len(calls)} calls: logits {'==' if np.array_equal(logits, base[0]) else '!='}, "
              f"KV rows differing (summed over layers) {rows}  ({time.perf_counter() - t:.1f} s)", flush=True)
    print("row-invariant" if not bad else f"NOT row-invariant: {bad} partitions differ")


if __name__ == "__main__":
    main()
