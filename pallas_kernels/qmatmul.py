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

from pallas_kernels import quant

_MAGIC = 0x4B000000  # float32 2^23: an integer below 2^23 OR-ed into its mantissa reads as 2^23 + integer


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


def supports(n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether `qmatmul` takes an MLX-layout weight [N, K] with its default tiles (N=1, the MoE shared-expert gate,
    does not: the reference serves it)."""
    if bits not in quant.BITS or group_size not in quant.GROUP_SIZES:
        return False
    bs = BlockSizes.for_weight(n, k, group_size)
    return n % bs.block_n == 0 and bs.block_k % group_size == 0 and k % (bs.block_k * bs.split_k) == 0


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
# tile, with one scale and bias per output (a contiguous row of the transposed scales). The dot runs on the
# raw integers q (exact in bf16) and the group's affine map is applied to the [M, N]
# partial: sum_k x_k (s q_k + b) = s * dot(x, q) + b * sum_k x_k, which moves the per-weight multiply-add
# to a per-output one (measured: dequantizing into the operand first was slower, docs/kernels_qmatmul.md). Row invariance as above: tiles, fields and split come from the weight's shape.


@dataclasses.dataclass(frozen=True)
class TiledBlockSizes:
    """Tile sizes of `qmatmul_tiled`; all but ``block_m`` must depend only on the weight's shape."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # How a field q becomes the MMA operand: "convert" (int -> f32 -> x.dtype; one I2F per weight, which sm_90
    # runs at a quarter of the ALU rate), "magic" (q OR-ed into 2^23's mantissa, minus 2^23: the same values
    # without I2F, bit-identical; experimental, untimed), "pairs" (q OR-ed into bf16 128's mantissa: 128 + q, exact,
    # two weights per shift-AND-OR of a word: needs `quant.to_pair_layout`'s weights; 4-bit).
    unpack: str = "convert"
    # each group's sum(x) computed before the kernel (`group_sums`: elementwise adds in a fixed order,
    # row-invariant) instead of by every program for every field (~a third of the pairs kernel's SASS)
    sums_outside: bool = False
    # most K splits `for_weight` picks (more partials cost an [M, N] f32 each)
    max_split: int = 8

    @classmethod
    def for_weight(cls, n: int, k: int, bits: int = 4, group_size: int = 64, programs: int = 264,
                   **kw) -> TiledBlockSizes:
        """Smallest split of K's tiles (a divisor) giving >= `programs` programs; from the shape alone."""
        want = kw.pop("block_n", 64)
        block_n = next((b for b in (want, 64, 32, 16) if n % b == 0), want)  # N=48 (DeltaNet a, b): 16
        tiles = k // tile_inputs(bits, group_size, kw.get("unpack", "convert"))
        divisors = [s for s in range(1, tiles + 1) if tiles % s == 0]
        split = next((s for s in divisors if (n // block_n) * s >= programs), divisors[-1])
        split = min(split, max(d for d in divisors if d <= kw.get("max_split", 8)))  # partials cost [M, N] f32 each
        return cls(block_n=block_n, split_k=split, **kw)

    @classmethod
    def for_layout(cls, n: int, k: int, bits: int, group_size: int, layout: str) -> TiledBlockSizes:
        """The dispatch's tiles for weights in `layout` ("kernel": `to_kernel_layout`, "pairs": `to_pair_layout`)."""
        if layout == "pairs":
            return cls.for_weight(n, k, bits, group_size, **PAIRS_POLICY)
        return cls.for_weight(n, k, bits, group_size)


# `for_weight` keywords of the pair layout's dispatch. With packed scales the kernel holds 85 registers, 5 programs
# an SM; >= 1056 programs (2 waves) beat 528 (1.03 waves: a tail of 16) on the H200 (docs/benchmarks.md, fourth run)
PAIRS_POLICY = dict(programs=1056, unpack="pairs", sums_outside=True)


def _bf16_offset_pairs(words, j, dtype):
    """Fields j and j + 4 of pair-layout `words [bn, w]` as bf16 ``128 + q`` interleaved: ``[bn, 2w]`` in K order.

    One shift, AND and OR per word make both halves; the two halves are the word's own 16-bit parts."""
    v = ((words >> jnp.uint32(4 * j)) & jnp.uint32(0x000F000F)) | jnp.uint32(0x43004300)
    lo = lax.bitcast_convert_type((v & jnp.uint32(0xFFFF)).astype(jnp.uint16), jnp.bfloat16)
    hi = lax.bitcast_convert_type((v >> jnp.uint32(16)).astype(jnp.uint16), jnp.bfloat16)
    return jnp.stack([lo, hi], axis=-1).reshape(words.shape[0], 2 * words.shape[1]).astype(dtype)


def bf16_half(words, shift):
    """The bf16 held in bits [shift, shift + 16) of uint32 `words` (a packed scale at 0, its bias at 16)."""
    return lax.bitcast_convert_type(((words >> jnp.uint32(shift)) & jnp.uint32(0xFFFF)).astype(jnp.uint16), jnp.bfloat16)


def tile_inputs(bits: int, group_size: int, unpack: str) -> int:
    """Inputs per K tile of the layout `unpack` reads (pairs: `quant.pair_tile`, else `quant.kernel_tile`)."""
    return quant.pair_tile(group_size) if unpack == "pairs" else quant.kernel_tile(bits, group_size)


def group_sums(x: jax.Array, group_size: int) -> jax.Array:
    """``[M, K] -> [M, K // group_size]`` f32 sums of each group, added left to right (elementwise: row-invariant)."""
    m, k = x.shape
    parts = x.astype(jnp.float32).reshape(m, k // group_size, group_size)
    acc = parts[..., 0]
    for i in range(1, group_size):
        acc = acc + parts[..., i]
    return acc


def _tiled_kernel(x_ref, *refs, m, bits, group_size, tiles_per_split, unpack="convert", sums_outside=False,
                  packed_scales=False):
    # x_ref [block_m, K]; (xs_ref [block_m, K // group_size] f32 with sums_outside); w_ref [block_n, K * bits // 32]
    # uint32; s_ref, b_ref [K // group_size, block_n] (with packed_scales one uint32 ref, `quant.pack_scale_bias`);
    # o_ref [block_m, block_n]
    refs = refs if sums_outside else (None, *refs)
    xs_ref, w_ref, s_ref, b_ref, o_ref = (*refs[:3], None, refs[3]) if packed_scales else refs
    block_m = x_ref.shape[0]
    block_n = s_ref.shape[1]
    tile = tile_inputs(bits, group_size, unpack)
    fields = tile // group_size  # groups per tile: one per field (a field pair with "pairs")
    words_per_tile = tile * bits // 32
    row_mask = (pl.program_id(0) * block_m + jnp.arange(block_m) < m)[:, None]  # [block_m, 1]
    first = pl.program_id(2) * tiles_per_split
    offset = unpack == "pairs"  # weights are 128 + q; the fold takes 128 * sum(x) off

    def weights(words, j, dtype):  # group j of the tile as the MMA operand [bn, g]: the raw integers q (or 128 + q)
        if unpack == "pairs":
            return _bf16_offset_pairs(words, j, dtype)
        q = (words >> jnp.uint32(bits * j)) & jnp.uint32((1 << bits) - 1)  # [bn, g]
        if unpack == "magic":
            q = lax.bitcast_convert_type(q | jnp.uint32(_MAGIC), jnp.float32) - jnp.float32(2.0**23)
        else:
            q = q.astype(jnp.int32).astype(jnp.float32)
        return q.astype(dtype)

    def group_vectors(kt):  # per field of tile kt: its scales and biases [bn] (and group sums [bm])
        out = []
        for j in range(fields):
            g = kt * fields + j
            xs = plgpu.load(xs_ref.at[:, g], mask=row_mask[:, 0], other=0) if sums_outside else None
            if packed_scales:  # one 32-bit load a column for both: half the loads, 15 fewer registers (still plain
                # loads: Triton's pipeliner moves only the weight and x tiles)
                sb = s_ref[g, :]
                out.append((bf16_half(sb, 0), bf16_half(sb, 16), xs))
            else:
                out.append((s_ref[g, :], b_ref[g, :], xs))
        return tuple(out)

    def body(t, acc):  # acc [bn, bm]: the weight tile is the MMA's left operand (out.T = W @ x.T, 1.4-1.6x faster)
        kt = first + t
        vectors = group_vectors(kt)
        words = w_ref[:, pl.ds(kt * words_per_tile, words_per_tile)]  # [bn, words] uint32
        for j in range(fields):
            x = plgpu.load(x_ref.at[:, pl.ds(kt * tile + j * group_size, group_size)], mask=row_mask, other=0)
            s, b, xs = vectors[j]
            s, b = s.astype(jnp.float32), b.astype(jnp.float32)  # [bn]
            d = lax.dot_general(weights(words, j, x.dtype), x, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [bn, bm]
            if not sums_outside:
                xs = jnp.sum(x.astype(jnp.float32), axis=1)  # [bm]
            if offset:  # s * (d - 128 xs) + b xs = s d + (b - 128 s) xs
                b = b - jnp.float32(128.0) * s
            acc = acc + d * s[:, None] + b[:, None] * xs[None, :]  # two FMAs per output: (acc + d s) + b xs
        return acc

    acc = lax.fori_loop(0, tiles_per_split, body, jnp.zeros((block_n, block_m), jnp.float32))
    plgpu.store(o_ref, acc.T.astype(o_ref.dtype), mask=row_mask)


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
    if biases is None:
        if tuple(scales.shape) != want or scales.dtype != jnp.uint32:
            raise ValueError(f"packed scales (biases=None) must be uint32 {want} (`quant.pack_scale_bias`), got "
                             f"{scales.shape=} {scales.dtype=}")
    elif tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{scales.shape=} and {biases.shape=} must both be {want} (kernel layout: transposed)")
    tile = tile_inputs(bits, group_size, bs.unpack)
    for name in ("block_m", "block_n"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")
    if n % bs.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={bs.block_n}")
    if k % (tile * bs.split_k):
        raise ValueError(f"K={k} must be a multiple of tile*split_k={tile}*{bs.split_k}")
    if bs.unpack not in ("convert", "magic", "pairs"):
        raise ValueError(f"unpack={bs.unpack!r} must be 'convert', 'magic' or 'pairs'")
    if bs.unpack == "pairs" and bits != 4:
        raise ValueError(f"unpack='pairs' needs bits=4 (128 + q exact in bf16), got {bits=}")


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
    """``x [..., K] @ W.T -> [..., N]`` for W in `quant.to_kernel_layout`'s or `to_pair_layout`'s layout; scales and
    biases apart, or packed into one uint32 `scales` (`quant.pack_scale_bias`, biases=None); row-invariant."""
    n = weight.shape[0]
    k = x.shape[-1]
    bs = block_sizes or TiledBlockSizes.for_weight(n, k, bits, group_size)
    x2 = x.reshape(-1, k)
    _check_tiled(x2, weight, scales, biases, bits, group_size, bs)
    m = x2.shape[0]
    split = bs.split_k
    tiles_per_split = k // tile_inputs(bits, group_size, bs.unpack) // split
    sums = bs.sums_outside
    packed = biases is None
    kernel = functools.partial(_tiled_kernel, m=m, bits=bits, group_size=group_size, tiles_per_split=tiles_per_split,
                               unpack=bs.unpack, sums_outside=sums, packed_scales=packed)
    out_shape, out_spec = _split_output(m, n, x.dtype, bs)
    ng = k // group_size
    rows_spec = [pl.BlockSpec((bs.block_m, k), lambda i, j, s: (i, 0))]
    args = [x2]
    if sums:
        rows_spec.append(pl.BlockSpec((bs.block_m, ng), lambda i, j, s: (i, 0)))
        args.append(group_sums(x2, group_size))
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bs.block_m), n // bs.block_n, split),  # rows fastest: row blocks share a weight tile
        in_specs=[
            *rows_spec,
            pl.BlockSpec((bs.block_n, weight.shape[1]), lambda i, j, s: (j, 0)),
            *[pl.BlockSpec((ng, bs.block_n), lambda i, j, s: (0, j))] * (1 if packed else 2),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="qmatmul_tiled",
    )(*args, weight, *([scales] if packed else [scales, biases]))
    return _sum_splits(out, split, x.dtype).reshape(*x.shape[:-1], n)


def reference_tiled(x, weight, scales, biases, *, bits: int = 4, group_size: int = 64) -> jax.Array:
    """Plain XLA for the kernel layout: back to MLX, dequantize, dot (f32 accumulation)."""
    w, s, b = quant.from_kernel_layout(weight, scales, biases, bits, group_size)
    return quant.qmatmul_reference(x, w, s, b, bits, group_size)
