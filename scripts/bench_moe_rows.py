"""Routed experts of one moe35a3 layer (E 256, D 2048, I 512, k 8, 4-bit MLX, group 64) for 1, 4 and 16 decode rows:
the grouped-GEMM kernels in their decode placement (`moe(rows=False)`: a 16-row tile a pair, the path lane rounds
took before issue 31's K-split kernels) against the lane-round kernels (`moe(rows=True)`), in device time.

  JAX_PLATFORMS=cuda PYTHONPATH=. python3 scripts/bench_moe_rows.py [--rows 1,4,16] [--reps 7] [--sets 8]

One jitted program applies a variant to `--sets` routings in turn (fresh random experts each, so ~8 x sets experts'
bytes a program, well past the 50 MB L2), after a compile and a warm-up call; the JAX profiler then records `--reps`
calls. Each kernel: median (min..max) over its launches; "all" sums every device kernel a call (glue included) per
routing, median (min..max) over the calls. Roofline: the bytes of the distinct experts a routing chose (packed weights,
scales, biases; x and the outputs are < 1%) at `--bandwidth` GB/s (the H100's best measured copy: cudaMemcpy, 3032).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe
from tfjax.profiling import latest_events

E, D, I, K, BITS, GROUP = 256, 2048, 512, 8, 4, 64


def stacks(seed: int = 0):
    """Random 4-bit gate, up, down stacks in the MLX layout, bf16 scales and biases (~453 MB)."""
    out = []
    for n, (rows, cols) in enumerate(((I, D), (I, D), (D, I))):
        kw, ks, kb = jax.random.split(jax.random.key(seed * 10 + n), 3)
        w = jax.random.bits(kw, (E, rows, cols * BITS // 32), jnp.uint32)
        s = (jax.random.uniform(ks, (E, rows, cols // GROUP)) * 0.01 + 0.001).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (E, rows, cols // GROUP)) * 0.01).astype(jnp.bfloat16)
        out.append((w, s, b))
    return tuple(out)


def routings(n: int, sets: int, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sets):
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
        w = rng.random((n, K)) + 0.1
        x = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (n, D), jnp.bfloat16)
        out.append((x, jnp.asarray(idx), jnp.asarray(w / w.sum(1, keepdims=True), jnp.bfloat16)))
    return out


def expert_bytes(st) -> tuple[int, int]:
    """(gate + up, down) bytes of one expert."""
    one = lambda t: sum(a.nbytes // E for a in t)
    return one(st[0]) + one(st[1]), one(st[2])


def profile(fn, args, reps: int):
    """{kernel name: launch durations (s)}, and each call's summed device time (s), over `reps` traced calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    folder = Path(tempfile.mkdtemp(prefix="bench_moe_rows_"))
    with jax.profiler.trace(str(folder)):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    events = sorted(latest_events(folder), key=lambda e: float(e["ts"]))
    by_name = defaultdict(list)
    for e in events:
        by_name[e["name"]].append(float(e["dur"]) * 1e-6)
    per_call = [sum(float(e["dur"]) for e in chunk) * 1e-6 for chunk in np.array_split(np.array(events, dtype=object), reps)]
    return by_name, per_call


def spread(ts) -> str:
    ts = np.asarray(ts) * 1e6
    return f"{np.median(ts):.1f} ({ts.min():.1f}..{ts.max():.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--bandwidth", type=float, default=3032.0, help="GB/s for the roofline")
    args = ap.parse_args()
    st = stacks()
    gu_bytes, down_bytes = expert_bytes(st)
    print(f"{jax.devices()[0].device_kind}; one expert {gu_bytes + down_bytes} B (gate+up {gu_bytes}, down "
          f"{down_bytes}); 8 experts {8 * (gu_bytes + down_bytes) / 1e6:.2f} MB = "
          f"{8 * (gu_bytes + down_bytes) / args.bandwidth / 1e3:.2f} us at {args.bandwidth:.0f} GB/s", flush=True)
    rows_bs = moe.RowsBlockSizes.for_shapes(D, I, GROUP, BITS)
    variants = {  # name: (rows, block sizes); the first is the baseline
        "old: grouped GEMM, a tile a pair": (False, None),
        f"new: K split {rows_bs.split_gate_up}/{rows_bs.split_down} (default)": (True, rows_bs),
        "new: 64 programs an expert": (True, moe.RowsBlockSizes.for_shapes(D, I, GROUP, BITS, programs=64)),
        "new: 2 stages": (True, dataclasses.replace(rows_bs, num_stages=2)),
    }
    print("| rows | variant | block sizes | gate/up us | down us | all kernels us a layer | roofline us (gate/up, "
          "down) | share of roofline | rel err |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in (int(v) for v in args.rows.split(",")):
        sets = routings(n, args.sets, seed=n)
        distinct = np.mean([len(np.unique(np.asarray(i))) for _, i, _ in sets])
        roof_gu, roof_down = distinct * gu_bytes / args.bandwidth / 1e3, distinct * down_bytes / args.bandwidth / 1e3
        x0, i0, w0 = sets[0]
        ref = moe.reference(x0, i0, w0, *st, bits=BITS, group_size=GROUP)
        for name, (rows, bs) in variants.items():
            one = lambda x, i, w, rows=rows, bs=bs: moe.moe(x, i, w, *st, bits=BITS, group_size=GROUP, rows=rows,
                                                           block_sizes=bs)
            err = float(jnp.linalg.norm((one(x0, i0, w0) - ref).astype(jnp.float32))
                        / jnp.linalg.norm(ref.astype(jnp.float32)))
            prog = jax.jit(lambda sets, one=one: [one(*s) for s in sets])
            by_name, per_call = profile(prog, (sets,), args.reps)
            gu = [t for k, v in by_name.items() if "gate_up" in k for t in v]
            dn = [t for k, v in by_name.items() if "moe" in k and "down" in k for t in v]
            layer = np.asarray(per_call) / args.sets
            share = (roof_gu + roof_down) / (np.median(layer) * 1e6)
            desc = "-" if bs is None else (f"bn {bs.block_n} bk {bs.block_k} split {bs.split_gate_up}/{bs.split_down} "
                                           f"stages {bs.num_stages}")
            print(f"| {n} | {name} | {desc} | {spread(gu)} | {spread(dn)} | {spread(layer)} | "
                  f"{roof_gu + roof_down:.2f} ({roof_gu:.2f}, {roof_down:.2f}; {distinct:.1f} experts) | {share:.1%} | "
                  f"{err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
