"""Gated DeltaNet: the lane-round recurrence (`recurrent_qkv`) against XLA's, and the chunked prompt kernel's
candidates against XLA's chunked scan."""

from __future__ import annotations

import math

from tfjax.bench.common import RESULTS, per_call, rel_err, row


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
