"""Does writing one row into a donated KV pool cost the pool's size on this backend? (issue 32)

    PYTHONPATH=. python scripts/probes/cpu_pool_write.py

Times a jitted `dynamic_update_slice` and a `.at[].set` scatter of one [3, 64] bf16 row into a donated
[pages, 16, 3, 64] pool at 512 and 2560 pages (SmolLM2's per-layer pool at 4 lanes of 2048 without and with the
default prefix cache); in place, both would cost the same at either size.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def bench(pages: int, variant: str) -> float:
    pool = jnp.zeros((pages, 16, 3, 64), jnp.bfloat16)
    row = jnp.ones((1, 1, 3, 64), jnp.bfloat16)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def write(pool, row, i):
        if variant == "dynamic_update_slice":
            return jax.lax.dynamic_update_slice(pool, row, (i, 0, 0, 0))
        return pool.at[i, 0].set(row[0, 0], mode="drop")

    pool = write(pool, row, 3).block_until_ready()
    times = []
    for _ in range(30):
        t = time.perf_counter()
        pool = write(pool, row, 3).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


if __name__ == "__main__":
    for pages in (512, 2560):
        for variant in ("scatter", "dynamic_update_slice"):
            print(f"{pages:5d} pages  {variant:22s} {bench(pages, variant):.3f} ms", flush=True)
