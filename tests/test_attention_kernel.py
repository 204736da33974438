"""The Pallas paged verify/decode attention equals the reference and is row-invariant.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention as pa
from tests.helpers import check_kernel, rel_err

SMALL = pa.BlockSizes(block_q=16, block_k=32, chunk_k=64, chunk_programs=0)  # fixed chunks


def _case(rng, b, t, h, g, e, n, page, dtype, positions=None):
    p = b * n + 3  # a pool larger than the lanes' pages, shuffled: pages are not in position order
    kp = jnp.asarray(rng.standard_normal((p, page, g, e)), dtype)
    vp = jnp.asarray(rng.standard_normal((p, page, g, e)), dtype)
    pt = jnp.asarray(rng.permutation(p)[: b * n].reshape(b, n), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, h, e)), dtype)
    if positions is None:
        ends = rng.integers(t - 1, n * page, size=b)
        positions = ends[:, None] - t + 1 + np.arange(t)[None]
    return q, kp, vp, pt, jnp.asarray(positions, jnp.int32)


def _check(args, bs, interpret, dtype):
    check_kernel(pa.paged_attention, pa.reference, args, bs, interpret, dtype)


# (positions per lane): length 1, a page boundary (15 -> 16), block + 1 (32 -> 33), a chunk edge (63, 64)
RAGGED = [[[0], [16]], [[15], [32]], [[63], [64]]]


@pytest.mark.parametrize("positions", RAGGED)
def test_interpret_decode_ragged_lengths_match_reference(positions):
    rng = np.random.default_rng(len(str(positions)))
    _check(_case(rng, 2, 1, 4, 2, 64, 6, 16, jnp.float32, positions), SMALL, True, jnp.float32)


@pytest.mark.parametrize("e,h,g", [(64, 6, 2), (128, 4, 4), (256, 2, 1)])
def test_interpret_verify_rows_gqa_head_dims_match_reference(e, h, g):
    rng = np.random.default_rng(e + h)
    _check(_case(rng, 2, 3, h, g, e, 8, 16, jnp.float32), SMALL, True, jnp.float32)


def test_interpret_rows_bit_identical_to_each_row_alone():
    rng = np.random.default_rng(3)
    q, kp, vp, pt, pos = _case(rng, 1, 5, 4, 2, 64, 8, 16, jnp.float32, [[60, 61, 62, 63, 64]])
    f = lambda q, pos: np.asarray(pa.paged_attention(q, kp, vp, pt, pos, block_sizes=SMALL, interpret=True))
    full = f(q, pos)
    for i in range(5):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")


def test_chunk_policy_follows_the_span_and_kv_heads_only():
    bs = pa.BlockSizes(block_k=64, chunk_programs=264)
    assert [bs.chunk_for(span, 4) for span in (2048, 16384, 65536)] == [64, 256, 1024]
    assert pa.BlockSizes(chunk_k=512, chunk_programs=0).chunk_for(2048, 4) == 512  # a fixed chunk stays fixed
    assert pa.BlockSizes().chunk_for(2048, 4) == 64  # the default sizes chunks from the span


def test_interpret_span_chunks_match_reference_and_keep_rows_bit_identical():
    rng = np.random.default_rng(4)
    bs = pa.BlockSizes(block_q=16, block_k=32, chunk_programs=4)  # 8 pages of 16, 2 KV heads: chunks of 64
    args = _case(rng, 2, 5, 4, 2, 64, 8, 16, jnp.float32, [[60, 61, 62, 63, 64], [0, 1, 2, 3, 4]])
    _check(args, bs, True, jnp.float32)
    q, kp, vp, pt, pos = args
    f = lambda q, pos: np.asarray(pa.paged_attention(q, kp, vp, pt, pos, block_sizes=bs, interpret=True))
    full = f(q, pos)
    for i in range(5):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")


def test_group_policy_spreads_blocks_evenly_over_the_fewest_programs():
    bs = pa.BlockSizes(block_q=16, q_blocks=4)
    assert [bs.group_for(rows) for rows in (6, 16, 17, 48, 64, 66, 96, 200)] == [1, 1, 2, 3, 4, 3, 3, 4]


@pytest.mark.parametrize("t", [8, 11])
def test_interpret_blocks_sharing_a_program_match_reference_and_each_row_alone(t):
    """8 rows of 6 heads: 48 rows, 3 blocks in one program; 11 rows: 66 rows, 5 blocks in 2 programs of 3."""
    rng = np.random.default_rng(t)
    bs = pa.BlockSizes(block_q=16, block_k=32, chunk_k=64, chunk_programs=0, q_blocks=4)
    args = _case(rng, 2, t, 6, 1, 64, 8, 16, jnp.float32)
    _check(args, bs, True, jnp.float32)
    q, kp, vp, pt, pos = args
    f = lambda q, pos, bs=bs: np.asarray(pa.paged_attention(q, kp, vp, pt, pos, block_sizes=bs, interpret=True))
    full = f(q, pos)
    np.testing.assert_array_equal(f(q, pos, dataclasses.replace(bs, q_blocks=1)), full)
    for i in (0, t - 1):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")


# the default (8 rows x 6 heads in one 64-row block) and 16-row blocks sharing a program
@pytest.mark.parametrize("bs", [pa.DEFAULT, pa.BlockSizes(block_q=16, num_warps=4)], ids=["default", "blocks-sharing"])
def test_lowers_to_triton_for_cuda(bs):
    sds = jax.ShapeDtypeStruct
    q, pages = sds((1, 8, 24, 256), jnp.bfloat16), sds((40, 16, 4, 256), jnp.bfloat16)
    f = jax.jit(lambda *a: pa.paged_attention(*a, block_sizes=bs))
    text = f.trace(q, pages, pages, sds((1, 32), jnp.int32), sds((1, 8), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "paged_attention" in text


def test_interpret_unallocated_pages_holding_nan_never_reach_a_row():
    """The engine marks a lane's unallocated pages with P (past the pool); what lies there can be NaN."""
    rng = np.random.default_rng(5)
    q, kp, vp, _, _ = _case(rng, 1, 3, 4, 2, 64, 4, 16, jnp.float32)
    table = jnp.asarray([[2, 0, 1, kp.shape[0]]], jnp.int32)  # 3 pages allocated, the 4th marked P
    positions = jnp.asarray([[37, 38, 39]], jnp.int32)  # the key tile [32, 64) spans pages 2 and 3
    clean = pa.reference(q, kp, vp, table, positions)
    last = kp.shape[0] - 1  # interpret mode clamps P to the pool's last page: poison it
    kp, vp = kp.at[last].set(jnp.nan), vp.at[last].set(jnp.nan)
    y = pa.paged_attention(q, kp, vp, table, positions, block_sizes=SMALL, interpret=True)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_err(y, clean) < 1e-5


def test_bad_shapes_raise_naming_the_value():
    rng = np.random.default_rng(4)
    q, kp, vp, pt, pos = _case(rng, 1, 1, 4, 2, 64, 4, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_k=24"):
        pa.paged_attention(q, kp, vp, pt, pos, block_sizes=pa.BlockSizes(block_k=24), interpret=True)
    with pytest.raises(ValueError, match="h=3"):
        pa.paged_attention(q[:, :, :3], kp, vp, pt, pos, block_sizes=SMALL, interpret=True)


# The same cases compiled on a GPU: `pytest -m gpu tests/test_attention_kernel.py` on the device.
@pytest.mark.gpu
@pytest.mark.parametrize("positions", RAGGED)
def test_gpu_decode_ragged_lengths_match_reference(positions):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(11)
    _check(_case(rng, 2, 1, 24, 4, 256, 6, 16, jnp.bfloat16, positions), SMALL, False, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,g,t", [(64, 8, 2, 1), (128, 16, 4, 7), (256, 24, 4, 16)])
def test_gpu_verify_rows_match_reference(e, h, g, t):
    rng = np.random.default_rng(e + t)
    _check(_case(rng, 2, t, h, g, e, 200, 16, jnp.bfloat16), None, False, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_rows_bit_identical_to_each_row_alone():
    rng = np.random.default_rng(5)
    t = 16
    q, kp, vp, pt, pos = _case(rng, 2, t, 24, 4, 256, 300, 16, jnp.bfloat16, [np.arange(t) + 3000, np.arange(t) + 77])
    f = lambda q, pos: np.asarray(pa.paged_attention(q, kp, vp, pt, pos)).view(np.uint16)
    full = f(q, pos)
    for i in range(t):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")
