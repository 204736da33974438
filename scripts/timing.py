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


def device_time(fn, args, match: str | None, calls: int = 3, per_call: int = 1) -> float:
    """Device seconds from the JAX profiler over `calls` calls of `fn(*args)` (compiled and warm first): the median
    launch of the kernels whose name holds `match`, or with `match=None` all kernels' time per call divided by
    `per_call` (ops a call applies). Unlike `median_time`, launch gaps on the host don't count."""
    import tempfile
    from pathlib import Path

    import jax
    from profile_round import latest_events

    jax.block_until_ready(fn(*args))
    folder = Path(tempfile.mkdtemp(prefix="device_time_"))
    with jax.profiler.trace(str(folder)):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    return kernel_seconds(latest_events(folder), match, calls * per_call)


def kernel_seconds(events: list[dict], match: str | None, ops: int) -> float:
    """The median launch (microsecond events) of kernels named like `match`, or all kernels' time over `ops`."""
    durs = [float(e["dur"]) for e in events if match is None or match in e["name"]]
    if not durs:
        return float("nan")
    return sum(durs) * 1e-6 / ops if match is None else float(np.median(durs)) * 1e-6
