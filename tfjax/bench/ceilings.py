"""The device's ceilings: copy bandwidth as the best of the driver's, XLA's and Pallas' copies; the bf16 matmul rate.

Copy bandwidth counts bytes read + written. Every "% of roofline" is stated against the best copy measured
(`best_copy`), never against one XLA elementwise kernel alone (which reads 20-25% below a device-to-device copy).
"""

from __future__ import annotations

import functools

import numpy as np

from tfjax.profiling import call_times


def spread(fn, reps: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of `fn()` after two warm-up calls; fn synchronises itself."""
    ts = call_times(fn, reps)
    return float(np.median(ts)), min(ts), max(ts)


def run_sync(fn, *args) -> None:
    """Call a jitted `fn` and wait for it."""
    fn(*args).block_until_ready()


def jax_copies(nbytes: int, reps: int) -> list[tuple[str, tuple]]:
    """XLA's and Pallas' copies of an f32 buffer of `nbytes`: [(name, (median, min, max))]."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import copy as cp

    a = jax.random.normal(jax.random.key(0), (nbytes // 4 // 1024 // 32 * 32, 1024), jnp.float32)
    rows = []
    for name, fn in [("xla a*1.0001", jax.jit(lambda a: a * 1.0001)),
                     ("xla copy", jax.jit(lambda a: jnp.copy(a)))]:
        rows.append((name, spread(functools.partial(run_sync, fn, a), reps)))
    if jax.default_backend() != "gpu":
        return rows  # Pallas' Triton copy needs a GPU
    for br, nw in [(4, 4), (8, 4), (8, 8), (16, 8), (32, 8)]:
        fn = jax.jit(functools.partial(cp.copy, block_sizes=cp.BlockSizes(rows=br, num_warps=nw)))
        rows.append((f"pallas copy rows={br} warps={nw}", spread(functools.partial(run_sync, fn, a), reps)))
    return rows


def torch_copy(nbytes: int, reps: int) -> list[tuple[str, tuple]]:
    """The driver's device-to-device memcpy through torch (none without a CUDA torch)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    x = torch.randn(nbytes // 4, device="cuda")
    y = torch.empty_like(x)

    def run(dst, src):
        dst.copy_(src)
        torch.cuda.synchronize()

    times = spread(functools.partial(run, y, x), reps)
    x = y = None
    torch.cuda.empty_cache()  # give the bytes back before JAX's copies
    return [("cudaMemcpy D2D (torch)", times)]


def matmul_rate(n: int, reps: int) -> tuple[float, float, float]:
    """bf16 [n, n] @ [n, n] through XLA: (median, min, max) seconds."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return spread(lambda: f(x, y).block_until_ready(), reps)


def best_copy(gibs: list[float], reps: int) -> tuple[float, str, list[tuple[str, float, tuple]]]:
    """(best GB/s, which copy, [(name, GiB, (median, min, max))]) over every copy at each size."""
    rows, best = [], (0.0, "")
    for gib in gibs:
        nbytes = int(gib * 2**30) // 2**17 * 2**17
        for name, times in torch_copy(nbytes, reps) + jax_copies(nbytes, reps):
            rows.append((name, gib, times))
            best = max(best, (2 * nbytes / times[0] / 1e9, f"{name} at {gib:g} GiB"))
    return best[0], best[1], rows
