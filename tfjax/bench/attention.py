"""Verify attention over the paged cache: the served kernel's device time at 2k-64k keys and 1 and 8 rows beside
the copy rate over the KV bytes, tile and chunk sweeps of the Triton kernel, and A/B candidates (`--attn-cands`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from tfjax.bench.common import RESULTS, checked_time, per_call, rel_err, row
from tfjax.profiling import device_time


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
