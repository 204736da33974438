"""Pallas GPU (Triton) row-invariant matmul for dense (bf16/f32) weights: lane-round rows of unquantized models.

Why: a cuBLAS GEMM picks its algorithm (tiles, split-K) from M, so a row's result can change with the number
of rows beside it; the reference path therefore runs fixed 64-row tiles in a loop, which on the GPU costs a
launch per tile and, for fewer than 64 rows, a padded tile computed twice (a loop XLA would otherwise inline).
Here the tiles are fixed by the weight's shape: each program takes `block_m` rows (masked past M) and a
`block_n` column block, and walks K in `block_k` steps in the same order whatever M is; an MMA output element
depends only on its own row and column, so rows are bit-identical alone or among others. One launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of `matmul`; block_n and block_k depend on the weight's shape only (row invariance)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def for_weight(cls, n: int, k: int) -> BlockSizes:
        """The largest of 64/32/16 dividing N (block_n) and of 128/64/32/16 dividing K (block_k)."""
        bn = next((b for b in (64, 32, 16) if n % b == 0), 16)
        bk = next((b for b in (128, 64, 32, 16) if k % b == 0), 16)
        return cls(block_n=bn, block_k=bk)


def supports(n: int, k: int) -> bool:
    """Shapes the kernel takes: K a multiple of 16; any N (`matmul` pads it to whole 16-column blocks)."""
    return n > 0 and k % 16 == 0


def _matmul_kernel(x_ref, w_ref, o_ref, *, m: int, steps: int):
    # x_ref [block_m, K]; w_ref [block_n, K]; o_ref [block_m, block_n]
    block_m, block_n = o_ref.shape
    block_k = w_ref.shape[1] // steps
    rows = (pl.program_id(0) * block_m + jnp.arange(block_m) < m)[:, None]  # [block_m, 1]

    def body(t, acc):
        x = plgpu.load(x_ref.at[:, pl.ds(t * block_k, block_k)], mask=rows, other=0)  # [bm, bk]
        w = w_ref[:, pl.ds(t * block_k, block_k)].astype(x.dtype)  # [bn, bk]
        return acc + lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((block_n, block_m), jnp.float32))  # [bn, bm]: W tile on the left
    plgpu.store(o_ref, acc.T.astype(o_ref.dtype), mask=rows)


def _check(x, w, bs: BlockSizes):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"want x [M, K] and w [N, K], got {x.shape=} {w.shape=}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{x.shape=} and {w.shape=} disagree on K")
    n, k = w.shape
    if n % bs.block_n or k % bs.block_k:
        raise ValueError(f"N={n} and K={k} must be multiples of block_n={bs.block_n} and block_k={bs.block_k}")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(bs, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of 2 >= 16")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def matmul(x: jax.Array, w: jax.Array, *, block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in x's dtype, f32 accumulation; row-invariant. An N short of 16-column
    blocks (the MoE shared expert's gate, N=1) is padded with zero rows and sliced off: still one launch."""
    n, k = w.shape[0], x.shape[-1]
    w = jnp.pad(w, ((0, -n % 16), (0, 0))) if n % 16 else w
    bs = block_sizes or BlockSizes.for_weight(w.shape[0], k)
    x2 = x.reshape(-1, k)
    _check(x2, w, bs)
    m = x2.shape[0]
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, m=m, steps=k // bs.block_k),
        grid=(pl.cdiv(m, bs.block_m), w.shape[0] // bs.block_n),
        in_specs=[pl.BlockSpec((bs.block_m, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((bs.block_n, k), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((bs.block_m, bs.block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, w.shape[0]), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="dense_matmul",
    )(x2, w)
    return out[:, :n].reshape(*x.shape[:-1], n)


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """Plain XLA: x @ w.T with f32 accumulation, in x's dtype."""
    y = lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
