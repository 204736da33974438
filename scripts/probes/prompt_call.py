"""Where a CPU prompt call's time goes: one `prefill_chunk` call at given rows and start, its attention as the engine
runs it, as main ran it (the lane's keys gathered over a power of two of pages, `attention_reference`), or left out.

  PYTHONPATH=. python3 scripts/probes/prompt_call.py --model smollm2 --calls 64:0,64:256,24:320,32:320

A call is `rows:start` (a chunk of `rows` padded rows starting at `start`, every row valid); each variant is its own
program, compiled first, then the calls alternate (median (min-max) of `--reps`). "tiles" is the engine's prompt
attention (`attention.paged_prompt_reference`: key tiles up to the chunk's last row, the lane's whole table);
"bucket" main's (the pages a power of two holding the chunk's keys, all of them read); "none" returns q, so the
rest of the call (projections, MLP, head, KV writes) is what is left. docs/prefix_cache.md, "The chunk".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as pk
from tfjax import api
from tfjax.lanes import round as lane_round

VARIANT = {"now": "tiles"}  # read while tracing: each variant is its own jit (a jit caches traces by function)
TILES = pk.paged_prompt_reference


def _attention(q, pages, table, positions, **kw):
    if VARIANT["now"] == "bucket":
        k, v = pk.gather_pages(pages, table)
        return pk.attention_reference(q, k, v, positions)
    if VARIANT["now"] == "none":
        return q
    return TILES(q, pages, table, positions, **kw)


def _program():
    def call(graphdef, params, cache, lane, tokens, start, valid, pages=None):
        return lane_round.prefill_chunk.__wrapped__(graphdef, params, cache, lane, tokens, start, valid, pages)

    return jax.jit(call, static_argnames=("graphdef", "pages"), donate_argnames=("cache",))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--calls", default="64:0,64:256,24:320,32:320")
    ap.add_argument("--variants", default="tiles,bucket,none")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args()
    llm = api.load(args.model, lanes=1, context=args.context, prefix_cache_gb=0.0)
    runner = llm.engine.runner
    page, width = runner.lanes.page_size, runner.lanes.pages_per_lane
    pk.paged_prompt_reference = _attention
    programs = {v: _program() for v in args.variants.split(",")}
    calls = [tuple(int(x) for x in c.split(":")) for c in args.calls.split(",")]
    rng = np.random.default_rng(0)
    state = {"cache": runner.state.cache}

    def run(variant, rows, start):
        need = -(-(start + rows) // page)
        pages = width if variant == "tiles" else min(width, 1 << (need - 1).bit_length())
        tokens = jnp.asarray(rng.integers(0, runner.vocab, (1, rows)), jnp.int32)
        VARIANT["now"] = variant
        t = time.perf_counter()
        logits, state["cache"], _ = programs[variant](runner.target_def, runner.target_params, state["cache"],
                                                      jnp.int32(0), tokens, jnp.int32(start), jnp.int32(rows),
                                                      pages=pages)
        logits.block_until_ready()
        return time.perf_counter() - t

    keys = [(v, c) for c in calls for v in programs]
    for v, c in keys:  # compiles
        run(v, *c)
    times = {k: [] for k in keys}
    for _ in range(args.reps):
        for v, c in keys:
            times[(v, c)].append(run(v, *c))
    print(f"{args.model} on {jax.devices()[0].device_kind}: one prompt call, median (min-max) of {args.reps}, "
          f"alternated; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| rows | start | keys reached | " + " | ".join(f"{v} ms" for v in programs) + " |")
    print("|---|---|---|" + "---|" * len(programs))
    for c in calls:
        cells = [f"{statistics.median(times[(v, c)]) * 1e3:.1f} ({min(times[(v, c)]) * 1e3:.1f}-"
                 f"{max(times[(v, c)]) * 1e3:.1f})" for v in programs]
        print(f"| {c[0]} | {c[1]} | {c[1] + c[0]} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
