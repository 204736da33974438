"""Prefill throughput of a long prompt at several prefill chunks, alternated in one process (cache off).

  PYTHONPATH=. python3 scripts/probes/prefill_chunk.py --model smollm2 --chunks 64,128,256 --tokens 1536
  PYTHONPATH=. python3 scripts/probes/prefill_chunk.py --geometry tiny_dense --chunks 64,128,256 --tokens 1536
  PYTHONPATH=. python3 scripts/probes/prefill_chunk.py --geometry dense27 --random-weights 4 (a GPU)

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
    ap.add_argument("--geometry", default=None, help="a named geometry with random weights (tiny_dense, dense27...)")
    ap.add_argument("--random-weights", type=int, default=0, metavar="BITS", help="MLX BITS-bit (0: unquantized)")
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="the checkpoint's weights cast to this dtype (float32...)")
    args = ap.parse_args()
    kw = dict(lanes=1, context=max(2048, args.tokens + 64), prefix_cache_gb=0.0, dtype=args.dtype)
    if args.geometry is not None:
        from flax import nnx

        from tfjax import geometry, models
        from tfjax.config import QuantConfig

        config = geometry.named(args.geometry)
        if args.random_weights:
            config = config.replace(quantization=QuantConfig(bits=args.random_weights, group_size=64))
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

    print(f"{args.geometry or args.model} ({first.config.dtype}) on {jax.devices()[0].device_kind}: a {args.tokens}-token prompt, cache off, "
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
