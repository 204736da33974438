"""Pallas GPU (Triton) depthwise causal conv + silu for Gated DeltaNet rows in lane rounds.

Each row's output is silu(sum_j taps[j, c] * w[c, j]) per channel c, from its own K inputs (the row and the
K-1 before it). On the reference path a lane round computes it in fixed row tiles inside a loop (so fusion
never sees M). Here a program computes one row's block of channels with the same code whatever the other rows
hold: row-invariant by construction, one launch. Channels are read in power-of-two pieces of at most 2048 (Triton
blocks are powers of two; 10240 = 5 x 2048). `conv_silu_window` reads the conv tail and the new rows where they lie
(no stacked taps), takes the weight as the model holds it, and writes the lane's next tail: one launch where the
decode step had five (the tail's copy and gather, the taps' stack, the weight's transpose, the conv). The
stacked-taps kernel it replaced lost with the rest of the unfused DeltaNet rows (H200, dense27 decode 9.66 against
9.22 ms a step pipelined, docs/benchmarks.md sixth run) and was deleted in issue 27; `reference` keeps its
arithmetic for the CPU path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.row_norm import pieces

PIECE = 2048  # channels per step: 16 f32 registers a thread at 4 warps


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """A program: one row and `channels` of its channels (all of them when C is not a multiple); from C only."""

    num_warps: int = 4
    channels: int = 512  # a power of two: dense27's 10240 channels are 20 programs a row, not one (16 us -> ~2)

    def split(self, c: int) -> tuple[int, int]:
        """(programs a row, channels a program)."""
        return (c // self.channels, self.channels) if c % self.channels == 0 else (1, c)


def _silu_conv(tap, weight, k: int) -> jax.Array:
    """silu(sum_j tap(j) * weight(j)) in f32, the taps summed oldest first (`reference`'s arithmetic)."""
    acc = None
    for j in range(k):
        term = tap(j).astype(jnp.float32) * weight(j)
        acc = term if acc is None else acc + term
    return acc * jax.nn.sigmoid(acc)


def reference(taps: jax.Array, weight: jax.Array) -> jax.Array:
    """The model's conv in plain jax.numpy: f32 products summed over taps in order, silu, cast back."""
    w = weight.astype(jnp.float32)
    acc = sum(taps[..., j, :].astype(jnp.float32) * w[:, j] for j in range(taps.shape[-2]))
    return jax.nn.silu(acc).astype(taps.dtype)


def _window_kernel(count_ref, tail_ref, x_ref, w_ref, o_ref, tail_out, *, k: int, c: int, block: int):
    # count_ref [1] i32; tail_ref [(K-1) * C]; x_ref [T * C] (the lane's new rows); w_ref [C, K]; o_ref [C] (row r);
    # tail_out [(K-1) * C]: the lane's next tail, written by row 0's programs
    r, base = pl.program_id(1), pl.program_id(2) * block
    km1 = k - 1

    def window(w, off, size):  # window row w (the tail's K-1 rows, then the new rows), channels [off, off + size)
        old = tail_ref[pl.ds(jnp.minimum(w, km1 - 1) * c + off, size)]
        new = x_ref[pl.ds(jnp.maximum(w - km1, 0) * c + off, size)]
        return jnp.where(w < km1, old.astype(new.dtype), new)

    for piece_off, size in pieces(block, PIECE):
        off = base + piece_off
        y = _silu_conv(lambda j, off=off, size=size: window(r + j, off, size),
                       lambda j, off=off, size=size: w_ref[pl.ds(off, size), j].astype(jnp.float32), k)
        o_ref[pl.ds(off, size)] = y.astype(o_ref.dtype)

        @pl.when(r == 0)
        def _(off=off, size=size):
            for i in range(km1):
                tail_out[pl.ds(i * c + off, size)] = window(count_ref[0] + i, off, size).astype(tail_out.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def conv_silu_window(tail: jax.Array, rows: jax.Array, weight: jax.Array, count: jax.Array, *,
                     block_sizes: BlockSizes = BlockSizes(), interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Lane rows through the conv: tail [B, K-1, C], rows [B, T, C], weight [C, K], count [B] ->
    (silu(conv) [B, T, C] in rows' dtype, the tail after each lane's first `count` rows [B, K-1, C])."""
    b, t, c = rows.shape
    k = weight.shape[1]
    if tail.shape != (b, k - 1, c) or weight.shape != (c, k) or count.shape != (b,):
        raise ValueError(f"want tail [B, K-1, C], rows [B, T, C], weight [C, K], count [B], got {tail.shape=} "
                         f"{rows.shape=} {weight.shape=} {count.shape=}")
    programs, block = block_sizes.split(c)
    lane = lambda n: pl.BlockSpec((None, n), lambda i, r, j: (i, 0))
    out, new_tail = pl.pallas_call(
        functools.partial(_window_kernel, k=k, c=c, block=block),
        grid=(b, t, programs),
        in_specs=[pl.BlockSpec((None, 1), lambda i, r, j: (i, 0)), lane((k - 1) * c), lane(t * c),
                  pl.BlockSpec((c, k), lambda i, r, j: (0, 0))],
        out_specs=[pl.BlockSpec((None, None, c), lambda i, r, j: (i, r, 0)), lane((k - 1) * c)],
        out_shape=[jax.ShapeDtypeStruct((b, t, c), rows.dtype), jax.ShapeDtypeStruct((b, (k - 1) * c), tail.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv_window",
    )(count.astype(jnp.int32)[:, None], tail.reshape(b, -1), rows.reshape(b, -1), weight)
    return out, new_tail.reshape(b, k - 1, c)


def window_reference(tail: jax.Array, rows: jax.Array, weight: jax.Array, count: jax.Array):
    """`conv_silu_window` in plain jax.numpy: the stacked taps through `reference`, the tail by slicing."""
    t, k = rows.shape[1], weight.shape[1]
    window = jnp.concatenate([tail.astype(rows.dtype), rows], axis=1)
    taps = jnp.stack([window[:, j : j + t] for j in range(k)], axis=2)
    new_tail = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, k - 1, axis=0))(window, count)
    return reference(taps, weight), new_tail.astype(tail.dtype)
