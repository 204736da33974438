"""The prompt path: XLA's dequantize-then-dot and causal attention over the bf16 matmul rate; the flash kernel's
tile sweep beside jax's own kernels and cuDNN."""

from __future__ import annotations

import dataclasses
import functools
import time

from tfjax.bench.attention import kv_sets
from tfjax.bench.common import BUDGET, RESULTS, START, per_call, rel_err, row
from tfjax.bench.qmatmul import BITS, GROUP, SHAPES, qweights


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


def over_pages(fn):
    """A kernel over pages (`flash_attention`, its reference) called with lanes' keys [B, S, G, E]: S padded to a
    multiple of 16, then pages of 16 keys in order."""
    def call(q, k, v, pos, **kw):
        import jax.numpy as jnp

        from pallas_kernels.attention import paged_keys

        pad = ((0, 0), (0, -k.shape[1] % 16), (0, 0), (0, 0))
        pool, table = paged_keys(jnp.pad(k, pad), jnp.pad(v, pad), 16)
        return fn(q, pool.k, pool.v, table, pos, **kw)

    return call


def flash_section():
    """Causal prompt attention through the flash kernel (a sweep of tiles at each size), beside jax's kernels."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import flash_attention as fa
    from tfjax import ops

    flash, flash_ref = over_pages(fa.flash_attention), over_pages(fa.reference)
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
    checks["prompt 2048"] = rel_err(flash(q, k, v, pos), flash_ref(q, k, v, pos))
    q, k, v = qkv(256, 4100, 2)
    pos = (3000 + jnp.arange(256, dtype=jnp.int32))[None]
    checks["chunk 256 at 3000 of 4100 keys"] = rel_err(flash(q, k, v, pos), flash_ref(q, k, v, pos))
    q2, k2, v2 = (jnp.concatenate([a, b]) for a, b in zip(qkv(200, 1000, 3), qkv(200, 1000, 4), strict=True))
    pos2 = jnp.stack([jnp.arange(200, dtype=jnp.int32), 777 + jnp.arange(200, dtype=jnp.int32)])
    checks["2 lanes x 200 rows"] = rel_err(flash(q2, k2, v2, pos2), flash_ref(q2, k2, v2, pos2))
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
        ref = flash(q, k, v, pos)
        times = []
        for bq, bk, nw, ns in FLASH_SWEEP:
            bs = fa.BlockSizes(bq, bk, nw, ns)
            if time.perf_counter() - START > BUDGET and bs != fa.BlockSizes() and times:
                continue  # past the run's budget: the default tiles only
            f = lambda q, k, v, pos, bs=bs: flash(q, k, v, pos, block_sizes=bs)
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
