"""Pallas GPU (Triton) combine of the paged attention's chunk partials: one launch where XLA ran three fusions.

Shapes: ``o [B, G, Cp, R', E]`` f32 (unnormalised), ``m``, ``l [B, G, Cp, R'']`` f32 (R'' >= R' >= T x heads; row =
t * heads + query head of a KV head), the rows' positions ``pos [B, R'']`` i32 (-1: padding). A row sees chunk
(partial) c, whose first key is c * chunk_k, when c < ``chunks`` and c * chunk_k <= its position; every other (the
padding of the chunk axis to a power of two for Triton's blocks, never written) is never read, NaN included. An
interleaved attention's partial c holds its program's chunks c, c + P, ...: the same rule holds. Output ``[B, T, G *
heads, E]`` (the attention's own layout, no transpose after) in the given dtype; rows with no keys are exact zeros.

A program takes one row t's query heads of one (lane, KV head), ``block_e`` columns, over every chunk: the max
(exact in any order), the weights, then the weighted sums over the chunk axis, ``block_c`` chunks a register
reduction, the blocks' sums added in order. Row invariance: a row's sums use only its own partials, and the
reductions' shapes (block_c, heads rounded to a power of two, block_e) come from the span and the model, never
the number of rows, so a verify row and the same row alone take the same bits.

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


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    values: int = 8192  # f32 values of o a program holds at once (chunks x rows x block_e): sets block_e
    block_c: int = 32  # chunks a step: more (a 64k span in 256-key chunks has 256) are summed a block at a time
    num_warps: int = 4

    def block_e(self, chunks_pad: int, block_rows: int, head_dim: int) -> int:
        """Columns a program: the most keeping chunks a step x rows x block_e <= `values`, 16..64, at most the head
        dim."""
        e = 64
        while e > 16 and min(chunks_pad, self.block_c) * block_rows * e > self.values:
            e //= 2
        return min(e, head_dim)


DEFAULT = BlockSizes()


def chunks_pad(chunks: int) -> int:
    """The partials' chunk axis: `chunks` rounded up to a power of two."""
    return 1 << (chunks - 1).bit_length()


def _kernel(o_ref, m_ref, l_ref, pos_ref, out_ref, *, chunks: int, chunk_k: int, heads: int, block_rows: int,
            block_c: int):
    # o_ref [Cp, R', be] f32 and m_ref, l_ref [Cp, R''] f32 of one (lane, KV head); pos_ref [R''] i32 (-1: padding);
    # out_ref [H, be] of one (lane, t)
    t, j = pl.program_id(1), pl.program_id(2)
    rows = pl.ds(t * heads, block_rows)  # the query heads of row t (a power of two of rows, those past `heads` masked)
    cp, be = o_ref.shape[0], o_ref.shape[2]
    iota = functools.partial(lax.broadcasted_iota, jnp.int32)
    pos = plgpu.load(pos_ref.at[rows], mask=iota((block_rows,), 0) < heads, other=-1)

    def live(c0):  # the chunks from c0 a row can see: any other (past `chunks` or the lane's end) is never read
        chunk = c0 + iota((block_c, block_rows), 0)
        return (chunk < chunks) & (chunk * chunk_k <= pos[None, :]) & (iota((block_c, block_rows), 1) < heads)

    blocks = range(0, cp, block_c)
    seens = [live(c0) for c0 in blocks]
    ms = [plgpu.load(m_ref.at[pl.ds(c0, block_c), rows], mask=seen, other=NEG)
          for c0, seen in zip(blocks, seens, strict=True)]
    top = functools.reduce(jnp.maximum, [jnp.max(m, axis=0) for m in ms])  # [rows]; exact in any order
    lsum = jnp.zeros((block_rows,), jnp.float32)
    osum = jnp.zeros((block_rows, be), jnp.float32)
    for c0, seen, m in zip(blocks, seens, ms, strict=True):  # the sums a block of chunks at a time, in order
        w = jnp.where(seen, jnp.exp(m - top[None, :]), 0.0)
        lsum += jnp.sum(w * plgpu.load(l_ref.at[pl.ds(c0, block_c), rows], mask=seen, other=0.0), axis=0)
        o = plgpu.load(o_ref.at[pl.ds(c0, block_c), rows, :],
                       mask=jnp.broadcast_to(seen[:, :, None], (block_c, block_rows, be)), other=0.0)
        osum += jnp.sum(w[:, :, None] * o, axis=0)  # [rows, be]
    out = jnp.where(lsum[:, None] > 0, osum / jnp.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
    plgpu.store(out_ref.at[pl.ds(j * heads, block_rows), :], out.astype(out_ref.dtype),
                mask=iota((block_rows, be), 0) < heads)


def _check(o, m, l, pos, chunks: int, t: int, heads: int):
    b, g, cp, ro, e = o.shape
    if m.shape != l.shape or m.shape[:3] != (b, g, cp) or m.shape[3] < ro:
        raise ValueError(f"m {m.shape} and l {l.shape} must be [B, G, Cp, >= rows] of o {o.shape}")
    if pos.shape != (b, m.shape[3]) or pos.dtype != jnp.int32:
        raise ValueError(f"positions {pos.shape} {pos.dtype} must be int32 [B, rows] as m {m.shape}")
    if cp != chunks_pad(cp) or not 1 <= chunks <= cp:
        raise ValueError(f"the chunk axis {cp} must be a power of two holding {chunks=} live chunks")
    if ro < t * heads or e % 64 and e not in (16, 32):
        raise ValueError(f"o holds {ro} rows, fewer than {t=} x {heads=}, or head dim {e} is not 16, 32 or a "
                         f"multiple of 64 (block_e must divide it)")


@functools.partial(jax.jit, static_argnames=("chunks", "chunk_k", "t", "heads", "dtype", "block_sizes", "interpret"))
def combine(o: jax.Array, m: jax.Array, l: jax.Array, pos: jax.Array, *, chunks: int, chunk_k: int, t: int,
            heads: int, dtype=jnp.bfloat16, block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Normalised output of the partials of the chunks each row can see (chunk c of `chunk_k` keys from c *
    chunk_k, c < `chunks`, at or before the row's position `pos`), row = t * heads + head of a KV head:
    ``[B, T, G * heads, E]`` in `dtype`."""
    bs = block_sizes or DEFAULT
    _check(o, m, l, pos, chunks, t, heads)
    b, g, cp, ro, e = o.shape
    block_rows = chunks_pad(heads)
    be = bs.block_e(cp, block_rows, e)
    kernel = functools.partial(_kernel, chunks=chunks, chunk_k=chunk_k, heads=heads, block_rows=block_rows,
                               block_c=min(cp, bs.block_c))
    return pl.pallas_call(
        kernel,
        grid=(b, t, g, e // be),
        in_specs=[
            pl.BlockSpec((None, None, cp, ro, be), lambda n, i, j, c: (n, j, 0, 0, c)),
            pl.BlockSpec((None, None, cp, m.shape[3]), lambda n, i, j, c: (n, j, 0, 0)),
            pl.BlockSpec((None, None, cp, m.shape[3]), lambda n, i, j, c: (n, j, 0, 0)),
            pl.BlockSpec((None, m.shape[3]), lambda n, i, j, c: (n, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, g * heads, be), lambda n, i, j, c: (n, i, 0, c)),
        out_shape=jax.ShapeDtypeStruct((b, t, g * heads, e), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret,
        name="attention_combine",
    )(o, m, l, pos)


def reference(o, m, l, pos, *, chunks: int, chunk_k: int, t: int, heads: int, dtype=jnp.bfloat16) -> jax.Array:
    """Plain jax.numpy over the chunks each row can see (XLA's order of the sums: equal to the kernel within f32
    rounding)."""
    rows = t * heads
    o, m, l = o[:, :, :chunks, :rows], m[:, :, :chunks, :rows], l[:, :, :chunks, :rows]
    seen = (jnp.arange(chunks)[:, None] * chunk_k <= pos[:, None, None, :rows])  # [B, 1, C, rows]
    m = jnp.where(seen, m, NEG)
    w = jnp.where(seen, jnp.exp(m - jnp.max(m, axis=2, keepdims=True)), 0.0)
    l = jnp.where(seen, l, 0.0)
    o = jnp.where(seen[..., None], o, 0.0)
    lsum = jnp.sum(w * l, axis=2)
    osum = jnp.sum(w[..., None] * o, axis=2)
    out = jnp.where(lsum[..., None] > 0, osum / jnp.where(lsum > 0, lsum, 1.0)[..., None], 0.0)  # [B, G, rows, E]
    b, g, _, e = out.shape
    return out.reshape(b, g, t, heads, e).transpose(0, 2, 1, 3, 4).reshape(b, t, g * heads, e).astype(dtype)
