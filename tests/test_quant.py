"""MLX affine quantization: packing layout, quantize/dequantize round trips, the plain matmul."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import quant


def _rng(seed):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits):
    q = _rng(bits).integers(0, 1 << bits, size=(3, 5, 64), dtype=np.uint32)
    packed = quant.pack(q, bits)
    assert packed.shape == (3, 5, 64 * bits // 32) and packed.dtype == np.uint32
    np.testing.assert_array_equal(quant.unpack(packed, bits), q)
    np.testing.assert_array_equal(np.asarray(quant.unpack(jnp.asarray(packed), bits)), q)
    np.testing.assert_array_equal(np.asarray(quant.pack(jnp.asarray(q), bits)), packed)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_puts_element_j_at_bits_j_times_b(bits):
    q = _rng(10 + bits).integers(0, 1 << bits, size=(2, 32), dtype=np.uint32)
    packed = quant.pack(q, bits)
    per_word = 32 // bits
    for r in range(2):
        for i in range(32 // per_word):
            want = sum(int(q[r, i * per_word + j]) << (bits * j) for j in range(per_word))
            assert int(packed[r, i]) == want


def _mlx_quantize_numpy(w, bits, group_size):
    """Element-by-element transcription of MLX's CPU `quantize` loop."""
    n_bins = np.float32((1 << bits) - 1)
    out, k = w.shape
    q = np.zeros((out, k), np.uint32)
    scales = np.zeros((out, k // group_size), np.float32)
    biases = np.zeros_like(scales)
    for r in range(out):
        for g in range(k // group_size):
            grp = w[r, g * group_size : (g + 1) * group_size].astype(np.float32)
            w_min, w_max = grp.min(), grp.max()
            mask = abs(w_min) > abs(w_max)
            scale = np.float32(max((w_max - w_min) / n_bins, np.float32(1e-7)))
            scale = scale if mask else -scale
            edge = w_min if mask else w_max
            q0 = np.rint(edge / scale)
            bias = np.float32(0)
            if q0 != 0:
                scale = np.float32(edge / q0)
                bias = edge
            for j, v in enumerate(grp):
                q[r, g * group_size + j] = min(max(np.rint((v - bias) / scale), 0), n_bins)
            scales[r, g], biases[r, g] = scale, bias
    return q, scales, biases


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 128)])
def test_quantize_matches_mlx_rule_element_by_element(bits, group_size):
    w = _rng(bits * group_size).standard_normal((4, 2 * group_size)).astype(np.float32)
    weight, scales, biases = quant.quantize(w, bits, group_size)
    q, s, b = _mlx_quantize_numpy(w, bits, group_size)
    np.testing.assert_array_equal(quant.unpack(weight, bits), q)
    np.testing.assert_array_equal(scales, s)
    np.testing.assert_array_equal(biases, b)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantized_weights_within_half_a_step(bits, group_size):
    w = jnp.asarray(_rng(bits + group_size).standard_normal((8, 256)), jnp.float32)
    weight, scales, biases = quant.quantize(w, bits, group_size)
    assert weight.shape == (8, 256 * bits // 32) and scales.shape == (8, 256 // group_size)
    w_hat = quant.dequantize(weight, scales, biases, bits, group_size)
    err = jnp.abs(w_hat - w)
    step = jnp.repeat(jnp.abs(scales), group_size, axis=-1)
    q = quant.unpack(weight, bits)
    # MLX snaps the larger-magnitude edge to an exact level, so the far edge may clip to the top
    # level: interior levels are within half a step, clipped ones within one step.
    interior = (q > 0) & (q < (1 << bits) - 1)
    assert bool(jnp.all(jnp.where(interior, err <= 0.5 * step * (1 + 1e-5) + 1e-7, True)))
    assert bool(jnp.all(err <= step * (1 + 1e-5) + 1e-7))


def test_dequantize_equals_hand_written_numpy():
    bits, group_size = 4, 32
    rng = _rng(7)
    weight = rng.integers(0, 2**32, size=(3, 8), dtype=np.uint32)  # 3 rows x 64 inputs
    scales = rng.standard_normal((3, 2)).astype(np.float32)
    biases = rng.standard_normal((3, 2)).astype(np.float32)
    want = np.zeros((3, 64), np.float32)
    for r in range(3):
        for k in range(64):
            nibble = (int(weight[r, k // 8]) >> (4 * (k % 8))) & 0xF
            want[r, k] = scales[r, k // group_size] * nibble + biases[r, k // group_size]
    got = quant.dequantize(weight, scales, biases, bits, group_size)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(quant.dequantize(*map(jnp.asarray, (weight, scales, biases)), bits, group_size)),
        want,
        rtol=1e-6,
        atol=1e-6,
    )


def test_leading_expert_dim_quantizes_each_expert_alone():
    w = jnp.asarray(_rng(3).standard_normal((3, 16, 128)), jnp.bfloat16)
    weight, scales, biases = quant.quantize(w, 4, 64)
    assert weight.shape == (3, 16, 16) and scales.shape == (3, 16, 2) and scales.dtype == jnp.bfloat16
    for e in range(3):
        we, se, be = quant.quantize(w[e], 4, 64)
        np.testing.assert_array_equal(np.asarray(weight[e]), np.asarray(we))
        np.testing.assert_array_equal(np.asarray(scales[e]), np.asarray(se))
    w_hat = quant.dequantize(weight, scales, biases, 4, 64)
    assert w_hat.shape == w.shape and w_hat.dtype == jnp.bfloat16


def test_qmatmul_reference_is_x_times_dequantized_transpose():
    rng = _rng(11)
    w = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    weight, scales, biases = quant.quantize(w, 4, 32)
    y = quant.qmatmul_reference(x, weight, scales, biases, 4, 32)
    w_hat = quant.dequantize(weight, scales, biases, 4, 32)
    assert y.shape == (2, 3, 24) and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w_hat.T), rtol=1e-5, atol=1e-4)


def test_bad_bits_and_group_sizes_raise_naming_the_value():
    w = np.ones((4, 128), np.float32) * _rng(1).standard_normal((4, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="bits=3"):
        quant.quantize(w, bits=3)
    with pytest.raises(ValueError, match="group_size=48"):
        quant.quantize(w, group_size=48)
    with pytest.raises(ValueError, match="group_size=128"):
        quant.quantize(w[:, :96], group_size=128)
    with pytest.raises(ValueError, match="scales.shape"):
        weight, scales, biases = quant.quantize(w, 4, 64)
        quant.dequantize(weight, scales[:, :1], biases, 4, 64)
