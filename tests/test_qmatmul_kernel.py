"""The Pallas 4/8-bit matmul equals the XLA reference and is row-invariant.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qmatmul as qm
from tfjax import quant

SMALL = qm.BlockSizes(block_m=16, block_n=16, block_k=128, split_k=2, num_warps=4, num_stages=2)


def _weights(rng, n, k, bits, group_size, dtype):
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    weight, scales, biases = quant.quantize(w, bits, group_size)
    return weight, scales.astype(dtype), biases.astype(dtype)


def _rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return np.linalg.norm(y - r) / np.linalg.norm(r)


def _check_matches_reference(m, n, k, bits, group_size, dtype, block_sizes, interpret, seed):
    rng = np.random.default_rng(seed)
    weight, scales, biases = _weights(rng, n, k, bits, group_size, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    y = qm.qmatmul(
        x,
        weight,
        scales,
        biases,
        bits=bits,
        group_size=group_size,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    r = qm.reference(x, weight, scales, biases, bits=bits, group_size=group_size)
    assert y.shape == (m, n) and y.dtype == dtype
    assert np.isfinite(np.asarray(y, np.float32)).all()
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert _rel_err(y, r) < tol


def _check_rows_invariant(m_values, n, k, block_sizes, dtype, interpret, seed):
    rng = np.random.default_rng(seed)
    weight, scales, biases = _weights(rng, n, k, 4, 64, dtype)
    f = lambda x: qm.qmatmul(x, weight, scales, biases, block_sizes=block_sizes, interpret=interpret)
    x_all = jnp.asarray(rng.standard_normal((max(m_values), k)), dtype)
    alone = np.stack([np.asarray(f(x_all[i : i + 1]))[0] for i in range(max(m_values))])
    for m in m_values:
        others = jnp.asarray(rng.standard_normal((m, k)), dtype)  # fresh neighbours for each M
        for i in range(m):
            batch = np.asarray(f(others.at[i].set(x_all[i])))
            np.testing.assert_array_equal(batch[i], alone[i], err_msg=f"row {i} of M={m}")


@pytest.mark.parametrize(
    "m,bits,group_size",
    [(1, 4, 64), (17, 4, 32), (5, 4, 128), (16, 8, 64)],
)
def test_interpret_matches_reference(m, bits, group_size):
    _check_matches_reference(m, 32, 256, bits, group_size, jnp.float32, SMALL, True, seed=m + bits)


def test_interpret_shift_unpack_matches_reference():
    bs = dataclasses.replace(SMALL, unpack="shift")
    _check_matches_reference(17, 32, 256, 4, 64, jnp.float32, bs, True, seed=21)


def test_interpret_default_block_sizes_match_reference_in_bf16():
    _check_matches_reference(3, 64, 512, 4, 64, jnp.bfloat16, None, True, seed=5)


def test_interpret_rows_bit_identical_whatever_m_and_neighbours():
    _check_rows_invariant((3, 16), 32, 256, SMALL, jnp.float32, True, seed=9)


def test_leading_dims_of_x_are_flattened():
    rng = np.random.default_rng(4)
    weight, scales, biases = _weights(rng, 32, 256, 4, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    y = qm.qmatmul(x, weight, scales, biases, block_sizes=SMALL, interpret=True)
    assert y.shape == (2, 3, 32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(qm.reference(x, weight, scales, biases)), rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise_naming_the_value():
    rng = np.random.default_rng(6)
    weight, scales, biases = _weights(rng, 40, 256, 4, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    with pytest.raises(ValueError, match="N=40"):  # ragged N is refused, not silently dropped
        qm.qmatmul(x, weight, scales, biases, block_sizes=SMALL, interpret=True)
    weight, scales, biases = _weights(rng, 32, 256, 4, 64, jnp.float32)
    with pytest.raises(ValueError, match="K=128"):
        qm.qmatmul(x[:, :128], weight, scales, biases, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="bits=3"):
        qm.qmatmul(x, weight, scales, biases, bits=3, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="block_k=32"):
        bs = qm.BlockSizes(block_n=16, block_k=32)
        qm.qmatmul(x, weight, scales, biases, block_sizes=bs, interpret=True)


def test_block_sizes_depend_on_weight_shape_only():
    bs = qm.BlockSizes.for_weight(5120, 17408, 64)
    assert bs.block_k == 256 and (5120 // bs.block_n) * bs.split_k >= 256
    assert qm.BlockSizes.for_weight(17408, 5120, 64).split_k == 1


# The same cases compiled on a GPU: `pytest -m gpu tests/test_qmatmul_kernel.py` on the device.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,bits,group_size",
    [(1, 4, 64), (17, 4, 32), (5, 4, 128), (16, 8, 64), (129, 4, 64), (512, 4, 64)],
)
def test_gpu_matches_reference(m, bits, group_size):
    assert jax.default_backend() == "gpu"
    _check_matches_reference(m, 4096, 2048, bits, group_size, jnp.bfloat16, None, False, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("unpack", ["shift", "reshape"])
def test_gpu_small_blocks_match_reference(unpack):
    bs = dataclasses.replace(SMALL, unpack=unpack)
    _check_matches_reference(17, 32, 256, 4, 64, jnp.bfloat16, bs, False, seed=3)


@pytest.mark.gpu
def test_gpu_rows_bit_identical_whatever_m_and_neighbours():
    _check_rows_invariant((2, 5, 16, 33), 5120, 4096, None, jnp.bfloat16, False, seed=9)


# --- the kernel layout (`quant.to_kernel_layout`) and `qmatmul_tiled` ---
TILED = qm.TiledBlockSizes(block_n=16, split_k=2)


def _tiled(rng, n, k, bits, group_size, dtype):
    w, s, b = _weights(rng, n, k, bits, group_size, dtype)
    return (w, s, b), quant.to_kernel_layout(w, s, b, bits, group_size)


def test_kernel_layout_round_trips_and_dequantizes_the_same():
    rng = np.random.default_rng(1)
    (w, s, b), (wt, st, bt) = _tiled(rng, 32, 1024, 4, 64, jnp.float32)
    back = quant.from_kernel_layout(wt, st, bt, 4, 64)
    for x, y in zip(back, (w, s, b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(quant.dequantize_kernel_layout(wt, st, bt, 4, 64)),
                                  np.asarray(quant.dequantize(w, s, b, 4, 64)))


@pytest.mark.parametrize("m,bits,group_size", [(1, 4, 64), (17, 4, 32), (5, 4, 128), (3, 8, 64)])
def test_interpret_tiled_matches_reference(m, bits, group_size):
    rng = np.random.default_rng(m + bits)
    k = 2 * quant.kernel_tile(bits, group_size)
    mlx, tiled = _tiled(rng, 32, k, bits, group_size, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    y = qm.qmatmul_tiled(x, *tiled, bits=bits, group_size=group_size, block_sizes=TILED, interpret=True)
    r = qm.reference(x, *mlx, bits=bits, group_size=group_size)
    assert y.shape == (m, 32) and _rel_err(y, r) < 1e-5


@pytest.mark.parametrize("sums_outside", [True, False])
def test_interpret_tiled_magic_unpack_gives_the_same_bits(sums_outside):
    rng = np.random.default_rng(12)
    _, tiled = _tiled(rng, 32, 1024, 4, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.float32)
    bs = dataclasses.replace(TILED, sums_outside=sums_outside)
    a, b = (qm.qmatmul_tiled(x, *tiled, block_sizes=dataclasses.replace(bs, unpack=u), interpret=True)
            for u in ("convert", "magic"))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pairs_unpack_refuses_8_bit_weights():
    rng = np.random.default_rng(13)
    _, tiled = _tiled(rng, 32, 2 * quant.kernel_tile(8, 64), 8, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 2 * quant.kernel_tile(8, 64))), jnp.float32)
    with pytest.raises(ValueError, match="bits=4"):
        qm.qmatmul_tiled(x, *tiled, bits=8, block_sizes=dataclasses.replace(TILED, unpack="pairs"), interpret=True)


def test_interpret_tiled_rows_bit_identical_whatever_m_and_neighbours():
    rng = np.random.default_rng(2)
    _, tiled = _tiled(rng, 32, 1024, 4, 64, jnp.float32)
    f = lambda x: np.asarray(qm.qmatmul_tiled(x, *tiled, block_sizes=TILED, interpret=True))
    x = jnp.asarray(rng.standard_normal((17, 1024)), jnp.float32)
    alone = np.stack([f(x[i : i + 1])[0] for i in (0, 16)])
    batch = f(x)
    np.testing.assert_array_equal(batch[[0, 16]], alone)


def test_ops_kernel_layout_reference_path_equals_mlx_path():
    from tfjax import ops

    rng = np.random.default_rng(3)
    mlx, tiled = _tiled(rng, 48, 512, 4, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.float32)
    a = ops.qmatmul(x, *mlx, bits=4, group_size=64, rows=True)
    b = ops.qmatmul(x, *tiled, bits=4, group_size=64, rows=True, layout="kernel")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tiled_block_sizes_depend_on_weight_shape_only():
    bs = qm.TiledBlockSizes.for_weight(5120, 17408, 4, 64)
    assert (5120 // bs.block_n) * bs.split_k >= 160 and 34 % bs.split_k == 0
    assert qm.TiledBlockSizes.for_weight(17408, 5120, 4, 64).split_k == 1


def _assert_rows_alone_equal_rows_in_batches(f, x, ms, rng):
    """Each row of x computed alone equals, bit for bit, the same row inside batches of M with random neighbours."""
    rows, k = x.shape
    alone = np.stack([f(x[i : i + 1])[0] for i in range(rows)])
    for m in ms:
        others = jnp.asarray(rng.standard_normal((m, k)), x.dtype)
        for start in range(0, rows, m):
            idx = np.arange(start, min(start + m, rows))
            np.testing.assert_array_equal(f(others.at[: len(idx)].set(x[idx]))[: len(idx)], alone[idx], err_msg=f"{m=}")


# --- the pair layout (`quant.to_pair_layout`) and `qmatmul_tiled(unpack="pairs")` ---
PAIRS = dataclasses.replace(TILED, unpack="pairs", sums_outside=True)


def _pairs(rng, n, k, group_size, dtype):
    w, s, b = _weights(rng, n, k, 4, group_size, dtype)
    return (w, s, b), quant.to_pair_layout(w, s, b, 4, group_size)


def test_pair_layout_round_trips_and_puts_a_groups_neighbours_in_one_words_halves():
    rng = np.random.default_rng(21)
    (w, s, b), (pw, ps, pb) = _pairs(rng, 16, 512, 64, jnp.float32)
    for x, y in zip(quant.from_pair_layout(pw, ps, pb, 4, 64), (w, s, b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    q = np.asarray(quant.unpack(w, 4)).reshape(16, 2, 4, 32, 2)  # [n, tile, group j, word i, neighbour]
    fields = np.asarray(quant.unpack(pw, 4)).reshape(16, 2, 32, 2, 4)  # [n, tile, word i, half, j]
    np.testing.assert_array_equal(fields, q.transpose(0, 1, 3, 4, 2))
    with pytest.raises(ValueError, match="4-bit"):
        quant.to_pair_layout(quant.pack(np.zeros((4, 512), np.uint32), 8), ps[:, :4].T, pb[:, :4].T, 8, 64)


def test_bf16_offset_pairs_are_128_plus_q_in_k_order():
    q = np.random.default_rng(22).integers(0, 16, (4, 256), dtype=np.uint32)
    q[0, :2] = 0, 15  # both ends of the range
    pw, _, _ = quant.to_pair_layout(quant.pack(q, 4), np.ones((4, 4), np.float32), np.ones((4, 4), np.float32))
    for j in range(4):
        got = qm._bf16_offset_pairs(jnp.asarray(pw), j, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), 128.0 + q[:, j * 64 : (j + 1) * 64])


@pytest.mark.parametrize("m,group_size,dtype,sums_outside", [
    (1, 64, jnp.float32, True), (17, 32, jnp.float32, True), (5, 128, jnp.bfloat16, True), (3, 64, jnp.float32, False),
])  # fmt: skip
def test_interpret_tiled_pairs_match_reference(m, group_size, dtype, sums_outside):
    rng = np.random.default_rng(m + group_size)
    k = 2 * quant.pair_tile(group_size)
    mlx, pairs = _pairs(rng, 32, k, group_size, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    bs = dataclasses.replace(PAIRS, sums_outside=sums_outside)
    y = qm.qmatmul_tiled(x, *pairs, group_size=group_size, block_sizes=bs, interpret=True)
    r = qm.reference(x, *mlx, group_size=group_size)
    assert y.shape == (m, 32) and _rel_err(y, r) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_pack_scale_bias_round_trips_bf16_bits_and_refuses_f32():
    rng = np.random.default_rng(31)
    s, b = (jnp.asarray(rng.standard_normal((5, 8)), jnp.bfloat16) for _ in range(2))
    packed = quant.pack_scale_bias(s, b)
    assert packed.dtype == jnp.uint32
    for got, want in zip(quant.unpack_scale_bias(packed), (s, b), strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    with pytest.raises(ValueError, match="bf16"):
        quant.pack_scale_bias(s.astype(jnp.float32), b.astype(jnp.float32))


def test_interpret_tiled_pairs_packed_scales_give_the_same_bits():
    rng = np.random.default_rng(33)
    _, (w, s, b) = _pairs(rng, 64, 1024, 64, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.bfloat16)
    bs = dataclasses.replace(PAIRS, block_n=32, split_k=2)
    want = qm.qmatmul_tiled(x, w, s, b, block_sizes=bs, interpret=True)
    got = qm.qmatmul_tiled(x, w, quant.pack_scale_bias(s, b), None, block_sizes=bs, interpret=True)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    with pytest.raises(ValueError, match="packed scales"):
        qm.qmatmul_tiled(x, w, s, None, block_sizes=bs, interpret=True)


def test_interpret_tiled_pairs_rows_bit_identical_whatever_m_and_neighbours():
    rng = np.random.default_rng(23)
    _, pairs = _pairs(rng, 32, 1024, 64, jnp.float32)
    f = lambda x: np.asarray(qm.qmatmul_tiled(x, *pairs, block_sizes=PAIRS, interpret=True))
    x = jnp.asarray(rng.standard_normal((17, 1024)), jnp.float32)
    alone = np.stack([f(x[i : i + 1])[0] for i in (0, 16)])
    np.testing.assert_array_equal(f(x)[[0, 16]], alone)


def test_group_sums_of_a_row_do_not_depend_on_the_other_rows():
    rng = np.random.default_rng(24)
    x = jnp.asarray(rng.standard_normal((9, 256)), jnp.bfloat16)
    sums = np.asarray(qm.group_sums(x, 64))
    np.testing.assert_allclose(sums, np.asarray(x, np.float32).reshape(9, 4, 64).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(qm.group_sums(x[4:5], 64))[0], sums[4])


def test_ops_pair_layout_reference_path_equals_mlx_path_and_linears_take_it():
    from flax import nnx

    from tfjax import ops
    from tfjax.models.layers import Linear, use_kernel_layout

    rng = np.random.default_rng(25)
    mlx, pairs = _pairs(rng, 48, 512, 64, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.float32)
    a = ops.qmatmul(x, *mlx, bits=4, group_size=64, rows=True)
    b = ops.qmatmul(x, *pairs, bits=4, group_size=64, rows=True, layout="pairs")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lin = Linear(512, 48, quant=(4, 64), dtype=jnp.float32, rngs=nnx.Rngs(0))
    lin8 = Linear(512, 48, quant=(8, 64), dtype=jnp.float32, rngs=nnx.Rngs(0))
    before = lin(x)
    assert use_kernel_layout(lin) == 1 and lin.layout == "pairs"
    assert use_kernel_layout(lin8) == 1 and lin8.layout == "kernel"  # 8-bit: no pair layout
    np.testing.assert_array_equal(np.asarray(lin(x)), np.asarray(before))


def test_bf16_pair_linears_pack_their_scales_and_give_the_same_bits(monkeypatch):
    from flax import nnx

    from tfjax.models.layers import Linear, use_kernel_layout

    x = jnp.asarray(np.random.default_rng(26).standard_normal((3, 512)), jnp.bfloat16)
    lin = Linear(512, 48, quant=(4, 64), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lin.scales = nnx.Param(jnp.asarray(np.random.default_rng(27).uniform(0, 0.01, (48, 8)), jnp.bfloat16))
    before = lin(x)
    assert use_kernel_layout(lin) == 1
    np.testing.assert_array_equal(np.asarray(lin(x)).view(np.uint16), np.asarray(before).view(np.uint16))
    assert lin.biases is None and lin.scales.dtype == jnp.uint32


def test_tiled_pairs_split_depends_on_weight_shape_only():
    bs = qm.TiledBlockSizes.for_layout(17408, 5120, 4, 64, "pairs")
    assert bs.unpack == "pairs" and bs.sums_outside and 20 % bs.split_k == 0
    assert qm.TiledBlockSizes.for_layout(17408, 5120, 4, 64, "kernel").unpack == "convert"


@pytest.mark.gpu
@pytest.mark.parametrize("m,group_size", [(1, 64), (17, 32), (5, 128), (129, 64)])
def test_gpu_tiled_pairs_match_reference(m, group_size):
    rng = np.random.default_rng(m + 7)
    mlx, pairs = _pairs(rng, 4096, 4096, group_size, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
    bs = qm.TiledBlockSizes.for_layout(4096, 4096, 4, group_size, "pairs")
    y = qm.qmatmul_tiled(x, *pairs, group_size=group_size, block_sizes=bs)
    assert _rel_err(y, qm.reference(x, *mlx, group_size=group_size)) < 1e-2


@pytest.mark.gpu
def test_gpu_tiled_pairs_packed_scales_give_the_same_bits():
    rng = np.random.default_rng(28)
    _, (w, s, b) = _pairs(rng, 4096, 4096, 64, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((20, 4096)), jnp.bfloat16)
    bs = qm.TiledBlockSizes.for_layout(4096, 4096, 4, 64, "pairs")
    want = np.asarray(qm.qmatmul_tiled(x, w, s, b, block_sizes=bs)).view(np.uint16)
    got = np.asarray(qm.qmatmul_tiled(x, w, quant.pack_scale_bias(s, b), None, block_sizes=bs)).view(np.uint16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_gpu_tiled_pairs_rows_1_to_64_bit_identical():
    rng = np.random.default_rng(26)
    _, (w, s, b) = _pairs(rng, 5120, 6144, 64, jnp.bfloat16)
    pairs = (w, quant.pack_scale_bias(s, b), None)  # as the serving layout holds them
    bs = qm.TiledBlockSizes.for_layout(5120, 6144, 4, 64, "pairs")
    f = lambda x: np.asarray(qm.qmatmul_tiled(x, *pairs, block_sizes=bs)).view(np.uint16)
    x = jnp.asarray(rng.standard_normal((64, 6144)), jnp.bfloat16)
    _assert_rows_alone_equal_rows_in_batches(f, x, (2, 5, 16, 33, 64), rng)


@pytest.mark.gpu
@pytest.mark.parametrize("m,bits,group_size", [(1, 4, 64), (17, 4, 32), (5, 4, 128), (16, 8, 64), (129, 4, 64)])
def test_gpu_tiled_matches_reference(m, bits, group_size):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(m)
    mlx, tiled = _tiled(rng, 4096, 4096, bits, group_size, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
    y = qm.qmatmul_tiled(x, *tiled, bits=bits, group_size=group_size)
    assert _rel_err(y, qm.reference(x, *mlx, bits=bits, group_size=group_size)) < 1e-2


@pytest.mark.gpu
def test_gpu_tiled_rows_1_to_128_bit_identical():
    rng = np.random.default_rng(9)
    _, tiled = _tiled(rng, 5120, 6144, 4, 64, jnp.bfloat16)
    f = lambda x: np.asarray(qm.qmatmul_tiled(x, *tiled)).view(np.uint16)
    x = jnp.asarray(rng.standard_normal((128, 6144)), jnp.bfloat16)
    _assert_rows_alone_equal_rows_in_batches(f, x, (2, 5, 16, 33, 128), rng)
