"""Pallas Mosaic GPU 4-bit matmul over the pair layout with packed scales (Hopper): TMA-pipelined, one MMA chain.

``x [..., K] @ W.T`` for ``W`` in `quant.to_pair_layout`'s words ``[N, K/8]`` uint32 and
`quant.pack_scale_bias`'s scales ``[K/64, N]`` uint32; group size 64. What the Triton pair kernel
(`qmatmul.qmatmul_tiled`, unpack="pairs") could not do, measured on the H200 (docs/kernels_qmatmul.md, run 5):
- scales and biases are plain loads there, waiting a DRAM latency every tile; here they ride the same TMA
  pipeline as the weights and x (`plgpu.emit_pipeline`);
- each group's MMA starts from zero there, for its own fold, so every group waits for its MMA; here every
  weight is dequantized before the MMA (``q * s + b`` in bf16, one rounding, as MLX's own dequantize) and all
  MMAs of the K range chain into one accumulator, waited once a tile; no group sums of x are needed.
Layout: the pair layout's words: word ``c`` of a tile row holds, at bits ``4f`` and ``16 + 4f``, inputs ``2c`` and
``2c + 1`` of the tile's group ``f``. A row's 32 words are read into registers in `WORDS_LAYOUT` (lane l's register
j: word 4j + l, the pair the bf16 operand keeps in its register j), so a group's operand is
``((w >> 4f) & 0x000F000F) | 0x43004300``, two bf16 ``128 + q`` a word in place; minus 128 (exact), times the scale,
plus the bias. (A 16-bit unpack per weight lost: 13.6M against 11.2M instructions on the down projection, H200
dense27 decode 8.51 against 7.31-7.34 ms a step, docs/kernels_qmatmul.md run 7; deleted in issue 27.)
Grid: (column block, row block, K split); 64 outputs (the MMA's M) by M rows of x rounded up to 8, at most 64
(the MMA's N), a program: one weight read serves up to 64 rows. The dequantized group goes to the MMA from
registers, x from shared memory in K-major 128-byte rows (x itself, transposed by the MMA); rows of x past M are
TMA's zero fill (past 8 rows the wrapper pads to whole 8-row tiles). H200, 17408x5120, M=1: 23.3 us against 30.8
through shared memory and 31.6 for the Triton pair kernel (docs/kernels_qmatmul.md, run 6; the shared-memory
operand was deleted in issue 27).
Row invariance: the tile order, the split and the MMA shape come from the weight's shape; a row's products
are its own column of every MMA; split partials are summed outside in a fixed order, elementwise.
Out: the partials ``[split, M, N]`` f32, real rows only: the accumulator goes to shared memory transposed and TMA
drops a block's rows past M (writing ``[split, N, Mp]``, 8 columns for one row, lost: H200 dense27 decode 7.28
against 6.94-7.05 ms a step, run 8). `qmatmul_parts` hands them to a consumer that sums them (`ops.add_norm`).
GPU interpret mode (CPU tests) runs the same body except two register loads, which there are plain reads
(the interpreter has no layout-annotated load), the words' reinterpretation (a bitcast and reshape there), and the
register-operand MMA, which it computes with a dot into the output tile; `lowered_for_gpu` checks the Mosaic GPU
lowering (the real MMA) on any host; the GPU tests check the kernel against the reference and rows alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quant
from pallas_kernels.qmatmul import bf16_half

MAX_BLOCK_M = 64  # rows of x a program at most (one weight read serves them)
GROUP = 64  # inputs per group: a tile is 4 groups, 64 uint16 a row (128 bytes: one 128-byte swizzle)
TILE = 4 * GROUP
WORDS = TILE // 8  # uint32 words a row of a tile
# unpack "words": a tile row's 32 words in registers so that lane l's register j holds word 4j + l (inputs 8j + 2l
# and 8j + 2l + 1 of every group), the pair the bf16 MMA operand keeps in register j: a group is one shift and one
# AND-OR of each word, reinterpreted as two bf16 (`_pairs_as_bf16`), no cross-lane moves
WORDS_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((64, WORDS), (16, WORDS), (8, WORDS), (4,), (1,))),
                                  warp_dims=(-8,), lane_dims=(-4, -2), vector_dim=-1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of `qmatmul_pairs`: from the weight's shape, except block_m 0, which follows the rows."""

    block_n: int = 64  # outputs a program: the MMA's M
    block_m: int = 0  # rows of x a program (the MMA's N); 0: M rounded up to 8, at most `MAX_BLOCK_M`
    split_k: int = 1
    stages: int = 2  # tiles in flight in the TMA pipeline

    @classmethod
    def for_weight(cls, n: int, k: int, programs: int = 2176, max_split: int = 17, **kw) -> BlockSizes:
        """Smallest split of K's tiles (a divisor, at most `max_split`) giving >= `programs` programs.

        17 (H200, 2026-12-04): dense27's down projection (5120x17408: 68 tiles) splits 17 ways, 1360 programs,
        not 4 ways (320): 23.1 against 27.2 us, a decode step 0.25 ms shorter with the larger f32 partials.
        2176 programs (about 16 an SM; was 1056), measured with unpack "words": gate+up 34816x5120 splits 4, not 2 (33.7
        against 35.2 us), 17408x5120 10, not 4 (18.6 against 20.3); decode 7.30 against 7.37 ms, within noise."""
        tiles = k // TILE
        divisors = [s for s in range(1, min(tiles, max_split) + 1) if tiles % s == 0]
        split = next((s for s in divisors if (n // 64) * s >= programs), divisors[-1])
        return cls(split_k=split, **kw)

    @staticmethod
    def serves(n: int, k: int, group_size: int) -> bool:
        """Whether this kernel takes a weight [N, K] (else the caller uses the Triton kernel)."""
        return group_size == GROUP and n % 64 == 0 and k % TILE == 0


def _kernel(x_gmem, w_gmem, sb_gmem, o_gmem, o_smem, *, bs: BlockSizes, tiles: int, interpret: bool):
    # x_gmem [Mp, K] bf16 (rows padded to whole 8-row tiles past 8); w_gmem [N, K/8] uint32; sb_gmem [K/64, N] uint32;
    # o_gmem [split, M, N] f32; o_smem [block_m, block_n] f32, the accumulator transposed
    j, i, s = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k")
    bn, bm = bs.block_n, bs.block_m
    first = s * tiles

    def read(ref, layout):  # registers in the MMA operand's layout (a plain read in interpret mode)
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def rows(v):  # [bn] -> [bn, GROUP], one value a row
        return lax.broadcast_in_dim(v, (bn, GROUP), (0,))

    def body(_, x_smem, w_smem, sb_smem, acc):
        v = read(w_smem, WORDS_LAYOUT)  # uint32 [bn, 32]
        for f in range(4):
            # let group f - 2's MMA finish (group f - 1's may still run); waiting only at the tile's end measured the
            # same on the H200
            if f >= 2:
                plgpu.wgmma_wait(1)
            sb = read(sb_smem.at[f], plgpu.Layout.WGMMA.reduce(1))  # uint32 [bn]: scale low, bias high
            scale, bias = bf16_half(sb, 0), bf16_half(sb, 16)
            # two bf16 halves 128 + q of a word per shift and AND-OR, exact
            q = _pairs_as_bf16((v >> jnp.uint32(4 * f) if f else v) & jnp.uint32(0x000F000F) | jnp.uint32(0x43004300),
                               interpret)
            # q exactly, then one product and one sum in bf16 (folding -128 s into b loses q * s to rounding)
            a = (q - jnp.asarray(128, jnp.bfloat16)) * rows(scale) + rows(bias)
            xg = x_smem.at[:, pl.ds(f * GROUP, GROUP)]
            if interpret:  # the interpreter's MMA takes no register operand: the same product, into o_smem
                o_smem[...] += jnp.dot(a, xg[...].T, preferred_element_type=jnp.float32).T
            else:  # the MMA reads the group from registers: no shared-memory round trip
                plgpu.wgmma(acc, a, plgpu.transpose_ref(xg, (1, 0)))
        # the pipeline refills this step's buffers once the body returns (letting the MMAs run on into the next
        # step, x released a step late, measured slower on the H200: 24.9 against 23.7 us at 17408x5120)
        plgpu.wgmma_wait(0)
        return acc

    def scope(acc):
        if interpret:
            o_smem[...] = jnp.zeros_like(o_smem)
        plgpu.emit_pipeline(
            body,
            grid=(tiles,),
            in_specs=[
                # x [block_m, TILE] K-major, 128-byte rows: transposed, the MMA's right operand
                plgpu.BlockSpec((bm, TILE), lambda t: (i, first + t),
                                transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
                plgpu.BlockSpec((bn, WORDS), lambda t: (j, first + t),
                                transforms=(plgpu.TilingTransform((8, WORDS)), plgpu.SwizzleTransform(128))),
                plgpu.BlockSpec((4, bn), lambda t: (first + t, j)),
            ],
            max_concurrent_steps=bs.stages,
            init_carry=acc,
        )(x_gmem, w_gmem, sb_gmem)
        if not interpret:
            _store_transposed(acc[...], o_smem, interpret)
        plgpu.commit_smem()
        # TMA drops a block's rows past M
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, pl.ds(i * bm, bm), pl.ds(j * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.ACC((bn, bm), jnp.float32))


def _store_transposed(acc: jax.Array, ref, interpret: bool) -> None:
    """acc [bn, bm] f32 (the MMA accumulator's layout) into ref [bm, bn]: each thread's values, one at a time (a
    transposed ref takes no vector stores, and the layout's vectors are column pairs)."""
    if interpret:
        ref[...] = acc.T
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, value, smem):
        from jaxlib.mlir.dialects import memref

        value.foreach(lambda v, idx: memref.store(v, smem, [idx[1], idx[0]]))

    store(acc, ref)


def _pairs_as_bf16(q: jax.Array, interpret: bool) -> jax.Array:
    """uint32 [bn, 32] (`WORDS_LAYOUT`) -> bf16 [bn, 64] (the MMA operand's layout): each word as its two halves,
    low first. In registers a reinterpretation only: lane l's word register j is the operand's pair register j."""
    bn = q.shape[0]
    if interpret:  # the interpreter's arrays are plain: word c holds inputs 2c, 2c + 1
        return lax.bitcast_convert_type(q, jnp.bfloat16).reshape(bn, 2 * WORDS)

    @plgpu.inline_mgpu(arg_types=(WORDS_LAYOUT,),
                       return_type=plgpu.ShapeDtypeStruct((bn, 2 * WORDS), jnp.bfloat16, plgpu.Layout.WGMMA))
    def cast(_, words):
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import vector

        layout = plgpu.Layout.WGMMA.to_mgpu()
        shape = layout.registers_shape((bn, 2 * WORDS))  # [bn / 64, pair j, 1, 1, row half h, 1, 1, 1, 1]
        assert shape[1:] == (8, 1, 1, 2, 1, 1, 1, 1) and words.registers.shape[1:] == (1, 1, 1, 2, 1, 1, 8, 1, 1)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = np.empty(shape, dtype=object)
        for b, j, _, _, h, *_ in np.ndindex(shape):
            regs[b, j, 0, 0, h, 0, 0, 0, 0] = vector.bitcast(pair, words.registers[b, 0, 0, 0, h, 0, 0, j, 0, 0])
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return cast(q)


def _check(x, words, packed, group_size, bs: BlockSizes):
    if group_size != GROUP:
        raise ValueError(f"the Mosaic GPU pair kernel serves group_size={GROUP}, got {group_size}")
    k = x.shape[-1]
    if words.ndim != 2 or words.dtype != jnp.uint32 or words.shape[1] * 8 != k:
        raise ValueError(f"want pair-layout words uint32 [N, K/8] for K={k}, got {words.shape=} {words.dtype=}")
    n = words.shape[0]
    if packed.dtype != jnp.uint32 or packed.shape != (k // GROUP, n):
        raise ValueError(f"want packed scales uint32 {(k // GROUP, n)} (`quant.pack_scale_bias`), got "
                         f"{packed.shape=} {packed.dtype=}")
    if bs.block_m % 8 or bs.block_m > 256:
        raise ValueError(f"block_m={bs.block_m} must be a multiple of 8 (TMA's 8-row tiles) and at most 256")
    if n % bs.block_n or k % (TILE * bs.split_k):
        raise ValueError(f"N={n} must be a multiple of {bs.block_n} and K={k} of {TILE}*split {bs.split_k}")


@functools.partial(jax.jit, static_argnames=("group_size", "block_sizes", "interpret"))
def qmatmul_pairs(x: jax.Array, words: jax.Array, packed: jax.Array, *, group_size: int = GROUP,
                  block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """``x [..., K] @ W.T -> [..., N]`` in x's dtype (bf16 operands, f32 accumulation); row-invariant."""
    parts = qmatmul_parts(x, words, packed, group_size=group_size, block_sizes=block_sizes, interpret=interpret)
    out = parts[0]
    for p in range(1, parts.shape[0]):  # fixed order, elementwise: the same for every row
        out = out + parts[p]
    return out.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "block_sizes", "interpret"))
def qmatmul_parts(x: jax.Array, words: jax.Array, packed: jax.Array, *, group_size: int = GROUP,
                  block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """The K split's partial products ``[split, ..., N]`` f32, for a consumer that sums them in order (the residual
    step, `ops.add_norm`, sums them with its add in one fusion)."""
    k = x.shape[-1]
    n = words.shape[0]
    bs = block_sizes or BlockSizes.for_weight(n, k)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not bs.block_m:  # a row's bits do not depend on the MMA's N (H200, 8..64: `probe_qmatmul --block-m-check`)
        bs = dataclasses.replace(bs, block_m=min(MAX_BLOCK_M, pl.cdiv(m, 8) * 8))
    _check(x, words, packed, group_size, bs)
    mp = pl.cdiv(m, bs.block_m) * bs.block_m
    xp = x2.astype(jnp.bfloat16)
    if interpret:  # the interpreter takes no block past the array's end
        xp = jnp.pad(xp, ((0, mp - m), (0, 0)))
    elif m > 8 and m % 8:  # TMA reads an array of under 8 rows or of whole 8-row tiles; boxes past it read zeros
        xp = jnp.pad(xp, ((0, -m % 8), (0, 0)))
    tiles = k // TILE // bs.split_k
    call = plgpu.kernel(
        functools.partial(_kernel, bs=bs, tiles=tiles, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((bs.split_k, mp if interpret else m, n), jnp.float32),
        scratch_types=[plgpu.SMEM((bs.block_m, bs.block_n), jnp.float32)],
        grid=(n // bs.block_n, mp // bs.block_m, bs.split_k),
        grid_names=("n", "m", "k"),
        kernel_name="qmatmul_mgpu",
        interpret=_interpret_params() if interpret else None,
    )
    parts = call(xp, words, packed)[:, :m]  # [split, M, N]
    return parts.reshape(bs.split_k, *x.shape[:-1], n)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(uninitialized_memory="zero")  # a fresh accumulator reads as zeros, as on the GPU


def reference(x, words, packed, *, group_size: int = GROUP) -> jax.Array:
    """Plain XLA: back to MLX, dequantize, dot (f32 accumulation)."""
    scales, biases = quant.unpack_scale_bias(packed)
    w, s, b = quant.from_pair_layout(words, scales, biases, 4, group_size)
    return quant.qmatmul_reference(x, w, s, b, 4, group_size)


def lowered_for_gpu(n: int, k: int, m: int = 1, block_sizes: BlockSizes | None = None) -> str:
    """The kernel lowered for CUDA (Mosaic GPU) as StableHLO text; no GPU needed. Raises what the lowering finds."""
    from jax import export

    sds = jax.ShapeDtypeStruct
    f = jax.jit(lambda x, w, p: qmatmul_pairs(x, w, p, block_sizes=block_sizes))
    exp = export.export(f, platforms=["cuda"])(sds((m, k), jnp.bfloat16), sds((n, k // 8), jnp.uint32),
                                                sds((k // GROUP, n), jnp.uint32))
    return exp.mlir_module()
