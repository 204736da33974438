"""Prefill throughput of a long prompt at several prefill chunks, alternated in one process (cache off).

  PYTHONPATH=. python3 scripts/probes/prefill_chunk.py --model smollm2 --chunks 64,128,256 --tokens 1536
  PYTHONPATH=. python3 scripts/probes/prefill_chunk.py --geometry tiny_dense --chunks 64,128,256 --tokens 1536

The chunk is the prefix cache's resume grid (docs/prefix_cache.md), so a smaller one resumes closer to a shared
prefix's end; this measures what it costs a cold prompt. A prompt's time is a one-token generation of it (every
chunk's prefill and the first sample); each chunk's engine first compiles on the same prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from tfjax import api


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="a checkpoint (its tokenizer) or packaged name")
    ap.add_argument("--geometry", default=None, help="a named geometry with random float32 weights (tiny_dense...)")
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    kw = dict(lanes=1, context=max(2048, args.tokens + 64), prefix_cache_gb=0.0)
    if args.geometry is not None:
        from flax import nnx

        from tfjax import geometry, models

        config = geometry.named(args.geometry)
        kw["model"] = (nnx.merge(*models.random_params(config)), config)
    chunks = [int(c) for c in args.chunks.split(",")]
    first = api.load(args.model, prefill_chunk=chunks[0], **kw)
    kw["model"] = (first.model, first.config)  # one set of weights for every engine
    engines = {c: first if c == chunks[0] else api.load(args.model, prefill_chunk=c, **kw) for c in chunks}
    vocab = first.config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, args.tokens).tolist()
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for rep in range(args.reps + 1):
        for c, llm in engines.items():
            t = time.perf_counter()
            llm.generate(prompt, max_tokens=1, ignore_eos=True)
            if rep:  # the first pass compiles
                times[c].append(time.perf_counter() - t)
    import jax

    print(f"{args.geometry or args.model} on {jax.devices()[0].device_kind}: a {args.tokens}-token prompt, cache off, "
          f"median (min-max) of {args.reps}, chunks alternated; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| chunk | calls | prefill ms | tok/s |")
    print("|---|---|---|---|")
    for c in chunks:
        xs = times[c]
        med = statistics.median(xs)
        print(f"| {c} | {-(-args.tokens // c)} | {med * 1e3:.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}) | "
              f"{args.tokens / med:.0f} |")


if __name__ == "__main__":
    main()
