"""The one timing helper the bench scripts share (they run as `python3 scripts/NAME.py`, so this imports as `timing`)."""

from __future__ import annotations

import time

import numpy as np


def median_time(fn, args, reps: int = 20) -> float:
    """Median seconds of `fn(*args)` over `reps` synchronised calls, after a compile and a warm-up call."""
    import jax  # lazily: bench_graph's torch peer section runs without jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))
