"""The Pallas causal flash attention for prompt chunks equals the reference.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from tests.helpers import check_kernel, rel_err

SMALL = fa.BlockSizes(block_q=16, block_k=16)


def _case(rng, b, t, h, g, e, s, dtype, starts=None, page=16):
    """Fresh random q [B, T, H, E] and a pool of random pages [P, page, G, E] (more than the lanes use) with each
    lane's table, S = s keys a lane (rounded up to pages), in shuffled pages; each lane's chunk starts at `starts[b]`
    (random if None). Returns (q, k pages, v pages, table, positions)."""
    n = -(-s // page)
    pool = b * n + 3
    q = jnp.asarray(rng.standard_normal((b, t, h, e)), dtype)
    k = jnp.asarray(rng.standard_normal((pool, page, g, e)), dtype)
    v = jnp.asarray(rng.standard_normal((pool, page, g, e)), dtype)
    table = jnp.asarray(rng.permutation(pool)[: b * n].reshape(b, n), jnp.int32)
    if starts is None:
        starts = rng.integers(0, s - t + 1, size=b)
    positions = np.asarray(starts)[:, None] + np.arange(t)[None]
    return q, k, v, table, jnp.asarray(positions, jnp.int32)


def _check(args, bs, interpret, dtype):
    check_kernel(fa.flash_attention, fa.reference, args, bs, interpret, dtype)


# T: one row, one block, block + 1 (a padded second block); chunks from position 0 and mid-context
@pytest.mark.parametrize("t", [1, 16, 17])
@pytest.mark.parametrize("starts", [[0, 0], [37, 5]])
def test_interpret_ragged_chunks_match_reference(t, starts):
    rng = np.random.default_rng(t + sum(starts))
    _check(_case(rng, 2, t, 4, 2, 64, 70, jnp.float32, starts), SMALL, True, jnp.float32)


@pytest.mark.parametrize("e,h,g", [(64, 6, 2), (128, 4, 4), (256, 8, 1), (256, 6, 1)])
def test_interpret_gqa_head_dims_match_reference(e, h, g):
    rng = np.random.default_rng(e + h + g)
    _check(_case(rng, 2, 33, h, g, e, 64, jnp.float32), SMALL, True, jnp.float32)


def test_interpret_keys_not_a_tile_multiple_and_rows_past_the_keys():
    rng = np.random.default_rng(7)
    q, k, v, table, _ = _case(rng, 1, 20, 4, 2, 64, 45, jnp.float32)
    positions = jnp.asarray(30 + np.arange(20)[None], jnp.int32)  # rows 18.. sit past key 47: they see all keys
    _check((q, k, v, table, positions), SMALL, True, jnp.float32)


def test_interpret_bf16_in_bf16_out():
    rng = np.random.default_rng(8)
    _check(_case(rng, 1, 40, 4, 2, 128, 96, jnp.bfloat16, [50]), fa.BlockSizes(32, 16), True, jnp.bfloat16)


def _chunks_vs_whole(t, cut, bs, interpret, dtype):
    """Rows of a prompt fed in two chunks (cut anywhere) and fed at once."""
    rng = np.random.default_rng(9)
    q, k, v, table, pos = _case(rng, 1, t, 4, 2, 64, t, dtype, [0])
    whole = fa.flash_attention(q, k, v, table, pos, block_sizes=bs, interpret=interpret)
    first = fa.flash_attention(q[:, :cut], k, v, table, pos[:, :cut], block_sizes=bs, interpret=interpret)
    second = fa.flash_attention(q[:, cut:], k, v, table, pos[:, cut:], block_sizes=bs, interpret=interpret)
    return np.concatenate([first, second], axis=1), np.asarray(whole)


@pytest.mark.parametrize("cut", [16, 20, 33])
def test_interpret_chunks_equal_the_whole_prompt_bit_for_bit(cut):
    """A row's result never depends on which tiles its query block sees whole (where a chunk was cut)."""
    chunked, whole = _chunks_vs_whole(48, cut, SMALL, True, jnp.float32)
    np.testing.assert_array_equal(chunked, whole)


def test_interpret_whole_table_equals_the_pages_the_chunk_reaches_bit_for_bit():
    """A chunk reads key tiles up to its last row only: the lane's whole table gives the same bits as the table cut
    to the pages its rows reach, so one program serves a row count at any depth of the prompt."""
    rng = np.random.default_rng(11)
    q, k, v, table, _ = _case(rng, 1, 20, 4, 2, 64, 160, jnp.float32)
    pos = jnp.asarray(37 + np.arange(20)[None], jnp.int32)  # rows 37..56: pages 0..3
    whole = fa.flash_attention(q, k, v, table, pos, block_sizes=SMALL, interpret=True)
    cut = fa.flash_attention(q, k, v, table[:, :4], pos, block_sizes=SMALL, interpret=True)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(cut))


def test_interpret_nan_in_keys_past_every_row_never_reaches_an_output():
    """Pages past the chunk's last row hold whatever they hold (a lane's unallocated tail, another lane's keys):
    NaN there, in the last tile and in tiles past it, leaves every output as it was."""
    rng = np.random.default_rng(12)
    q, k, v, table, _ = _case(rng, 1, 10, 4, 2, 64, 96, jnp.float32)
    pos = jnp.asarray(20 + np.arange(10)[None], jnp.int32)  # last row at 29: page 1's rows 14, 15 are past it
    clean = fa.flash_attention(q, k, v, table, pos, block_sizes=fa.BlockSizes(16, 32), interpret=True)
    page1, later = int(table[0, 1]), np.asarray(table[0, 2:])
    k = k.at[page1, 14:].set(jnp.nan).at[later].set(jnp.nan)
    v = v.at[page1, 14:].set(jnp.nan).at[later].set(jnp.nan)
    dirty = fa.flash_attention(q, k, v, table, pos, block_sizes=fa.BlockSizes(16, 32), interpret=True)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_bad_shapes_raise_naming_the_value():
    rng = np.random.default_rng(4)
    q, k, v, table, pos = _case(rng, 1, 4, 4, 2, 64, 16, jnp.float32)
    with pytest.raises(ValueError, match="block_k=24"):
        fa.flash_attention(q, k, v, table, pos, block_sizes=fa.BlockSizes(block_k=24), interpret=True)
    with pytest.raises(ValueError, match="h=3"):
        fa.flash_attention(q[:, :, :3], k, v, table, pos, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="positions.shape"):
        fa.flash_attention(q, k, v, table, pos[:, :2], block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="page=32"):
        fa.flash_attention(q, k.reshape(-1, 32, 2, 64)[:1], v.reshape(-1, 32, 2, 64)[:1], table, pos,
                           block_sizes=SMALL, interpret=True)


@pytest.mark.parametrize("e,h,g", [(64, 8, 2), (256, 24, 4)])
def test_lowers_to_triton_for_cuda_without_a_gpu(e, h, g):
    """The compiled path's Pallas -> Triton lowering (not Triton's own compile) checked on the CPU."""
    q = jax.ShapeDtypeStruct((2, 300, h, e), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((100, 16, g, e), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 44), jnp.int32)
    p = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    text = fa.flash_attention.trace(q, k, k, table, p).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and 'name = "flash_attention"' in text


# The same kind of cases compiled on a GPU, at the model's geometry: `pytest -m gpu tests/test_flash_attention.py`.
@pytest.mark.gpu
@pytest.mark.parametrize("t,starts", [(1, [0, 300]), (129, [0, 77]), (256, [1000, 3]), (1000, [0, 0])])
def test_gpu_prompt_chunks_match_reference(t, starts):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(t)
    _check(_case(rng, 2, t, 24, 4, 256, 1400, jnp.bfloat16, starts), None, False, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("e,h,g", [(64, 8, 2), (128, 16, 4), (256, 8, 8)])
def test_gpu_gqa_head_dims_match_reference(e, h, g):
    rng = np.random.default_rng(e)
    _check(_case(rng, 2, 300, h, g, e, 700, jnp.bfloat16), None, False, jnp.bfloat16)


def test_model_prompt_path_takes_flash_and_rows_take_paged(monkeypatch):
    """With kernels on, a prompt chunk goes to flash and lane-round rows (f32: no Mosaic kernel) to the paged kernel."""
    from pallas_kernels import attention as pa
    from tfjax import ops

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs, block_sizes=SMALL if name == "flash" else None, interpret=True)

        return wrapped

    monkeypatch.setattr(fa, "flash_attention", spy("flash", fa.flash_attention))
    monkeypatch.setattr(pa, "paged_attention", spy("paged", pa.paged_attention))
    rng = np.random.default_rng(10)
    p, page, g, e, n = 12, 16, 2, 64, 5
    pages = ops.KVPages(jnp.asarray(rng.standard_normal((p, page, g, e)), jnp.float32),
                           jnp.asarray(rng.standard_normal((p, page, g, e)), jnp.float32))
    pt = jnp.asarray(rng.permutation(p)[:n][None], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 20, 4, e)), jnp.float32)
    pos = jnp.asarray(31 + np.arange(20)[None], jnp.int32)
    with ops.using(ops.REFERENCE):
        want = ops.paged_attention(q, pages, pt, pos)
    assert calls == []
    with ops.using(ops.PALLAS):
        got = ops.paged_attention(q, pages, pt, pos)
        got_rows = ops.paged_attention(q, pages, pt, pos, rows=True)
    assert calls == ["flash", "paged"]
    assert rel_err(got, want) < 1e-5 and rel_err(got_rows, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("cut", [128, 200])
def test_gpu_chunks_equal_the_whole_prompt_bit_for_bit(cut):
    chunked, whole = _chunks_vs_whole(600, cut, None, False, jnp.bfloat16)
    np.testing.assert_array_equal(chunked, whole)

