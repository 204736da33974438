"""Seconds to trace, lower and compile a prompt-chunk program at several row counts (issue 28: 16-23 s each on
the H100 for SmolLM2, against 4.7 s for its lane round).

  PYTHONPATH=. python3 scripts/probes/prompt_compile.py --model FOLDER --random-weights 4 --rows 16,64,128,256
  XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=. python3 scripts/probes/prompt_compile.py ...
  PYTHONPATH=. python3 scripts/probes/prompt_compile.py ... --kernel-max-rows 64   # the kernels only to 64 rows (before)

Each row count is a fresh program (`jax.clear_caches()` between them is not needed: each shape is new); the lane
round's compile is timed last for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import api, ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS")
    ap.add_argument("--rows", default="16,64,128,256")
    ap.add_argument("--reps", type=int, default=5, help="timed calls of each compiled program")
    ap.add_argument("--kernel-max-rows", type=int, default=None, help="prompt rows up to which 4-bit products take "
                    "the kernels (ops.KERNEL_MAX_ROWS and ops.MOSAIC_MAX_ROWS; 64 was the default before 2026-12-07)")
    args = ap.parse_args()
    if args.kernel_max_rows is not None:
        ops.KERNEL_MAX_ROWS = ops.MOSAIC_MAX_ROWS = args.kernel_max_rows  # read while tracing: this probe's only
    kw = {}
    if args.random_weights is not None:
        import sys

        sys.path.insert(0, "scripts")
        from bench_generate import random_model

        kw["model"] = random_model(args.model, args.random_weights)
    llm = api.load(args.model, lanes=1, prefix_cache_gb=0, **kw)
    r = llm.engine.runner
    from tfjax.lanes import round as lane_round

    print(f"{args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}, kernel rows <= {ops.KERNEL_MAX_ROWS} (Triton), "
          f"{ops.MOSAIC_MAX_ROWS} (Mosaic)")
    prompt = np.arange(1, 1 + max(int(x) for x in args.rows.split(",")), dtype=np.int32) % 1000 + 10
    for rows in (int(x) for x in args.rows.split(",")):
        tokens, s, n, pages = r._call(prompt[:rows], 0, rows)
        t0 = time.perf_counter()
        lowered = lane_round.prefill_chunk.lower(r.target_def, r.target_params, r.state.cache, jnp.int32(0), tokens,
                                                 jnp.int32(s), jnp.int32(n), pages=pages)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        times, cache = [], r.state.cache
        for _ in range(args.reps):  # the call itself: its cache is donated, so each call takes the last one's
            t = time.perf_counter()
            out = compiled(r.target_params, cache, jnp.int32(0), tokens, jnp.int32(s), jnp.int32(n))
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
            cache = out[1]
        r.state = dataclasses.replace(r.state, cache=cache)  # the donated cache lives on in the last output
        print(f"prefill_chunk, {tokens.shape[1]} rows, {pages} pages: trace+lower {t1 - t0:.1f} s, compile "
              f"{t2 - t1:.1f} s, a call {statistics.median(times) * 1e3:.1f} ms ({min(times) * 1e3:.1f}-"
              f"{max(times) * 1e3:.1f}, {args.reps} calls)", flush=True)
    t0 = time.perf_counter()
    n = r.compile_rounds()
    print(f"lane_round, {n} lane buckets: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
