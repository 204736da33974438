"""The device's ceilings, measured right: copy bandwidth as the best of several copies, and the bf16 matmul rate.

  PYTHONPATH=. python3 scripts/bench_roofline.py [--gib 2,4] [--json OUT.json]

Copy bandwidth counts bytes read + written. Candidates: XLA's elementwise kernel (`a * 1.0001`, what
bench_graph used), XLA's copy of a buffer, the driver's device-to-device memcpy (through torch, when it sees a
GPU) and the Pallas copy (`pallas_kernels/copy.py`) over a few block shapes. Every "% of roofline" in the docs is
stated against the best of these. Each row is the median of `--reps` synchronised calls, with min and max.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np


def spread(fn, reps: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of `fn()` after two warm-up calls; fn synchronises itself."""
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
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

    return [("cudaMemcpy D2D (torch)", spread(functools.partial(run, y, x), reps))]


def matmul_rate(n: int, reps: int) -> tuple[float, float, float]:
    """bf16 [n, n] @ [n, n] through XLA: (median, min, max) seconds."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return spread(lambda: f(x, y).block_until_ready(), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", default="2,4", help="copy sizes in GiB, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--matmul", type=int, default=8192)
    ap.add_argument("--json", default=None, help="write the best copy and matmul rate here")
    args = ap.parse_args()
    import jax

    print(f"device: {jax.devices()[0].device_kind}")
    print("| copy | GiB | median | min..max | GB/s (read + write) |\n|---|---|---|---|---|")
    best = (0.0, "")
    for gib in [float(g) for g in args.gib.split(",")]:
        nbytes = int(gib * 2**30) // 2**17 * 2**17
        for name, (med, lo, hi) in torch_copy(nbytes, args.reps) + jax_copies(nbytes, args.reps):
            gbps = 2 * nbytes / med / 1e9
            best = max(best, (gbps, f"{name} at {gib:g} GiB"))
            print(f"| {name} | {gib:g} | {med * 1e3:.3f} ms | {lo * 1e3:.3f}..{hi * 1e3:.3f} | {gbps:.0f} |",
                  flush=True)
    med, lo, hi = matmul_rate(args.matmul, args.reps)
    tflops = 2 * args.matmul**3 / med / 1e12
    print(f"\nbest copy: {best[0]:.0f} GB/s ({best[1]}); bf16 matmul {args.matmul}^3: {tflops:.0f} TFLOP/s "
          f"(median {med * 1e3:.2f} ms, {lo * 1e3:.2f}..{hi * 1e3:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": best[0], "copy_best": best[1], "bf16_TFLOPs": tflops}, f)


if __name__ == "__main__":
    main()
