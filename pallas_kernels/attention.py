"""Pallas GPU (Triton) verify/decode attention over the paged KV cache, row-invariant.

Shapes: ``q [B, T, H, E]`` (T query rows per lane at absolute ``positions [B, T]``), ``k_pages``,
``v_pages [P, page, G, E]``, ``page_table [B, n]`` (a lane's position p lives in page
``page_table[b, p // page]`` at offset ``p % page``). A row at p sees keys 0..p (causal within the lane's
window). GQA: the ``R = H // G`` query heads of a KV head and the T rows form the query block's rows.

Grid: (query group, key chunk, KV head, lane). A program takes up to ``q_blocks`` blocks of ``block_q`` rows
of one (lane, KV head) and one chunk of ``chunk_k`` keys starting at an absolute position that is a multiple
of ``chunk_k``; it walks that chunk in ``block_k`` key tiles, each tile read once for all its blocks, each
block its own online softmax in float32, and writes its partial (unnormalised output, running max, running
sum). The partials are combined outside the kernel: max, then a sum in a fixed pairwise order over chunks.

Row invariance (a row's result is bit-identical whether it is alone or one of T verify rows): chunk and
tile boundaries are fixed by absolute key position; a row's scores, running max and sum use only its own
q and the keys; tiles a row cannot see (past its position, processed because another row of the block
can) leave its state untouched (a select, not an update by exp(0) * ... + 0); ``block_q`` is fixed, so
every row goes through the same instructions whether its block is alone in a program or beside others;
chunks past a row's position contribute exact zeros.

Served where the Mosaic GPU kernel (`attention_mgpu`, the winner: 1.4-1.9x this one at 2k-64k keys, H100) does not
serve: f32 q or pages, q and pages of different dtypes, page sizes not a multiple of 8 (`ops.paged_attention`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fenced

REFERENCE_ROW_BLOCK = 64  # rows of a prompt chunk's reference attention a step (`paged_prompt_reference`)
NEG = -1e30  # finite "minus infinity" for the running max, so dead rows never compute inf - inf


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # query rows (row, head) a block: the dots' M, fixed so every row runs the same instructions. 64 (H200, 2026-12-04,
    # 8 warps): a width-8 round's 48 rows (8 rows x 6 heads) in one block, 8 rows at 64k 251 -> 156 us, 16k 85 -> 61;
    # one row pays the 64-row block (64k 108 -> 158 us), and lane rounds always verify `width` rows
    block_q: int = 64
    q_blocks: int = 4  # blocks at most a program (one read of a key tile serves them)
    block_k: int = 64  # keys per tile; a multiple of the page size
    chunk_k: int = 512  # keys per program; a multiple of block_k
    num_warps: int = 8
    num_stages: int = 2
    # > 0: chunk_k is instead the fewest keys (block_k times a power of 2) that keep chunks x KV heads at or under
    # this many programs, from the lane's span (its page table's width) and the KV heads alone, never from the
    # rows or the lanes in a call, so row invariance holds: short contexts get many small chunks to fill the GPU.
    # 264 won the H200 sweep at 2k/16k/64k (2k decode 77 -> 35 us, 64k 251 -> 198 us); 0 keeps chunk_k
    chunk_programs: int = 264

    def chunk_for(self, span: int, kv_heads: int) -> int:
        """Keys per program for a lane span of `span` keys."""
        return chunk_keys(span, kv_heads, self.block_k, self.chunk_programs) if self.chunk_programs else self.chunk_k

    def group_for(self, rows: int) -> int:
        """Blocks a program for `rows` query rows: the fewest programs, then blocks spread evenly over them."""
        blocks = pl.cdiv(rows, self.block_q)
        return pl.cdiv(blocks, pl.cdiv(blocks, self.q_blocks))


def chunk_keys(span: int, kv_heads: int, block_k: int, programs: int) -> int:
    """The fewest keys a chunk (block_k times a power of 2) keeping chunks x KV heads <= `programs` for a lane span
    of `span` keys: from the span and the KV heads alone, never the rows or the lanes, so row invariance holds."""
    chunk = block_k
    while pl.cdiv(span, chunk) * kv_heads > programs:
        chunk *= 2
    return chunk


DEFAULT = BlockSizes()  # what a call without block_sizes takes (benchmarks A/B it: bench_graph.py --attn-blocks)


def _paged_kernel(q_ref, pos_ref, pt_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, page, block_k, chunk_k, scale,
                  blocks):
    # q_ref [blocks * bq, E]; pos_ref [blocks * bq] i32 (-1 marks a padding row); pt_ref [n_pad] i32;
    # k_ref, v_ref [P, page, E]; o_ref [blocks * bq, E] f32 (unnormalised); m_ref, l_ref [blocks * bq] f32
    e = q_ref.shape[1]
    bq = q_ref.shape[0] // blocks
    rows = [pl.ds(j * bq, bq) for j in range(blocks)]
    start = pl.program_id(1) * chunk_k
    last = functools.reduce(jnp.maximum, [jnp.max(pos_ref[r]) for r in rows])  # Triton values: power-of-2 sizes
    tiles = jnp.clip((last - start) // block_k + 1, 0, chunk_k // block_k)  # tiles any row can see
    per_tile = block_k // page

    def update(q, pos, k, v, k0, keys, carry):  # one block's online softmax over one key tile
        acc, m, l = carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(keys[None, :] <= pos[:, None], s, -jnp.inf)  # [bq, bk]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        live = k0 <= pos  # the row sees at least one key of this tile
        acc = jnp.where(live[:, None], acc * alpha[:, None] + pv, acc)
        l = jnp.where(live, l * alpha + jnp.sum(p, axis=1), l)
        m = jnp.where(live, m_new, m)
        return acc, m, l

    def body(i, carry):
        k0 = start + i * block_k
        pids = pt_ref[pl.ds(k0 // page, per_tile)]  # the tile's pages
        keys = k0 + jnp.arange(block_k)
        k = k_ref[pids].reshape(block_k, e)
        # keys past every row hold whatever their pages hold (a lane's unallocated tail): never let a NaN
        # there reach a row through 0 * NaN in the p @ v product (a row's p is 0 past its position: 0 * v = 0)
        v = jnp.where((keys <= last)[:, None], v_ref[pids].reshape(block_k, e), 0)
        return tuple(update(q_ref[r, :], pos_ref[r], k, v, k0, keys, c) for r, c in zip(rows, carry, strict=True))

    init = (jnp.zeros((bq, e), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    out = lax.fori_loop(0, tiles, body, (init,) * blocks)
    for r, (acc, m, l) in zip(rows, out, strict=True):
        o_ref[r, :] = acc
        m_ref[r] = m
        l_ref[r] = l


def _tree_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis` in a fixed pairwise order (elementwise adds only), whatever the other dims are."""
    c = x.shape[axis]
    width = 1 << (c - 1).bit_length()
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - c)
    x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        x = lax.slice_in_dim(x, 0, None, 2, axis) + lax.slice_in_dim(x, 1, None, 2, axis)
    return lax.index_in_dim(x, 0, axis, keepdims=False)


HEAD_DIMS = (64, 128, 256)


def supports(head_dim: int) -> bool:
    """Whether the kernel serves this head dim (callers fall back to the reference otherwise)."""
    return head_dim in HEAD_DIMS


def _check(q, k_pages, v_pages, page_table, positions, bs: BlockSizes):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"want q [B, T, H, E] and pages [P, page, G, E], got {q.shape=} {k_pages.shape=}")
    b, t, h, e = q.shape
    _, page, g, ek = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
    if ek != e or not supports(e):
        raise ValueError(f"head dim {e=} (pages {ek}) must match and be one of 64, 128, 256")
    if h % g:
        raise ValueError(f"query heads {h=} must be a multiple of KV heads {g=}")
    if page_table.ndim != 2 or page_table.shape[0] != b or positions.shape != (b, t):
        raise ValueError(f"{page_table.shape=} must be [B={b}, n] and {positions.shape=} [B, T]=[{b}, {t}]")
    for name in ("block_q", "block_k", "chunk_k"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if bs.q_blocks < 1:
        raise ValueError(f"q_blocks={bs.q_blocks} must be >= 1")
    if bs.block_k % page or bs.chunk_k % bs.block_k:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of {page=}, chunk_k={bs.chunk_k} of block_k")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal GQA attention of q rows over a lane's pages: ``[B, T, H, E]`` in ``q.dtype``."""
    bs = block_sizes or DEFAULT
    _check(q, k_pages, v_pages, page_table, positions, bs)
    b, t, h, e = q.shape
    _, page, g, _ = k_pages.shape
    r = h // g
    rows = t * r
    blocks = bs.group_for(rows)
    group = blocks * bs.block_q  # rows a program
    rows_pad = pl.cdiv(rows, group) * group
    span = page_table.shape[1] * page  # keys a lane can hold
    qr, pos = query_rows(q, positions, g, rows_pad, span)
    chunk_k = bs.chunk_for(span, g)
    chunks = pl.cdiv(span, chunk_k)
    pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, chunks * chunk_k // page - page_table.shape[1])))
    pt = jnp.clip(pt, 0, k_pages.shape[0] - 1)  # the engine marks unallocated pages with P: never load past the pool
    qb = rows_pad // group
    p_total = k_pages.shape[0]
    kernel = functools.partial(_paged_kernel, page=page, block_k=bs.block_k, chunk_k=chunk_k, scale=e**-0.5,
                               blocks=blocks)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(qb, chunks, g, b),  # query groups fastest: they share a chunk's keys in L2
        in_specs=[
            pl.BlockSpec((None, None, group, e), lambda i, c, j, n: (n, j, i, 0)),
            pl.BlockSpec((None, group), lambda i, c, j, n: (n, i)),
            pl.BlockSpec((None, pt.shape[1]), lambda i, c, j, n: (n, 0)),
            pl.BlockSpec((p_total, page, None, e), lambda i, c, j, n: (0, 0, j, 0)),
            pl.BlockSpec((p_total, page, None, e), lambda i, c, j, n: (0, 0, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group, e), lambda i, c, j, n: (n, j, c, i, 0)),
            pl.BlockSpec((None, None, None, group), lambda i, c, j, n: (n, j, c, i)),
            pl.BlockSpec((None, None, None, group), lambda i, c, j, n: (n, j, c, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, g, chunks, rows_pad, e), jnp.float32),
            jax.ShapeDtypeStruct((b, g, chunks, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, g, chunks, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="paged_attention",
    )(qr, pos, pt, k_pages, v_pages)
    return combine(o, m, l, rows, (b, t, h, e), q.dtype)


def query_rows(q, positions, kv_heads: int, rows_pad: int, span: int):
    """A KV head's query rows (row = t * R + head) padded to `rows_pad`: (q [B, G, rows_pad, E], their positions
    [B, rows_pad] i32, at most span - 1, -1 on padding rows)."""
    b, t, h, e = q.shape
    r = h // kv_heads
    rows = t * r
    qr = q.reshape(b, t, kv_heads, r, e).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, rows, e)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    pos = jnp.broadcast_to(jnp.minimum(positions, span - 1)[:, :, None], (b, t, r)).reshape(b, rows)
    return qr, jnp.pad(pos.astype(jnp.int32), ((0, 0), (0, rows_pad - rows)), constant_values=-1)


def combine(o, m, l, rows: int, shape, dtype) -> jax.Array:
    """The chunks' partials (o [B, G, C, rows_pad, E] unnormalised, m and l [B, G, C, rows_pad]) as ``[B, T, H, E]``:
    max, then a sum in a fixed pairwise order over chunks (a row's chunks past its position weigh exact zeros)."""
    b, t, h, e = shape
    g = o.shape[1]
    top = jnp.max(m, axis=2, keepdims=True)  # max is exact in any order
    w = jnp.exp(m - top)  # [B, G, C, rows]; 0 for chunks a row cannot see
    lsum = _tree_sum(w * l, axis=2)
    osum = _tree_sum(w[..., None] * o, axis=2)  # [B, G, rows, E]
    out = jnp.where(lsum[..., None] > 0, osum / jnp.where(lsum > 0, lsum, 1.0)[..., None], 0.0)
    out = out[:, :, :rows].reshape(b, g, t, h // g, e).transpose(0, 2, 1, 3, 4).reshape(b, t, h, e)
    return out.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """One attention layer's paged KV pool: k, v [P, page, G, E]; lanes map positions via a page table."""

    k: jax.Array
    v: jax.Array


def gather_pages(pages: KVPages, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A lane's keys and values in position order: [B, S, G, E] with S = n * page."""
    b, n = page_table.shape
    k = pages.k[page_table].reshape(b, -1, *pages.k.shape[2:])
    v = pages.v[page_table].reshape(b, -1, *pages.v.shape[2:])
    return k, v


def paged_keys(k: jax.Array, v: jax.Array, page: int) -> tuple[KVPages, jax.Array]:
    """Lanes' keys and values [B, S, G, E] (S a multiple of `page`) as a pool and a table, lane b on pages
    b * n .. b * n + n - 1: `gather_pages`'s inverse (benchmarks and tests)."""
    b, s = k.shape[:2]
    n = s // page
    pool = KVPages(k.reshape(b * n, page, *k.shape[2:]), v.reshape(b * n, page, *v.shape[2:]))
    return pool, jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, rows: bool = False, *,
                        gpu: bool = False) -> jax.Array:
    """Causal GQA attention of q [B, T, H, E] over k, v [B, S, G, E]; key s is seen by a row at p iff s <= p.

    With `rows`, each lane's each query row is computed on its own (fixed shapes, a fenced loop: `gpu` says
    which, `fenced.fenced_map`), so its result never depends on T or on the other lanes.
    """
    if rows:
        def lane(xs):  # q [T, H, E], k, v [S, G, E], positions [T]
            qb, kb, vb, pb = xs
            return fenced.fenced_map(lambda r: attention_reference(r[0][None, None], kb[None], vb[None],
                                                                   r[1][None, None])[0, 0], (qb, pb), gpu=gpu)

        return fenced.fenced_map(lane, (q, k, v, positions), gpu=gpu)
    b, t, h, e = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, e)
    s = jnp.einsum("btgre,bsge->bgrts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    s = s * (e**-0.5)
    keys = jnp.arange(k.shape[1])
    mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgrts,bsge->btgre", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, e).astype(q.dtype)


def reference(q, k_pages, v_pages, page_table, positions) -> jax.Array:
    """Plain jax.numpy: gather the lane's pages, then `attention_reference`."""
    k, v = gather_pages(KVPages(k_pages, v_pages), page_table)
    return attention_reference(q, k, v, positions)


REFERENCE_TILE_PAGES = 4  # pages of keys per step of `paged_rows_reference` (64 keys at the usual page of 16)


def paged_rows_reference(q: jax.Array, pages: KVPages, page_table: jax.Array, positions: jax.Array, *,
                         tile_pages: int = REFERENCE_TILE_PAGES, kv_head: jax.Array | None = None,
                         valid: jax.Array | None = None) -> jax.Array:
    """Lane-round rows' causal attention on the CPU, reading only the key tiles each row can see.

    q [B, T, H, E] at `positions` [B, T] over the lane's pages. Each row runs on its own (fenced loops over
    lanes and rows), walking key tiles of `tile_pages` pages from position 0 with an online softmax in float32
    until the tile holding its position: its arithmetic depends on its q, its position and the keys only, never
    on T, the lane count, the page table's width (the configured context) or the other lanes' lengths, and its
    cost follows its own length.

    `kv_head` (a scalar, possibly traced): every q head attends that one KV head of the pages (a tensor-parallel
    device's loop over its own q heads, one a step: `ops.paged_attention`); the tiles gather only its keys.
    `valid` [B]: each lane's rows to compute (its first ones); the rest come out zeros at no cost (a lane round's rows
    past its proposals).
    """
    b, t, h, e = q.shape
    n_pages, page, g, _ = pages.k.shape
    if kv_head is not None:
        g = 1
    width = page_table.shape[1]
    pad = (-width) % tile_pages
    table = jnp.pad(page_table, ((0, 0), (0, pad)))  # whole tiles; the padding is past every row's position
    tiles = table.shape[1] // tile_pages
    tile = tile_pages * page
    r = h // g

    def row(qr, pos, lane_table):  # qr [H, E], pos scalar
        qg = qr.reshape(g, r, e)
        count = fenced.opaque_count(jnp.clip(pos // tile + 1, 1, tiles), gpu=False)

        def step(i, carry):
            m, l, acc = carry
            ids = jnp.clip(jax.lax.dynamic_slice_in_dim(lane_table, i * tile_pages, tile_pages), 0, n_pages - 1)
            k, v = pages.k[ids], pages.v[ids]  # [tile_pages, page, G, E]
            if kv_head is not None:
                k, v = (jax.lax.dynamic_index_in_dim(a, kv_head, axis=2) for a in (k, v))
            k, v = k.reshape(tile, g, e).astype(q.dtype), v.reshape(tile, g, e).astype(q.dtype)
            s = jnp.einsum("gre,sge->grs", qg, k, preferred_element_type=jnp.float32) * (e**-0.5)
            seen = i * tile + jnp.arange(tile) <= pos
            s = jnp.where(seen[None, None], s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(seen[None, None], jnp.exp(s - m_new[..., None]), 0.0)
            pv = jnp.einsum("grs,sge->gre", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((g, r), NEG, jnp.float32), jnp.zeros((g, r), jnp.float32), jnp.zeros((g, r, e), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, count, step, init)
        return (acc / l[..., None]).reshape(h, e).astype(q.dtype)

    def lane(xs):  # q [T, H, E], positions [T], table [n], rows scalar
        qb, pb, tb, nb = xs
        return fenced.fenced_map(lambda x: row(x[0], x[1], tb), (qb, pb), gpu=False, count=nb)

    rows = jnp.full((b,), t, jnp.int32) if valid is None else valid.astype(jnp.int32)
    return fenced.fenced_map(lane, (q, positions, table, rows), gpu=False)


def paged_prompt_reference(q: jax.Array, pages: KVPages, page_table: jax.Array, positions: jax.Array, *,
                           tile_pages: int = REFERENCE_TILE_PAGES, row_block: int = REFERENCE_ROW_BLOCK) -> jax.Array:
    """A prompt chunk's causal attention on the CPU, reading only the key tiles up to its last row.

    q [B, T, H, E] at `positions` [B, T] (each lane's rows in order, the last the deepest) over the lane's pages. A
    loop over key tiles of `tile_pages` pages from position 0 (an online softmax in float32, all T rows and the R
    query heads of a KV head as one [R * T, E] block a step) runs to the tile holding the lane's last position, so
    its cost follows the keys the chunk reaches, not the page table's width (a power-of-two bucket read up to twice
    the keys). Its bits follow from q, the positions and the keys alone: the tiles are fixed by absolute position
    and their count by the last position, never by the table's width, so a resumed prompt's call computes what a
    fresh one's does. Dtypes as `attention_reference`: scores and the softmax in float32, products in q's dtype.

    Rows go in fixed blocks of `row_block` (a fenced loop; the last block padded with its last position), each
    walking the tiles up to its own last row: XLA:CPU sums and multiplies a small block in another order than a
    large one, so one block shape for every call keeps a row's bits independent of the call's start and row count
    (a fully masked tile adds exact zeros), which lets a prefix resume start at any page (`Runner.grain`).
    """
    b, t, h, e = q.shape
    pad = (-t) % row_block
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge")
    n_pages, page, g, _ = pages.k.shape
    r = h // g
    width = page_table.shape[1]
    table = jnp.pad(page_table, ((0, 0), (0, (-width) % tile_pages)))  # whole tiles; the padding is never reached
    tile = tile_pages * page

    def block(xs):  # q [RB, H, E], positions [RB], table [n]
        qb, pb, tb = xs
        t = row_block
        qg = qb.reshape(t, g, r, e).transpose(1, 2, 0, 3).reshape(g, r * t, e)  # a KV head's rows: head-major
        row_pos = jnp.tile(pb, r)  # [R * T]
        count = jnp.clip(pb[-1] // tile + 1, 1, table.shape[1] // tile_pages)

        def step(i, carry):
            m, l, acc = carry
            ids = jnp.clip(jax.lax.dynamic_slice_in_dim(tb, i * tile_pages, tile_pages), 0, n_pages - 1)
            k = pages.k[ids].reshape(tile, g, e).astype(q.dtype)  # [tile, G, E]
            v = pages.v[ids].reshape(tile, g, e).astype(q.dtype)
            s = jnp.einsum("gqe,sge->gqs", qg, k, preferred_element_type=jnp.float32) * (e**-0.5)
            seen = i * tile + jnp.arange(tile)[None, :] <= row_pos[:, None]  # [R * T, tile]
            s = jnp.where(seen[None], s, NEG)  # every row sees key 0 in tile 0, so exp(NEG - m) is an exact 0 after
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("gqs,sge->gqe", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((g, r * t), NEG, jnp.float32), jnp.zeros((g, r * t), jnp.float32),
                jnp.zeros((g, r * t, e), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, count, step, init)
        out = (acc / l[..., None]).reshape(g, r, t, e).transpose(2, 0, 1, 3)  # [RB, G, R, E]
        return out.reshape(t, h, e).astype(q.dtype)

    def lane(i):
        blocks = (q[i].reshape(-1, row_block, h, e), positions[i].reshape(-1, row_block))
        out = fenced.fenced_map(lambda xs: block((*xs, table[i])), blocks, gpu=False)
        return out.reshape(-1, h, e)[:t]

    return jnp.stack([lane(i) for i in range(b)])  # B is 1 for a prompt chunk
