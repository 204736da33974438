"""Pallas GPU (Triton) routed experts on MLX affine 4/8-bit weights: ``sum_s w[n, s] * expert_{idx[n, s]}(x[n])``.

Shapes: ``x [N, D]``; ``idx``, ``weights`` ``[N, k]`` (row -> its k experts and their combine weights);
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


def _check(x, idx, weights, gate, up, down, bits, group_size, bs: BlockSizes):
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

    Returns (tile_expert [T] i32, -1 for unused tiles; pair_row [T * block_m] i32, the padded row's pair
    n * k + s or -1; row_of_pair [N * k] i32, the pair's padded row), with ``T = cdiv(P, bm) + min(P, E)``."""
    p = idx.size
    flat = idx.reshape(-1).astype(jnp.int32)
    tiles = pl.cdiv(p, block_m) + min(p, num_experts)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
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
    tile_expert = jnp.where(first < pad_end[-1], tile_expert, -1)
    return tile_expert, pair_row, row_of_pair


def pair_tiles(idx: jax.Array, block_m: int):
    """``placement``'s outputs with one tile a pair, its row first: T = N * k tiles, no sort."""
    p = idx.size
    slot = jnp.arange(p * block_m, dtype=jnp.int32)
    pair_row = jnp.where(slot % block_m == 0, slot // block_m, -1)
    return idx.reshape(-1).astype(jnp.int32), pair_row, jnp.arange(p, dtype=jnp.int32) * block_m


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_sizes", "interpret"))
def moe(x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple, down: tuple, *, bits: int = 4,
        group_size: int = 64, block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Routed experts: x [N, D], idx/weights [N, k], gate/up/down (weight, scales, biases) -> [N, D] in x.dtype."""
    d, i = x.shape[-1], gate[0].shape[1]
    bs = block_sizes or BlockSizes.for_shapes(d, i, group_size)
    _check(x, idx, weights, gate, up, down, bits, group_size, bs)
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
    return combine(jnp.take(y, row_of_pair, axis=0).reshape(n, k, d), x.dtype)


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
    element of a batched dot, so a row's result depends only on its own input and experts (for a fixed N)."""
    n, k = idx.shape
    flat = idx.reshape(-1)

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
    return combine(y.reshape(n, k, -1), x.dtype)
