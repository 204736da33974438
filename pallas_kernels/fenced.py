"""Row-invariant loops for the jax.numpy references: each row's arithmetic fixed whatever rows share the call.

XLA inlines a loop it knows runs once and then fuses its body with the neighbours, which changes the arithmetic
of reductions; a row computed alone would then differ from the same row among others. On the CPU
(`gpu=False`) a loop's trip count is hidden behind an optimization barrier; on the GPU (`gpu=True`) trip counts
stay known (no host syncs) and are never 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_TILE = 8  # rows per tile of `row_tiled` on the CPU
GPU_ROW_TILE = 64  # rows per tile on the GPU, where a tile is one loop iteration of its own


def opaque_count(n: jax.Array | int, *, gpu: bool) -> jax.Array:
    """A loop bound XLA cannot fold (CPU); the plain value on the GPU."""
    n = jnp.asarray(n, jnp.int32)
    return n if gpu else jax.lax.optimization_barrier(n)


def fenced_map(fn, xs, *, gpu: bool, count: jax.Array | None = None):
    """`lax.map` whose single iteration XLA never inlines: one iteration stays a loop body of its own.

    `count` (CPU only): map the first `count` entries only, the others' outputs zeros (the same loop body, fewer
    trips: an entry's result never depends on `count`)."""
    n = jax.tree.leaves(xs)[0].shape[0]
    if gpu and count is not None:
        raise ValueError("fenced_map's count is for the CPU loop (gpu=False)")
    if gpu:  # a known trip count, never 1, so XLA keeps the body a loop of its own
        if n >= 2:
            return jax.lax.map(fn, xs)
        twice = jax.tree.map(lambda a: jnp.concatenate([a, a]), xs)
        return jax.tree.map(lambda a: a[:n], jax.lax.map(fn, twice))
    first = jax.eval_shape(fn, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs))
    out = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), first)
    trips = opaque_count(n if count is None else jnp.clip(count, 0, n), gpu=False)

    def body(i, out):
        y = fn(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))
        return jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), out, y)

    return jax.lax.fori_loop(0, trips, body, out)


def row_tiled(fn, x: jax.Array, *, gpu: bool, tile: int | None = None) -> jax.Array:
    """Apply fn (rows [tile, in] -> [tile, out]) over fixed row tiles, so each row's arithmetic is fixed."""
    tile = tile or (GPU_ROW_TILE if gpu else ROW_TILE)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    m = rows.shape[0]
    pad = (-m) % tile
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
    tiles = rows.reshape(-1, tile, d)
    out = fenced_map(fn, tiles, gpu=gpu)
    out = out.reshape(-1, out.shape[-1])[:m]
    return out.reshape(*lead, out.shape[-1])


def rowwise(fn, x: jax.Array, rows: bool, *, gpu: bool) -> jax.Array:
    """fn over the last axis; with `rows`, in fixed row tiles (reductions never see M)."""
    return row_tiled(fn, x, gpu=gpu) if rows else fn(x)
