"""The attention partials' combine kernel (Triton, interpret mode on CPU) against plain jax.numpy: the chunks a row
can see, and nothing else, whatever they hold."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_combine as ac


def _partials(seed, b=2, g=3, chunks=5, rows=16, rows_ml=64, e=128, chunk_k=256):
    """Random partials with the shapes the Mosaic attention writes (rows: T x heads rounded up to 8; the last a
    padding row at position -1), each row at a random position: NaN in every chunk a row cannot see (what the
    attention wrote there has no meaning for the row) and in the chunk axis' padding (never written on the GPU)."""
    rng = np.random.default_rng(seed)
    cp = ac.chunks_pad(chunks)
    o = rng.standard_normal((b, g, cp, rows, e)).astype(np.float32) * 3
    m = rng.standard_normal((b, g, cp, rows_ml)).astype(np.float32) * 4
    l = rng.uniform(0.5, 20, (b, g, cp, rows_ml)).astype(np.float32)
    seen = rng.integers(1, chunks + 1, (b, rows_ml))  # chunks a row can see
    pos = ((seen - 1) * chunk_k + rng.integers(0, chunk_k, (b, rows_ml))).astype(np.int32)
    pos[:, rows - 1] = -1
    past = np.broadcast_to(np.arange(cp)[None, None, :, None] * chunk_k > pos[:, None, None, :], m.shape)
    m[past], l[past] = np.nan, np.nan
    o[past[..., :rows]] = np.nan
    return jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), jnp.asarray(pos)


def _combine(parts, rows, **kw):
    """The combine of `rows` (a slice) of the partials alone."""
    o, m, l, pos = parts
    return ac.combine(o[:, :, :, rows], m[:, :, :, rows], l[:, :, :, rows], pos[:, rows], **kw)


# (chunks, o rows, T, heads, head dim): dense27's 6 heads at 1 and 5 rows, one head, 16 heads (two row blocks)
CASES = [(5, 16, 2, 6, 128), (1, 8, 8, 1, 64), (32, 8, 1, 6, 256), (33, 32, 5, 6, 256), (3, 32, 2, 16, 64),
         (200, 8, 1, 6, 64)]  # the last: 256 chunks (a 64k span in 256-key chunks), summed 32 at a time


@pytest.mark.parametrize("chunks,rows,t,heads,e", CASES)
def test_interpret_combine_matches_reference_on_random_partials(chunks, rows, t, heads, e):
    o, m, l, pos = _partials(chunks, chunks=chunks, rows=rows, e=e)
    kw = dict(chunks=chunks, chunk_k=256, t=t, heads=heads, dtype=jnp.float32)
    got = np.asarray(ac.combine(o, m, l, pos, **kw, interpret=True))
    want = np.asarray(ac.reference(o, m, l, pos, **kw))
    assert got.shape == (2, t, 3 * heads, e) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.abs(got).max() > 0.1
    if t * heads == rows:  # the last row has no keys: exact zeros
        assert np.count_nonzero(got[:, t - 1, -1]) == 0


def test_interpret_combine_rows_are_their_own_whatever_the_rows_beside_them():
    parts = _partials(7, rows=24)
    kw = dict(chunks=5, chunk_k=256, heads=6, interpret=True)
    full = np.asarray(_combine(parts, slice(None), t=4, **kw)).view(np.uint16)
    for i in range(4):  # row i alone: its partials moved to the front, nothing beside them
        one = np.asarray(_combine(parts, slice(6 * i, 6 * i + 6), t=1, **kw)).view(np.uint16)
        np.testing.assert_array_equal(one[:, 0], full[:, i])


def test_bad_partials_raise_naming_the_value():
    o, m, l, pos = _partials(1)
    kw = dict(chunk_k=256, heads=6, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        ac.combine(o[:, :, :6], m[:, :, :6], l[:, :, :6], pos, chunks=5, t=2, **kw)
    with pytest.raises(ValueError, match="chunks=9"):
        ac.combine(o, m, l, pos, chunks=9, t=2, **kw)
    with pytest.raises(ValueError, match="t=3"):
        ac.combine(o, m, l, pos, chunks=5, t=3, **kw)
    with pytest.raises(ValueError, match="int32"):
        ac.combine(o, m, l, pos[:, :8], chunks=5, t=2, **kw)
    with pytest.raises(ValueError, match="head dim 80"):
        ac.combine(o[..., :80], m, l, pos, chunks=5, t=2, **kw)


def test_block_e_shrinks_with_the_chunks_and_heads_never_with_the_rows():
    assert [ac.DEFAULT.block_e(cp, 8, 256) for cp in (1, 16, 32, 64, 256)] == [64, 64, 32, 32, 32]
    assert ac.DEFAULT.block_e(16, 16, 256) == 32 and ac.DEFAULT.block_e(1, 8, 32) == 32


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,rows,t,heads,e", CASES + [(33, 48, 8, 6, 256)])
def test_gpu_combine_matches_reference_and_rows_keep_their_bits(chunks, rows, t, heads, e):
    parts = _partials(chunks, chunks=chunks, rows=rows, e=e)
    kw = dict(chunks=chunks, chunk_k=256, heads=heads, dtype=jnp.float32)
    got = np.asarray(ac.combine(*parts, t=t, **kw))
    np.testing.assert_allclose(got, np.asarray(ac.reference(*parts, t=t, **kw)), rtol=2e-5, atol=2e-6)
    last = slice((t - 1) * heads, t * heads)  # the last row alone: the rows beside it have no say in its bits
    one = np.asarray(_combine(parts, last, t=1, **kw))
    np.testing.assert_array_equal(one[:, 0].view(np.uint32), got[:, t - 1].view(np.uint32))
