"""Seconds `LLM.precompile` takes on W compile threads, and the first request after it (docs/benchmarks.md).

  TFJAX_COMPILE_CACHE=off PYTHONPATH=. python3 scripts/probes/precompile_time.py W [--model smollm2] [--lanes 4]
  ... precompile_time.py W --model FOLDER --random-weights 4     # a GPU: is W > 1 (XLA autotuning at once) a win?

Run each W in its own process (JAX keeps compiled programs in memory), alternating, for a comparison.
"""

from __future__ import annotations

import argparse
import sys
import time

from tfjax import api


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workers", type=int)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS",
                    help="random MLX BITS-bit weights of the folder's geometry (bench_generate.py's)")
    args = ap.parse_args()
    kw = {}
    if args.random_weights is not None:
        sys.path.insert(0, "scripts")
        from bench_generate import random_model

        kw["model"] = random_model(args.model, args.random_weights)
    llm = api.load(args.model, lanes=args.lanes, context=args.context, **kw)
    t = time.perf_counter()
    n = llm.precompile(workers=args.workers)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    out = llm.generate("The capital of France is", max_tokens=8)
    print(f"workers {args.workers}: {n} programs in {compile_s:.1f} s; first request {time.perf_counter() - t:.2f} s; "
          f"{out.token_sha256[:8]}", flush=True)


if __name__ == "__main__":
    main()
