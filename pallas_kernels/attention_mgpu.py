"""Pallas Mosaic GPU verify/decode attention over the paged KV cache (Hopper): TMA-fed key tiles, MMAs from shared
memory, row-invariant.

The same contract as `attention.paged_attention` (shapes, causal rows, GQA, the partials' combine), built the way
the Mosaic matmul is: each key tile's pages arrive by TMA into shared memory `stages` tiles ahead of the MMAs, so
the reads stay in flight while the dots and the softmax run. The Triton kernel gathers a tile's pages with
computed pointers through registers; at 64k and 8 rows it moved the KV bytes at half the copy rate (H200,
docs/benchmarks.md, ninth run). This one reads them at the copy rate at 64k, 1.6-1.9x Triton's speed at 16k-64k
and 1.4x at 2k with its combine kernel (H100, eleventh and twelfth runs); the dispatch takes it wherever
`supports()` holds.

Grid: (query block, program, KV head, lane). A program takes one block of 64 query rows (row, head) of one
(lane, KV head), the MMA's M, and its chunks of keys at absolute offsets; its page ids and the block's
positions come by TMA first, then K and V tiles of `block_k` keys, one TMA copy a page. Per tile: S = Q K^T (the
MMA, Q and K from shared memory), whose slot then takes the K of `stages` tiles on, the online softmax in float32
registers, then acc = acc * alpha + P V (P from registers), whose slot then takes the next V. The tile holding the
lane's last position has its V rows past it zeroed in shared memory first, so what unwritten or unallocated pages
hold (NaN included) never reaches a row through 0 * NaN.

Interleaved chunks: chunks of a fixed `chunk_k` keys (a tile by default) dealt out round-robin, program c of P (a KV
head's share of `chunk_programs`, a power of two) taking chunks c, c + P, ... up to the lane's last position into one
softmax state, one pipeline, one partial. Chunk boundaries do not follow the span, so a short context in a wide page
table (an engine's `LaneConfig.context` sets every lane's span) still runs on every SM. The span policy it replaced
(a chunk a program, sized from the span) gave 2k keys in a 64k span one program a KV head: 65.7 us against 15.9
interleaved, and a dense27 decode step 9.00 against 8.13-8.21 ms (H100, docs/benchmarks.md thirteenth run); at a
span the context fills the two were within 0-4% of the attention call. It was deleted in issue 27. Each program's
page ids are laid out contiguously first (`program_pages`), so it holds only its own: 512 at a 262k span.

Row invariance: chunk and tile boundaries are fixed by absolute key position (and which program takes a chunk by
static P), a row's scores and softmax state use only its own q and the keys (an MMA row is its own), and a tile past
a row's position is an exact no-op on its state: its scores are -inf, so p = 0, alpha = exp(m - m) = 1, acc * 1 + 0
and l * 1 + 0 keep their bits. Partials whose first key is past a row are never read by the combine:
`attention_combine` (one Triton launch writing [B, T, H, E]; 2.7-6 us a call faster than XLA's three fusions on the
H100, twelfth run, which were deleted).

GPU interpret mode (CPU tests) runs the same pipeline, barriers and TMA copies; its two products are plain dots
(the interpreter has no register-operand MMA), so the CPU checks the schedule and the masking, the GPU tests the
MMAs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import attention as triton_attention
from pallas_kernels import attention_combine

BLOCK_Q = 64  # query rows a program: the MMA's M
NEG = triton_attention.NEG
PT_WINDOW = 32  # page ids a program reads at least (TMA moves multiples of 128 bytes a warpgroup)
PT_PIECE = 256  # page ids a TMA copy (a box holds at most 256 elements a dimension)
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16 tiles in 128-byte rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_k: int = 64  # keys a tile: a multiple of the page size and of 64 (the V tail's mask is a 64-row layout)
    stages: int = 2  # key tiles in flight (K and V of 64 keys at head dim 256: 64 KB a stage)
    # programs over the KV heads, a KV head's share rounded down to a power of two (one program an SM at head dim 256:
    # 264 and 66 lost to 132, H100, eleventh and thirteenth runs)
    chunk_programs: int = 132
    chunk_k: int = 0  # keys a chunk (a multiple of block_k); 0: block_k (128 measured within 1% of 64, thirteenth run)


DEFAULT = BlockSizes()


def _kernel(q_gmem, pos_gmem, last_gmem, pt_gmem, k_gmem, v_gmem, o_gmem, m_gmem, l_gmem, *, page, chunk_k, chunks,
            programs, ids, stride, scale, bs: BlockSizes, interpret: bool):
    # q_gmem [B, G, rows_pad, E] bf16; pos_gmem [B, rows_pad] i32 (-1: padding); last_gmem [B, 32] i32 (the lane's
    # last position at 0); pt_gmem [B, n_pad] i32 (P or more: unallocated); k_gmem, v_gmem [P, page, G, E]; o_gmem
    # [B, G, Cp, rows, E] f32 (unnormalised); m_gmem, l_gmem [B, G, Cp, rows_pad] f32, a partial a program (Cp >=
    # programs: past them unwritten); pt_gmem holds a program's `ids` page ids from `pt_base` (see `_partials`)
    qi, c, j, b = (lax.axis_index(n) for n in ("q", "c", "g", "b"))
    e = q_gmem.shape[-1]
    bk, stages = bs.block_k, bs.stages
    per_tile = bk // page
    tpc = chunk_k // bk  # tiles a chunk
    pt_base = c * stride  # the program's first page id in the table row
    rows = pl.ds(qi * BLOCK_Q, BLOCK_Q)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def read(ref, layout):  # registers in `layout` (a plain read in interpret mode)
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def iota(shape, axis):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

    def full(shape, value, layout):
        x = jnp.full(shape, value, jnp.float32)
        return x if interpret else plgpu.layout_cast(x, layout)

    def store(acc, m, l, o_smem, ml_smem):  # the program's partials (partial c), 64 columns of o a TMA store
        ml_smem[0] = m
        ml_smem[1] = l
        for f in range(e // 64):
            slot = f % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's previous store has read it
            o_smem[slot] = acc[:, f * 64:(f + 1) * 64]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[slot], o_gmem.at[b, j, c, rows, pl.ds(f * 64, 64)])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_gmem.at[b, j, c, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_gmem.at[b, j, c, rows])
        plgpu.wait_smem_to_gmem(0)

    def loop(q_smem, pos_smem, last_smem, pt_smem, k_smem, v_smem, head_bar, k_bars, v_bars):
        plgpu.copy_gmem_to_smem(last_gmem.at[b], last_smem, head_bar.at[0])
        for off in range(0, ids, PT_PIECE):  # past 256 ids (a 4096-key chunk of 16-key pages) in pieces
            n = min(PT_PIECE, ids - off)
            plgpu.copy_gmem_to_smem(pt_gmem.at[b, pl.ds(pt_base + off, n)], pt_smem.at[pl.ds(off, n)], head_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_gmem.at[b, rows], pos_smem, head_bar.at[0])
        plgpu.copy_gmem_to_smem(q_gmem.at[b, j, rows], q_smem, head_bar.at[0])
        plgpu.barrier_wait(head_bar.at[0])
        last = last_smem[0]

        def tiles_of(chunk):  # tiles of a chunk any row of the lane can see
            return jnp.clip((last - chunk * chunk_k) // bk + 1, 0, tpc)

        # chunks c, c + P, ... up to the lane's last position, all but the lane's last whole
        live = jnp.minimum((last + chunk_k) // chunk_k, chunks)
        mine = (live - c + programs - 1) // programs  # >= 0: c < programs
        before = jnp.maximum(mine, 1) - 1  # whole chunks before the last (none: tiles_of(c) is 0 then)
        total = before * tpc + tiles_of(c + before * programs)

        def issue(u, pages_gmem, pages_smem, bars):  # tile u's K or V pages into its slot, one TMA copy a page
            slot = lax.rem(u, stages)
            first = u * per_tile  # a program's page ids are its tiles' in order
            for p in range(per_tile):
                pid = jnp.clip(pt_smem[first + p], 0, k_gmem.shape[0] - 1)  # unallocated: a real page, masked
                plgpu.copy_gmem_to_smem(pages_gmem.at[pid, :, j], pages_smem.at[slot, pl.ds(p * page, page)],
                                        bars.at[slot])

        issue_k = functools.partial(issue, pages_gmem=k_gmem, pages_smem=k_smem, bars=k_bars)
        issue_v = functools.partial(issue, pages_gmem=v_gmem, pages_smem=v_smem, bars=v_bars)

        def refill(u, issue_kv):  # a slot's next tile (the next chunk's too), once its MMAs are done
            pl.when(u + stages < total)(lambda: issue_kv(u + stages))

        for u in range(stages):
            @pl.when(u < total)
            def _(u=u):
                issue_k(u)
                issue_v(u)

        pos = read(pos_smem, row_layout)  # [64] i32

        def scores(slot):  # S = Q K^T, f32 [64, bk]
            if interpret:
                return jnp.dot(q_smem[...], k_smem[slot].T, preferred_element_type=jnp.float32)

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            return pl.run_scoped(mma, plgpu.ACC((BLOCK_Q, bk), jnp.float32))

        def accumulate(acc, p, slot):  # acc + P V
            if interpret:
                return acc + jnp.dot(p, v_smem[slot], preferred_element_type=jnp.float32)

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                plgpu.wgmma_wait(0)

            return pl.run_state(mma)(plgpu.ACC.init(acc))

        def tile(u, carry):
            acc, m, l = carry
            slot = lax.rem(u, stages)
            k0 = (c + (u // tpc) * programs) * chunk_k + lax.rem(u, tpc) * bk  # tile u: its chunk, its place there
            plgpu.barrier_wait(k_bars.at[slot])
            s = scores(slot) * scale
            refill(u, issue_k)  # K's slot is free once S is: its next tile loads under the softmax and P V
            s = jnp.where(k0 + iota((BLOCK_Q, bk), 1) <= lax.broadcast_in_dim(pos, (BLOCK_Q, bk), (0,)), s,
                          jnp.full_like(s, -jnp.inf))
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, (0,)))
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(axis=1)
            plgpu.barrier_wait(v_bars.at[slot])

            @pl.when(last < k0 + bk - 1)  # the tail tile: V rows past the lane's last position to exact zeros
            def _():
                v = read(v_smem.at[slot], plgpu.Layout.WGMMA)
                v_smem.at[slot][...] = jnp.where(k0 + iota((bk, e), 0) <= last, v, jnp.zeros_like(v))
                plgpu.commit_smem()

            acc = accumulate(acc * lax.broadcast_in_dim(alpha, acc.shape, (0,)), p.astype(v_smem.dtype), slot)
            refill(u, issue_v)
            return acc, m_new, l

        def init():
            return (full((BLOCK_Q, e), 0.0, plgpu.Layout.WGMMA), full((BLOCK_Q,), NEG, row_layout),
                    full((BLOCK_Q,), 0.0, row_layout))

        return lax.fori_loop(0, total, tile, init())

    scratch = [
        plgpu.SMEM((BLOCK_Q, e), q_gmem.dtype, transforms=SWIZZLED),
        plgpu.SMEM((BLOCK_Q,), jnp.int32),
        plgpu.SMEM((PT_WINDOW,), jnp.int32),
        plgpu.SMEM((ids,), jnp.int32),
        plgpu.SMEM((stages, bk, e), k_gmem.dtype, transforms=SWIZZLED),
        plgpu.SMEM((stages, bk, e), v_gmem.dtype, transforms=SWIZZLED),
        # num_barriers always given: since jax 0.11.2 a Barrier without it is a 0-d ref, which `.at[0]` can't index
        plgpu.Barrier(num_arrivals=3 + pl.cdiv(ids, PT_PIECE), num_barriers=1),
        plgpu.Barrier(num_arrivals=per_tile, num_barriers=stages),
        plgpu.Barrier(num_arrivals=per_tile, num_barriers=stages),
    ]
    out_scratch = [plgpu.SMEM((2, BLOCK_Q, 64), jnp.float32), plgpu.SMEM((2, BLOCK_Q), jnp.float32)]
    acc, m, l = pl.run_scoped(loop, *scratch)  # the partial's store after the loop, in shared memory K and V held
    pl.run_scoped(lambda o_smem, ml_smem: store(acc, m, l, o_smem, ml_smem), *out_scratch)


HEAD_DIMS = (64, 128, 256)
SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may take


def smem_bytes(head_dim: int, window: int, bs: BlockSizes) -> int:
    """Shared memory of the main loop: the query block, K and V stages, positions, `window` page ids, and 6 KB for
    barriers, alignment and Mosaic's own (its lowering counted 4.6 KB more than the buffers at head dim 256, 3
    stages)."""
    return 2 * (BLOCK_Q + 2 * bs.stages * bs.block_k) * head_dim + 4 * (BLOCK_Q + PT_WINDOW + window) + 6 * 1024


@dataclasses.dataclass(frozen=True)
class Plan:
    """A lane span's split: `chunks` of `chunk_k` keys over `programs` programs a (lane, KV head), one partial each;
    a program holds `ids` page ids, from `c * stride` of a page table row `width` ids wide as the kernel reads it."""

    chunk_k: int
    chunks: int
    programs: int
    ids: int
    stride: int
    width: int


def plan(width: int, page: int, kv_heads: int, bs: BlockSizes) -> Plan:
    """The split of a span of `width` pages (from the span, the KV heads and `bs`, never the rows)."""
    chunk_k = bs.chunk_k or bs.block_k
    chunks = pl.cdiv(width * page, chunk_k)
    per_head = max(1, bs.chunk_programs // kv_heads)  # a power of two: 32, not 33, kept the combine's chunk axis
    programs = min(chunks, 1 << (per_head.bit_length() - 1))  # unpadded (16k: 2.9 us against 3.5, H100)
    ids = -(-pl.cdiv(chunks, programs) * (chunk_k // page) // PT_WINDOW) * PT_WINDOW  # whole warpgroup loads
    return Plan(chunk_k, chunks, programs, ids, ids, programs * ids)


def program_pages(page_table: jax.Array, page: int, p: Plan) -> jax.Array:
    """The plan's page table: each program's page ids in the order its tiles take them, `p.ids` apiece."""
    b, w = page_table.shape
    per = pl.cdiv(p.chunks, p.programs) * (p.chunk_k // page)  # a program's ids before padding
    t = jnp.pad(page_table, ((0, 0), (0, per * p.programs - w)))
    t = t.reshape(b, -1, p.programs, p.chunk_k // page).transpose(0, 2, 1, 3).reshape(b, p.programs, per)
    return jnp.pad(t, ((0, 0), (0, 0), (0, p.ids - per))).reshape(b, p.width)


def supports(head_dim: int, page: int, dtype, bs: BlockSizes = DEFAULT) -> bool:
    """Whether the kernel serves this head dim, page size and dtype (q and pages; callers take the Triton kernel
    otherwise)."""
    return (head_dim in HEAD_DIMS and page % 8 == 0 and bs.block_k % page == 0 and dtype == jnp.bfloat16
            and smem_bytes(head_dim, 1024, bs) <= SMEM_BYTES)  # a 16k-key chunk's or a 1M span's ids in pages of 16


def _check(q, k_pages, v_pages, page_table, positions, bs: BlockSizes):
    triton_attention._check(q, k_pages, v_pages, page_table, positions, triton_attention.BlockSizes())
    page = k_pages.shape[1]
    if q.dtype != jnp.bfloat16 or k_pages.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU attention takes bf16 q and pages, got {q.dtype=} {k_pages.dtype=}")
    if bs.block_k % 64 or bs.block_k % page or page % 8:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of 64 and of {page=}, a multiple of 8")
    if bs.chunk_k % bs.block_k:
        raise ValueError(f"chunk_k={bs.chunk_k} must be a multiple of block_k={bs.block_k}")
    if bs.stages < 1 or bs.chunk_programs < 1:
        raise ValueError(f"stages={bs.stages} and chunk_programs={bs.chunk_programs} must be >= 1")
    ids = plan(page_table.shape[1], page, k_pages.shape[2], bs).ids
    if (need := smem_bytes(q.shape[-1], ids, bs)) > SMEM_BYTES:
        raise ValueError(f"stages={bs.stages} of block_k={bs.block_k} at head dim {q.shape[-1]} with {ids} page ids "
                         f"need {need} bytes of shared memory, more than {SMEM_BYTES}")


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
    """Causal GQA attention of q rows over a lane's pages: ``[B, T, H, E]`` bf16 (as `attention.paged_attention`)."""
    bs = block_sizes or DEFAULT
    o, m, l, pos, chunk_k, parts = _partials(q, k_pages, v_pages, page_table, positions, bs, interpret)
    t, h = q.shape[1:3]
    g = k_pages.shape[2]
    return attention_combine.combine(o, m, l, pos, chunks=parts, chunk_k=chunk_k, t=t, heads=h // g, dtype=q.dtype,
                                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def paged_partials(q, k_pages, v_pages, page_table, positions, *, block_sizes: BlockSizes | None = None,
                   interpret: bool = False):
    """The kernel alone: each program's partials (its chunks c, c + P, ...) for the query
    rows (row = t * R + head of a KV head), o [B, G, C, rows', E] f32 unnormalised, m and l [B, G, C, rows'] f32,
    rows' >= the real rows (past them: no meaning)."""
    o, m, l, _, _, parts = _partials(q, k_pages, v_pages, page_table, positions, block_sizes or DEFAULT, interpret)
    return o[:, :, :parts], m[:, :, :parts, : o.shape[3]], l[:, :, :parts, : o.shape[3]]


def _partials(q, k_pages, v_pages, page_table, positions, bs: BlockSizes, interpret: bool):
    """The kernel's outputs as written and what the combine needs: (o [B, G, Cp, rows', E], m and l [B, G, Cp,
    rows_pad], the rows' positions [B, rows_pad] (-1: padding), chunk_k, C), a partial a program, C of them (its
    first key at c * chunk_k), the axis padded to a power of two for the combine kernel (past C unwritten), rows' the
    real rows rounded up to 8 (rows_pad in interpret mode)."""
    _check(q, k_pages, v_pages, page_table, positions, bs)
    b, t, h, e = q.shape
    _, page, g, _ = k_pages.shape
    r = h // g
    rows = t * r
    rows_pad = pl.cdiv(rows, BLOCK_Q) * BLOCK_Q
    span = page_table.shape[1] * page
    qr, pos = triton_attention.query_rows(q, positions, g, rows_pad, span)
    last = jnp.pad(jnp.max(pos, axis=1, keepdims=True), ((0, 0), (0, PT_WINDOW - 1)))
    p = plan(page_table.shape[1], page, g, bs)
    pt = page_table.astype(jnp.int32)  # unallocated (P) is clipped to a real page in the kernel, then masked
    pt = program_pages(pt, page, p)
    kernel = functools.partial(_kernel, page=page, chunk_k=p.chunk_k, chunks=p.chunks, programs=p.programs, ids=p.ids,
                               stride=p.stride, scale=e**-0.5, bs=bs, interpret=interpret)
    qb = rows_pad // BLOCK_Q
    # o of the real rows rounded up to 8 (TMA drops a block's rows past the array; Mosaic took 28 rows for no
    # store); m and l whole blocks: a 1-D TMA store past the rows spilled into the next chunk's (H100, jax 0.11.2);
    # the interpreter takes no block past an array's end
    o_rows = rows_pad if interpret else min(pl.cdiv(rows, 8) * 8, rows_pad)
    cp = attention_combine.chunks_pad(p.programs)
    o, m, l = plgpu.kernel(
        kernel,
        out_type=[
            jax.ShapeDtypeStruct((b, g, cp, o_rows, e), jnp.float32),
            jax.ShapeDtypeStruct((b, g, cp, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, g, cp, rows_pad), jnp.float32),
        ],
        grid=(qb, p.programs, g, b),
        grid_names=("q", "c", "g", "b"),
        kernel_name="paged_attention_mgpu",
        interpret=_interpret_params() if interpret else None,
    )(qr, pos, last, pt, k_pages, v_pages)
    return o, m, l, pos, p.chunk_k, p.programs


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(uninitialized_memory="zero")


reference = triton_attention.reference


def lowered_for_gpu(q_shape, pages_shape, table_width: int, block_sizes: BlockSizes | None = None) -> str:
    """The kernel and its combine lowered for CUDA (Mosaic GPU, Triton) as StableHLO text; no GPU needed. Raises
    what the lowering finds."""
    from jax import export

    sds = jax.ShapeDtypeStruct
    b, t = q_shape[:2]
    f = jax.jit(lambda *a: paged_attention(*a, block_sizes=block_sizes))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # the combine kernel
    exp = export.export(f, platforms=["cuda"], disabled_checks=[triton])(
        sds(q_shape, jnp.bfloat16), sds(pages_shape, jnp.bfloat16), sds(pages_shape, jnp.bfloat16),
        sds((b, table_width), jnp.int32), sds((b, t), jnp.int32))
    return exp.mlir_module()
