"""Pallas GPU (Triton) routed experts on MLX affine 4/8-bit weights: ``sum_s w[n, s] * expert_{idx[n, s]}(x[n])``.

Shapes: ``x [N, D]``; ``idx``, ``weights`` ``[N, k]`` (row -> its k experts and their combine weights; an expert
id of -1 skips the pair: no program reads weights for it and its slot adds 0, so rows a lane round pads with cost
no expert bytes);
expert weights in the plain MLX layout, stacked: ``gate``/``up`` ``[E, I, D * bits // 32]`` uint32 with
scales/biases ``[E, I, D // group_size]``, ``down`` ``[E, D, I * bits // 32]`` with ``[E, D, I // group_size]``.
An expert is SwiGLU: ``down(silu(gate(x)) * up(x))``. Output ``[N, D]`` in ``x.dtype``.

Why the MLX layout: the expert stacks stay as the checkpoint ships them (no load-time repack of 3 x E matrices,
and the reference and the kernel read the same arrays); the unpack is the measured "reshape" unpack of
`qmatmul.qmatmul`, and the kernel's cost is the expert bytes it reads, which no layout changes.

Placement (plain XLA, in `moe`): the N * k (row, slot) pairs are sorted by expert and each expert's pairs
padded to a multiple of ``block_m``, so a tile of ``block_m`` padded rows belongs to one expert; the tile
count is fixed by N * k and E (``cdiv(N * k, block_m) + min(N * k, E)``), tiles past the used ones skip.
Decode (up to ``BlockSizes.sort_above`` pairs, 16 rows at k=8): each pair gets a tile of its own, unsorted, so
each (row, slot) program reads only its expert's weight tiles and the placement costs no sort. Prompts: the same
kernel is a grouped GEMM over the pairs sorted by expert.

Fused: kernel 1 does gate and up of a tile together (x read once) and writes ``silu(gate) * up``;
kernel 2 does the down projection and multiplies each padded row by its pair's combine weight. The sum over a
row's k slots is an elementwise XLA add in slot order 0..k-1 (in-kernel it would take atomics, whose order
is not fixed, or one program per row, which loses the grouping of prompts).

Row invariance (exact speculative decoding verifies k+1 rows and must match 1-row decode bit for bit): a
padded row goes through the same instructions wherever it lands: K tiles, their order and ``block_k`` are
fixed by the weight's shape (``BlockSizes.for_shapes``), the dot's rows are independent, padding rows are
zeros, and the slot sum's order is fixed. Sorting (or not) moves a row between tiles and places in a tile, never
changes its arithmetic; the choice depends on N * k alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
_MAGIC = 0x4B000000  # float32 2^23: an integer below 2^23 OR-ed into its mantissa reads as 2^23 + integer


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes; ``block_n``/``block_k`` depend only on the weights' shapes (row invariance)."""

    block_m: int = 16  # padded rows per tile (one expert's); Triton's dot needs >= 16
    block_n: int = 64  # output columns per program (of I in kernel 1, of D in kernel 2)
    block_k: int = 256  # inputs per K tile
    num_warps: int = 4
    num_stages: int = 2
    # Up to this many (row, slot) pairs, each pair gets a tile of its own (decode: no sort, no bincount, a few
    # launches fewer a layer); above, pairs are sorted into tiles by expert (prompts: a grouped GEMM).
    sort_above: int = 128

    @classmethod
    def for_shapes(cls, d: int, i: int, group_size: int = 64) -> BlockSizes:
        """Defaults from the expert shape (D, I) alone."""
        block_n = next((b for b in (64, 32, 16) if d % b == 0 and i % b == 0), 64)
        block_k = next((b for b in (256, 128, 64, 32) if d % b == 0 and i % b == 0 and b >= group_size), 256)
        return cls(block_n=block_n, block_k=block_k)


def _unpack_dequant(packed, s, b, bits, group_size, dtype):
    """[bn, words] uint32 + [bn, groups] scales/biases -> [bn, words * 32 // bits] in ``dtype`` (f32 math)."""
    bn, words = packed.shape
    per_word = 32 // bits
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    q = (packed[:, :, None] >> shifts[None, None, :]) & jnp.uint32((1 << bits) - 1)
    groups = words * per_word // group_size
    q = q.astype(jnp.int32).astype(jnp.float32).reshape(bn, groups, group_size)
    w = q * s.astype(jnp.float32)[:, :, None] + b.astype(jnp.float32)[:, :, None]
    return w.astype(dtype).reshape(bn, groups * group_size)


def _tile_dot(x_ref, w_ref, s_ref, b_ref, e, j, kt, *, bits, group_size, block_n, block_k):
    """One K tile of x [bm, bk] against expert e's rows [j * bn, (j + 1) * bn): [bm, bn] f32."""
    words, groups = block_k * bits // 32, block_k // group_size
    x = x_ref[:, pl.ds(kt * block_k, block_k)]
    rows = pl.ds(j * block_n, block_n)
    w = _unpack_dequant(w_ref[e, rows, pl.ds(kt * words, words)], s_ref[e, rows, pl.ds(kt * groups, groups)],
                        b_ref[e, rows, pl.ds(kt * groups, groups)], bits, group_size, x.dtype)
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _gate_up_kernel(tile_ref, x_ref, gw, gs, gb, uw, us, ub, h_ref, *, bits, group_size, block_k):
    # tile_ref [T] i32 (the tile's expert, -1 unused); x_ref [bm, D]; g*/u* whole [E, I, ...]; h_ref [bm, bn]
    e = tile_ref[pl.program_id(0)]
    j = pl.program_id(1)
    block_m, block_n = h_ref.shape
    kw = dict(bits=bits, group_size=group_size, block_n=block_n, block_k=block_k)

    @pl.when(e >= 0)
    def _():
        def body(kt, acc):
            g, u = acc
            return (g + _tile_dot(x_ref, gw, gs, gb, e, j, kt, **kw), u + _tile_dot(x_ref, uw, us, ub, e, j, kt, **kw))

        zero = jnp.zeros((block_m, block_n), jnp.float32)
        g, u = lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zero, zero))
        h_ref[...] = silu_mul(g, u, h_ref.dtype)


def silu_mul(g: jax.Array, u: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up from f32 sums, each rounded to ``dtype`` first; silu in f32 (Triton divides no bf16)."""
    g = g.astype(dtype).astype(jnp.float32)
    return (g / (1.0 + jnp.exp(-g))).astype(dtype) * u.astype(dtype)


def _down_kernel(tile_ref, h_ref, c_ref, dw, ds_, db, y_ref, *, bits, group_size, block_k, dtype):
    # h_ref [bm, I]; c_ref [bm] f32 combine weights (0 on padding rows); d* whole [E, D, ...]; y_ref [bm, bn] f32
    e = tile_ref[pl.program_id(0)]
    j = pl.program_id(1)
    block_m, block_n = y_ref.shape
    kw = dict(bits=bits, group_size=group_size, block_n=block_n, block_k=block_k)

    @pl.when(e >= 0)
    def _():
        body = lambda kt, acc: acc + _tile_dot(h_ref, dw, ds_, db, e, j, kt, **kw)
        acc = lax.fori_loop(0, h_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        y_ref[...] = acc.astype(dtype).astype(jnp.float32) * c_ref[...][:, None]


def _check(x, idx, weights, gate, up, down, bits, group_size):
    if bits not in BITS:
        raise ValueError(f"{bits=} is not supported; use one of {BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{group_size=} is not supported; use one of {GROUP_SIZES}")
    if x.ndim != 2:
        raise ValueError(f"want x [N, D], got {x.shape=}")
    n, d = x.shape
    if idx.ndim != 2 or idx.shape[0] != n or tuple(weights.shape) != tuple(idx.shape):
        raise ValueError(f"want idx and weights [N={n}, k], got {idx.shape=} {weights.shape=}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"idx must hold integer expert ids, got {idx.dtype=}")
    e, i = gate[0].shape[0], gate[0].shape[1]
    for name, (w, s, b), (out, inp) in (("gate", gate, (i, d)), ("up", up, (i, d)), ("down", down, (d, i))):
        if w.dtype != jnp.uint32:
            raise ValueError(f"{name} weight must be uint32, got {w.dtype=}")
        if tuple(w.shape) != (e, out, inp * bits // 32):
            raise ValueError(f"{name} weight {w.shape=} must be {(e, out, inp * bits // 32)} for {x.shape=}, {bits=}")
        want = (e, out, inp // group_size)
        if tuple(s.shape) != want or tuple(b.shape) != want:
            raise ValueError(f"{name} {s.shape=} and {b.shape=} must both be {want}")


def _check_tiles(d, i, group_size, bs: BlockSizes):
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    for name, v in (("D", d), ("I", i)):
        if v % bs.block_n or v % bs.block_k:
            raise ValueError(f"{name}={v} must be a multiple of block_n={bs.block_n} and block_k={bs.block_k}")
    if bs.block_k % group_size:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of {group_size=}")


def placement(idx: jax.Array, num_experts: int, block_m: int):
    """Pairs sorted by expert into tiles of ``block_m`` rows of one expert each.

    Returns (tile_expert [T] i32, -1 for unused tiles and those of skipped pairs; pair_row [T * block_m] i32, the
    padded row's pair n * k + s or -1; row_of_pair [N * k] i32, the pair's padded row), with
    ``T = cdiv(P, bm) + min(P, E + 1)``."""
    p = idx.size
    flat = idx.reshape(-1).astype(jnp.int32)
    flat = jnp.where(flat < 0, num_experts, flat)  # skipped pairs (-1): a bucket past the experts, whose tiles skip
    tiles = pl.cdiv(p, block_m) + min(p, num_experts + 1)
    counts = jnp.bincount(flat, length=num_experts + 1).astype(jnp.int32)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded)
    order = jnp.argsort(flat, stable=True)  # placement only: a pair's arithmetic does not depend on it
    ranked = flat[order]
    rank = jnp.arange(p, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[ranked]
    slot = (pad_end - padded)[ranked] + rank
    row_of_pair = jnp.zeros((p,), jnp.int32).at[order].set(slot)
    pair_row = jnp.full((tiles * block_m,), -1, jnp.int32).at[row_of_pair].set(jnp.arange(p, dtype=jnp.int32))
    first = jnp.arange(tiles, dtype=jnp.int32) * block_m
    tile_expert = jnp.searchsorted(pad_end, first, side="right").astype(jnp.int32)
    tile_expert = jnp.where((first < pad_end[-1]) & (tile_expert < num_experts), tile_expert, -1)
    return tile_expert, pair_row, row_of_pair


def pair_tiles(idx: jax.Array, block_m: int):
    """``placement``'s outputs with one tile a pair, its row first: T = N * k tiles, no sort."""
    p = idx.size
    slot = jnp.arange(p * block_m, dtype=jnp.int32)
    pair_row = jnp.where(slot % block_m == 0, slot // block_m, -1)
    return idx.reshape(-1).astype(jnp.int32), pair_row, jnp.arange(p, dtype=jnp.int32) * block_m


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_sizes", "rows", "slots", "interpret"))
def moe(x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple, down: tuple, *, bits: int = 4,
        group_size: int = 64, block_sizes: BlockSizes | RowsBlockSizes | None = None, rows: bool = False,
        slots: bool = False, interpret: bool = False) -> jax.Array:
    """Routed experts: x [N, D], idx/weights [N, k], gate/up/down (weight, scales, biases) -> [N, D] in x.dtype.

    ``rows`` (lane rounds: decode, verify): the K-split kernels of `RowsBlockSizes`; else the grouped GEMM.
    ``slots``: the weighted slot outputs [N, k, D] f32 instead, for the caller to `combine` (experts split over
    devices: each device computes the slots of its own experts)."""
    d, i = x.shape[-1], gate[0].shape[1]
    _check(x, idx, weights, gate, up, down, bits, group_size)
    if rows:
        bs = block_sizes or RowsBlockSizes.for_shapes(d, i, group_size, bits)
        if problem := rows_problem(d, i, bits, group_size, bs):
            raise ValueError(problem)
        y = _moe_rows(x, idx, weights, gate, up, down, bits=bits, group_size=group_size, bs=bs, interpret=interpret)
        return y if slots else combine(y, x.dtype)
    bs = block_sizes or BlockSizes.for_shapes(d, i, group_size)
    _check_tiles(d, i, group_size, bs)
    n, k = idx.shape
    e = gate[0].shape[0]
    if idx.size <= bs.sort_above:
        tile_expert, pair_row, row_of_pair = pair_tiles(idx, bs.block_m)
    else:
        tile_expert, pair_row, row_of_pair = placement(idx, e, bs.block_m)
    tiles, bm = tile_expert.shape[0], bs.block_m
    live = pair_row >= 0
    xs = jnp.where(live[:, None], jnp.take(x, jnp.maximum(pair_row, 0) // k, axis=0), 0).astype(x.dtype)
    comb = jnp.where(live, weights.reshape(-1).astype(jnp.float32)[jnp.maximum(pair_row, 0)], 0.0)
    whole = pl.no_block_spec
    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    kernel1 = functools.partial(_gate_up_kernel, bits=bits, group_size=group_size, block_k=bs.block_k)
    h = pl.pallas_call(
        kernel1,
        grid=(tiles, i // bs.block_n),
        in_specs=[whole, pl.BlockSpec((bm, d), lambda t, j: (t, 0))] + [whole] * 6,
        out_specs=pl.BlockSpec((bm, bs.block_n), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((tiles * bm, i), x.dtype),
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(tile_expert, xs, *gate, *up)
    kernel2 = functools.partial(_down_kernel, bits=bits, group_size=group_size, block_k=bs.block_k, dtype=x.dtype)
    y = pl.pallas_call(
        kernel2,
        grid=(tiles, d // bs.block_n),
        in_specs=[whole, pl.BlockSpec((bm, i), lambda t, j: (t, 0)), pl.BlockSpec((bm,), lambda t, j: (t,))]
        + [whole] * 3,
        out_specs=pl.BlockSpec((bm, bs.block_n), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((tiles * bm, d), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(tile_expert, h, comb, *down)
    y = skipped_zero(jnp.take(y, row_of_pair, axis=0).reshape(n, k, d), idx)
    return y if slots else combine(y, x.dtype)


# --- Lane-round rows (decode, verify): tiles of the chosen experts x column blocks x K slices --------------------------


@dataclasses.dataclass(frozen=True)
class RowsBlockSizes:
    """Tiles of the lane-round kernels (``moe(..., rows=True)``); all but ``sort_above`` depend on (D, I) alone."""

    block_m: int = 16  # pair rows per tile; Triton's dot needs >= 16
    block_n: int = 64  # output columns per program: the weight tile is the MMA's left operand (64 rows: wgmma's M)
    block_k: int = 256  # inputs per K tile: one dot of K = block_k * bits / 32 words per bit field
    split_gate_up: int = 4  # K slices of D in kernel 1 (f32 partials, summed in slot order 0..S-1 outside)
    split_down: int = 1  # K slices of I in kernel 2
    num_warps: int = 4
    num_stages: int = 3
    sort_above: int = 128  # pairs above which tiles group pairs by expert (each expert's bytes read once a tile)

    @classmethod
    def for_shapes(cls, d: int, i: int, group_size: int = 64, bits: int = 4, programs: int = 32,
                   **kw) -> RowsBlockSizes:
        """Smallest K split giving >= ``programs`` programs an expert (column blocks x slices), from the shape alone:
        at one row (k = 8) that is 8 * programs programs a kernel, 256 by default for the H100's 132 SMs."""
        block_n = kw.pop("block_n", 64)
        block_k = kw.pop("block_k", next((b for b in (256, 128, 512) if d % b == 0 and i % b == 0
                                          and b >= group_size and b * bits // 32 >= 16), 256))

        def split(n_out, k_in):
            tiles = max(k_in // block_k, 1)
            divisors = [s for s in range(1, tiles + 1) if tiles % s == 0]
            return next((s for s in divisors if (n_out // block_n) * s >= programs), divisors[-1])

        return cls(block_n=block_n, block_k=block_k, split_gate_up=split(i, d), split_down=split(d, i), **kw)


def fields_first(x: jax.Array, block_k: int, bits: int) -> jax.Array:
    """``[..., K]`` with each K tile's inputs in bit-field order: tile position ``f * W + w`` holds input
    ``(32 // bits) * w + f`` (W = block_k * bits // 32 words), the input that bit field f of word w multiplies."""
    per_word = 32 // bits
    lead, k = x.shape[:-1], x.shape[-1]
    return x.reshape(*lead, k // block_k, block_k // per_word, per_word).swapaxes(-1, -2).reshape(*lead, k)


def _rows_tile(acc, x, w_ref, s_ref, b_ref, e, j, kt, *, bits, group_size, block_n, block_k):
    """acc [bn, bm] f32 + expert e's rows [j * bn, (j + 1) * bn) over K tile kt against the tile's x rows.

    x(f) -> [bm, W]: the rows' inputs that field f of the tile's W words meets (x in `fields_first` order). No reshape
    of the weight tile: each bit field of the loaded words is one [bn, W] operand, dequantized with its word's group
    scale and bias (gathered per word: a group's words share them), one dot each, fields in order 0..per_word-1."""
    per_word, words = 32 // bits, block_k * bits // 32
    groups, words_per_group = block_k // group_size, group_size * bits // 32
    packed = w_ref[e, pl.ds(j * block_n, block_n), pl.ds(kt * words, words)]  # [bn, W] uint32
    r = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n, words), 0)
    c = kt * groups + lax.broadcasted_iota(jnp.int32, (block_n, words), 1) // words_per_group
    s, b = s_ref[e, r, c].astype(jnp.float32), b_ref[e, r, c].astype(jnp.float32)  # [bn, W]: each word's group
    for f in range(per_word):
        q = (packed >> jnp.uint32(bits * f)) & jnp.uint32((1 << bits) - 1)
        q = lax.bitcast_convert_type(q | jnp.uint32(_MAGIC), jnp.float32) - jnp.float32(2.0**23)  # exact, no I2F
        w = (q * s + b).astype(x(f).dtype)  # as `dequantize`: f32 affine, then the model dtype
        acc = acc + lax.dot_general(w, x(f), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc


def _store_pairs(out_ref, acc, pair, sl, j, block_n):
    """acc [bn, bm] f32 into out_ref[sl, pair, j-th column block] for the tile's live pairs; dead rows address the
    spare last row (masked off as well)."""
    block_m = pair.shape[0]
    out_r = jnp.where(pair >= 0, pair, out_ref.shape[1] - 1)[:, None] + jnp.zeros((block_m, block_n), jnp.int32)
    out_c = j * block_n + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 1)
    plgpu.store(out_ref.at[sl, out_r, out_c], acc.T, mask=(pair >= 0)[:, None])


def _rows_gate_up_kernel(pair_ref, tile_ref, x_ref, gw, gs, gb, uw, us, ub, g_ref, u_ref, *, k, bits, group_size,
                         block_n, block_k, tiles):
    # grid (T, I / bn, S); pair_ref [bm] i32 the tile's pairs (-1: none); x_ref [N, D] fields first; g*/u* whole
    # [E, I, ...]; g_ref/u_ref whole [S, P + 1, I] f32: slice s's partial sums of each pair's gate and up, and a spare
    # last row that masked-off rows address (no two stores of live rows ever meet)
    t, j, sl = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = tile_ref[t]
    pair = pair_ref[...]
    block_m = pair.shape[0]
    live = (pair >= 0)[:, None]
    kw = dict(bits=bits, group_size=group_size, block_n=block_n, block_k=block_k)

    @pl.when(e >= 0)
    def _():
        words = block_k * bits // 32
        rows = (jnp.maximum(pair, 0) // k)[:, None] + jnp.zeros((block_m, words), jnp.int32)
        cols = lax.broadcasted_iota(jnp.int32, (block_m, words), 1)

        def body(step, acc):
            kt = sl * tiles + step
            xs = [plgpu.load(x_ref.at[rows, kt * block_k + f * words + cols], mask=live, other=0)
                  for f in range(32 // bits)]  # loaded once for gate and up
            x = xs.__getitem__
            return (_rows_tile(acc[0], x, gw, gs, gb, e, j, kt, **kw), _rows_tile(acc[1], x, uw, us, ub, e, j, kt, **kw))

        zero = jnp.zeros((block_n, block_m), jnp.float32)
        g, u = lax.fori_loop(0, tiles, body, (zero, zero))
        _store_pairs(g_ref, g, pair, sl, j, block_n)
        _store_pairs(u_ref, u, pair, sl, j, block_n)


def _rows_down_kernel(pair_ref, tile_ref, h_ref, w_ref, dw, ds_, db, y_ref, *, bits, group_size, block_n, block_k,
                      tiles, weigh):
    # grid (T, D / bn, S); h_ref [P, I] fields first (a pair's silu(gate) * up); w_ref [P] f32 the pairs' routing
    # weights; y_ref whole [S, P + 1, D] f32. `weigh` (S = 1): the stored slot is the pair's output rounded to h's dtype
    # times its weight, so no XLA program holds that multiply beside `combine`'s sum (where it became an FMA in one
    # program and not in another: experts split over devices were an ulp off)
    t, j, sl = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = tile_ref[t]
    pair = pair_ref[...]
    block_m = pair.shape[0]
    live = (pair >= 0)[:, None]
    kw = dict(bits=bits, group_size=group_size, block_n=block_n, block_k=block_k)

    @pl.when(e >= 0)
    def _():
        words = block_k * bits // 32
        rows = jnp.maximum(pair, 0)[:, None] + jnp.zeros((block_m, words), jnp.int32)
        cols = lax.broadcasted_iota(jnp.int32, (block_m, words), 1)

        def body(step, acc):
            kt = sl * tiles + step
            x = lambda f: plgpu.load(h_ref.at[rows, kt * block_k + f * words + cols], mask=live, other=0)
            return _rows_tile(acc, x, dw, ds_, db, e, j, kt, **kw)

        acc = lax.fori_loop(0, tiles, body, jnp.zeros((block_n, block_m), jnp.float32))
        if weigh:
            w = plgpu.load(w_ref.at[jnp.maximum(pair, 0)], mask=pair >= 0, other=0)  # [bm]
            acc = acc.astype(h_ref.dtype).astype(jnp.float32) * w[None, :]
        _store_pairs(y_ref, acc, pair, sl, j, block_n)


def rows_problem(d: int, i: int, bits: int, group_size: int, bs: RowsBlockSizes) -> str | None:
    """Why the lane-round kernels cannot tile experts of shape (D, I) with ``bs``, or None when they can."""
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of 2 >= 16"
    if bs.block_k * bits // 32 < 16:
        return f"block_k={bs.block_k} gives {bs.block_k * bits // 32} words a tile at {bits=}; Triton's dot needs >= 16"
    if bs.block_k % group_size:
        return f"block_k={bs.block_k} must be a multiple of {group_size=}"
    for name, v, split in (("D", d, bs.split_gate_up), ("I", i, bs.split_down)):
        if v % bs.block_n or v % (bs.block_k * split):
            return f"{name}={v} must be a multiple of block_n={bs.block_n} and of block_k * split = {bs.block_k} * {split}"
    return None


def _sum_slices(p: jax.Array) -> jax.Array:
    """[S, ...] f32 partials summed in slice order 0..S-1 (elementwise: the same for every row)."""
    acc = p[0]
    for s in range(1, p.shape[0]):
        acc = acc + p[s]
    return acc


def _moe_rows(x, idx, weights, gate, up, down, *, bits, group_size, bs: RowsBlockSizes, interpret):
    """The lane-round kernels: grid (tiles, column blocks, K slices); pairs read and written through their index, so
    no padded copy of x or of any intermediate exists; every program reads only its tile's expert's weight tiles."""
    n, k = idx.shape
    d, i, e = x.shape[1], gate[0].shape[1], gate[0].shape[0]
    p = n * k
    if p <= bs.sort_above:
        tile_expert, pair_row, _ = pair_tiles(idx, bs.block_m)
    else:
        tile_expert, pair_row, _ = placement(idx, e, bs.block_m)
    tiles, bm, bn = tile_expert.shape[0], bs.block_m, bs.block_n
    s1, s2 = bs.split_gate_up, bs.split_down
    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    whole = pl.no_block_spec
    pairs = pl.BlockSpec((bm,), lambda t, j, s: (t,))
    kw = dict(bits=bits, group_size=group_size, block_n=bn, block_k=bs.block_k)
    partial = jax.ShapeDtypeStruct((s1, p + 1, i), jnp.float32)
    g, u = pl.pallas_call(
        functools.partial(_rows_gate_up_kernel, k=k, tiles=d // bs.block_k // s1, **kw),
        grid=(tiles, i // bn, s1),
        in_specs=[pairs, whole, whole] + [whole] * 6,
        out_specs=(whole, whole),
        out_shape=(partial, partial),
        compiler_params=params,
        interpret=interpret,
        name="moe_rows_gate_up",
    )(pair_row, tile_expert, fields_first(x, bs.block_k, bits), *gate, *up)
    h = fields_first(silu_mul(_sum_slices(g[:, :p]), _sum_slices(u[:, :p]), x.dtype), bs.block_k, bits)  # [P, I]
    w = weights.reshape(p).astype(jnp.float32)
    y = pl.pallas_call(
        functools.partial(_rows_down_kernel, tiles=i // bs.block_k // s2, weigh=s2 == 1, **kw),
        grid=(tiles, d // bn, s2),
        in_specs=[pairs, whole, whole, whole] + [whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((s2, p + 1, d), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="moe_rows_down",
    )(pair_row, tile_expert, h, w, *down)
    if s2 == 1:
        y = y[0, :p]  # weighted in the kernel
    else:  # K slices: summed, rounded and weighted here (experts split over devices are then not exact)
        y = _sum_slices(y[:, :p]).astype(x.dtype).astype(jnp.float32) * w[:, None]
    return skipped_zero(y.reshape(n, k, d), idx)  # the weighted slots; `moe` combines them


def skipped_zero(y: jax.Array, idx: jax.Array) -> jax.Array:
    """Slot outputs [N, k, D] with skipped pairs' (idx -1: no program wrote them) set to 0."""
    return jnp.where((idx >= 0)[..., None], y, 0.0)


def combine(y: jax.Array, dtype) -> jax.Array:
    """Weighted slot outputs [N, k, D] f32 summed in slot order 0..k-1 (elementwise: the same for every row)."""
    acc = y[:, 0]
    for s in range(1, y.shape[1]):
        acc = acc + y[:, s]
    return acc.astype(dtype)


def dequantize(weight, scales, biases, bits: int, group_size: int, dtype) -> jax.Array:
    """MLX affine ``[..., out, in * bits // 32]`` -> ``[..., out, in]`` in ``dtype`` (f32 math, as the kernel)."""
    per_word = 32 // bits
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    q = (weight[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    q = q.reshape(*scales.shape, group_size).astype(jnp.float32)
    w = q * scales.astype(jnp.float32)[..., None] + biases.astype(jnp.float32)[..., None]
    return w.reshape(*weight.shape[:-1], -1).astype(dtype)


def reference(x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple, down: tuple, *,
              bits: int | None = 4, group_size: int = 64) -> jax.Array:
    """Plain XLA, gathering only the chosen experts: each pair (n, s) dequantizes its own expert's weights.

    A dense stack is ``(weight [E, out, in],)`` (``bits`` then unused for it). Every pair's matmuls are one batch
    element of a batched dot, so a row's result depends only on its own input and experts (for a fixed N). A pair
    of expert -1 adds 0 (it is computed on expert 0 here and dropped: shapes are static)."""
    n, k = idx.shape
    flat = jnp.maximum(idx.reshape(-1), 0)

    def chosen(ws):  # the pairs' own experts: [P, out, in]
        if len(ws) == 1:  # a dense stack (a model may quantize only some projections)
            return jnp.take(ws[0], flat, axis=0).astype(x.dtype)
        w, s, b = (jnp.take(a, flat, axis=0) for a in ws)
        return dequantize(w, s, b, bits, group_size, x.dtype)

    def mm(h, ws):  # h [P, in] -> [P, out] f32 sums
        return jnp.einsum("pk,pok->po", h, chosen(ws), preferred_element_type=jnp.float32)

    xs = jnp.repeat(x, k, axis=0)  # [P, D], pair n * k + s
    h = silu_mul(mm(xs, gate), mm(xs, up), x.dtype)
    y = mm(h, down).astype(x.dtype).astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
    return combine(skipped_zero(y.reshape(n, k, -1), idx), x.dtype)
