"""The Pallas DeltaNet conv equals its reference; rows are independent of the rows beside them.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import causal_conv as cc
from tests.helpers import rel_err, spy_interpreted


def _case(rng, m, k, c, dtype=jnp.float32):
    taps = jnp.asarray(rng.standard_normal((m, k, c)), dtype)
    w = jnp.asarray(rng.standard_normal((c, k)) * 0.5, dtype)
    return taps, w


# C: a power of two, the tiny model's 96 (64 + 32) and 2048 + 96 (a full piece then a ragged tail)
@pytest.mark.parametrize("m,c", [(1, 64), (5, 96), (2, 2144)])
def test_interpret_matches_reference(m, c):
    taps, w = _case(np.random.default_rng(c), m, 4, c)
    got = cc.conv_silu(taps, w, interpret=True)
    assert got.shape == (m, c) and rel_err(got, cc.reference(taps, w)) < 1e-6


@pytest.mark.parametrize("channels", [32, 64])  # 96 channels: 3 programs a row; not a multiple: one program
def test_interpret_channel_blocks_give_the_one_program_result(channels):
    taps, w = _case(np.random.default_rng(4), 3, 4, 96)
    bs = cc.BlockSizes(channels=channels)
    assert bs.split(96) == ((3, 32) if channels == 32 else (1, 96))
    np.testing.assert_array_equal(cc.conv_silu(taps, w, block_sizes=bs, interpret=True),
                                  cc.conv_silu(taps, w, block_sizes=cc.BlockSizes(channels=4096), interpret=True))


def test_interpret_rows_are_bit_identical_alone_and_among_others():
    taps, w = _case(np.random.default_rng(1), 6, 4, 96, jnp.bfloat16)
    together = cc.conv_silu(taps, w, interpret=True)
    for i in range(6):
        np.testing.assert_array_equal(cc.conv_silu(taps[i : i + 1], w, interpret=True)[0], together[i])


def test_bad_shapes_raise_naming_the_value():
    taps, w = _case(np.random.default_rng(2), 2, 4, 64)
    with pytest.raises(ValueError, match="weight.shape"):
        cc.conv_silu(taps, w[:, :3], interpret=True)


def test_model_rows_take_the_kernel_only_with_kernels(monkeypatch):
    """A DeltaNet layer's conv goes to the kernel for lane-round rows with kernels on, else the tile loop."""
    from tfjax import geometry, models, ops
    from tfjax.models.qwen3_5 import GatedDeltaNet

    calls = spy_interpreted(monkeypatch, cc, "conv_silu", lambda args, kw: args[0].shape)
    model = models.build(geometry.tiny_dense, seed=1)
    layer = next(m for _, m in models.nnx.iter_modules(model) if isinstance(m, GatedDeltaNet))
    window = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3 + 5, geometry.tiny_dense.linear_conv_dim)),
                         jnp.float32)
    want = layer.conv(window, 5, rows=True)
    assert calls == []
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    got = layer.conv(window, 5, rows=True)
    assert calls == [(10, 4, geometry.tiny_dense.linear_conv_dim)] and rel_err(got, want) < 1e-6


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """The compiled path's Pallas -> Triton lowering at dense27's conv width (10240 channels, 4 taps)."""
    taps = jax.ShapeDtypeStruct((8, 4, 10240), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((10240, 4), jnp.bfloat16)
    text = jax.jit(cc.conv_silu).trace(taps, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "causal_conv_silu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 40])
def test_gpu_matches_reference_and_rows_are_independent(m):
    assert jax.default_backend() == "gpu"
    taps, w = _case(np.random.default_rng(m), m, 4, 10240, jnp.bfloat16)
    got = cc.conv_silu(taps, w)
    assert rel_err(got, cc.reference(taps, w)) < 1e-2
    np.testing.assert_array_equal(cc.conv_silu(taps[m - 1 :], w)[0], got[m - 1])


def _window_case(rng, b, t, c, dtype=jnp.float32):
    tail = jnp.asarray(rng.standard_normal((b, 3, c)), dtype)
    rows = jnp.asarray(rng.standard_normal((b, t, c)), dtype)
    w = jnp.asarray(rng.standard_normal((c, 4)) * 0.5, dtype)
    count = jnp.asarray(rng.integers(0, t + 1, (b,)), jnp.int32)
    return tail, rows, w, count


# one row (decode), a verify block of 5 with counts 0..T; channels: 96 (3 programs of 32), 2048 + 96 (one program)
@pytest.mark.parametrize("b,t,c,channels", [(1, 1, 96, 32), (3, 5, 96, 32), (2, 3, 2144, 512)])
def test_window_interpret_matches_stacked_taps_and_slices_the_next_tail(b, t, c, channels):
    tail, rows, w, count = _window_case(np.random.default_rng(t), b, t, c, jnp.bfloat16)
    out, new_tail = cc.conv_silu_window(tail, rows, w, count, block_sizes=cc.BlockSizes(channels=channels),
                                        interpret=True)
    want, want_tail = cc.window_reference(tail, rows, w, count)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(new_tail, want_tail)


def test_window_rows_are_bit_identical_to_the_stacked_kernel():
    """The window form gives the stacked-taps kernel's bits (same products, same order)."""
    tail, rows, w, count = _window_case(np.random.default_rng(8), 2, 4, 96)
    out, _ = cc.conv_silu_window(tail, rows, w, count, interpret=True)
    window = jnp.concatenate([tail, rows], axis=1)
    taps = jnp.stack([window[:, j : j + 4] for j in range(4)], axis=2).reshape(8, 4, 96)
    np.testing.assert_array_equal(out.reshape(8, 96), cc.conv_silu(taps, w, interpret=True))


def test_window_bad_shapes_raise_naming_the_value():
    tail, rows, w, count = _window_case(np.random.default_rng(2), 2, 3, 64)
    with pytest.raises(ValueError, match="tail.shape"):
        cc.conv_silu_window(tail[:, :2], rows, w, count, interpret=True)


def test_window_lowers_to_triton_for_cuda_without_a_gpu():
    sds = jax.ShapeDtypeStruct
    text = cc.conv_silu_window.trace(sds((1, 3, 10240), jnp.bfloat16), sds((1, 4, 10240),
                                     jnp.bfloat16), sds((10240, 4), jnp.bfloat16), sds((1,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "causal_conv_window" in text


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_window_equals_the_stacked_kernel_and_slices_the_tail(t):
    assert jax.default_backend() == "gpu"
    tail, rows, w, count = _window_case(np.random.default_rng(t), 2, t, 10240, jnp.bfloat16)
    out, new_tail = cc.conv_silu_window(tail, rows, w, count)
    window = jnp.concatenate([tail, rows], axis=1)
    taps = jnp.stack([window[:, j : j + t] for j in range(4)], axis=2).reshape(2 * t, 4, 10240)
    np.testing.assert_array_equal(out.reshape(2 * t, 10240), cc.conv_silu(taps, w))
    np.testing.assert_array_equal(new_tail, cc.window_reference(tail, rows, w, count)[1])
