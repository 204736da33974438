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
from tfjax.models.decoder import Cache, lane_cache, put_lane, reset_if_first
from tfjax.models.layers import PROMPT


def _lane_view(cache: Cache, lane: jax.Array) -> Cache:
    """A drafter cache seen by one lane (pools shared, its page-table row)."""
    return Cache(cache.layers, cache.page_table[lane][None])


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "pages"),
                   donate_argnames=("cache", "draft_cache"))
def prefill_chunk(target_def, target_params, drafter_def, drafter_params, cache: Cache, draft_cache: Cache,
                  lane: jax.Array, tokens: jax.Array, start: jax.Array, valid: jax.Array, pages: int | None = None):
    """Feed one prompt chunk [1, C] of one lane to the target and the drafter's context: (logits [1, V], caches).
    `pages`: the target reads the lane's first pages, as plain's `round.prefill_chunk` does (the same program's
    attention, so the same bits on the GPU, whose kernels split keys by the table's width)."""
    drafter = models.merge(drafter_def, drafter_params)
    sub = lane_cache(cache, lane)
    if pages is not None:
        sub = dataclasses.replace(sub, page_table=sub.page_table[:, :pages])
    sub = dataclasses.replace(sub, layers=[reset_if_first(l, start) for l in sub.layers])
    mode = dataclasses.replace(PROMPT, taps=drafter.config.target_layer_ids)
    logits, sub, _, taps = models.merge(target_def, target_params)(tokens, start[None], valid[None], sub, mode)
    drafted = drafter.absorb(taps, start[None], valid[None], _lane_view(draft_cache, lane))
    return logits, put_lane(cache, sub, lane), Cache(drafted.layers, draft_cache.page_table)


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
