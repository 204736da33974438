"""Pallas GPU (Triton) causal flash attention for prompt chunks (prefill), GQA, reading the lane's KV pages.

Shapes: ``q [B, T, H, E]`` (T query rows per lane at absolute ``positions [B, T]``), ``k_pages, v_pages
[P, page, G, E]`` (the pool), ``page_table [B, n]`` (each lane's pages in position order: key s of lane b is row
s % page of page ``page_table[b, s // page]``). A row at p sees keys 0..p. GQA: query head ``h`` reads KV head
``h // (H // G)``.

Grid: (query head, query block, lane), heads fastest: the ``H // G`` heads of one KV head and neighbouring
query blocks run together and read the same key tiles from L2; query blocks go heaviest (latest) first so
the causal tail is short. A program takes ``block_q`` rows of one head and walks key tiles of ``block_k``
(``block_k // page`` pages each, loaded through the table): first the tiles every row of the block sees whole
(no mask), then the diagonal tiles up to the block's last position (masked), keeping an online softmax in
float32 (base 2: the scale folds log2(e)). The tiles read follow the rows' positions only, never the table's
width, so a lane's whole table costs no more than the pages its chunk reaches (one program a row count).

Not row-invariant: a row's arithmetic depends on the block it shares. Lane-round rows (decode, verify)
use the paged kernel in `attention.py`, which is.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import KVPages, attention_reference, gather_pages

HEAD_DIMS = (64, 128, 256)
NEG = -1e30  # finite start for the running max: a fully masked tile gives exp2(-inf - NEG) = 0, never NaN
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 128  # query rows (of one head) per program
    block_k: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 2


def _flash_kernel(q_ref, pos_ref, pt_ref, k_ref, v_ref, o_ref, *, page, block_k, scale):
    # q_ref [bq, E]; pos_ref [bq] i32 (rows in position order); pt_ref [n_pad] i32; k_ref, v_ref [P, page, E];
    # o_ref [bq, E]
    block_q, e = q_ref.shape
    q = q_ref[...]
    pos = pos_ref[...]
    last = jnp.max(pos)
    full = (jnp.min(pos) + 1) // block_k  # tiles every row sees whole
    tiles = last // block_k + 1  # tiles any row sees at all
    qk_scale = scale * LOG2E
    per_tile = block_k // page

    def body(i, carry, masked):
        acc, m, l = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        pids = pt_ref[pl.ds(k0 // page, per_tile)]  # the tile's pages
        k = k_ref[pids].reshape(block_k, e).astype(q.dtype)
        v = v_ref[pids].reshape(block_k, e).astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bq, bk]
        # The mask only selects: a visible score takes the same instructions in a masked tile as in a whole
        # one, so a row's result never depends on which tiles its query block sees whole (chunk invariance).
        keys = k0 + jnp.arange(block_k)
        seen = keys[None, :] <= pos[:, None] if masked else None
        top = jnp.max(jnp.where(seen, s, -jnp.inf) if masked else s, axis=1)
        m_new = jnp.maximum(m, top * qk_scale)  # m in scaled (base-2) units; qk_scale > 0
        p = jnp.exp2(s * qk_scale - m_new[:, None])  # one fused multiply-add per score
        if masked:  # keys past every row hold whatever their pages hold: never let a NaN reach p @ v as 0 * NaN
            p = jnp.where(seen, p, 0.0)
            v = jnp.where((keys <= last)[:, None], v, 0)
        alpha = jnp.exp2(m - m_new)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, e), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), init)
    acc, _, l = lax.fori_loop(full, tiles, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # l >= 1: every row sees key 0


def _check(q, k_pages, v_pages, page_table, positions, bs: BlockSizes):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"want q [B, T, H, E] and pages [P, page, G, E], got {q.shape=} {k_pages.shape=}")
    b, t, h, e = q.shape
    _, page, g, ek = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    if ek != e or e not in HEAD_DIMS:
        raise ValueError(f"head dim {e=} (pages {ek}) must match and be one of 64, 128, 256")
    if h % g:
        raise ValueError(f"query heads {h=} must be a multiple of KV heads {g=}")
    if page_table.ndim != 2 or page_table.shape[0] != b or positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} must be [B={b}, n] and {positions.shape=} [B, T]=[{b}, {t}]")
    for name in ("block_q", "block_k"):
        x = getattr(bs, name)
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of 2 >= 16")
    if bs.block_k % page:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of {page=}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def flash_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal GQA attention of q rows at `positions` over the lane's pages: ``[B, T, H, E]`` in ``q.dtype``.

    Rows should come in position order within a lane (a prompt chunk): a block's work is bounded by its
    first and last positions. Every position must be >= 0.
    """
    bs = block_sizes or BlockSizes()
    _check(q, k_pages, v_pages, page_table, positions, bs)
    b, t, h, e = q.shape
    p_total, page, g, _ = k_pages.shape
    r = h // g
    s = page_table.shape[1] * page  # keys a lane can hold
    t_pad = pl.cdiv(t, bs.block_q) * bs.block_q
    n_pad = pl.cdiv(s, bs.block_k) * bs.block_k // page
    pos = jnp.minimum(positions.astype(jnp.int32), s - 1)  # a row past the keys sees them all
    if t_pad != t:  # padding rows repeat the last position: no extra tiles, finite results, sliced away
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, t_pad - t)), mode="edge")
    # keys past s are never seen (pos <= s - 1) but a last tile may reach past the table: those read page 0; the
    # engine marks unallocated pages with P: never load past the pool
    pt = jnp.clip(jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, n_pad - page_table.shape[1]))), 0, p_total - 1)
    nq = t_pad // bs.block_q
    kernel = functools.partial(_flash_kernel, page=page, block_k=bs.block_k, scale=e**-0.5)
    out = pl.pallas_call(
        kernel,
        grid=(h, nq, b),
        in_specs=[
            pl.BlockSpec((None, bs.block_q, None, e), lambda j, i, n: (n, nq - 1 - i, j, 0)),
            pl.BlockSpec((None, bs.block_q), lambda j, i, n: (n, nq - 1 - i)),
            pl.BlockSpec((None, n_pad), lambda j, i, n: (n, 0)),
            pl.BlockSpec((p_total, page, None, e), lambda j, i, n: (0, 0, j // r, 0)),
            pl.BlockSpec((p_total, page, None, e), lambda j, i, n: (0, 0, j // r, 0)),
        ],
        out_specs=pl.BlockSpec((None, bs.block_q, None, e), lambda j, i, n: (n, nq - 1 - i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, e), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(q, pos, pt, k_pages, v_pages)
    return out[:, :t]


def reference(q, k_pages, v_pages, page_table, positions) -> jax.Array:
    """Plain jax.numpy: the lane's pages gathered, then `attention.attention_reference` (keys s <= position)."""
    k, v = gather_pages(KVPages(k_pages, v_pages), page_table)
    return attention_reference(q, k.astype(q.dtype), v.astype(q.dtype), positions)
