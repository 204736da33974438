"""XLA:CPU's dot of one row against a large weight (a prompt's last-row logits) against two rows and more.

  PYTHONPATH=. python3 scripts/probes/one_row_dot.py [--vocab 49152 --hidden 576]

A one-row dot lowers to a loop and a two-row one to a GEMM: on the CPU the one-row SmolLM2 head took 132 ms against
17 ms for two rows (load 9.5), most of a prompt chunk's fixed cost, so `ops.matmul` gives the CPU a padded row tile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    w = (jax.random.normal(jax.random.PRNGKey(0), (args.vocab, args.hidden)) * 0.01).astype(dtype)
    dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    times = {rows: [] for rows in (1, 2, 8, 16)}
    xs = {rows: jnp.ones((rows, args.hidden), dtype) for rows in times}
    for rows in times:
        dot(xs[rows], w).block_until_ready()  # compiles
    for _ in range(args.reps):  # alternated, so a change in the machine's load hits every row count alike
        for rows in times:
            t = time.perf_counter()
            dot(xs[rows], w).block_until_ready()
            times[rows].append(time.perf_counter() - t)
    print(f"[rows, {args.hidden}] x [{args.vocab}, {args.hidden}].T in {dtype.name} on {jax.devices()[0].device_kind}, "
          f"median (min-max) of {args.reps}; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for rows, ts in times.items():
        print(f"  {rows:2d} rows: {statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) ms")


if __name__ == "__main__":
    main()
