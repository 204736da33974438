"""Pallas GPU (Triton) matmul against MLX affine-quantized weights: ``x @ dequantize(W).T``.

Shapes: ``x [M, K]`` (bf16, or f32 for CPU tests), ``weight [N, K * bits // 32]`` uint32 packed as
in ``tfjax.quant``, ``scales``/``biases`` ``[N, K // group_size]``. Output ``[M, N]`` in ``x.dtype``.

Each program owns ``block_m`` rows of x, ``block_n`` output columns and one of ``split_k`` equal
slices of K. It walks its slice in ``block_k`` tiles: unpack the uint32 words (shift, mask),
dequantize in float32 (``scale * q + bias``), cast to ``x.dtype``, and accumulate the tile's dot in
float32. Split-K partials are added in a fixed order (0, 1, ..., split_k - 1) outside the kernel.

Row invariance (exact speculative decoding verifies k+1 rows and must match 1-row decode bit for
bit): the K tiles, their order and the split are chosen from the weight's shape alone
(``BlockSizes.for_weight``), ``block_m`` is fixed, and rows past M are masked loads of zeros, so
every row goes through the same instructions whatever M is and whatever the other rows hold.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tfjax import quant


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes; all but ``block_m`` must depend only on the weight's shape (row invariance)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # "reshape": unpack the tile to [block_n, block_k] and do one dot (measured on an H200);
    # "shift": one dot per bit field against x permuted outside the kernel, no in-kernel reshape of
    # the weight tile (passes interpret tests and lowers to Triton IR; not yet run on a GPU).
    unpack: str = "reshape"

    @classmethod
    def for_weight(cls, n: int, k: int, group_size: int = 64) -> BlockSizes:
        """Defaults from the weight's shape: enough programs (>= ~256) to keep an H200's 132 SMs fed."""
        block_n = next((b for b in (64, 32, 16) if n % b == 0), 64)
        block_k = next((b for b in (256, 128, 64, 32) if k % b == 0 and b >= group_size), 256)
        tiles = k // block_k
        split_k = 1
        for s in (1, 2, 4, 8):
            if tiles % s == 0:
                split_k = s
                if (n // block_n) * s >= 256:
                    break
        return cls(block_n=block_n, block_k=block_k, split_k=split_k)


def _qmatmul_kernel(
    x_ref,  # [block_m, K]
    w_ref,  # [block_n, K * bits // 32] uint32
    s_ref,  # [block_n, K // group_size]
    b_ref,  # [block_n, K // group_size]
    o_ref,  # [block_m, block_n]
    *,
    m: int,
    bits: int,
    group_size: int,
    block_k: int,
    tiles_per_split: int,
    unpack: str,
):
    block_m = x_ref.shape[0]
    block_n = w_ref.shape[0]
    per_word = 32 // bits
    words = block_k // per_word  # uint32 words per K tile
    groups = block_k // group_size  # scale groups per K tile
    row_mask = (pl.program_id(0) * block_m + jnp.arange(block_m) < m)[:, None]  # [block_m, 1]
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)  # [per_word]
    first = pl.program_id(2) * tiles_per_split

    def body_shift(t, acc):
        # x_ref holds x permuted per K tile to [bit field j, word i] (see `_permute_x`), so field j
        # of every word in the tile meets the contiguous slice x[:, j * words : (j + 1) * words].
        kt = first + t
        packed = w_ref[:, pl.ds(kt * words, words)]  # [bn, words] uint32
        s = s_ref[:, pl.ds(kt * groups, groups)].astype(jnp.float32)  # [bn, groups]
        b = b_ref[:, pl.ds(kt * groups, groups)].astype(jnp.float32)
        per_group = group_size // per_word  # words sharing one scale
        s = jnp.broadcast_to(s[:, :, None], (block_n, groups, per_group)).reshape(block_n, words)
        b = jnp.broadcast_to(b[:, :, None], (block_n, groups, per_group)).reshape(block_n, words)
        for j in range(per_word):
            x = plgpu.load(x_ref.at[:, pl.ds(kt * block_k + j * words, words)], mask=row_mask, other=0)  # [bm, words]
            q = (packed >> jnp.uint32(bits * j)) & jnp.uint32((1 << bits) - 1)
            w = (q.astype(jnp.int32).astype(jnp.float32) * s + b).astype(x.dtype)  # [bn, words]
            acc += lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    def body_reshape(t, acc):
        kt = first + t
        x = plgpu.load(x_ref.at[:, pl.ds(kt * block_k, block_k)], mask=row_mask, other=0)  # [bm, bk]
        packed = w_ref[:, pl.ds(kt * words, words)]  # [bn, words] uint32
        q = (packed[:, :, None] >> shifts[None, None, :]) & jnp.uint32((1 << bits) - 1)
        q = q.astype(jnp.int32).astype(jnp.float32).reshape(block_n, groups, group_size)
        s = s_ref[:, pl.ds(kt * groups, groups)].astype(jnp.float32)  # [bn, groups]
        b = b_ref[:, pl.ds(kt * groups, groups)].astype(jnp.float32)
        w = (q * s[:, :, None] + b[:, :, None]).astype(x.dtype).reshape(block_n, block_k)
        dot = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + dot  # [bm, bn]

    body = body_shift if unpack == "shift" else body_reshape
    acc = lax.fori_loop(0, tiles_per_split, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=row_mask)


def _permute_x(x, block_k, per_word):
    """Within each K tile, reorder x from [word i, field j] to [field j, word i]."""
    m, k = x.shape
    x = x.reshape(m, k // block_k, block_k // per_word, per_word)
    return x.swapaxes(2, 3).reshape(m, k)


def _check_shapes(x, weight, scales, biases, bits, group_size, bs: BlockSizes):
    if bits not in quant.BITS:
        raise ValueError(f"{bits=} is not supported; use one of {quant.BITS}")
    if group_size not in quant.GROUP_SIZES:
        raise ValueError(f"{group_size=} is not supported; use one of {quant.GROUP_SIZES}")
    if x.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"want x [M, K] and weight [N, K*bits/32], got {x.shape=} {weight.shape=}")
    m, k = x.shape
    n, kw = weight.shape
    if weight.dtype != jnp.uint32:
        raise ValueError(f"weight must be uint32, got {weight.dtype=}")
    if kw * 32 // bits != k:
        raise ValueError(f"{x.shape=} has K={k} but {weight.shape=} unpacks to K={kw * 32 // bits}")
    want = (n, k // group_size)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{scales.shape=} and {biases.shape=} must both be {want}")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if bs.unpack not in ("shift", "reshape"):
        raise ValueError(f"unpack={bs.unpack!r} must be 'shift' or 'reshape'")
    if bs.unpack == "shift" and bs.block_k // (32 // bits) < 16:
        raise ValueError(f"block_k={bs.block_k} gives fewer than 16 words per tile for {bits=}")
    if n % bs.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={bs.block_n}")
    if bs.block_k % group_size or bs.block_k < group_size:
        raise ValueError(f"block_k={bs.block_k} must be a multiple of {group_size=}")
    if k % (bs.block_k * bs.split_k):
        raise ValueError(f"K={k} must be a multiple of block_k*split_k={bs.block_k}*{bs.split_k}")


def _split_output(m: int, n: int, dtype, bs) -> tuple:
    """(out_shape, out_spec): [M, N] in `dtype`, or one f32 partial per K split [split, M, N]."""
    if bs.split_k == 1:
        return jax.ShapeDtypeStruct((m, n), dtype), pl.BlockSpec((bs.block_m, bs.block_n), lambda i, j, s: (i, j))
    return (jax.ShapeDtypeStruct((bs.split_k, m, n), jnp.float32),
            pl.BlockSpec((None, bs.block_m, bs.block_n), lambda i, j, s: (s, i, j)))


def _sum_splits(out: jax.Array, split: int, dtype) -> jax.Array:
    """The K splits' partials summed in a fixed order (elementwise: identical for every row and every M)."""
    if split == 1:
        return out
    acc = out[0]
    for s in range(1, split):
        acc = acc + out[s]
    return acc.astype(dtype)


def _qmatmul_call(x, weight, scales, biases, *, bits, group_size, bs: BlockSizes, interpret):
    m, k = x.shape
    n, kw = weight.shape
    split = bs.split_k
    tiles_per_split = k // bs.block_k // split
    grid = (pl.cdiv(m, bs.block_m), n // bs.block_n, split)  # rows fastest: prompts reuse a weight tile
    kernel = functools.partial(
        _qmatmul_kernel,
        m=m,
        bits=bits,
        group_size=group_size,
        block_k=bs.block_k,
        tiles_per_split=tiles_per_split,
        unpack=bs.unpack,
    )
    if bs.unpack == "shift":
        x = _permute_x(x, bs.block_k, 32 // bits)
    out_shape, out_spec = _split_output(m, n, x.dtype, bs)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bs.block_m, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((bs.block_n, kw), lambda i, j, s: (j, 0)),
            pl.BlockSpec((bs.block_n, k // group_size), lambda i, j, s: (j, 0)),
            pl.BlockSpec((bs.block_n, k // group_size), lambda i, j, s: (j, 0)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="qmatmul",
    )(x, weight, scales, biases)
    return _sum_splits(out, split, x.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_sizes", "interpret"))
def qmatmul(
    x: jax.Array,
    weight: jax.Array,
    scales: jax.Array,
    biases: jax.Array,
    *,
    bits: int = 4,
    group_size: int = 64,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [..., K] @ dequantize(weight).T -> [..., N]`` in ``x.dtype``; recompiles per shape/static arg."""
    n = weight.shape[0]
    k = x.shape[-1]
    bs = block_sizes or BlockSizes.for_weight(n, k, group_size)
    x2 = x.reshape(-1, k)
    _check_shapes(x2, weight, scales, biases, bits, group_size, bs)
    out = _qmatmul_call(x2, weight, scales, biases, bits=bits, group_size=group_size, bs=bs, interpret=interpret)
    return out.reshape(*x.shape[:-1], n)


def reference(x, weight, scales, biases, *, bits: int = 4, group_size: int = 64) -> jax.Array:
    """Plain XLA: dequantize, then dot with float32 accumulation."""
    return quant.qmatmul_reference(x, weight, scales, biases, bits, group_size)


# --- The kernel-layout version (weights repacked once by `quant.to_kernel_layout`) ---
# Per K tile of T = (32 // bits) * group_size inputs, bit field j of the tile's group_size words is
# group j of the tile, so the unpack is one shift and mask per field on a [block_n, group_size] word
# tile, with one scale and bias per output (a contiguous row of the transposed scales). With `fold`, the
# dot runs on the raw integers q (exact in bf16) and the group's affine map is applied to the [M, N]
# partial: sum_k x_k (s q_k + b) = s * dot(x, q) + b * sum_k x_k, which moves the per-weight multiply-add
# to a per-output one. Row invariance as above: tiles, fields and split come from the weight's shape.


@dataclasses.dataclass(frozen=True)
class TiledBlockSizes:
    """Tile sizes of `qmatmul_tiled`; all but ``block_m`` must depend only on the weight's shape."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True  # the weight tile as the MMA's left operand (out.T = W @ x.T): measured 1.4-1.6x faster
    fold: bool = True  # dot with raw q, then scale and add bias * sum(x) per group

    @classmethod
    def for_weight(cls, n: int, k: int, bits: int = 4, group_size: int = 64, programs: int = 264,
                   **kw) -> TiledBlockSizes:
        """Smallest split of K's tiles (a divisor) giving >= `programs` programs; from the shape alone."""
        want = kw.pop("block_n", 64)
        block_n = next((b for b in (want, 64, 32, 16) if n % b == 0), want)  # N=48 (DeltaNet a, b): 16
        tiles = k // quant.kernel_tile(bits, group_size)
        divisors = [s for s in range(1, tiles + 1) if tiles % s == 0]
        split = next((s for s in divisors if (n // block_n) * s >= programs), divisors[-1])
        split = min(split, max(d for d in divisors if d <= 8))  # more partials cost more than they feed
        return cls(block_n=block_n, split_k=split, **kw)


def _tiled_kernel(x_ref, w_ref, s_ref, b_ref, o_ref, *, m, bits, group_size, tiles_per_split, swap, fold):
    # x_ref [block_m, K]; w_ref [block_n, K * bits // 32] uint32; s_ref, b_ref [K // group_size, block_n]
    block_m = x_ref.shape[0]
    block_n = w_ref.shape[0]
    per_word = 32 // bits
    tile = per_word * group_size
    row_mask = (pl.program_id(0) * block_m + jnp.arange(block_m) < m)[:, None]  # [block_m, 1]
    first = pl.program_id(2) * tiles_per_split

    def body(t, acc):
        kt = first + t
        words = w_ref[:, pl.ds(kt * group_size, group_size)]  # [bn, g] uint32
        for j in range(per_word):
            x = plgpu.load(x_ref.at[:, pl.ds(kt * tile + j * group_size, group_size)], mask=row_mask, other=0)
            q = ((words >> jnp.uint32(bits * j)) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)  # [bn, g]
            s = s_ref[kt * per_word + j, :].astype(jnp.float32)  # [bn]
            b = b_ref[kt * per_word + j, :].astype(jnp.float32)
            if fold:
                w = q.astype(jnp.float32).astype(x.dtype)
            else:
                w = (q.astype(jnp.float32) * s[:, None] + b[:, None]).astype(x.dtype)
            if swap:  # [bn, bm]
                d = lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                if fold:
                    xs = jnp.sum(x.astype(jnp.float32), axis=1)  # [bm]
                    d = d * s[:, None] + b[:, None] * xs[None, :]
            else:  # [bm, bn]
                d = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                if fold:
                    xs = jnp.sum(x.astype(jnp.float32), axis=1)
                    d = d * s[None, :] + xs[:, None] * b[None, :]
            acc = acc + d
        return acc

    shape = (block_n, block_m) if swap else (block_m, block_n)
    acc = lax.fori_loop(0, tiles_per_split, body, jnp.zeros(shape, jnp.float32))
    if swap:
        acc = acc.T
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=row_mask)


def _check_tiled(x, weight, scales, biases, bits, group_size, bs: TiledBlockSizes):
    if bits not in quant.BITS or group_size not in quant.GROUP_SIZES:
        raise ValueError(f"{bits=} / {group_size=} not supported; use {quant.BITS} / {quant.GROUP_SIZES}")
    if x.ndim != 2 or weight.ndim != 2 or weight.dtype != jnp.uint32:
        raise ValueError(f"want x [M, K] and uint32 weight [N, K*bits/32], got {x.shape=} {weight.shape=} {weight.dtype=}")
    m, k = x.shape
    n, kw = weight.shape
    if kw * 32 // bits != k:
        raise ValueError(f"{x.shape=} has K={k} but {weight.shape=} unpacks to K={kw * 32 // bits}")
    want = (k // group_size, n)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{scales.shape=} and {biases.shape=} must both be {want} (kernel layout: transposed)")
    tile = quant.kernel_tile(bits, group_size)
    for name in ("block_m", "block_n"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if n % bs.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={bs.block_n}")
    if k % (tile * bs.split_k):
        raise ValueError(f"K={k} must be a multiple of tile*split_k={tile}*{bs.split_k}")


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_sizes", "interpret"))
def qmatmul_tiled(
    x: jax.Array,
    weight: jax.Array,
    scales: jax.Array,
    biases: jax.Array,
    *,
    bits: int = 4,
    group_size: int = 64,
    block_sizes: TiledBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [..., K] @ W.T -> [..., N]`` for W in `quant.to_kernel_layout`'s layout; row-invariant."""
    n = weight.shape[0]
    k = x.shape[-1]
    bs = block_sizes or TiledBlockSizes.for_weight(n, k, bits, group_size)
    x2 = x.reshape(-1, k)
    _check_tiled(x2, weight, scales, biases, bits, group_size, bs)
    m = x2.shape[0]
    split = bs.split_k
    tiles_per_split = k // quant.kernel_tile(bits, group_size) // split
    kernel = functools.partial(_tiled_kernel, m=m, bits=bits, group_size=group_size,
                               tiles_per_split=tiles_per_split, swap=bs.swap, fold=bs.fold)
    out_shape, out_spec = _split_output(m, n, x.dtype, bs)
    ng = k // group_size
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bs.block_m), n // bs.block_n, split),  # rows fastest: row blocks share a weight tile
        in_specs=[
            pl.BlockSpec((bs.block_m, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((bs.block_n, weight.shape[1]), lambda i, j, s: (j, 0)),
            pl.BlockSpec((ng, bs.block_n), lambda i, j, s: (0, j)),
            pl.BlockSpec((ng, bs.block_n), lambda i, j, s: (0, j)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="qmatmul_tiled",
    )(x2, weight, scales, biases)
    return _sum_splits(out, split, x.dtype).reshape(*x.shape[:-1], n)


def reference_tiled(x, weight, scales, biases, *, bits: int = 4, group_size: int = 64) -> jax.Array:
    """Plain XLA for the kernel layout: back to MLX, dequantize, dot (f32 accumulation)."""
    w, s, b = quant.from_kernel_layout(weight, scales, biases, bits, group_size)
    return quant.qmatmul_reference(x, w, s, b, bits, group_size)
