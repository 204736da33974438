"""Where the 4-bit matmul's time goes on the GPU: the pair kernel beside load-only probes of its tiling.

    PYTHONPATH=. python3 scripts/probe_qmatmul.py [--shapes 17408x5120,5120x17408] [--only probes|kernels]
    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:'qmatmul|probe' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 scripts/probe_qmatmul.py --ncu

A probe streams the packed weight [N, K/8] through the same grid and tile as the kernel and only XORs the
words together (one op a word): its time is what the layout and the grid allow the loads; the kernel's
time above it is what the unpack, the MMAs and the scales cost. XLA's own reduction of the weight is the
ceiling at that size. Each config prints the wall time per call (one jitted program cycling through 8
weight sets, median: it includes the launch gaps) and the device time per kernel launch (JAX profiler
over the same program, so L2 holds none of the sets). `--ncu` runs each config twice and times nothing
(for the profiler: without preallocation its replay does not back up the whole GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp
from bench_graph import qweights, rel_err
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from timing import device_time, median_time

from pallas_kernels import qmatmul as qm
from tfjax import quant


def _probe_kernel(w_ref, o_ref, *, block_n, words_per_step, steps):
    first = pl.program_id(1) * steps

    def body(t, acc):
        return acc ^ w_ref[:, pl.ds((first + t) * words_per_step, words_per_step)]

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_n, words_per_step), jnp.uint32))
    o_ref[...] = jnp.sum(acc.astype(jnp.float32), axis=1)  # the value is never checked, only that it is read


@functools.partial(jax.jit, static_argnames=("block_n", "words_per_step", "split", "num_warps", "num_stages",
                                             "interpret"))
def probe(w, *, block_n, words_per_step, split, num_warps=4, num_stages=3, interpret=False):
    """Stream `w [N, KW]` in [block_n, words_per_step] tiles, `split` programs along K per column block."""
    n, kw = w.shape
    steps = kw // words_per_step // split
    kernel = functools.partial(_probe_kernel, block_n=block_n, words_per_step=words_per_step, steps=steps)
    return pl.pallas_call(
        kernel,
        grid=(n // block_n, split),
        in_specs=[pl.BlockSpec((block_n, kw), lambda j, s: (j, 0))],
        out_specs=pl.BlockSpec((None, block_n), lambda j, s: (s, j)),
        out_shape=jax.ShapeDtypeStruct((split, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="probe_loads",
    )(w)


PROBES = [  # (block_n, words_per_step, split, num_warps, num_stages)
    (64, 32, 2, 4, 3),  # the pair kernel's tile, split 2 (N = 17408 at 528 programs)
    (64, 32, 4, 4, 3),
]
KERNELS = [  # (PAIRS_POLICY overrides, packed scales)
    (dict(programs=528), False),  # the dispatch before packed scales
    (dict(programs=528), True),
    ({}, True),  # the dispatch now
    (dict(num_stages=4), True),
    (dict(sums_outside=False), True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="17408x5120,5120x17408")
    ap.add_argument("--only", choices=["probes", "kernels", "all"], default="all")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--mgpu-sweep", action="store_true", help="the Mosaic GPU kernel's splits, stages and probes")
    ap.add_argument("--rows", default="1", help="rows of x for the Mosaic GPU kernel, e.g. 1,16,64")
    ap.add_argument("--unpack", default="", help="the Mosaic GPU kernel's unpacks to time, e.g. words,halves")
    ap.add_argument("--outs", default="", help="the Mosaic GPU kernel's partial layouts to time, e.g. rows,cols")
    ap.add_argument("--splits", default="", help="the Mosaic GPU kernel's K splits to time (any divisor of K's tiles), "
                    "e.g. 12,24,48")
    ap.add_argument("--block-m-check", action="store_true", help="are a row's bits the same for every block_m?")
    a = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    if a.block_m_check:
        return block_m_check()

    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        sets = [s[2] for s in qweights(n, k, 1 if a.ncu else 8, n + k)]  # pair layout
        x = jax.random.normal(jax.random.key(3), (1, k), jnp.bfloat16)
        mb = sum(t.nbytes for t in sets[0]) / 1e6
        t0 = time.perf_counter()
        xla = jax.jit(lambda w: jnp.bitwise_xor.reduce(w, axis=1))
        report(a.ncu, f"xla-reduce {shape}", xla, [(w,) for w, _, _ in sets], sets[0][0].nbytes / 1e6, t0)
        for p in PROBES if a.only != "kernels" else []:
            bn, wps, split, nw, ns = p
            f = functools.partial(probe, block_n=bn, words_per_step=wps, split=split, num_warps=nw, num_stages=ns)
            report(a.ncu, f"probe {shape} {p}", f, [(w,) for w, _, _ in sets], sets[0][0].nbytes / 1e6,
                   time.perf_counter())
        ref = qm.reference(x, *quant.from_pair_layout(*sets[0]), bits=4, group_size=64)
        for kw, packed in (KERNELS[2:3] if a.mgpu_sweep or a.rows != "1" else KERNELS) if a.only != "probes" else []:
            bs = qm.TiledBlockSizes.for_weight(n, k, 4, 64, **{**qm.PAIRS_POLICY, **kw})
            f = functools.partial(qm.qmatmul_tiled, x, bits=4, group_size=64, block_sizes=bs)
            ws = [(w, *((quant.pack_scale_bias(s, b), None) if packed else (s, b))) for w, s, b in sets]
            label = f"pairs {shape} {kw}{' packed' * packed} split {bs.split_k} programs {n // bs.block_n * bs.split_k}"
            t = time.perf_counter()
            if not a.ncu:
                label += f" err {rel_err(f(*ws[0]), ref):.1e}"
            report(a.ncu, label, f, ws, mb, t)
        if a.only != "probes":  # the Mosaic GPU kernel on the same packed pair layout
            from pallas_kernels import qmatmul_mgpu as mg

            ws = [(w, quant.pack_scale_bias(s, b)) for w, s, b in sets]
            configs = mgpu_configs(n, k, a.mgpu_sweep)
            if a.unpack:
                configs = [dataclasses.replace(bs, unpack=u) for bs in configs for u in a.unpack.split(",")]
            if a.outs:
                configs = [dataclasses.replace(bs, out=o) for bs in configs for o in a.outs.split(",")]
            if a.splits:
                tiles = k // mg.TILE
                configs = [dataclasses.replace(bs, split_k=int(sp)) for bs in configs for sp in a.splits.split(",")
                           if tiles % int(sp) == 0]
            for m, bs in itertools.product(map(int, a.rows.split(",")), configs):
                xm = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
                t = time.perf_counter()
                label = (f"mgpu {shape} M={m} {bs.operand} m{bs.block_m or 'rows'} split {bs.split_k} programs "
                         f"{n // 64 * bs.split_k} stages {bs.stages} {bs.unpack} out {bs.out} {bs.probe}")
                f = functools.partial(mg.qmatmul_pairs, xm, block_sizes=bs)
                if not a.ncu and not bs.probe:
                    ref_m = ref if m == 1 else qm.reference(xm, *quant.from_pair_layout(*sets[0]), bits=4, group_size=64)
                    label += f" err {rel_err(f(*ws[0]), ref_m):.1e}"
                report(a.ncu, label, f, ws, mb, t)


def block_m_check(n=5120, k=6144, rows=64):
    """Whether the Mosaic GPU kernel's rows keep their bits when the MMA's N (block_m) changes: if so, block_m
    could follow M (one weight read for 64 rows) without breaking row invariance."""
    from pallas_kernels import qmatmul_mgpu as mg

    w, s, b = qweights(n, k, 1, 5)[0][2]
    packed = quant.pack_scale_bias(s, b)
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    base = mg.BlockSizes.for_weight(n, k)
    ys = {bm: jax.device_get(mg.qmatmul_pairs(x, w, packed, block_sizes=dataclasses.replace(base, block_m=bm)))
          for bm in (8, 16, 32, 64)}
    for bm, y in ys.items():
        same = (y.view("uint16") == ys[8].view("uint16")).all()
        print(f"  block_m {bm}: rows bit-identical to block_m 8: {bool(same)}", flush=True)


def mgpu_configs(n, k, sweep):
    """The Mosaic GPU kernel's dispatch; with `sweep`, its stages, probes and every split of K's tiles."""
    from pallas_kernels import qmatmul_mgpu as mg

    base = mg.BlockSizes.for_weight(n, k)
    if not sweep:
        return [base]
    tiles = k // mg.TILE
    smem = dataclasses.replace(base, operand="smem", block_m=16)
    out = [smem, dataclasses.replace(smem, probe="loads")]
    out += [dataclasses.replace(base, stages=st) for st in (2, 3, 4)] + [dataclasses.replace(base, block_m=16)]
    out += [dataclasses.replace(base, probe=p) for p in ("no_dequant", "loads")]
    out += [dataclasses.replace(base, split_k=sp) for sp in range(1, 21) if tiles % sp == 0 and sp != base.split_k]
    return out


def report(ncu, label, f, sets, mb, t0):
    try:
        if ncu:
            for _ in range(2):
                jax.block_until_ready(f(*sets[0]))
            print(f"  {label}: ran twice [{time.perf_counter() - t0:.1f} s]", flush=True)
            return
        g = jax.jit(lambda sets: [f(*s) for s in sets])
        t = median_time(g, (sets,), 20) / len(sets)
        match = {"probe": "probe", "pairs": "qmatmul", "mgpu": "qmatmul_mgpu"}.get(label.split()[0], "reduce")
        dev = device_time(g, (sets,), match) * 1e6
        print(f"  {label}: wall {t * 1e6:.1f} us ({mb / t / 1e3:.0f} GB/s), device {dev:.1f} us "
              f"({mb / dev * 1e3:.0f} GB/s) [{time.perf_counter() - t0:.1f} s]", flush=True)
    except Exception as e:  # a config Triton refuses is reported, not fatal
        print(f"  {label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
