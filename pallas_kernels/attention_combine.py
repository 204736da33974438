"""Pallas GPU (Triton) combine of the paged attention's chunk partials: one launch where XLA ran three fusions.

Shapes: ``o [B, G, Cp, R', E]`` f32 (unnormalised), ``m``, ``l [B, G, Cp, R'']`` f32 (R'' >= R', rows a multiple of
8), of which the first ``chunks`` chunks are live: the chunk axis is padded to a power of two (Triton's blocks)
and what the padding holds (never written, NaN included) never reaches a row: every read of it is a select.
Output ``[B, G, R', E]`` in the given dtype; rows with no keys (l = 0) are exact zeros.

A program takes 8 rows and ``block_e`` columns of one (lane, KV head) over every chunk at once: the max (exact in
any order), the weights, then the weighted sums over the chunk axis in one register reduction. Row invariance: a
row's sums use only its own partials, and the reduction's shape (Cp, 8, block_e) comes from the span and the
head dim, never the number of rows, so a verify row and the same row alone take the same bits.

On the H100 XLA's combine (attention.combine, a pairwise tree) took 5 us a call at one row and 8 us at 8 rows, as
three fusions (the max, the tree, the divide and transpose; docs/benchmarks.md, twelfth run).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import NEG

BLOCK_ROWS = 8  # rows a program: the partials' row count is a multiple of it


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    values: int = 8192  # f32 values of o a program holds at once (Cp x 8 x block_e): sets block_e from the chunks
    num_warps: int = 4

    def block_e(self, chunks_pad: int, head_dim: int) -> int:
        """Columns a program: the most keeping Cp x 8 x block_e <= `values`, 16..64, at most the head dim."""
        e = 64
        while e > 16 and chunks_pad * BLOCK_ROWS * e > self.values:
            e //= 2
        return min(e, head_dim)


DEFAULT = BlockSizes()


def chunks_pad(chunks: int) -> int:
    """The partials' chunk axis: `chunks` rounded up to a power of two."""
    return 1 << (chunks - 1).bit_length()


def _kernel(o_ref, m_ref, l_ref, out_ref, *, chunks: int):
    # o_ref [Cp, 8, be] f32; m_ref, l_ref [Cp, 8] f32; out_ref [8, be]
    live = lax.broadcasted_iota(jnp.int32, m_ref.shape, 0) < chunks  # chunks past `chunks`: padding, never read
    m = jnp.where(live, m_ref[...], NEG)
    top = jnp.max(m, axis=0)  # [8]
    w = jnp.where(live, jnp.exp(m - top[None, :]), 0.0)  # 0 for chunks a row cannot see (m = NEG)
    lsum = jnp.sum(jnp.where(live, w * l_ref[...], 0.0), axis=0)
    osum = jnp.sum(jnp.where(live[:, :, None], w[:, :, None] * o_ref[...], 0.0), axis=0)  # [8, be]
    out = jnp.where(lsum[:, None] > 0, osum / jnp.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
    out_ref[...] = out.astype(out_ref.dtype)


def _check(o, m, l, chunks: int):
    b, g, cp, ro, e = o.shape
    if m.shape != l.shape or m.shape[:3] != (b, g, cp) or m.shape[3] < ro:
        raise ValueError(f"m {m.shape} and l {l.shape} must be [B, G, Cp, >= rows] of o {o.shape}")
    if cp != chunks_pad(cp) or not 1 <= chunks <= cp:
        raise ValueError(f"the chunk axis {cp} must be a power of two holding {chunks=} live chunks")
    if ro % BLOCK_ROWS or m.shape[3] % BLOCK_ROWS or e % 16:
        raise ValueError(f"rows {ro} and {m.shape[3]} must be multiples of {BLOCK_ROWS}, head dim {e} of 16")


@functools.partial(jax.jit, static_argnames=("chunks", "dtype", "block_sizes", "interpret"))
def combine(o: jax.Array, m: jax.Array, l: jax.Array, *, chunks: int, dtype=jnp.bfloat16,
            block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Normalised output of the live chunks' partials: ``[B, G, R', E]`` in `dtype`."""
    bs = block_sizes or DEFAULT
    _check(o, m, l, chunks)
    b, g, cp, ro, e = o.shape
    be = bs.block_e(cp, e)
    return pl.pallas_call(
        functools.partial(_kernel, chunks=chunks),
        grid=(b, g, ro // BLOCK_ROWS, e // be),
        in_specs=[
            pl.BlockSpec((None, None, cp, BLOCK_ROWS, be), lambda n, j, r, c: (n, j, 0, r, c)),
            pl.BlockSpec((None, None, cp, BLOCK_ROWS), lambda n, j, r, c: (n, j, 0, r)),
            pl.BlockSpec((None, None, cp, BLOCK_ROWS), lambda n, j, r, c: (n, j, 0, r)),
        ],
        out_specs=pl.BlockSpec((None, None, BLOCK_ROWS, be), lambda n, j, r, c: (n, j, r, c)),
        out_shape=jax.ShapeDtypeStruct((b, g, ro, e), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="attention_combine",
    )(o, m, l)


def reference(o, m, l, *, chunks: int, dtype=jnp.bfloat16) -> jax.Array:
    """Plain jax.numpy over the live chunks (XLA's order of the sums: equal to the kernel within f32 rounding)."""
    o, m, l = o[:, :, :chunks], m[:, :, :chunks, : o.shape[3]], l[:, :, :chunks, : o.shape[3]]
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    lsum = jnp.sum(w * l, axis=2)
    osum = jnp.sum(w[..., None] * o, axis=2)
    out = jnp.where(lsum[..., None] > 0, osum / jnp.where(lsum > 0, lsum, 1.0)[..., None], 0.0)
    return out.astype(dtype)
