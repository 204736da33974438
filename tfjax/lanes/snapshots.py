"""The prefix cache's snapshot pool: DeltaNet recurrent state and conv tail of a lane at a chunk-grid boundary.

A pool is a list aligned with a cache's layers: `DeltaState` with a leading slot axis [S, ...] for DeltaNet
layers, None for paged attention layers (their K/V stay in the shared pages). Save and restore copy bits, so
a restored lane holds exactly the state a fresh prefill had at that boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfjax.models.decoder import Cache, DeltaState


def empty_pool(cache: Cache | None, slots: int) -> list | None:
    """A pool of `slots` snapshots for `cache`'s DeltaNet layers; None when it has none (or no slots)."""
    if cache is None or slots < 1 or not any(isinstance(l, DeltaState) for l in cache.layers):
        return None
    return [DeltaState(jnp.zeros((slots, *l.conv.shape[1:]), l.conv.dtype),
                       jnp.zeros((slots, *l.state.shape[1:]), l.state.dtype))
            if isinstance(l, DeltaState) else None for l in cache.layers]


def slot_bytes(cache: Cache | None) -> int:
    """Bytes of one lane's DeltaNet state in `cache` (one snapshot)."""
    if cache is None:
        return 0
    return sum((l.conv.nbytes + l.state.nbytes) // l.conv.shape[0] for l in cache.layers if isinstance(l, DeltaState))


def _put(dst: jax.Array, i: jax.Array, src: jax.Array, j: jax.Array) -> jax.Array:
    """dst with row i replaced by src's row j: a dynamic-update-slice, in place in a donated dst."""
    return jax.lax.dynamic_update_index_in_dim(dst, jax.lax.dynamic_index_in_dim(src, j, keepdims=True), i, 0)


@functools.partial(jax.jit, donate_argnames=("pool",))
def save(pool: list, cache: Cache, lane: jax.Array, slot: jax.Array) -> list:
    """Copy `lane`'s DeltaNet state into snapshot `slot` (the pool is updated in place: it is the budget's bulk)."""
    return [None if p is None else DeltaState(_put(p.conv, slot, l.conv, lane), _put(p.state, slot, l.state, lane))
            for p, l in zip(pool, cache.layers, strict=True)]


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore(cache: Cache, pool: list, lane: jax.Array, slot: jax.Array) -> Cache:
    """Put snapshot `slot` into `lane`'s DeltaNet state (the cache is updated in place)."""
    layers = [l if p is None else DeltaState(_put(l.conv, lane, p.conv, slot), _put(l.state, lane, p.state, slot))
              for p, l in zip(pool, cache.layers, strict=True)]
    return Cache(layers, cache.page_table)
