"""Pallas GPU (Triton) copy: the bandwidth ceiling a memory-bound kernel can reach, beside XLA's and the driver's.

A program copies `rows` whole rows of a 2-D array. Its reference is the identity. `scripts/bench_roofline.py`
times it over a few block shapes and states every roofline against the best copy measured.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows a program copies (a power of two dividing the row count) and its warps."""

    rows: int = 8
    num_warps: int = 4


def reference(x: jax.Array) -> jax.Array:
    """The copy's reference: the same values."""
    return x


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def copy(x: jax.Array, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False) -> jax.Array:
    """A fresh buffer holding `x` [R, C] (R a multiple of `block_sizes.rows`, C a power of two)."""
    r, c = x.shape
    br = block_sizes.rows
    if r % br:
        raise ValueError(f"{r} rows are not a multiple of {br} rows a program")
    spec = pl.BlockSpec((br, c), lambda i: (i, 0))
    return pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(r // br,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps, num_stages=1),
        interpret=interpret,
    )(x)
