"""The Mosaic GPU 4-bit matmul over the pair layout: GPU interpret mode against the reference, row invariance, and
its lowering for CUDA checked on the CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qmatmul_mgpu as mg
from tests.helpers import rel_err
from tfjax import quant


def _weights(rng, n, k):
    w = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
    s = jnp.asarray(rng.uniform(0.001, 0.01, (n, k // 64)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.05, (n, k // 64)), jnp.bfloat16)
    words, ps, pb = quant.to_pair_layout(w, s, b, 4, 64)
    return jnp.asarray(words), quant.pack_scale_bias(jnp.asarray(ps), jnp.asarray(pb))


# one row; 9 rows in one 16-row block; 70 rows in two 64-row blocks (the second's 6 rows past M dropped); 17 rows in
# two 16-row blocks; K splits; 200 rows (a prompt chunk's, ops.MOSAIC_MAX_ROWS) in four 64-row blocks
@pytest.mark.parametrize("m,split,block_m", [(1, 1, 0), (9, 2, 0), (70, 1, 0), (17, 2, 16), (200, 2, 0)])
def test_interpret_matches_reference(m, split, block_m):
    rng = np.random.default_rng(m + split)
    words, packed = _weights(rng, 128, 1024)
    x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
    bs = mg.BlockSizes(split_k=split, block_m=block_m)
    y = mg.qmatmul_pairs(x, words, packed, block_sizes=bs, interpret=True)
    assert y.shape == (m, 128) and y.dtype == jnp.bfloat16
    assert rel_err(y, mg.reference(x, words, packed)) < 1e-2  # bf16 weights, as MLX dequantizes them


def test_interpret_rows_bit_identical_whatever_m_and_neighbours():
    rng = np.random.default_rng(5)
    words, packed = _weights(rng, 64, 512)
    f = lambda x: np.asarray(mg.qmatmul_pairs(x, words, packed, interpret=True)).view(np.uint16)
    x = jnp.asarray(rng.standard_normal((18, 512)), jnp.bfloat16)
    alone = np.stack([f(x[i : i + 1])[0] for i in (0, 17)])
    np.testing.assert_array_equal(f(x)[[0, 17]], alone)


def _element(layout, shape, warp, lane, reg, v=0):
    """The logical index a thread's register element holds in a Mosaic tiled layout (its `thread_idxs`, in numpy)."""
    from jax.experimental.mosaic.gpu.fragmented_array import Replicated

    tiled, sizes = list(reg), layout.tiled_tiling_shape
    for idx, dims in ((warp, layout.warp_dims), (lane, layout.lane_dims)):
        extents = [d.times if isinstance(d, Replicated) else sizes[d] for d in dims]
        strides = np.cumprod([1, *extents[::-1]])[:-1][::-1]
        for d, stride, extent in zip(dims, strides, extents, strict=True):
            if not isinstance(d, Replicated):
                tiled[len(tiled) + d] = idx // stride % extent
    tiled[len(tiled) + layout.vector_dim] = v
    return layout.tiling.untile_indices(tuple(tiled))


def test_words_layout_puts_each_word_where_the_operand_keeps_its_two_inputs():
    """What `_pairs_as_bf16` relabels without moving data: lane l's word register (h, j) holds word 4j + l % 4 of
    row 16w + 8h + l // 4, whose halves are inputs 2c and 2c + 1; the bf16 MMA operand's register (h, j) holds
    exactly those two inputs of that row (Mosaic's own layout definitions, evaluated on the CPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    words, operand = mg.WORDS_LAYOUT.to_mgpu(), plgpu.Layout.WGMMA.to_mgpu()
    bn = 128
    assert words.registers_shape((bn, mg.WORDS)) == (2, 1, 1, 1, 2, 1, 1, 8, 1, 1)
    assert operand.registers_shape((bn, 2 * mg.WORDS)) == (2, 8, 1, 1, 2, 1, 1, 1, 1)
    for warp, lane, b, h, j in np.ndindex(4, 32, 2, 2, 8):
        row, c = _element(words, (bn, mg.WORDS), warp, lane, (b, 0, 0, 0, h, 0, 0, j, 0, 0))
        assert (row, c) == (64 * b + 16 * warp + 8 * h + lane // 4, 4 * j + lane % 4)
        for v in range(2):
            assert _element(operand, (bn, 2 * mg.WORDS), warp, lane, (b, j, 0, 0, h, 0, 0, 0, 0), v) == (row, 2 * c + v)


@pytest.mark.parametrize("n,k,kw", [(17408, 5120, {}), (5120, 17408, {}), (17408, 5120, dict(stages=3)),
                                    (5120, 17408, dict(block_m=16)), (17408, 5120, dict(block_m=64))])
def test_lowers_to_mosaic_gpu_for_the_dense27_mlp_without_a_gpu(n, k, kw):
    text = mg.lowered_for_gpu(n, k, m=3, block_sizes=mg.BlockSizes.for_weight(n, k, **kw))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("m", [1, 5, 9, 33, 64, 70, 256])
def test_lowers_for_any_row_count_leaving_the_row_pad_to_tma(m):
    """Default tiles (x not padded to block_m): TMA takes an array of under 8 rows or whole 8-row tiles, so past
    8 rows the wrapper pads to a multiple of 8; the H200 refused 33 unpadded rows, and so does this lowering."""
    assert "mosaic_gpu" in mg.lowered_for_gpu(5120, 6144, m=m)


def test_serves_only_whole_column_blocks_and_tiles_of_group_64():
    assert mg.BlockSizes.serves(17408, 5120, 64)
    assert not mg.BlockSizes.serves(16480, 5120, 64)  # dense27's fused DeltaNet projections: N % 64 != 0
    assert not mg.BlockSizes.serves(17408, 5120, 32) and not mg.BlockSizes.serves(64, 320, 64)


def test_split_comes_from_the_weight_shape_and_divides_its_tiles():
    for n, k in [(17408, 5120), (5120, 17408), (1024, 5120)]:
        bs = mg.BlockSizes.for_weight(n, k)
        assert (k // mg.TILE) % bs.split_k == 0 and bs.split_k <= 17
    # dense27: the N = 5120 shapes split further than the wide ones (80 column blocks against 272..3880)
    splits = {(n, k): mg.BlockSizes.for_weight(n, k).split_k
              for n, k in [(5120, 17408), (5120, 6144), (17408, 5120), (34816, 5120), (248320, 5120)]}
    assert splits == {(5120, 17408): 17, (5120, 6144): 12, (17408, 5120): 10, (34816, 5120): 4, (248320, 5120): 1}


def test_bad_inputs_raise_naming_the_value():
    rng = np.random.default_rng(6)
    words, packed = _weights(rng, 64, 512)
    x = jnp.ones((1, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="group_size"):
        mg.qmatmul_pairs(x, words, packed, group_size=32, interpret=True)
    with pytest.raises(ValueError, match="packed scales"):
        mg.qmatmul_pairs(x, words, packed.astype(jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_m=12"):
        mg.qmatmul_pairs(x, words, packed, block_sizes=mg.BlockSizes(block_m=12), interpret=True)
    with pytest.raises(ValueError, match="K=256"):
        mg.qmatmul_pairs(x[:, :256], words, packed, interpret=True)


GPU_VARIANTS = [mg.BlockSizes(), mg.BlockSizes(block_m=16, stages=3)]
GPU_IDS = ["rows-tma-fill", "m16-3-stages"]


@pytest.mark.gpu
@pytest.mark.parametrize("bs", GPU_VARIANTS, ids=GPU_IDS)
@pytest.mark.parametrize("m", [1, 16, 33])
def test_gpu_matches_reference(m, bs):
    rng = np.random.default_rng(m)
    words, packed = _weights(rng, 4096, 4096)
    x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
    assert rel_err(mg.qmatmul_pairs(x, words, packed, block_sizes=bs), mg.reference(x, words, packed)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bs", GPU_VARIANTS, ids=GPU_IDS)
def test_gpu_rows_1_to_64_bit_identical(bs):
    rng = np.random.default_rng(7)
    words, packed = _weights(rng, 5120, 6144)
    f = lambda x: np.asarray(mg.qmatmul_pairs(x, words, packed, block_sizes=bs)).view(np.uint16)
    x = jnp.asarray(rng.standard_normal((64, 6144)), jnp.bfloat16)
    alone = np.stack([f(x[i : i + 1])[0] for i in range(64)])
    for m in (2, 5, 16, 33, 64):
        for start in range(0, 64, m):
            idx = np.arange(start, min(start + m, 64))
            np.testing.assert_array_equal(f(x[idx]), alone[idx], err_msg=f"{m=}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 17408), (17408, 5120)])
@pytest.mark.parametrize("m", [1, 33, 70, 256])
def test_gpu_dense27_mlp_tiles_match_reference(n, k, m):
    """The dispatch's tiles at the dense27 MLP shapes (K splits 17 and 10; 70 rows: TMA drops the second block's 6
    rows past M) against the reference."""
    rng = np.random.default_rng(n + m)
    words, packed = _weights(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    assert rel_err(mg.qmatmul_pairs(x, words, packed), mg.reference(x, words, packed)) < 1e-2
