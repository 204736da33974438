"""The Pallas DeltaNet conv of lane-round rows (`conv_silu_window`) equals its reference; lanes are independent of
the lanes beside them; channel blocks do not change a bit.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import causal_conv as cc
from tests.helpers import rel_err


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


@pytest.mark.parametrize("channels", [32, 64])  # 96 channels: 3 programs a row; not a multiple: one program
def test_window_channel_blocks_give_the_one_program_result(channels):
    tail, rows, w, count = _window_case(np.random.default_rng(4), 2, 3, 96)
    bs = cc.BlockSizes(channels=channels)
    assert bs.split(96) == ((3, 32) if channels == 32 else (1, 96))
    got = cc.conv_silu_window(tail, rows, w, count, block_sizes=bs, interpret=True)
    one = cc.conv_silu_window(tail, rows, w, count, block_sizes=cc.BlockSizes(channels=4096), interpret=True)
    for a, b in zip(got, one, strict=True):
        np.testing.assert_array_equal(a, b)


def test_window_lanes_are_bit_identical_alone_and_among_others():
    tail, rows, w, count = _window_case(np.random.default_rng(1), 3, 4, 96, jnp.bfloat16)
    out, new_tail = cc.conv_silu_window(tail, rows, w, count, interpret=True)
    for i in range(3):
        one, one_tail = cc.conv_silu_window(tail[i : i + 1], rows[i : i + 1], w, count[i : i + 1], interpret=True)
        np.testing.assert_array_equal(one[0], out[i])
        np.testing.assert_array_equal(one_tail[0], new_tail[i])


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
def test_gpu_window_matches_reference_slices_the_tail_and_lanes_are_independent(t):
    assert jax.default_backend() == "gpu"
    tail, rows, w, count = _window_case(np.random.default_rng(t), 2, t, 10240, jnp.bfloat16)
    out, new_tail = cc.conv_silu_window(tail, rows, w, count)
    want, want_tail = cc.window_reference(tail, rows, w, count)
    assert rel_err(out, want) < 1e-2
    np.testing.assert_array_equal(new_tail, want_tail)
    one, _ = cc.conv_silu_window(tail[1:], rows[1:], w, count[1:])
    np.testing.assert_array_equal(one[0], out[1])
