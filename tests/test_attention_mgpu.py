"""The Mosaic GPU paged attention equals the reference, keeps NaN in unwritten pages away, and is row-invariant.

CPU: GPU interpret mode (the TMA pipeline, barriers and masking; plain dots for the MMAs) and the CUDA lowering;
`-m gpu`: compiled, MMAs included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention as pa
from pallas_kernels import attention_mgpu as am
from tests.helpers import check_kernel, finished, rel_err
from tests.test_attention_kernel import RAGGED, _case


def _check(args, bs, interpret):
    finished(check_kernel(am.paged_attention, am.reference, args, bs, interpret, jnp.bfloat16))


def _partials_reference(q, k_pages, v_pages, page_table, positions, chunk_k, programs):
    """Numpy float64: each program's (o unnormalised, m, l) per query row, as the kernel's contract states them:
    program c of `programs` takes the interleaved chunks c, c + programs, ..."""
    b, t, h, e = q.shape
    _, page, g, _ = k_pages.shape
    rows, span = t * (h // g), page_table.shape[1] * page
    qr, pos = pa.query_rows(q, positions, g, rows, span)
    qr, pos = np.asarray(qr, np.float64), np.asarray(pos)
    table = np.asarray(page_table)
    k = np.asarray(k_pages, np.float64)[table].reshape(b, span, g, e)
    v = np.asarray(v_pages, np.float64)[table].reshape(b, span, g, e)
    o, m, l = (np.zeros((b, g, programs, rows, e)), np.full((b, g, programs, rows), pa.NEG),
               np.zeros((b, g, programs, rows)))
    keys = np.arange(span)
    for i in range(b):
        for j in range(g):
            s = qr[i, j] @ k[i, :, j].T * e**-0.5  # [rows, span]
            for c in range(programs):
                seen = ((keys[None] // chunk_k) % programs == c) & (keys[None] <= pos[i][:, None])  # [rows, span]
                live = seen.any(1)
                mc = np.where(seen, s, -np.inf).max(1)
                p = np.where(seen, np.exp(s - np.where(live, mc, 0)[:, None]), 0.0)
                m[i, j, c] = np.where(live, mc, pa.NEG)
                l[i, j, c] = p.sum(1)
                o[i, j, c] = p @ v[i, :, j]
    return o, m, l


def _check_partials(args, bs, interpret):
    """The kernel's raw partials, chunk by chunk and row by row: what the GPU got wrong once (docs/benchmarks.md,
    eleventh run) while the interpreter was exact."""
    q, k_pages, _, page_table, _ = args
    parts = finished(am.paged_partials(*args, block_sizes=bs, interpret=interpret))
    o, m, l = (np.asarray(x, np.float64) for x in parts)
    p = am.plan(page_table.shape[1], k_pages.shape[1], k_pages.shape[2], bs or am.DEFAULT)
    ro, rm, rl = _partials_reference(*args, p.chunk_k, p.programs)
    rows = ro.shape[3]
    o, m, l = o[:, :, :, :rows], m[:, :, :, :rows], l[:, :, :, :rows]
    live = rl > 0
    np.testing.assert_allclose(np.where(live, m, 0), np.where(live, rm, 0), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(l, rl, rtol=1e-2, atol=1e-2)
    row_err = np.abs(o - ro).max(-1) / np.maximum(np.abs(ro).max(-1), 1e-6)  # P goes to the MMA as bf16
    assert row_err[live].max() < 2e-2 and not o[~live].any(), (row_err[live].max(), np.abs(o[~live]).max())


@pytest.mark.parametrize("positions", RAGGED)
def test_interpret_decode_ragged_lengths_match_reference(positions):
    rng = np.random.default_rng(len(str(positions)))
    _check(_case(rng, 2, 1, 4, 2, 64, 6, 16, jnp.bfloat16, positions), None, True)


@pytest.mark.parametrize("e,h,g,t,bs", [(64, 6, 2, 3, am.DEFAULT), (128, 16, 4, 5, am.BlockSizes(stages=3)),
                                        (64, 4, 1, 20, am.BlockSizes(block_k=128, stages=1))],
                         ids=["two-blocks", "three-stages", "long-tiles-two-query-blocks"])
def test_interpret_verify_rows_gqa_match_reference(e, h, g, t, bs):
    rng = np.random.default_rng(e + t)
    _check(_case(rng, 2, t, h, g, e, 20, 16, jnp.bfloat16), bs, True)


@pytest.mark.parametrize("page", [8, 32, 64])
def test_interpret_page_sizes_the_dispatch_may_send_match_reference(page):
    rng = np.random.default_rng(page)
    assert am.supports(64, page, jnp.bfloat16)
    _check(_case(rng, 2, 4, 4, 2, 64, 256 // page, page, jnp.bfloat16), None, True)


def test_interpret_fixed_chunks_over_a_wide_page_table_match_reference():
    """A short context in a lane whose page table spans more (unallocated entries), chunks of a fixed size."""
    rng = np.random.default_rng(9)
    q, kp, vp, pt, _ = _case(rng, 1, 3, 4, 2, 64, 10, 16, jnp.bfloat16)
    table = jnp.concatenate([pt, jnp.full((1, 22), kp.shape[0], jnp.int32)], axis=1)  # 32 pages, 10 allocated
    positions = jnp.asarray([[150, 151, 152]], jnp.int32)
    for bs in (am.DEFAULT, am.BlockSizes(chunk_k=128)):
        _check((q, kp, vp, table, positions), bs, True)


INTERLEAVED = am.BlockSizes(chunk_programs=4)  # 2 KV heads: 2 programs take the 64-key chunks


@pytest.mark.parametrize("t,bs", [(8, am.DEFAULT), (1, am.DEFAULT), (8, am.BlockSizes(chunk_programs=8)),
                                  (3, INTERLEAVED), (2, am.BlockSizes(chunk_k=128, chunk_programs=6))],
                         ids=["8-rows", "1-row", "4-programs-a-head", "2-programs-a-head", "128-key-chunks"])
def test_interpret_partials_per_chunk_and_row_match_numpy(t, bs):
    _check_partials(_case(np.random.default_rng(t), 1, t, 12, 2, 64, 20, 16, jnp.bfloat16), bs, True)


def test_interpret_interleaved_chunks_give_the_same_bits_in_a_wider_page_table():
    """Interleaved, a lane's split follows its keys, not the span: the same lanes (of different lengths) in a page
    table twice as wide (unallocated entries) take the same bits, and equal the reference."""
    rng = np.random.default_rng(12)
    q, kp, vp, pt, _ = _case(rng, 2, 3, 4, 2, 64, 30, 16, jnp.bfloat16)
    wide = jnp.concatenate([pt, jnp.full((2, 34), kp.shape[0], jnp.int32)], axis=1)  # 64 pages, 30 allocated
    positions = jnp.asarray([[470, 471, 472], [60, 61, 62]], jnp.int32)  # 8 chunks of 64 keys, and 1
    own = finished(am.paged_attention(q, kp, vp, pt, positions, block_sizes=INTERLEAVED, interpret=True))
    walked = finished(am.paged_attention(q, kp, vp, wide, positions, block_sizes=INTERLEAVED, interpret=True))
    np.testing.assert_array_equal(np.asarray(walked).view(np.uint16), np.asarray(own).view(np.uint16))
    assert rel_err(walked, am.reference(q, kp, vp, wide, positions)) < 1e-2


def test_program_pages_deal_each_programs_tiles_in_order():
    p = am.plan(14, 16, 2, INTERLEAVED)  # 2 programs, 4 pages a chunk, 4 chunks (the last half allocated)
    table = am.program_pages(jnp.arange(14)[None], 16, p).reshape(p.programs, p.ids)
    assert (p.chunks, p.programs, p.ids) == (4, 2, am.PT_WINDOW)
    assert table[0, :8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and table[1, :6].tolist() == [4, 5, 6, 7, 12, 13]


@pytest.mark.parametrize("bs", [am.DEFAULT, INTERLEAVED], ids=["default", "2-programs-a-head"])
def test_interpret_rows_bit_identical_to_each_row_alone(bs):
    rng = np.random.default_rng(3)
    q, kp, vp, pt, pos = _case(rng, 1, 5, 4, 2, 64, 8, 16, jnp.bfloat16, [[60, 61, 62, 63, 64]])
    f = lambda q, pos: np.asarray(finished(am.paged_attention(q, kp, vp, pt, pos, block_sizes=bs,
                                                              interpret=True))).view(np.uint16)
    full = f(q, pos)
    for i in range(5):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")


def test_interpret_nan_past_the_last_position_never_reaches_a_row():
    """Unwritten slots of the lane's last page and unallocated pages (marked P, read as the pool's last) hold NaN."""
    rng = np.random.default_rng(5)
    q, kp, vp, _, _ = _case(rng, 1, 3, 4, 2, 64, 4, 16, jnp.bfloat16)
    table = jnp.asarray([[2, 0, 1, 5, kp.shape[0]]], jnp.int32)  # pages 2, 0, 1 and part of 5; the 5th marked P
    positions = jnp.asarray([[50, 51, 52]], jnp.int32)  # the key tile [0, 64) ends inside page 5
    clean = am.reference(q, kp, vp, table, positions)
    kp, vp = kp.at[5, 5:].set(jnp.nan), vp.at[5, 5:].set(jnp.nan)  # page 5 past position 52 (its offset 4)
    kp, vp = kp.at[-1].set(jnp.nan), vp.at[-1].set(jnp.nan)
    y = finished(am.paged_attention(q, kp, vp, table, positions, interpret=True))
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(y, clean) < 1e-2


@pytest.mark.parametrize("bs", [am.DEFAULT, am.BlockSizes(block_k=128, stages=1), am.BlockSizes(chunk_k=128)],
                         ids=["default", "long-tiles", "128-key-chunks"])
def test_lowers_to_mosaic_gpu_for_cuda(bs):
    text = am.lowered_for_gpu((1, 8, 24, 256), (256, 16, 4, 256), 256, bs)
    assert "mosaic_gpu" in text and 'name = "attention_combine"' in text


def test_lowers_at_qwen35s_longest_context():
    """A 262k-key span: 32 programs a KV head (132 // 4 rounded down) of 4096 chunks, 512 page ids a program, loaded
    in TMA boxes of at most 256."""
    p = am.plan(262144 // 16, 16, 4, am.DEFAULT)
    assert (p.programs, p.ids) == (32, 512)
    assert "mosaic_gpu" in am.lowered_for_gpu((1, 8, 24, 256), (256, 16, 4, 256), 262144 // 16)


def test_supports_names_what_the_dispatch_may_send():
    assert am.supports(256, 16, jnp.bfloat16) and am.supports(64, 64, jnp.bfloat16)
    assert not am.supports(256, 16, jnp.float32)  # bf16 q and pages only
    assert not am.supports(96, 16, jnp.bfloat16) and not am.supports(256, 4, jnp.bfloat16)
    assert not am.supports(256, 16, jnp.bfloat16, am.BlockSizes(stages=3))  # K and V stages past shared memory
    assert am.supports(128, 16, jnp.bfloat16, am.BlockSizes(stages=3))


def test_bad_inputs_raise_naming_the_value():
    rng = np.random.default_rng(4)
    q, kp, vp, pt, pos = _case(rng, 1, 1, 4, 2, 64, 4, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k=96"):
        am.paged_attention(q, kp, vp, pt, pos, block_sizes=am.BlockSizes(block_k=96), interpret=True)
    with pytest.raises(ValueError, match="bf16"):
        am.paged_attention(q.astype(jnp.float32), kp, vp, pt, pos, interpret=True)
    with pytest.raises(ValueError, match="chunk_k=96"):
        am.paged_attention(q, kp, vp, pt, pos, block_sizes=am.BlockSizes(chunk_k=96), interpret=True)
    q, kp, vp, pt, pos = _case(rng, 1, 1, 4, 2, 256, 4, 16, jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        am.paged_attention(q, kp, vp, pt, pos, block_sizes=am.BlockSizes(stages=3), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("positions", RAGGED)
def test_gpu_decode_ragged_lengths_match_reference(positions):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(11)
    _check(_case(rng, 2, 1, 24, 4, 256, 6, 16, jnp.bfloat16, positions), None, False)


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,g,t,bs", [(64, 8, 2, 1, am.DEFAULT), (128, 16, 4, 7, am.BlockSizes(stages=3)),
                                        (256, 24, 4, 16, am.DEFAULT),
                                        (256, 24, 4, 8, am.BlockSizes(block_k=128, stages=1))])
def test_gpu_verify_rows_match_reference(e, h, g, t, bs):
    rng = np.random.default_rng(e + t)
    _check(_case(rng, 2, t, h, g, e, 200, 16, jnp.bfloat16), bs, False)


@pytest.mark.gpu
def test_gpu_nan_past_the_last_position_never_reaches_a_row():
    rng = np.random.default_rng(6)
    q, kp, vp, _, _ = _case(rng, 1, 8, 24, 4, 256, 8, 16, jnp.bfloat16)
    table = jnp.asarray([[2, 0, 1, 5, 7, kp.shape[0], kp.shape[0], kp.shape[0]]], jnp.int32)
    positions = jnp.asarray([np.arange(8) + 60], jnp.int32)  # the tile [64, 128) ends inside page 7 (offset 3)
    clean = am.reference(q, kp, vp, table, positions)
    kp, vp = kp.at[7, 4:].set(jnp.nan), vp.at[7, 4:].set(jnp.nan)
    kp, vp = kp.at[-1].set(jnp.nan), vp.at[-1].set(jnp.nan)
    y = am.paged_attention(q, kp, vp, table, positions)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(y, clean) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [am.DEFAULT, am.BlockSizes(chunk_k=128, chunk_programs=8)],
                         ids=["default", "128-key-chunks"])
def test_gpu_rows_bit_identical_to_each_row_alone(bs):
    rng = np.random.default_rng(5)
    t = 16
    q, kp, vp, pt, pos = _case(rng, 2, t, 24, 4, 256, 300, 16, jnp.bfloat16, [np.arange(t) + 3000, np.arange(t) + 77])
    f = lambda q, pos: np.asarray(am.paged_attention(q, kp, vp, pt, pos, block_sizes=bs)).view(np.uint16)
    full = f(q, pos)
    for i in range(t):
        np.testing.assert_array_equal(f(q[:, i : i + 1], pos[:, i : i + 1])[:, 0], full[:, i], err_msg=f"row {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("t,bs", [(8, am.DEFAULT), (1, am.DEFAULT), (7, am.DEFAULT),
                                  (8, am.BlockSizes(chunk_programs=8)),
                                  (1, am.BlockSizes(chunk_k=128, chunk_programs=8))],
                         ids=["48-rows", "6-rows", "42-rows", "2-programs-a-head", "128-key-chunks"])
def test_gpu_partials_per_chunk_and_row_match_numpy(t, bs):
    assert jax.default_backend() == "gpu"
    _check_partials(_case(np.random.default_rng(t), 2, t, 24, 4, 256, 40, 16, jnp.bfloat16), bs, False)


@pytest.mark.gpu
def test_gpu_interleaved_chunks_give_the_same_bits_in_a_wider_page_table():
    rng = np.random.default_rng(13)
    q, kp, vp, pt, _ = _case(rng, 2, 8, 24, 4, 256, 300, 16, jnp.bfloat16)
    wide = jnp.concatenate([pt, jnp.full((2, 724), kp.shape[0], jnp.int32)], axis=1)  # a 16k span, 4800 keys
    positions = jnp.asarray([np.arange(8) + 4700, np.arange(8) + 900], jnp.int32)
    own = am.paged_attention(q, kp, vp, pt, positions)
    walked = am.paged_attention(q, kp, vp, wide, positions)
    np.testing.assert_array_equal(np.asarray(walked).view(np.uint16), np.asarray(own).view(np.uint16))
    assert rel_err(walked, am.reference(q, kp, vp, wide, positions)) < 1e-2
