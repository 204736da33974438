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
def absorb_chunk(drafter_def, drafter_params, draft_cache: Cache, lane: jax.Array, taps: jax.Array, start: jax.Array,
                 valid: jax.Array) -> Cache:
    """The drafter's context absorbs one prompt chunk's tapped target states (`round.prefill_chunk(taps=...)`).

    A program of its own: with the drafter in the target's chunk program, XLA compiled the target differently on
    the GPU (a row of a layer one bf16 step off, then flipped near-tie tokens: issue 34); apart, the target's chunk
    is plain's program with extra outputs, bit-identical to plain's (`scripts/probes/exact34_prefill.py`)."""
    drafted = models.merge(drafter_def, drafter_params).absorb(taps, start[None], valid[None],
                                                               _lane_view(draft_cache, lane))
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
