"""The residual step on the GPU: fused add + norm (`row_norm.add_norm`, one program a row) against XLA's sum and
add then the norm kernel (two launches), by the update's partial sums S (the 4-bit kernel's K split).

    PYTHONPATH=. python3 scripts/probe_add_norm.py [--parts 1,2,4,12,17] [--rows 1] [--d 5120] [--warps 8]

Each config chains 32 residual steps in one jitted program and prints the device time a step (JAX profiler: all
kernels' time over the steps, launch gaps on the host excluded). `ops.add_norm_fused`'s default comes from it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp
from timing import device_time

from pallas_kernels import row_norm as rn

STEPS = 32


def chain(fused: bool, warps: int = 0, eps: float = 1e-6):
    """STEPS residual steps, each x + sum(parts[i]) from the step before, and its norm."""

    def step(x, parts, w):
        if fused:
            return rn.add_norm(x, parts, w, kind="rms_offset", eps=eps, block_sizes=rn.BlockSizes(warps))
        nx = rn.add_update(x, parts)
        return nx, rn.row_norm(nx, w, kind="rms_offset", eps=eps)

    @jax.jit
    def run(x, parts, w):
        ys = []
        for i in range(STEPS):
            x, y = step(x, parts[i], w)
            ys.append(y)  # every norm is an output: none is left out of the program
        return x, tuple(ys)

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="1,2,4,12,17")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--d", type=int, default=5120)
    ap.add_argument("--warps", type=int, default=0, help="the fused kernel's warps (0: its default, 4 at 5120)")
    a = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    key = jax.random.key(0)
    x = jax.random.normal(key, (a.rows, a.d), jnp.bfloat16)
    w = jax.random.normal(key, (a.d,), jnp.bfloat16) * 0.2
    print("| parts S | fused us a step | XLA sum + add, norm kernel us a step |")
    print("|---|---|---|")
    for s in map(int, a.parts.split(",")):
        dtype = jnp.bfloat16 if s == 1 else jnp.float32  # a whole product comes in the row's dtype
        parts = jax.random.normal(jax.random.key(s), (STEPS, s, a.rows, a.d), dtype)
        t = {f: device_time(chain(f, a.warps), (x, parts, w), None, per_call=STEPS) * 1e6 for f in (True, False)}
        print(f"| {s} | {t[True]:.2f} | {t[False]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
