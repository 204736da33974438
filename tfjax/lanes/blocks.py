"""Block drafters outside the round: a prompt feeds the drafter's context, then the lane's first block is drafted.

Inside the round (`round.lane_round`) the verify pass returns the tapped states; here the prompt's chunks do.
Context K/V is written by absolute position for the prompt's valid rows only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tfjax import models
from tfjax.lanes.round import LaneState
from tfjax.models.decoder import Cache


def _lane_view(cache: Cache, lane: jax.Array) -> Cache:
    """A drafter cache seen by one lane (pools shared, its page-table row)."""
    return Cache(cache.layers, cache.page_table[lane][None])


@functools.partial(jax.jit, static_argnames=("drafter_def",), donate_argnames=("draft_cache",))
def absorb_chunk(drafter_def, drafter_params, draft_cache: Cache, lane: jax.Array, hidden: jax.Array,
                 start: jax.Array, valid: jax.Array) -> Cache:
    """The drafter's context absorbs one prompt chunk: its taps picked out of every target layer's output `hidden`
    [1, C, L * D] (`round.prefill_chunk`), in a program apart from the target's (issue 34: the target's chunk is
    plain's program, bit for bit)."""
    drafter = models.merge(drafter_def, drafter_params)
    ids = drafter.config.target_layer_ids
    b, t, _ = hidden.shape
    layers = hidden.reshape(b, t, -1, drafter.config.hidden_size)
    taps = jnp.concatenate([layers[:, :, i] for i in ids], axis=-1)
    drafted = drafter.absorb(taps, start[None], valid[None], _lane_view(draft_cache, lane))
    return Cache(drafted.layers, draft_cache.page_table)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def"), donate_argnames=("state",))
def first_block(target_def, target_params, drafter_def, drafter_params, state: LaneState,
                lane: jax.Array) -> LaneState:
    """Draft a newly admitted lane's first block from its pending token."""
    drafter = models.merge(drafter_def, drafter_params)
    pos = state.length[lane] - 1
    pending = state.history[lane, pos]
    block = drafter.propose(models.merge(target_def, target_params), pending[None], pos[None],
                            _lane_view(state.draft_cache, lane))
    return dataclasses.replace(state, block=state.block.at[lane].set(block[0]))


def empty_blocks(lanes: int, block_size: int) -> jax.Array:
    return jnp.zeros((lanes, block_size - 1), jnp.int32)
