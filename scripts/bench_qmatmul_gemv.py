"""Checks, sweeps and times `qmatmul_gemv` (the CUDA-core 4-bit GEMV) at the dense27 shapes on a GPU.

    PYTHONPATH=. python3 scripts/bench_qmatmul_gemv.py [--old] [--budget 225] [--sweep] [--out results.json]

One call, in order of need: the copy bandwidth (device-to-device, bytes read + written); the compiled
kernel against XLA's dequantize-then-dot on fresh random data; rows 0..15 computed alone against the same
rows inside batches of M in {2, 3, 5, 8, 16, 17, 64} with fresh random neighbours (bit for bit); with
--sweep, tile variants at the two MLP shapes for M = 1 and 16 (the best by total time wins); then the
table: every shape, M in {1, 4, 16, 64}, for the winner and (with --old) `qmatmul_tiled`, the MMA kernel
that ops dispatches to. Each time is the median of 20 runs of one jitted program cycling
through enough weight sets (>= 400 MB) that L2 cannot hold them, divided by the set count. Stops starting
new work past --budget seconds and always prints the table of what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from pallas_kernels import qmatmul as qm
from tfjax import quant

BITS, GROUP = 4, 64
SHAPES = {  # dense27, (N, K)
    "mlp gate/up": (17408, 5120), "mlp down": (5120, 17408), "attn q+gate": (12288, 5120),
    "delta in qkv": (10240, 5120), "delta in z": (6144, 5120), "attn o": (5120, 6144), "attn k/v": (1024, 5120),
}
MS = (1, 4, 16, 64)
VARIANTS = {  # name -> GemvBlockSizes.for_weight keywords, most telling first (the sweep may stop early)
    "default": {},  # x one value at a time, x cast to f32 outside, one group per step
    "measured": dict(x_scalar=False, x_f32=False, groups_per_step=2),  # the form timed on 2026-12-02
    "cols8": dict(cols=8),
    "step2": dict(groups_per_step=2),
    "rows4": dict(block_m=4),
    "warps2k": dict(warps=2112),
    "warps4k": dict(warps=4224),  # 32 warps an SM: more loads in flight (56 registers leave room)
    "cols2w4k": dict(cols=2, warps=4224),  # smaller programs, more of them, no longer K splits
    "prefetch2": dict(prefetch=2),
    "prefetch2w2k": dict(prefetch=2, warps=2112),
    "prefetch2w4k": dict(prefetch=2, warps=4224),
    "prefetch1": dict(prefetch=1),
    "xbf16": dict(x_f32=False),
    "stages1": dict(num_stages=1),
    "stages3": dict(num_stages=3),
    "reduce": dict(x_scalar=False),
    "fast": dict(x_scalar=False, fold=True, offset=True, cols=8),
    "partials5": dict(partials=0.05),
}
INTERPRET = False  # --smoke: tiny shapes in interpret mode, to check this script on a CPU
T0 = time.perf_counter()
LOG: dict = {"rows": [], "sweep": [], "table": []}


def elapsed():
    return time.perf_counter() - T0


def per_call(op, x, sets):
    f = jax.jit(lambda x, sets: [op(x, *s) for s in sets])
    return median_time(f, (x, sets)) / len(sets)


def qbytes(m, n, k):
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2 + m * k * 2 + m * n * 2


def rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(y - r) / np.linalg.norm(r))


def sets_for(n, k, seed, layout):
    """Random packed words (any uint32 is a valid weight) in `layout` ("new": GEMV [K/8, N]; "old": [N, K/8])."""
    count = 2 if INTERPRET else max(2, min(32, math.ceil(400e6 / qbytes(1, n, k))))
    out = []
    for i in range(count):
        kw, ks, kb = jax.random.split(jax.random.key(seed * 1000 + i), 3)
        shape = (k * BITS // 32, n) if layout == "new" else (n, k * BITS // 32)
        w = jax.random.bits(kw, shape, jnp.uint32)
        s = (jax.random.uniform(ks, (k // GROUP, n)) * 0.01 + 0.001).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (k // GROUP, n)) * 0.05).astype(jnp.bfloat16)
        out.append((w, s, b))
    return out


def mlx_weights(n, k, seed):
    kw, ks, kb = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.bits(kw, (n, k * BITS // 32), jnp.uint32)
    s = (jax.random.uniform(ks, (n, k // GROUP)) * 0.01 + 0.001).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, k // GROUP)) * 0.05).astype(jnp.bfloat16)
    return w, s, b


def gemv(bs):
    return lambda x, w, s, b: qm.qmatmul_gemv(x, w, s, b, bits=BITS, group_size=GROUP, block_sizes=bs,
                                               interpret=INTERPRET)


def check_reference(variant):
    for (n, k), m in zip([SHAPES["mlp gate/up"], SHAPES["mlp down"], SHAPES["attn k/v"]], (1, 13, 4), strict=True):
        mlx = mlx_weights(n, k, n + k)
        kl = jax.jit(lambda w, s, b: quant.to_gemv_layout(w, s, b, BITS, GROUP))(*mlx)
        bs = qm.GemvBlockSizes.for_weight(n, k, BITS, GROUP, **variant)
        x = jax.random.normal(jax.random.key(m + n), (m, k), jnp.bfloat16)
        y = jax.jit(gemv(bs))(x, *kl)
        r = quant.qmatmul_reference(x, *mlx, BITS, GROUP)
        err = rel_err(y, r)
        ok = np.isfinite(np.asarray(y, np.float32)).all() and err < 1e-2
        print(f"  check {n}x{k} M={m} {bs}: rel err {err:.1e} {'ok' if ok else 'FAILED'}", flush=True)
        LOG.setdefault("check", []).append(dict(n=n, k=k, m=m, err=err, ok=bool(ok)))


def check_rows(variant, rows=16):
    n, k = SHAPES["mlp down"]
    mlx = mlx_weights(n, k, 7)
    kl = jax.jit(lambda w, s, b: quant.to_gemv_layout(w, s, b, BITS, GROUP))(*mlx)
    f = jax.jit(gemv(qm.GemvBlockSizes.for_weight(n, k, BITS, GROUP, **variant)))
    x = jax.random.normal(jax.random.key(5), (rows, k), jnp.bfloat16)
    alone = np.stack([np.asarray(f(x[i : i + 1], *kl))[0] for i in range(rows)]).view(np.uint16)
    bad = []
    for m in (2, 3, 5, 8, 16, 17, 64):
        others = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.bfloat16)
        for start in range(0, rows, m):
            idx = np.arange(start, min(start + m, rows))
            batch = np.asarray(f(others.at[: len(idx)].set(x[idx]), *kl))[: len(idx)].view(np.uint16)
            bad += [(m, int(idx[d])) for d in np.nonzero(np.any(batch != alone[idx], -1))[0]]
    print(f"  rows 0..{rows - 1} of {n}x{k} in M in (2,3,5,8,16,17,64): "
          f"{'bit-identical' if not bad else f'{len(bad)} MISMATCHES {bad[:8]}'}", flush=True)
    LOG["rows_bad"] = bad


def probe(name):
    """Compiles the kernel alone in modules named probe_NAME_mM (for XLA_FLAGS=--xla_dump_to: PTX to read)."""
    n, k = SHAPES["mlp gate/up"]
    bs = qm.GemvBlockSizes.for_weight(n, k, BITS, GROUP, **VARIANTS[name])
    w = jnp.zeros((k * BITS // 32, n), jnp.uint32)
    s = jnp.zeros((k // GROUP, n), jnp.bfloat16)
    for m in (1, 16):
        f = gemv(bs)
        f.__name__ = f"probe_{name}_m{m}"
        jax.jit(f).lower(jnp.zeros((m, k), jnp.bfloat16), w, s, s).compile()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", action="store_true", help="time qmatmul_tiled (the MMA kernel) beside it")
    ap.add_argument("--budget", type=float, default=225.0)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", default="", help="with --sweep: only these (comma separated)")
    ap.add_argument("--variant", default="default", help="the table's variant when not sweeping")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--probe", default="", help="variants to compile alone as probe_NAME_mM (for XLA dumps)")
    ap.add_argument("--check", default="default", help="variants to check against the reference")
    ap.add_argument("--rows", default=None, help="the variant whose row invariance is checked (--variant)")
    a = ap.parse_args()
    if a.smoke:
        global INTERPRET, SHAPES
        INTERPRET = True
        SHAPES = {"mlp gate/up": (1024, 512), "mlp down": (512, 1024), "attn k/v": (128, 512)}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    big = jax.random.normal(jax.random.key(0), (2**20 if INTERPRET else 512 * 2**20,), jnp.float32)  # 2 GiB
    bw = 2 * big.nbytes / median_time(jax.jit(lambda a: a * 1.0001), (big,))
    del big
    LOG["copy_GBps"] = bw / 1e9
    print(f"copy {bw / 1e9:.0f} GB/s  [{elapsed():.0f} s]", flush=True)
    variant = VARIANTS[a.variant]
    for name in a.check.split(","):
        check_reference(VARIANTS[name])
    check_rows(VARIANTS[a.rows or a.variant])
    for name in filter(None, a.probe.split(",")):
        probe(name)
    print(f"  [{elapsed():.0f} s]", flush=True)

    if a.sweep:
        totals: dict = {}
        shapes = ("mlp gate/up", "mlp down")
        sets = {s: sets_for(*SHAPES[s], 1, "new") for s in shapes}
        for m in (1, 16):  # every variant at M = 1 first: the sweep may stop early
            for name, kw in VARIANTS.items():
                if a.variants and name not in a.variants.split(","):
                    continue
                for shape in shapes:
                    n, k = SHAPES[shape]
                    if elapsed() > a.budget * 0.55 or totals.get(name) == math.inf:
                        break
                    bs = qm.GemvBlockSizes.for_weight(n, k, BITS, GROUP, **kw)
                    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                    try:
                        t = per_call(gemv(bs), x, sets[shape])
                    except Exception as e:  # a variant Triton refuses is skipped, not fatal
                        print(f"  sweep {name} {shape} M={m}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                        totals[name] = math.inf
                        continue
                    frac = qbytes(m, n, k) / t / bw
                    totals[name] = totals.get(name, 0.0) + t
                    LOG["sweep"].append(dict(variant=name, shape=shape, m=m, us=t * 1e6, frac=frac, bs=str(bs)))
                    print(f"  sweep {name:10s} {shape} M={m:2d}: {t * 1e6:7.1f} us {frac:6.1%}  [{elapsed():.0f} s]",
                          flush=True)
        count = {v: sum(r["variant"] == v for r in LOG["sweep"]) for v in totals}
        done = [v for v in totals if count[v] == 4] or [v for v in totals if count[v] == 2]
        if done:
            a.variant = min(done, key=totals.get)
            variant = VARIANTS[a.variant]
        print(f"  best variant {a.variant} {variant}", flush=True)
        del sets
    LOG["variant"] = a.variant

    old = a.old
    for shape, (n, k) in SHAPES.items():
        if elapsed() > a.budget:
            break
        sets = sets_for(n, k, 2, "new")
        old_sets = sets_for(n, k, 3, "old") if old else None
        bs = qm.GemvBlockSizes.for_weight(n, k, BITS, GROUP, **variant)
        for m in MS:
            if elapsed() > a.budget:
                break
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            t = per_call(gemv(bs), x, sets)
            rec = dict(shape=shape, n=n, k=k, m=m, us=t * 1e6, frac=qbytes(m, n, k) / t / bw, bs=str(bs))
            if old and elapsed() < a.budget:
                f = lambda x, w, s, b: qm.qmatmul_tiled(x, w, s, b, bits=BITS, group_size=GROUP, interpret=INTERPRET)
                rec["old_us"] = per_call(f, x, old_sets) * 1e6
            LOG["table"].append(rec)
            print(f"  {shape} {n}x{k} M={m}: {t * 1e6:.1f} us {rec['frac']:.1%} (old {rec.get('old_us', 0):.1f} us)"
                  f"  [{elapsed():.0f} s]", flush=True)
        del sets, old_sets

    if a.out:
        with open(a.out, "w") as f:
            json.dump(LOG, f, indent=1)
    print(f"\n{jax.devices()[0].device_kind}; copy {bw / 1e9:.0f} GB/s; variant {a.variant}; "
          f"rows {'bit-identical' if not LOG['rows_bad'] else 'MISMATCH'}")
    print("| weight N x K | M | kernel us | GB/s | % of copy | old kernel us |")
    print("|---|---|---|---|---|---|")
    for r in LOG["table"]:
        old_us = f"{r['old_us']:.1f}" if "old_us" in r else "-"
        gbs = qbytes(r["m"], r["n"], r["k"]) / r["us"] / 1e3
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | {r['us']:.1f} | {gbs:.0f} | {r['frac']:.1%} | {old_us} |")


if __name__ == "__main__":
    main()
