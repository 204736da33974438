"""Times the Pallas 4-bit matmul against XLA's dequantize-then-dot at the dense27 shapes, on a GPU.

    PYTHONPATH=. python3 scripts/bench_qmatmul.py [--sweep] [--out results.json]

Prints the device-to-device copy bandwidth (bytes read + written), then per shape and M: time (median
of many runs after warm-up, each run cycling through enough weight sets that L2 cannot hold them),
GB/s of bytes touched (packed weight + scales + biases + x + out), the fraction of copy bandwidth,
TFLOP/s, and the error against the reference. Checks row invariance compiled on the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from pallas_kernels import qmatmul as qm

SHAPES = [(17408, 5120), (5120, 17408), (12288, 5120)]  # (N, K): gate/up, down, qkv-like
MS = [1, 4, 16, 64, 512]
BITS, GROUP = 4, 64
INTERPRET = False  # --smoke: tiny shapes in interpret mode, to check this script on a CPU


def copy_bandwidth(reps=20, elems=512 * 2**20):
    a = jax.random.normal(jax.random.key(0), (elems,), jnp.float32)  # 2 GiB
    f = jax.jit(lambda a: a * 1.0001)
    t = median_time(f, (a,), reps)
    return 2 * a.nbytes / t


def weight_sets(n, k, count, key):
    """Random packed words (any uint32 is a valid packed weight) and small random scales/biases."""
    sets = []
    for i in range(count):
        kw, ks, kb = jax.random.split(jax.random.fold_in(key, i), 3)
        w = jax.random.bits(kw, (n, k * BITS // 32), jnp.uint32)
        s = (jax.random.uniform(ks, (n, k // GROUP)) * 0.01).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (n, k // GROUP)) * 0.05).astype(jnp.bfloat16)
        sets.append((w, s, b))
    return sets


def time_per_call(matmul, x, sets, reps):
    """One jitted program applies `matmul` to every weight set in turn; time / len(sets)."""
    f = jax.jit(lambda x, sets: [matmul(x, *s) for s in sets])
    return median_time(f, (x, sets), reps) / len(sets)


def kernel_fn(bs):
    return lambda x, w, s, b: qm.qmatmul(x, w, s, b, bits=BITS, group_size=GROUP, block_sizes=bs, interpret=INTERPRET)


def ref_fn(x, w, s, b):
    return qm.reference(x, w, s, b, bits=BITS, group_size=GROUP)


def bytes_touched(m, n, k):
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2 + m * k * 2 + m * n * 2


def rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(y - r) / np.linalg.norm(r))


def sweep_configs(n, k):
    base = qm.BlockSizes.for_weight(n, k, GROUP)
    out = [base, dataclasses.replace(base, unpack="reshape")]
    for bn, bk, nw, ns, unpack in [
        (128, 128, 8, 4, "reshape"), (128, 128, 8, 4, "shift"), (128, 256, 4, 3, "shift"),
        (128, 256, 8, 3, "shift"), (64, 256, 4, 4, "shift"), (32, 256, 4, 3, "shift"),
        (64, 512, 4, 3, "shift"), (256, 128, 8, 3, "shift"), (64, 128, 4, 4, "shift"),
    ]:  # fmt: skip
        tiles = k // bk
        splits = [s for s in (1, 2, 4, 8) if tiles % s == 0]
        split = next((s for s in splits if (n // bn) * s >= 256), splits[-1])
        bs = qm.BlockSizes(block_n=bn, block_k=bk, split_k=split, num_warps=nw, num_stages=ns, unpack=unpack)
        out.append(bs)
    return out


def row_invariance(n, k, bs, key, rows=128):
    """Rows of M in 1..rows (fresh random neighbours) against each row computed alone."""
    (w, s, b), = weight_sets(n, k, 1, key)  # fmt: skip
    f = jax.jit(kernel_fn(bs))
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, k), jnp.bfloat16)
    alone = np.stack([np.asarray(f(x[i : i + 1], w, s, b))[0] for i in range(rows)])
    bad = []
    for m in [m for m in (1, 2, 3, 5, 8, 16, 17, 31, 64, 100, 128) if m <= rows]:
        others = jax.random.normal(jax.random.fold_in(key, 100 + m), (m, k), jnp.bfloat16)
        for start in range(0, rows, m):  # place every row somewhere inside a batch of size m
            idx = np.arange(start, min(start + m, rows))
            batch = np.asarray(f(others.at[: len(idx)].set(x[idx]), w, s, b))
            diff = np.nonzero(np.any(batch[: len(idx)].view(np.uint16) != alone[idx].view(np.uint16), -1))
            bad += [(m, int(idx[d])) for d in diff[0]]
    return bad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="try tile configs at M=1 and M=16 first")
    p.add_argument("--sets", type=int, default=8, help="weight sets cycled per timed run")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    a = p.parse_args()
    global SHAPES, MS, INTERPRET
    if a.smoke:
        SHAPES, MS, INTERPRET, a.sets, a.reps = [(256, 512)], [1, 17], True, 2, 2
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    results = {"device": jax.devices()[0].device_kind, "rows": [], "sweep": []}
    bw = copy_bandwidth(elems=2**20 if a.smoke else 512 * 2**20)
    results["copy_GBps"] = bw / 1e9
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", flush=True)
    key = jax.random.key(1)
    best = {}
    for n, k in SHAPES:
        sets = weight_sets(n, k, a.sets, jax.random.fold_in(key, n * 7 + k))
        x0 = jax.random.normal(jax.random.fold_in(key, 3), (1, k), jnp.bfloat16)
        y = kernel_fn(None)(x0, *sets[0])
        print(f"[{n}x{k}] default {qm.BlockSizes.for_weight(n, k, GROUP)} rel err vs ref "
              f"{rel_err(y, ref_fn(x0, *sets[0])):.2e}", flush=True)  # fmt: skip
        best[(n, k)] = None
        if a.sweep:
            scored = []
            for bs in sweep_configs(n, k):
                try:
                    t1 = time_per_call(kernel_fn(bs), x0, sets, a.reps)
                    x16 = jnp.tile(x0, (16, 1))
                    t16 = time_per_call(kernel_fn(bs), x16, sets, a.reps)
                except Exception as e:  # a config Triton refuses is skipped, not fatal
                    print(f"  {bs}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                scored.append((t1 + t16, bs))
                g = bytes_touched(1, n, k) / t1 / 1e9
                print(f"  {bs}: M=1 {t1 * 1e6:.1f} us ({g:.0f} GB/s)  M=16 {t16 * 1e6:.1f} us", flush=True)
                results["sweep"].append(dict(n=n, k=k, bs=dataclasses.asdict(bs), t1=t1, t16=t16))
            best[(n, k)] = min(scored, key=lambda t: t[0])[1]
            print(f"  best: {best[(n, k)]}", flush=True)
        for m in MS:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            err = rel_err(kernel_fn(best[(n, k)])(x, *sets[0]), ref_fn(x, *sets[0]))
            tk = time_per_call(kernel_fn(best[(n, k)]), x, sets, a.reps)
            tr = time_per_call(ref_fn, x, sets, a.reps)
            row = dict(n=n, k=k, m=m, t_us=tk * 1e6, ref_us=tr * 1e6, rel_err=err)
            row["GBps"] = bytes_touched(m, n, k) / tk / 1e9
            row["copy_frac"] = row["GBps"] * 1e9 / bw
            row["TFLOPs"] = 2 * m * n * k / tk / 1e12
            row["ref_TFLOPs"] = 2 * m * n * k / tr / 1e12
            if m >= 512:  # a larger block_m is faster for prompts; is it still bit-identical?
                bs16 = best[(n, k)] or qm.BlockSizes.for_weight(n, k, GROUP)
                y16 = np.asarray(kernel_fn(bs16)(x, *sets[0]))
                for bm, bn, nw in ((64, 64, 4), (128, 128, 4), (128, 128, 8)):
                    bsm = dataclasses.replace(bs16, block_m=bm, block_n=bn, num_warps=nw)
                    try:
                        t = time_per_call(kernel_fn(bsm), x, sets, a.reps)
                        same = bool(np.array_equal(np.asarray(kernel_fn(bsm)(x, *sets[0])), y16))
                    except Exception as e:
                        print(f"  block_m={bm}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    row[f"bm{bm}_bn{bn}_w{nw}"] = dict(t_us=t * 1e6, TFLOPs=2 * m * n * k / t / 1e12,
                                                        bit_identical_to_bm16=same)  # fmt: skip
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    for n, k in SHAPES[:2]:
        bad = row_invariance(n, k, best[(n, k)], jax.random.fold_in(key, 99), rows=8 if a.smoke else 128)
        results[f"row_invariance_{n}x{k}"] = bad[:20]
        verdict = "bit-identical" if not bad else f"{len(bad)} MISMATCHES e.g. {bad[:5]}"
        print(f"row invariance {n}x{k} (rows 1..128, M in 1..128): {verdict}", flush=True)

    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; {results['device']}")
    cols = ("N x K", "M", "us", "GB/s", "copy%", "TFLOP/s", "ref us", "rel err")
    print("{:>13} {:>4} {:>8} {:>6} {:>6} {:>8} {:>8} {:>8}".format(*cols))
    for r in results["rows"]:
        pct = 100 * r["copy_frac"]
        print(f"{r['n']:>6}x{r['k']:<6} {r['m']:>4} {r['t_us']:>8.1f} {r['GBps']:>6.0f} {pct:>5.1f}% "
              f"{r['TFLOPs']:>8.1f} {r['ref_us']:>8.1f} {r['rel_err']:>8.1e}")  # fmt: skip
        for name, v in r.items():
            if name.startswith("bm"):
                print(f"{'':>20} {name}: {v['t_us']:.1f} us {v['TFLOPs']:.1f} TFLOP/s, "
                      f"bit-identical to block_m=16: {v['bit_identical_to_bm16']}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
