"""The Pallas dense matmul equals its reference; a row's result never depends on the rows beside it.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import matmul as mm
from tests.helpers import rel_err, spy_interpreted


def _case(rng, m, n, k, dtype=jnp.float32):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) / k**0.5, dtype)
    return x, w


# M: one row, a ragged block (block_m + 1), several blocks; K = 576 (SmolLM2's hidden: 9 steps of 64)
@pytest.mark.parametrize("m", [1, 17, 40])
@pytest.mark.parametrize("n,k", [(64, 576), (192, 128), (1, 128), (40, 64)])  # N=1, 40: padded to 16-column blocks
def test_interpret_matches_reference(m, n, k):
    x, w = _case(np.random.default_rng(m + n), m, n, k)
    got = mm.matmul(x, w, interpret=True)
    assert got.shape == (m, n) and rel_err(got, mm.reference(x, w)) < 1e-5


def test_interpret_rows_are_bit_identical_alone_and_among_others():
    x, w = _case(np.random.default_rng(1), 37, 64, 256)
    together = mm.matmul(x, w, interpret=True)
    for i in (0, 16, 36):
        np.testing.assert_array_equal(mm.matmul(x[i : i + 1], w, interpret=True)[0], together[i])


def test_leading_axes_are_kept():
    x, w = _case(np.random.default_rng(2), 6, 32, 64)
    got = mm.matmul(x.reshape(2, 3, 64), w, interpret=True)
    assert got.shape == (2, 3, 32) and rel_err(got.reshape(6, 32), mm.reference(x, w)) < 1e-5


def test_bad_shapes_raise_naming_the_value():
    x, w = _case(np.random.default_rng(3), 4, 64, 64)
    with pytest.raises(ValueError, match="disagree on K"):
        mm.matmul(x[:, :32], w, interpret=True)
    with pytest.raises(ValueError, match="block_n=64"):
        mm.matmul(x, w[:48], block_sizes=mm.BlockSizes(), interpret=True)
    with pytest.raises(ValueError, match="block_m=24"):
        mm.matmul(x, w, block_sizes=mm.BlockSizes(block_m=24), interpret=True)


def test_dense_rows_take_the_kernel_only_with_kernels(monkeypatch):
    from tfjax import ops

    calls = spy_interpreted(monkeypatch, mm, "matmul", lambda args, kw: args[1].shape)
    x, w = _case(np.random.default_rng(4), 5, 64, 128)
    want = mm.reference(x, w)
    assert rel_err(ops.matmul(x, w, rows=True), want) < 1e-5 and calls == []
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    assert rel_err(ops.matmul(x, w, rows=False), want) < 1e-5 and calls == []
    assert rel_err(ops.matmul(x, w, rows=True), want) < 1e-5 and calls == [(64, 128)]


def test_lowers_to_triton_for_cuda_without_a_gpu():
    x = jax.ShapeDtypeStruct((8, 5120), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 5120), jnp.bfloat16)
    text = jax.jit(mm.matmul).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "dense_matmul" in text


# The same cases compiled on a GPU: `pytest -m gpu tests/test_dense_matmul_kernel.py` on the device.
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 128])
def test_gpu_matches_reference(m):
    assert jax.default_backend() == "gpu"
    x, w = _case(np.random.default_rng(m), m, 1536, 576, jnp.bfloat16)
    assert rel_err(mm.matmul(x, w), mm.reference(x, w)) < 1e-2


@pytest.mark.gpu
def test_gpu_rows_are_bit_identical_alone_and_among_others():
    assert jax.default_backend() == "gpu"
    x, w = _case(np.random.default_rng(5), 128, 576, 1536, jnp.bfloat16)
    together = mm.matmul(x, w)
    for i in (0, 17, 127):
        np.testing.assert_array_equal(mm.matmul(x[i : i + 1], w)[0], together[i])
