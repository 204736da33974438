"""Pallas GPU (Triton) depthwise causal conv + silu for Gated DeltaNet rows in lane rounds.

Each row's output is silu(sum_j taps[j, c] * w[c, j]) per channel c, from its own K inputs (the row and the
K-1 before it). On the reference path a lane round computes it in fixed row tiles inside a loop (so fusion
never sees M); on the GPU that loop is several launches per DeltaNet layer. Here a program computes one
row's block of channels with the same code whatever M is: row-invariant by construction, one launch. Channels
are read in power-of-two pieces of at most 2048 (Triton blocks are powers of two; 10240 = 5 x 2048).
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


def _conv_kernel(x_ref, w_ref, o_ref, *, k: int, c: int, block: int):
    # x_ref [K * C] (tap j of channel c at j * C + c); w_ref [K, C] f32; o_ref [C]; this program: `block` channels
    base = pl.program_id(1) * block
    for piece_off, size in pieces(block, PIECE):
        off = base + piece_off
        acc = None
        for j in range(k):
            term = x_ref[pl.ds(j * c + off, size)].astype(jnp.float32) * w_ref[j, pl.ds(off, size)]
            acc = term if acc is None else acc + term
        o_ref[pl.ds(off, size)] = (acc * jax.nn.sigmoid(acc)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def conv_silu(taps: jax.Array, weight: jax.Array, *, block_sizes: BlockSizes = BlockSizes(),
              interpret: bool = False) -> jax.Array:
    """taps [M, K, C] (row r's K inputs, oldest first), weight [C, K] -> silu(conv) [M, C] in taps' dtype."""
    if taps.ndim != 3 or weight.shape != (taps.shape[2], taps.shape[1]):
        raise ValueError(f"want taps [M, K, C] and weight [C, K], got {taps.shape=} {weight.shape=}")
    m, k, c = taps.shape
    programs, block = block_sizes.split(c)
    row = pl.BlockSpec((None, k * c), lambda i, b: (i, 0))
    return pl.pallas_call(
        functools.partial(_conv_kernel, k=k, c=c, block=block),
        grid=(m, programs),
        in_specs=[row, pl.BlockSpec((k, c), lambda i, b: (0, 0))],
        out_specs=pl.BlockSpec((None, c), lambda i, b: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, c), taps.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv_silu",
    )(taps.reshape(m, k * c), weight.T.astype(jnp.float32))


def reference(taps: jax.Array, weight: jax.Array) -> jax.Array:
    """The model's conv in plain jax.numpy: f32 products summed over taps in order, silu, cast back."""
    w = weight.astype(jnp.float32)
    acc = sum(taps[..., j, :].astype(jnp.float32) * w[:, j] for j in range(taps.shape[-2]))
    return jax.nn.silu(acc).astype(taps.dtype)
