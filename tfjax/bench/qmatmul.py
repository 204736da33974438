"""4-bit matmul: what `ops.qmatmul` dispatches at dense27's shapes, device time beside the copy rate, tile sweeps of
the Triton tiled kernel, and row invariance (rows 1..N against each row alone, bit for bit)."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from tfjax.bench.common import RESULTS, checked_time, per_call, rel_err, row
from tfjax.profiling import device_time

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
    """The kernel layout's tiles: block_n, warps, stages and programs (swap and fold won 2026-12-03 and are the kernel)."""
    out = [dict(block_n=bn, num_warps=nw, num_stages=ns, programs=prog) for bn, nw, ns, prog in [
        (64, 4, 3, 264), (128, 4, 3, 264), (64, 8, 3, 264), (128, 8, 4, 528), (32, 4, 4, 528), (64, 4, 2, 132),
    ]]  # fmt: skip
    # the unpack through 2^23's mantissa (no I2F; bit-identical, untimed before): on the two first
    return out + [dict(out[i], unpack="magic") for i in (0, 1)]


def sweep_unpack():
    """The pair layout (two weights a LOP3, 128 + q in bf16) by split, stages and tiles, beside the kernel layout."""
    base = dict(block_n=64, num_warps=4, num_stages=3, programs=264)
    pairs = dict(base, unpack="pairs", sums_outside=True)
    return [pairs, base, dict(pairs, sums_outside=False), dict(pairs, programs=528), dict(pairs, programs=1056),
            dict(pairs, num_stages=4), dict(pairs, block_n=128, num_warps=8)]


def sweep_options():
    """The pair kernel's options: K split up to 34 ways, sums in the kernel; each twice, interleaved, since identical
    configs drifted up to 25% between runs."""
    from pallas_kernels import qmatmul as qm

    pairs = dict(block_n=64, num_warps=4, num_stages=3, **qm.PAIRS_POLICY)  # the dispatch's
    options = [pairs, dict(pairs, programs=1056, max_split=34), dict(pairs, sums_outside=False)]
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
    policy = dict(block_n=64, num_warps=4, num_stages=3, **qm.PAIRS_POLICY, packed=True)  # dispatch
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
