"""Kernels and the decode graph on a GPU, each beside its roofline (issue 5 receipts).

    PYTHONPATH=. python3 scripts/bench_graph.py [--sections base,qmatmul,attention,delta,delta_prompt,prompt,flash,prefill,decode,hf]
        [--sweep] [--out results.json]
    BENCH_QSHAPES=decode BENCH_MS=1,16 ... --sections base,qmatmul   # the shapes a decode step multiplies

Ceilings measured in the same run: copy bandwidth (device-to-device, bytes read + written) and the bf16
matmul rate (8192^3, random data). Every time is the median of many runs of one jitted program that
applies the op to enough distinct input sets that L2 cannot hold them, divided by the set count (no
compile time). The HF transformers peer runs in a child process after the JAX sections (its own memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tfjax.profiling import device_time, median_time

START, BUDGET = time.perf_counter(), float(os.environ.get("BENCH_BUDGET_S", "1e9"))  # sweeps stop past BUDGET
ROWS = []  # markdown rows: (section, what, time, achieved, ceiling, fraction)
RESULTS: dict = {}


def per_call(op, sets, reps=20, extra=()):
    """Seconds per application of `op(*set, *extra)`, one jitted program cycling through `sets`."""
    import jax

    f = jax.jit(lambda sets, extra: [op(*s, *extra) for s in sets])
    return median_time(f, (sets, tuple(extra)), reps) / len(sets)


def row(section, what, seconds, achieved, ceiling, unit):
    frac = achieved / ceiling
    ROWS.append((section, what, f"{seconds * 1e6:.1f} us", f"{achieved:.0f} {unit}", f"{ceiling:.0f} {unit}",
                 f"{frac:.1%}"))
    print(f"  {section} | {what} | {seconds * 1e6:.1f} us | {achieved:.0f} {unit} | {frac:.1%}", flush=True)


def checked_time(label, f, sets, ref):
    """(relative error of f on the first set against `ref`, seconds per call over `sets`), or None when the config
    fails (a config Triton refuses is skipped, not fatal)."""
    try:
        return rel_err(f(*sets[0]), ref), per_call(f, sets)
    except Exception as e:
        print(f"  {label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(y - r) / np.linalg.norm(r))


# --- ceilings ---
def base():
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (512 * 2**20,), jnp.float32)  # 2 GiB
    t = median_time(jax.jit(lambda a: a * 1.0001), (a,), 20)
    bw = 2 * a.nbytes / t
    del a
    n = 8192
    x = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    tm = median_time(jax.jit(lambda x, y: x @ y), (x, y), 10)
    RESULTS["copy_GBps"], RESULTS["bf16_TFLOPs"] = bw / 1e9, 2 * n**3 / tm / 1e12
    print(f"copy {bw / 1e9:.0f} GB/s, bf16 matmul {2 * n**3 / tm / 1e12:.0f} TFLOP/s", flush=True)


# --- 4-bit matmul ---
BITS, GROUP = 4, 64
SHAPES = {  # dense27, (N, K)
    "mlp gate/up": (17408, 5120), "mlp down": (5120, 17408), "attn q+gate": (12288, 5120),
    "attn k/v": (1024, 5120), "attn o / delta out": (5120, 6144), "delta in qkv": (10240, 5120),
    "delta in z": (6144, 5120),
}
DECODE_SHAPES = {  # what a dense27 decode step multiplies: fused sibling projections (64-row padded), the lm_head
    "mlp gate+up fused": (34816, 5120), "mlp down": (5120, 17408), "delta in fused": (16512, 5120),
    "attn q+gate+k+v fused": (14336, 5120), "attn o / delta out": (5120, 6144), "lm_head": (248320, 5120),
}


def qweights(n, k, count, seed):
    import jax
    import jax.numpy as jnp

    from tfjax import quant

    conv = jax.jit(lambda w, s, b: quant.to_kernel_layout(w, s, b, BITS, GROUP))
    pair = jax.jit(lambda w, s, b: quant.to_pair_layout(w, s, b, BITS, GROUP))
    out = []
    for i in range(count):
        kw, ks, kb = jax.random.split(jax.random.key(seed * 1000 + i), 3)
        w = jax.random.bits(kw, (n, k * BITS // 32), jnp.uint32)
        s = (jax.random.uniform(ks, (n, k // GROUP)) * 0.01).astype(jnp.bfloat16)
        b = (jax.random.normal(kb, (n, k // GROUP)) * 0.05).astype(jnp.bfloat16)
        pw, ps, pb = pair(w, s, b)
        out.append(((w, s, b), conv(w, s, b), (pw, ps, pb), (pw, quant.pack_scale_bias(ps, pb), None)))
        # MLX, kernel layout, pair layout, pair layout with packed scales (the serving layout)
    return out


def layout_of(policy) -> int:
    """Which of qweights' layouts a tiled policy reads: 3 (pairs, packed scales), 2 (pairs) or 1 (kernel layout)."""
    if policy.get("unpack") == "pairs":
        return 3 if policy.get("packed") else 2
    return 1


def qbytes(m, n, k):
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2 + m * k * 2 + m * n * 2


def sweep_tiled():

    out = []
    for bn, swap, fold, nw, ns, prog in [
        (64, False, True, 4, 3, 264), (64, True, True, 4, 3, 264), (64, False, False, 4, 3, 264),
        (64, True, False, 4, 3, 264), (128, True, True, 4, 3, 264), (32, False, True, 4, 3, 264),
        (64, False, True, 4, 4, 528), (64, True, True, 8, 3, 264), (128, True, True, 8, 4, 528),
        (64, False, True, 2, 3, 264), (32, True, True, 4, 4, 528), (64, True, True, 4, 2, 132),
    ]:  # fmt: skip
        out.append(dict(block_n=bn, swap=swap, fold=fold, num_warps=nw, num_stages=ns, programs=prog))
    # the unpack through 2^23's mantissa (no I2F; bit-identical, untimed before): on the two best of run 2
    out += [dict(out[i], unpack="magic") for i in (1, 2)]
    return out


def sweep_unpack():
    """The unpack variants (2026-12-04): bf16 128 + q fields, then two weights a LOP3 (pair layout), by split and stages."""
    base = dict(block_n=64, swap=True, fold=True, num_warps=4, num_stages=3, programs=264)
    pairs = dict(base, unpack="pairs", sums_outside=True)
    return [pairs, base, dict(base, unpack="bf16", sums_outside=True), dict(pairs, sums_outside=False),
            dict(pairs, programs=528), dict(pairs, programs=1056), dict(pairs, num_stages=4),
            dict(pairs, block_n=128, num_warps=8)]


def sweep_options():
    """The pair kernel's untimed options (2026-12-03): scales a tile ahead, K split up to 34 ways, sums in the kernel;
    each twice, interleaved, since identical configs drifted up to 25% between runs."""
    from pallas_kernels import qmatmul as qm

    pairs = dict(block_n=64, swap=True, fold=True, num_warps=4, num_stages=3, **qm.PAIRS_POLICY)  # the dispatch's
    options = [pairs, dict(pairs, prefetch=True), dict(pairs, programs=1056, max_split=34), dict(pairs, sums_outside=False)]
    return options + [dict(o, again=True) for o in options]


def tiled_bs(policy, n, k):
    from pallas_kernels import qmatmul as qm

    p = dict(policy)
    p.pop("again", None)  # a repeat's marker only
    p.pop("packed", None)  # a layout's marker (layout_of)
    bn = p.pop("block_n")
    bn = next(b for b in (bn, 64, 32, 16) if n % b == 0)
    return qm.TiledBlockSizes.for_weight(n, k, BITS, GROUP, block_n=bn, **p)


def qmatmul_section(sweep: bool | str, ms=(1, 4, 16, 64)):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import qmatmul as qm

    bw = RESULTS["copy_GBps"] * 1e9
    policy = dict(block_n=64, swap=True, fold=True, num_warps=4, num_stages=3, **qm.PAIRS_POLICY, packed=True)  # dispatch
    if sweep:
        scores = {}
        candidates = {"unpack": sweep_unpack, "options": sweep_options}.get(sweep, sweep_tiled)()
        for name in ("mlp gate/up", "mlp down"):
            n, k = SHAPES[name]
            sets = qweights(n, k, 8, n + k)
            x = jax.random.normal(jax.random.key(3), (1, k), jnp.bfloat16)
            ref = qm.reference(x, *sets[0][0], bits=BITS, group_size=GROUP)
            for i, pol in enumerate(candidates):
                bs = tiled_bs(pol, n, k)
                f = lambda x, w, s, b, bs=bs: qm.qmatmul_tiled(x, w, s, b, bits=BITS, group_size=GROUP, block_sizes=bs)
                lay = layout_of(pol)
                timed = checked_time(f"sweep {name} {pol}", f, [(x, *s[lay]) for s in sets], ref)
                if timed is None:
                    continue
                err, t = timed
                frac = qbytes(1, n, k) / t / bw
                print(f"  sweep {name} {bs}: {t * 1e6:.1f} us {frac:.1%} err {err:.1e}", flush=True)
                RESULTS.setdefault("qsweep", []).append(dict(shape=name, policy=pol, us=t * 1e6, frac=frac, err=err))
                if err < 2e-2:
                    scores[i] = scores.get(i, 0.0) + t
        both = [i for i in scores if sum(r["policy"] == candidates[i] for r in RESULTS["qsweep"]) == 2]
        policy = candidates[min(both, key=scores.get)]
        print(f"  best policy {policy}", flush=True)
    RESULTS["qpolicy"] = policy
    shapes = DECODE_SHAPES if os.environ.get("BENCH_QSHAPES") == "decode" else SHAPES
    ms = tuple(map(int, os.environ["BENCH_MS"].split(","))) if os.environ.get("BENCH_MS") else ms
    for name, (n, k) in shapes.items():
        count = max(2, min(32, math.ceil(400e6 / qbytes(1, n, k))))
        sets = qweights(n, k, count, n + 7 * k)
        f, bs = dispatched(policy, n, k)
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            g = lambda x, w, s, b: qm.reference(x, w, s, b, bits=BITS, group_size=GROUP)
            lay = layout_of(policy)
            err = rel_err(f(x, *sets[0][lay]), g(x, *sets[0][0]))
            args = [(x, *s[lay]) for s in sets]
            t = per_call(f, args)
            tr = per_call(g, [(x, *s[0]) for s in sets])
            dev = device_time(jax.jit(lambda args, f=f: [f(*a) for a in args]), (args,), "qmatmul")
            rec = dict(shape=name, n=n, k=k, m=m, us=t * 1e6, device_us=dev * 1e6, xla_us=tr * 1e6, err=err,
                       bs=dataclasses.asdict(bs))
            if name in ("mlp gate/up", "mlp down") and m in (1, 16):  # the run-1 kernel, for the notes
                h = lambda x, w, s, b: qm.qmatmul(x, w, s, b, bits=BITS, group_size=GROUP)
                rec["mlx_kernel_us"] = per_call(h, [(x, *s[0]) for s in sets]) * 1e6
            RESULTS.setdefault("qmatmul", []).append(rec)
            row("qmatmul", f"{name} {n}x{k} M={m}, device time (wall {t * 1e6:.0f} us, XLA's wall {tr * 1e6:.0f} us; "
                f"err {err:.0e})", dev, qbytes(m, n, k) / dev / 1e9, bw / 1e9, "GB/s")
    for name in ("mlp gate/up", "mlp down"):
        n, k = SHAPES[name]
        bad = row_invariance(n, k, dispatched(policy, n, k)[0], layout_of(policy), int(os.environ.get("BENCH_ROWS", "128")))
        RESULTS[f"rows_{name}"] = bad[:20]
        print(f"  row invariance {name}: {'bit-identical' if not bad else f'{len(bad)} MISMATCHES {bad[:5]}'}",
              flush=True)


def dispatched(policy, n, k):
    """(f(x, w, s, b), its tiles): what `ops.qmatmul` runs for this layout: the Mosaic GPU kernel for packed pairs
    it serves, else the Triton tiled kernel with the policy's tiles."""
    from pallas_kernels import qmatmul as qm
    from pallas_kernels import qmatmul_mgpu as mg

    if policy.get("packed") and mg.BlockSizes.serves(n, k, GROUP):
        bs = mg.BlockSizes.for_weight(n, k)
        return (lambda x, w, s, b: mg.qmatmul_pairs(x, w, s, block_sizes=bs)), bs
    bs = tiled_bs(policy, n, k)
    return (lambda x, w, s, b: qm.qmatmul_tiled(x, w, s, b, bits=BITS, group_size=GROUP, block_sizes=bs)), bs


def row_invariance(n, k, kernel, layout=1, rows=128):
    """Rows 1..rows, each inside batches of several M with fresh random neighbours, against the row alone."""
    import jax
    import jax.numpy as jnp

    w, s, b = qweights(n, k, 1, 99)[0][layout]
    f = jax.jit(lambda x: kernel(x, w, s, b))
    x = jax.random.normal(jax.random.key(5), (rows, k), jnp.bfloat16)
    alone = np.stack([np.asarray(f(x[i : i + 1]))[0] for i in range(rows)])
    bad = []
    for m in (2, 3, 5, 8, 16, 17, 31, 64, 100, 128):
        others = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.bfloat16)
        for start in range(0, rows, m):
            idx = np.arange(start, min(start + m, rows))
            batch = np.asarray(f(others.at[: len(idx)].set(x[idx])))
            diff = np.nonzero(np.any(batch[: len(idx)].view(np.uint16) != alone[idx].view(np.uint16), -1))[0]
            bad += [(m, int(idx[d])) for d in diff]
    return bad


# --- attention ---
def verify_rows(ctx, t, h, e, seed):
    """One lane's `t` query rows at the end of a `ctx`-key context: (q [1, t, h, e] bf16, positions [1, t])."""
    import jax
    import jax.numpy as jnp

    q = jax.random.normal(jax.random.key(seed), (1, t, h, e), jnp.bfloat16)
    return q, (ctx - t + jnp.arange(t, dtype=jnp.int32))[None]


def kv_sets(ctx, count, g=4, e=256, page=16, seed=0, span=0):
    """`count` KV pools of `ctx` keys in shuffled pages; a `span` past ctx widens the page table with unallocated
    entries (the pool's size), as a lane of a longer-context engine holding ctx tokens."""
    import jax
    import jax.numpy as jnp

    n = ctx // page
    out = []
    for i in range(count):
        k1, k2 = jax.random.split(jax.random.key(seed + i))
        kp = jax.random.normal(k1, (n, page, g, e), jnp.bfloat16)
        vp = jax.random.normal(k2, (n, page, g, e), jnp.bfloat16)
        pt = jax.random.permutation(jax.random.key(seed + 77 + i), n).astype(jnp.int32)
        pt = jnp.concatenate([pt, jnp.full((max(span // page - n, 0),), n, jnp.int32)])[None]
        out.append((kp, vp, pt))
    return out


ATTN_CANDS: list[dict] = []  # --attn-cands
ATTN_SPAN = [0]  # --attn-span: the candidates' page tables span this many keys whatever the context


def attention_section(sweep: bool | str):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import attention as pa

    bw = RESULTS["copy_GBps"] * 1e9
    h, g, e = 24, 4, 256
    best = pa.DEFAULT
    if sweep == "chunks":  # chunk policies (from the lane's span) at every context: best geometric mean of fractions
        q16, q64 = dict(block_q=16, num_warps=4), dict(block_q=64, num_warps=8)  # the old default and the new
        cands = [pa.BlockSizes(**q16), pa.BlockSizes(**q16, chunk_programs=528), pa.BlockSizes(**q16, q_blocks=1),
                 pa.BlockSizes(**q16, block_k=32, num_stages=3), pa.BlockSizes(**q64),
                 pa.BlockSizes(**q64, chunk_programs=528), pa.BlockSizes(**q64, block_k=32, num_stages=3),
                 pa.BlockSizes(block_q=64, num_warps=4), pa.BlockSizes(block_q=32, num_warps=4),
                 pa.BlockSizes(block_q=32, num_warps=8)]
        logs = {}
        for ctx in (2048, 16384, 65536):
            kvb = 2 * ctx * g * e * 2
            sets = kv_sets(ctx, max(2, min(8, math.ceil(256e6 / kvb))))
            for t in (1, 8):
                q, pos = verify_rows(ctx, t, h, e, seed=t)
                ref = pa.reference(q, *sets[0], pos)
                for i, bs in enumerate(cands):
                    f = lambda q, kp, vp, pt, pos, bs=bs: pa.paged_attention(q, kp, vp, pt, pos, block_sizes=bs)
                    timed = checked_time(f"attn chunks {bs}", f, [(q, *s, pos) for s in sets], ref)
                    if timed is None:
                        continue
                    err, tt = timed
                    frac = kvb / tt / bw
                    print(f"  attn chunks ctx {ctx} rows {t} {bs} chunk {bs.chunk_for(ctx, g)}: {tt * 1e6:.1f} us "
                          f"{frac:.1%} err {err:.1e}", flush=True)
                    RESULTS.setdefault("attn_sweep", []).append(dict(ctx=ctx, t=t, bs=dataclasses.asdict(bs),
                                                                     us=tt * 1e6, err=err))
                    if err < 2e-2:
                        logs.setdefault(i, []).append(math.log(frac))
        full = [i for i in logs if len(logs[i]) == 6]
        best = cands[max(full, key=lambda i: sum(logs[i]))]
        print(f"  best attention blocks {best}", flush=True)
    elif sweep:
        ctx, t = 16384, 8
        sets = kv_sets(ctx, 4)
        q, pos = verify_rows(ctx, t, h, e, seed=1)
        ref = pa.reference(q, *sets[0], pos)
        scored = []
        for bq, bk, ck, nw, ns in [(16, 64, 512, 4, 2), (16, 32, 256, 4, 3), (16, 64, 1024, 4, 2),
                                   (64, 64, 512, 4, 2), (64, 32, 512, 4, 3), (32, 64, 512, 4, 3),
                                   (16, 128, 1024, 8, 2), (64, 64, 1024, 8, 2)]:
            bs = pa.BlockSizes(block_q=bq, block_k=bk, chunk_k=ck, num_warps=nw, num_stages=ns, chunk_programs=0)
            f = lambda q, kp, vp, pt, pos, bs=bs: pa.paged_attention(q, kp, vp, pt, pos, block_sizes=bs)
            timed = checked_time(f"attn sweep {bs}", f, [(q, *s, pos) for s in sets], ref)
            if timed is None:
                continue
            err, tt = timed
            kvb = 2 * ctx * g * e * 2
            print(f"  attn sweep {bs}: {tt * 1e6:.1f} us {kvb / tt / bw:.1%} err {err:.1e}", flush=True)
            RESULTS.setdefault("attn_sweep", []).append(dict(bs=dataclasses.asdict(bs), us=tt * 1e6, err=err))
            if err < 2e-2:
                scored.append((tt, bs))
        best = min(scored, key=lambda s: s[0])[1]
        print(f"  best attention blocks {best}", flush=True)
    RESULTS["attn_bs"] = dataclasses.asdict(best)
    if ATTN_CANDS:
        attention_candidates(ATTN_CANDS, h, g, e, bw)
        return
    from pallas_kernels import attention_mgpu as am
    from tfjax.ops import mosaic_attention_serves

    # the table times what the engine serves: the Mosaic kernel where the dispatch takes it, unless a sweep chose
    mosaic = not sweep and mosaic_attention_serves(e, 16, jnp.bfloat16, jnp.bfloat16)
    RESULTS["attn_kernel"] = "mosaic" if mosaic else "triton"
    print(f"  attention kernel: {RESULTS['attn_kernel']}", flush=True)
    for ctx in (2048, 16384, 65536):
        kvb = 2 * ctx * g * e * 2
        sets = kv_sets(ctx, max(2, min(16, math.ceil(512e6 / kvb))))
        for t in (1, 8):
            q, pos = verify_rows(ctx, t, h, e, seed=t)
            f = (am.paged_attention if mosaic else
                 functools.partial(pa.paged_attention, block_sizes=best))
            err = rel_err(f(q, *sets[0], pos), pa.reference(q, *sets[0], pos))
            args = [(q, *s, pos) for s in sets]
            tt = per_call(f, args)
            tr = per_call(pa.reference, args)
            # the kernel and its partials' combine, launch gaps left out
            dev = device_time(jax.jit(lambda args, f=f: [f(*a) for a in args]), (args,), None, per_call=len(args))
            same = True
            if ctx == 2048 and t == 8:  # each verify row equals the row alone, bit for bit
                full = np.asarray(f(q, *sets[0], pos)).view(np.uint16)
                for i in range(t):
                    one = np.asarray(f(q[:, i : i + 1], *sets[0], pos[:, i : i + 1])).view(np.uint16)
                    same &= bool(np.array_equal(one[:, 0], full[:, i]))
                RESULTS["attn_rows_bit_identical"] = same
                print(f"  attention rows bit-identical to alone: {same}", flush=True)
            RESULTS.setdefault("attention", []).append(dict(ctx=ctx, t=t, us=tt * 1e6, device_us=dev * 1e6,
                                                            xla_us=tr * 1e6, err=err))
            row("attention", f"ctx {ctx} rows {t}, {RESULTS['attn_kernel']}, device time (wall {tt * 1e6:.0f} us, "
                f"XLA's wall {tr * 1e6:.0f} us; err {err:.0e})", dev, kvb / dev / 1e9, bw / 1e9, "GB/s")


def attention_candidates(cands, h, g, e, bw):
    """Device time of each candidate (BlockSizes keywords, plus `page`: the cache's page size, `kernel`: "mgpu"
    for the Mosaic GPU kernel, `parts`: that kernel without the combine) at every context and 1 and 8 rows, in one
    process: A/B rows of one table (a probe's errors are meaningless)."""
    import jax

    from pallas_kernels import attention as pa
    from pallas_kernels import attention_mgpu as am

    for ctx in (65536, 16384, 2048):  # the longest first: what a timeout would cut is the least telling
        kvb = 2 * ctx * g * e * 2
        count = max(2, min(16, math.ceil(512e6 / kvb)))
        for t in (1, 8):
            q, pos = verify_rows(ctx, t, h, e, seed=t)
            for label in cands:
                kw = dict(label)
                sets = kv_sets(ctx, count, page=kw.pop("page", 16), span=ATTN_SPAN[0])
                mod = am if kw.pop("kernel", "triton") == "mgpu" else pa
                parts = kw.pop("parts", False)  # the Mosaic kernel alone, without the combine (no error to check)
                bs = mod.BlockSizes(**kw)
                fn = am.paged_partials if parts else mod.paged_attention
                f = lambda q, kp, vp, pt, pos, bs=bs, fn=fn: fn(q, kp, vp, pt, pos, block_sizes=bs)
                args = [(q, *s, pos) for s in sets]
                try:
                    err = math.nan if parts else rel_err(f(*args[0]), pa.reference(*args[0]))
                    dev = device_time(jax.jit(lambda args, f=f: [f(*a) for a in args]), (args,), None,
                                      per_call=len(args))
                except Exception as ex:  # a config Triton refuses is a row, not the end of the run
                    print(f"  attn cand ctx {ctx} rows {t} {label}: failed {type(ex).__name__}: {str(ex)[:300]}",
                          flush=True)
                    continue
                print(f"  attn cand ctx {ctx} rows {t} {label}: {dev * 1e6:.1f} us "
                      f"{kvb / dev / bw:.1%} err {err:.1e}", flush=True)
                RESULTS.setdefault("attn_cands", []).append(dict(ctx=ctx, t=t, cand=label,
                                                                 device_us=dev * 1e6, err=err))
                del sets, args


# --- Gated DeltaNet recurrence (rounds) ---
def delta_section():
    """The Pallas recurrence fed by the conv output (`recurrent_qkv`, what lane rounds run) against XLA's split, norms
    and step at the dense27 DeltaNet shape (16 key heads, 48 value heads of 128), one layer's state per set."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gated_delta as gdk

    bw = RESULTS["copy_GBps"] * 1e9
    hk, hv, d = 16, 48, 128
    kernel = lambda *a, bs=None: gdk.recurrent_qkv(*a, key_heads=hk, out_dtype=jnp.bfloat16, block_sizes=bs)
    ref = lambda *a: gdk.qkv_reference(*a, key_heads=hk, out_dtype=jnp.bfloat16)
    for lanes, t in ((1, 1), (1, 8), (4, 8)):
        state_bytes = lanes * hv * d * d * 4
        keys = jax.random.split(jax.random.key(lanes * 10 + t), 4)
        sets = []
        for i in range(max(2, min(48, math.ceil(512e6 / state_bytes)))):
            st = jax.random.normal(jax.random.fold_in(keys[0], i), (lanes, hv, d, d), jnp.float32)
            qkv = jax.random.normal(keys[1], (lanes, t, (2 * hk + hv) * d), jnp.bfloat16)
            g = -jnp.abs(jax.random.normal(keys[2], (lanes, t, hv))) * 0.5
            beta = jax.nn.sigmoid(jax.random.normal(keys[3], (lanes, t, hv)))
            sets.append((st, qkv, g, beta, jnp.full((lanes,), t, jnp.int32)))
        if (lanes, t) == (1, 8):  # a small sweep of the free block sizes first
            for bs in (gdk.BlockSizes(16, 4), gdk.BlockSizes(32, 4), gdk.BlockSizes(64, 4), gdk.BlockSizes(64, 8),
                       gdk.BlockSizes(128, 8)):
                ts = per_call(lambda *a, bs=bs: kernel(*a, bs=bs), sets)
                print(f"  delta sweep {bs}: {ts * 1e6:.1f} us", flush=True)
        err = max(rel_err(a, b) for a, b in zip(kernel(*sets[0]), ref(*sets[0]), strict=True))
        tk = per_call(kernel, sets)
        tr = per_call(ref, sets)
        moved = 2 * state_bytes + sum(a.nbytes for a in sets[0][1:4]) + lanes * t * hv * d * 2
        RESULTS.setdefault("delta", []).append(dict(lanes=lanes, t=t, us=tk * 1e6, xla_us=tr * 1e6, err=err))
        row("delta", f"{lanes} lane(s) x {t} rows, 48 heads 128x128 (XLA {tr * 1e6:.0f} us; err {err:.0e})", tk,
            moved / tk / 1e9, bw / 1e9, "GB/s")


# --- Gated DeltaNet, prompts ---
DELTA_PROMPT_CANDS = (dict(), dict(num_warps=8), dict(precision="tf32"), dict(precision="ieee"),
                      dict(split=False, block_v=128), dict(split=False, block_v=128, num_warps=8))  # BlockSizes keywords
DELTA_PROMPT_ROWS = (2048, 8192, 16384)


def delta_prompt_section():
    """One dense27 DeltaNet layer's prompt (48 heads of 128, one lane): the chunked Pallas kernel (two launches or
    one; dot precisions) against XLA's chunked scan (the default), wall time a call, error against the scan at
    full f32."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gated_delta_chunked as gdc

    hv, d = 48, 128
    for t in DELTA_PROMPT_ROWS:
        keys = jax.random.split(jax.random.key(t), 7)
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        args = (jax.random.normal(keys[0], (1, hv, d, d), jnp.float32) * 0.1,
                unit(jax.random.normal(keys[1], (1, t, hv, d))) * d**-0.5, unit(jax.random.normal(keys[2], (1, t, hv, d))),
                jax.random.normal(keys[3], (1, t, hv, d)), -jax.nn.softplus(jax.random.normal(keys[4], (1, t, hv))),
                jax.nn.sigmoid(jax.random.normal(keys[5], (1, t, hv))))
        with jax.default_matmul_precision("highest"):
            want = jax.jit(gdc.reference)(*args)
        txla = per_call(gdc.reference, [args], reps=5)
        flops = t * hv * (6 * d * d + 4 * 64 * d + 24 * 64 * 64)  # state reads, writes and the chunk's triangle
        row("delta_prompt", f"XLA chunked scan, {t} rows, 48 heads 128x128", txla, flops / txla / 1e12,
            RESULTS["bf16_TFLOPs"], "TFLOP/s")
        for cand in DELTA_PROMPT_CANDS:
            bs = gdc.BlockSizes(**cand)
            f = lambda *a, bs=bs: gdc.chunked(*a, block_sizes=bs)
            what = (f"{'two launches' if bs.split else 'one launch'}, {bs.precision}, block_v {bs.block_v}, "
                    f"{bs.num_warps} warps")
            try:
                err = max(rel_err(a, b) for a, b in zip(f(*args), want, strict=True))
                tk = per_call(f, [args], reps=5)
            except Exception as ex:  # a config Triton refuses is a row, not the end of the run
                print(f"  delta_prompt {t} rows {what}: failed {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                continue
            RESULTS.setdefault("delta_prompt", []).append(dict(t=t, cand=cand, us=tk * 1e6, xla_us=txla * 1e6,
                                                               err=err))
            row("delta_prompt", f"kernel, {what}, {t} rows ({txla / tk:.2f}x XLA; err {err:.0e})", tk,
                flops / tk / 1e12, RESULTS["bf16_TFLOPs"], "TFLOP/s")


# --- prompt path ---
def prompt_section():
    import jax
    import jax.numpy as jnp

    from pallas_kernels import attention as pa
    from pallas_kernels import qmatmul as qm

    peak = RESULTS["bf16_TFLOPs"]
    n, k = SHAPES["mlp gate/up"]
    sets = qweights(n, k, 2, 5)
    for m in (2048, 8192, 16384):
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        g = lambda x, w, s, b: qm.reference(x, w, s, b, bits=BITS, group_size=GROUP)
        t = per_call(g, [(x, *s[0]) for s in sets], reps=10)
        row("prompt", f"qmatmul XLA dequant+dot {n}x{k} M={m}", t, 2 * m * n * k / t / 1e12, peak, "TFLOP/s")
    bs = pa.BlockSizes(**RESULTS.get("attn_bs", {}))
    h, e = 24, 256
    for t_ in (2048, 8192, 16384):
        (kp, vp, pt), = kv_sets(t_, 1)  # fmt: skip
        q = jax.random.normal(jax.random.key(2), (1, t_, h, e), jnp.bfloat16)
        pos = jnp.arange(t_, dtype=jnp.int32)[None]
        f = lambda q, kp, vp, pt, pos: pa.paged_attention(q, kp, vp, pt, pos, block_sizes=bs)
        tt = per_call(f, [(q, kp, vp, pt, pos)], reps=5)
        flops = 4 * h * e * t_ * t_ / 2  # causal: QK and PV over half the square
        row("prompt", f"attention (paged kernel) causal {t_} rows", tt, flops / tt / 1e12, peak, "TFLOP/s")
    flash_section()


FLASH_SWEEP = [(128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4), (64, 64, 4, 2), (64, 64, 4, 3),
               (128, 128, 8, 1)]  # (block_q, block_k, num_warps, num_stages); the default first
FLASH_SIZES = (16384, 2048, 8192)  # the sweep runs in this order until the budget is spent


def flash_section():
    """Causal prompt attention through the flash kernel (a sweep of tiles at each size), beside jax's kernels."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import flash_attention as fa
    from tfjax import ops

    peak = RESULTS["bf16_TFLOPs"]
    h, g, e = 24, 4, 256

    def qkv(t, s, seed):
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        return (jax.random.normal(kq, (1, t, h, e), jnp.bfloat16), jax.random.normal(kk, (1, s, g, e), jnp.bfloat16),
                jax.random.normal(kv, (1, s, g, e), jnp.bfloat16))

    # correctness first: a whole 2k prompt, a mid-context chunk, two lanes at different starts, the model's path
    checks = {}
    q, k, v = qkv(2048, 2048, 1)
    pos = jnp.arange(2048, dtype=jnp.int32)[None]
    checks["prompt 2048"] = rel_err(fa.flash_attention(q, k, v, pos), fa.reference(q, k, v, pos))
    q, k, v = qkv(256, 4100, 2)
    pos = (3000 + jnp.arange(256, dtype=jnp.int32))[None]
    checks["chunk 256 at 3000 of 4100 keys"] = rel_err(fa.flash_attention(q, k, v, pos), fa.reference(q, k, v, pos))
    q2, k2, v2 = (jnp.concatenate([a, b]) for a, b in zip(qkv(200, 1000, 3), qkv(200, 1000, 4), strict=True))
    pos2 = jnp.stack([jnp.arange(200, dtype=jnp.int32), 777 + jnp.arange(200, dtype=jnp.int32)])
    checks["2 lanes x 200 rows"] = rel_err(fa.flash_attention(q2, k2, v2, pos2), fa.reference(q2, k2, v2, pos2))
    page, n = 16, 80
    kp, vp, pt = kv_sets(n * page, 1, seed=5)[0]
    qq = jax.random.normal(jax.random.key(6), (1, 300, h, e), jnp.bfloat16)
    pp = (900 + jnp.arange(300, dtype=jnp.int32))[None]
    pages = ops.KVPages(kp, vp)

    def attend(q, kernels):
        with ops.using(kernels):
            return ops.paged_attention(q, pages, pt, pp)

    got = jax.jit(functools.partial(attend, kernels=ops.PALLAS))(qq)
    want = jax.jit(functools.partial(attend, kernels=ops.REFERENCE))(qq)
    checks["ops.paged_attention prompt (kernel vs reference path)"] = rel_err(got, want)
    for name, err in checks.items():
        print(f"  flash check {name}: err {err:.1e} {'ok' if err < 1e-2 else 'FAIL'}", flush=True)
    RESULTS["flash_checks"] = checks

    best = {}
    for t in FLASH_SIZES:
        q, k, v = qkv(t, t, t)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        flops = 4 * h * e * t * t / 2
        ref = fa.flash_attention(q, k, v, pos)
        times = []
        for bq, bk, nw, ns in FLASH_SWEEP:
            bs = fa.BlockSizes(bq, bk, nw, ns)
            if time.perf_counter() - START > BUDGET and bs != fa.BlockSizes() and times:
                continue  # past the run's budget: the default tiles only
            f = lambda q, k, v, pos, bs=bs: fa.flash_attention(q, k, v, pos, block_sizes=bs)
            try:
                err = rel_err(f(q, k, v, pos), ref)
                tt = per_call(f, [(q, k, v, pos)], reps=5)
            except Exception as ex:  # a config Triton refuses is skipped, not fatal
                print(f"  flash {t} {bs}: failed {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            print(f"  flash {t} {bs}: {tt * 1e6:.0f} us {flops / tt / 1e12:.0f} TFLOP/s err-vs-default {err:.0e}",
                  flush=True)
            RESULTS.setdefault("flash_sweep", []).append(dict(t=t, bs=dataclasses.asdict(bs), us=tt * 1e6, err=err))
            if err < 1e-2:
                times.append((tt, bs))
        tt, bs = min(times, key=lambda x: x[0])
        best[t] = dataclasses.asdict(bs)
        row("prompt", f"attention (flash kernel, {bs.block_q}/{bs.block_k}/{bs.num_warps}w/{bs.num_stages}s) "
            f"causal {t} rows", tt, flops / tt / 1e12, peak, "TFLOP/s")
        peers = {}  # jax's bundled kernels on the same problem (causal from 0; mha needs k, v repeated per head)
        try:
            from jax.experimental.pallas.ops.gpu import attention as jmha

            kr, vr = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
            for bq, bk, nw in ((128, 64, 8),):
                jb = jmha.BlockSizes(block_q=bq, block_k=bk)
                peers[f"jax mha {bq}/{bk}/{nw}w"] = (
                    lambda q, k, v, jb=jb, nw=nw: jmha.mha(q, k, v, None, sm_scale=e**-0.5, causal=True,
                                                           block_sizes=jb, num_warps=nw), (q, kr, vr))
        except Exception as ex:
            print(f"  jax mha unavailable: {ex}", flush=True)
        peers["cudnn (jax.nn.dot_product_attention)"] = (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), (q, k, v))
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as jmg

            cfg = jmg.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
            f16 = tuple(a.astype(jnp.float16) for a in (q, k, v))  # its shared-memory scratch is float16 only
            peers["jax mosaic-gpu attention 64/64 (f16)"] = (lambda q, k, v, cfg=cfg: jmg.attention(q, k, v, cfg), f16)
        except Exception as ex:
            print(f"  jax mosaic-gpu attention unavailable: {ex}", flush=True)
        for name, (f, args) in peers.items():
            try:
                err = rel_err(f(*args), ref)
                tp = per_call(f, [args], reps=5)
            except Exception as ex:
                print(f"  peer {name} {t}: failed {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            RESULTS.setdefault("flash_peers", []).append(dict(t=t, name=name, us=tp * 1e6, err=err))
            row("prompt", f"peer: {name} causal {t} rows (err vs ours {err:.0e})", tp, flops / tp / 1e12, peak,
                "TFLOP/s")
    RESULTS["flash_best"] = best


# --- dense27 decode ---
def decode_section(steps=20, context=2048, layers=0, modes=("reference", "kernel"), rows=1, span=0):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax import geometry, models, ops
    from tfjax.config import QuantConfig
    from tfjax.models.decoder import DeltaState
    from tfjax.models.layers import ROWS as ROWS_MODE
    from tfjax.models.layers import serving_layout

    bw = RESULTS["copy_GBps"] * 1e9
    unit = "tok/s" if rows == 1 else "rounds/s"  # a round of `rows` verify rows keeps one token or more
    config = geometry.named("dense27").replace(quantization=QuantConfig(4, 64))
    if layers:
        config = config.replace(num_hidden_layers=layers, layer_types=config.layer_types[:layers])
    graphdef, params = models.random_params(config)
    c = config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    weight_bytes -= sum(x.nbytes for x in jax.tree.leaves(params["model"]["embed_tokens"]["table"]))
    kv_bytes = len(c.attention_layers) * context * c.num_key_value_heads * c.head_dim * 2 * 2
    state_bytes = len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 8
    step_bytes = weight_bytes + kv_bytes + state_bytes
    tokens, first = {}, {}  # first: each path's logits at the same first step (same weights, cache and token)
    for mode in modes:
        model = nnx.merge(graphdef, params)
        model.kernels = ops.PALLAS if mode == "kernel" else ops.REFERENCE  # static, in the graphdef
        if mode == "kernel":
            fused, packed = serving_layout(model)
            print(f"  fused {fused} projection groups, repacked {packed} linears", flush=True)
        gd, ps = nnx.split(model) if os.environ.get("BENCH_PARAMS") == "state" else models.split(model)  # A/B
        cache = model.init_cache(1, span or context + 4 * steps + 64)
        key = jax.random.key(7)
        cache.layers = [DeltaState(l.conv, jax.random.normal(key, l.state.shape) * 0.01) if isinstance(l, DeltaState)
                        else type(l)(jax.random.normal(key, l.k.shape, l.k.dtype) * 0.5,
                                     jax.random.normal(key, l.v.shape, l.v.dtype)) for l in cache.layers]

        @functools.partial(jax.jit, donate_argnames=("cache",))
        def step(ps, token, pos, cache, gd=gd):
            logits, cache, _ = models.forward.__wrapped__(gd, ps, token, pos, jnp.full_like(pos, rows), cache,
                                                          ROWS_MODE)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, logits[:, -1]  # each row's argmax: [1, rows]

        token = jnp.full((1, rows), 11, jnp.int32)  # rows > 1: a verify round's shape, one position accepted a step
        t0 = time.perf_counter()
        token, cache, first[mode] = step(ps, token, jnp.array([context], jnp.int32), cache)
        token.block_until_ready()
        compile_s = time.perf_counter() - t0
        seq, times = [], []
        for i in range(steps):
            t = time.perf_counter()
            token, cache, _ = step(ps, token, jnp.array([context + 1 + i], jnp.int32), cache)
            token.block_until_ready()
            times.append(time.perf_counter() - t)
            seq.append(int(token[0, 0]))
        tokens[mode] = seq
        med = float(np.median(times))
        # the same steps dispatched back to back, the token and position staying on the device, one sync at the
        # end: what a step costs once the host's dispatch overlaps the device (an engine reading each token one
        # step late); the gap to `med` is the host's share of a synced step
        pos, batches = jnp.array([context + 1 + steps], jnp.int32), []
        for _ in range(3):  # the median of three batches: the host's share varies from batch to batch
            t = time.perf_counter()
            for _ in range(steps):
                token, cache, _ = step(ps, token, pos, cache)
                pos = pos + 1
            token.block_until_ready()
            batches.append((time.perf_counter() - t) / steps)
        pipelined = float(np.median(batches))
        print(f"  {mode}: synced step {med * 1e3:.2f} ms, pipelined step {pipelined * 1e3:.2f} ms "
              f"({1 / pipelined:.1f} {unit}; batches {', '.join(f'{b * 1e3:.2f}' for b in batches)} ms)", flush=True)
        if os.environ.get("BENCH_PROFILE"):  # where a step goes: device kernels from a profiler trace
            token, cache = profile_steps(step, ps, token, cache, context + 1 + 4 * steps, f"{mode} decode step")
        RESULTS[f"decode_{mode}"] = dict(tok_s=1 / med, ms=med * 1e3, pipelined_ms=pipelined * 1e3,
                                         compile_s=compile_s, tokens=seq, step_GB=step_bytes / 1e9)
        shape = f"1 lane x {rows} rows" if rows > 1 else "1 lane"
        row("decode", f"dense27 4-bit {shape} ctx {context}, {mode} ({1 / med:.1f} {unit}; compile {compile_s:.0f} s;"
            f" {step_bytes / 1e9:.2f} GB/step)", med, step_bytes / med / 1e9, bw / 1e9, "GB/s")
        del ps, cache, model
    if len(tokens) < 2:
        return
    RESULTS["decode_same_tokens"] = tokens["kernel"] == tokens["reference"]
    same = next((i for i, (a, b) in enumerate(zip(tokens["kernel"], tokens["reference"], strict=True)) if a != b),
                len(tokens["kernel"]))
    ref, got = (np.asarray(first[m], np.float32)[0] for m in ("reference", "kernel"))
    top2 = np.sort(ref)[-2:]
    RESULTS["decode_first_logits"] = dict(rel_err=float(np.abs(got - ref).max() / np.abs(ref).max()),
                                          same_argmax=bool(got.argmax() == ref.argmax()),
                                          ref_top2_margin=float(top2[1] - top2[0]),
                                          max_abs_err=float(np.abs(got - ref).max()), agreeing_steps=same)
    print(f"  kernel tokens == reference tokens: {RESULTS['decode_same_tokens']} (first {same} of {len(tokens['kernel'])} "
          f"agree); first step's logits, same inputs: {RESULTS['decode_first_logits']}", flush=True)


def prefill_section(rows=2048, layers=0, delta_chunked=("0", "1")):
    """One lane's prompt chunk of `rows` tokens through dense27 4-bit (random weights, kernels on), with prompt
    DeltaNet through XLA's chunked scan (`Kernels.delta_chunked` off: "0") and through the Pallas kernel ("1"): wall time a
    chunk, tokens/s, the rate over the bf16 matmul rate, and the two paths' last-row logits against each other."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax import geometry, models, ops
    from tfjax.config import QuantConfig
    from tfjax.models.layers import PROMPT, serving_layout

    config = geometry.named("dense27").replace(quantization=QuantConfig(4, 64))
    if layers:
        config = config.replace(num_hidden_layers=layers, layer_types=config.layer_types[:layers])
    graphdef, params = models.random_params(config)
    words = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]  # the 4-bit linears' packed weights
             if x.dtype == jnp.uint32 and "embed_tokens" not in jax.tree_util.keystr(path)]
    flops = 2 * rows * sum(x.size for x in words) * (32 // config.quantization.bits)  # matmuls only
    model = nnx.merge(graphdef, params)
    serving_layout(model)
    tokens = jax.random.randint(jax.random.key(3), (1, rows), 0, config.vocab_size, jnp.int32)
    last = {}
    for setting in delta_chunked:
        model.kernels = ops.Kernels(pallas=True, delta_chunked=setting == "1")  # static: one jit per setting
        gd, ps = models.split(model)
        cache = model.init_cache(1, rows + 64)

        @jax.jit
        def prefill(ps, tokens, cache, gd=gd):
            logits, _, _ = models.forward.__wrapped__(gd, ps, tokens, jnp.array([0]), jnp.array([rows]), cache, PROMPT)
            return logits[:, -1]

        t0 = time.perf_counter()
        last[setting] = prefill(ps, tokens, cache).block_until_ready()
        compile_s = time.perf_counter() - t0
        t = median_time(prefill, (ps, tokens, cache), reps=5)
        RESULTS.setdefault("prefill", []).append(dict(rows=rows, delta_chunked=setting, ms=t * 1e3,
                                                      tok_s=rows / t, compile_s=compile_s))
        what = "Pallas chunked kernel" if setting == "1" else "XLA chunked scan"
        row("prefill", f"dense27 4-bit, {rows}-token chunk, DeltaNet on the {what} ({rows / t:.0f} tok/s; compile "
            f"{compile_s:.0f} s)", t, flops / t / 1e12, RESULTS["bf16_TFLOPs"], "TFLOP/s")
        del cache
    if len(last) == 2:
        a, b = (np.asarray(v, np.float32)[0] for v in last.values())
        RESULTS["prefill_logits"] = dict(rel_err=float(np.abs(a - b).max() / np.abs(b).max()),
                                         same_argmax=bool(a.argmax() == b.argmax()))
        print(f"  prefill: last-row logits, kernel against scan: {RESULTS['prefill_logits']}", flush=True)


def override_pairs_policy(kw: dict) -> None:
    """Dispatch the pair layout with `TiledBlockSizes.for_weight(..., **kw)` keywords over the default ones."""
    from pallas_kernels import qmatmul as qm

    base = qm.PAIRS_POLICY
    default = qm.TiledBlockSizes.for_layout.__func__

    def for_layout(cls, n, k, bits, group_size, layout):
        if layout != "pairs":
            return default(cls, n, k, bits, group_size, layout)
        return cls.for_weight(n, k, bits, group_size, **{**base, **kw})

    qm.TiledBlockSizes.for_layout = classmethod(for_layout)
    print(f"  pairs policy {dict(base, **kw)}", flush=True)


def profile_steps(step, ps, token, cache, pos, what, count=5):
    """Run `count` more steps under the profiler and print their kernels per step (tfjax.profiling)."""
    import jax
    import jax.numpy as jnp
    from profile_round import latest_events, summarize

    out = Path(os.environ["BENCH_PROFILE"]) / what.replace(" ", "_")
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        t = time.perf_counter()
        for i in range(count):
            token, cache, _ = step(ps, token, jnp.array([pos + i], jnp.int32), cache)
        token.block_until_ready()
        wall = time.perf_counter() - t
    print(f"  profile of {what}:\n" + summarize(latest_events(out), count, wall), flush=True)
    return token, cache


# --- the HF transformers peer (child process) ---
def hf_section(steps=20, context=2048):
    import torch
    from transformers import Qwen3_5ForCausalLM

    from tests.helpers import hf_config
    from tfjax import geometry

    cfg = hf_config(geometry.named("dense27"))
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"  HF init {time.perf_counter() - t0:.0f} s", flush=True)
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t)
    med = float(np.median(times))
    print(json.dumps(dict(hf_tok_s=1 / med, hf_ms=med * 1e3, torch=torch.__version__)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="base,qmatmul,attention,prompt,decode,hf")
    ap.add_argument("--sweep", action="store_true", help="sweep tile configs first (qmatmul, attention)")
    ap.add_argument("--asweep", choices=["tiles", "chunks"], default="tiles",
                    help="with --sweep: the attention candidates (tiles at 16k, or chunk policies at every context)")
    ap.add_argument("--qsweep", choices=["tiles", "unpack", "options"], default="tiles",
                    help="with --sweep: the qmatmul candidates (tile shapes, the unpack variants, or the pair "
                    "kernel's options)")
    ap.add_argument("--decode-rows", type=int, default=1, help="decode: rows a step (8: a width-8 lane round's "
                    "verify shape, the engine's default)")
    ap.add_argument("--decode-context", type=int, default=2048, help="decode: the lane's context (keys before the "
                    "first step)")
    ap.add_argument("--decode-span", type=int, default=0, help="decode: the cache's keys a lane (0: the context "
                    "and the steps; more: a lane of a longer-context engine)")
    ap.add_argument("--layers", type=int, default=0, help="decode, prefill: truncate the layer count (0 = all 64)")
    ap.add_argument("--prefill-rows", type=int, default=2048, help="prefill: the prompt chunk's tokens")
    ap.add_argument("--decode-modes", default="reference,kernel", help="decode: the paths to time")
    ap.add_argument("--pairs-policy", default="", help="decode: keywords replacing the pair layout's dispatch tiles, "
                    "e.g. \"dict(programs=264, sums_outside=False)\" (A/B runs)")
    ap.add_argument("--attn-blocks", default="", help="attention's default BlockSizes keywords (decode and the "
                    "attention section), e.g. \"dict(q_blocks=1)\"")
    ap.add_argument("--attn-cands", default="", help="attention: instead of the table, device time of each "
                    "candidate, e.g. \"[dict(), dict(probe='loads'), dict(num_stages=1, page=64)]\"")
    ap.add_argument("--attn-span", type=int, default=0, help="attention candidates: page tables spanning this many "
                    "keys at every context (a short context in a long-context engine's lane)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.attn_cands:
        ATTN_CANDS.extend(eval(a.attn_cands))  # noqa: S307 (a benchmark's own flag)
    ATTN_SPAN[0] = a.attn_span
    sections = a.sections.split(",")
    if a.attn_blocks:
        from pallas_kernels import attention

        attention.DEFAULT = attention.BlockSizes(**eval(a.attn_blocks))  # noqa: S307 (a benchmark's own flag)
    if a.pairs_policy:
        override_pairs_policy(eval(a.pairs_policy))  # noqa: S307 (a benchmark's own flag)
    if sections == ["hf"]:
        hf_section()
        return
    if "hf" in sections:  # first, in a child, before this process's JAX takes most of the GPU's memory
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [".", os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, __file__, "--sections", "hf"], capture_output=True, text=True, env=env)
        print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                RESULTS["hf"] = json.loads(line)
    import jax

    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    RESULTS["device"] = jax.devices()[0].device_kind
    t0 = time.perf_counter()
    for name in ("base", "qmatmul", "attention", "delta", "delta_prompt", "prompt", "flash", "prefill", "decode"):
        if name in sections or (name == "base" and len(sections) > 0):
            ts = time.perf_counter()
            try:
                if name == "base":
                    base()
                elif name == "qmatmul":
                    qmatmul_section(a.sweep and (a.qsweep if a.qsweep != "tiles" else True))
                elif name == "attention":
                    attention_section(a.sweep and ("chunks" if a.asweep == "chunks" else True))
                elif name == "delta":
                    delta_section()
                elif name == "delta_prompt":
                    delta_prompt_section()
                elif name == "prefill":
                    prefill_section(rows=a.prefill_rows, layers=a.layers)
                elif name == "prompt":
                    prompt_section()
                elif name == "flash":
                    if "prompt" not in sections:  # prompt runs it too
                        flash_section()
                else:
                    decode_section(context=a.decode_context, span=a.decode_span, layers=a.layers,
                                   modes=tuple(a.decode_modes.split(",")), rows=a.decode_rows)
            except Exception as e:  # one failing section must not lose the others' numbers
                import traceback

                traceback.print_exc()
                RESULTS[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[{name}: {time.perf_counter() - ts:.0f} s]", flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(RESULTS, f, indent=1, default=str)
    if "hf" in sections:
        if "hf" in RESULTS and "decode_kernel" in RESULTS:
            ratio = RESULTS["decode_kernel"]["tok_s"] / RESULTS["hf"]["hf_tok_s"]
            ROWS.append(("peer", f"HF transformers bf16 dense27 1 stream ctx 2048: {RESULTS['hf']['hf_tok_s']:.1f} "
                         f"tok/s", f"{RESULTS['hf']['hf_ms'] * 1e3:.0f} us", f"ours/HF {ratio:.1f}x", "goal 5x",
                         f"{ratio / 5:.0%}"))
    print(f"\n{RESULTS['device']}; copy {RESULTS.get('copy_GBps', 0):.0f} GB/s; bf16 matmul "
          f"{RESULTS.get('bf16_TFLOPs', 0):.0f} TFLOP/s; total {time.perf_counter() - t0:.0f} s")
    print("| section | what | time | achieved | ceiling | fraction |\n|---|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    if a.out:
        RESULTS["table"] = ROWS
        with open(a.out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
