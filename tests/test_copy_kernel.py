"""The Pallas copy equals its reference on random data, in interpret mode (CPU) and compiled under `-m gpu`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import copy as cp


@pytest.mark.parametrize("rows,dtype", [(1, jnp.float32), (4, jnp.bfloat16)])
def test_interpret_copy_equals_its_input(rows, dtype):
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((8, 256)), dtype)
    got = cp.copy(x, cp.BlockSizes(rows=rows), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(cp.reference(x)))


def test_a_row_count_off_the_block_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of 4 rows"):
        cp.copy(jnp.ones((6, 128)), cp.BlockSizes(rows=4), interpret=True)


@pytest.mark.gpu
def test_gpu_copy_equals_its_input():
    x = jax.random.normal(jax.random.key(0), (4096, 1024), jnp.float32)
    np.testing.assert_array_equal(np.asarray(cp.copy(x, cp.BlockSizes(rows=16, num_warps=8))), np.asarray(x))
