"""The attention partials' combine kernel (Triton, interpret mode on CPU) against plain jax.numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_combine as ac
from pallas_kernels.attention import NEG


def _partials(seed, b=2, g=3, chunks=5, rows=16, rows_ml=64, e=128):
    # rows: the o rows written (T x heads rounded up to 8); the last is a padding row
    """Random partials with the shapes the Mosaic attention writes: chunks past a row's position (m = NEG, l = 0,
    o = 0), a padding row that sees no chunk, and NaN in the chunk axis' padding (never written on the GPU)."""
    rng = np.random.default_rng(seed)
    cp = ac.chunks_pad(chunks)
    o = rng.standard_normal((b, g, cp, rows, e)).astype(np.float32) * 3
    m = rng.standard_normal((b, g, cp, rows_ml)).astype(np.float32) * 4
    l = rng.uniform(0.5, 20, (b, g, cp, rows_ml)).astype(np.float32)
    seen = rng.integers(1, chunks + 1, (b, g, 1, rows_ml))  # chunks a row can see
    past = np.arange(cp)[None, None, :, None] >= seen
    m[past], l[past] = NEG, 0.0
    o[past[..., :rows]] = 0.0
    m[:, :, :, rows - 1], l[:, :, :, rows - 1], o[:, :, :, rows - 1] = NEG, 0.0, 0.0  # a padding row
    o[:, :, chunks:], m[:, :, chunks:], l[:, :, chunks:] = np.nan, np.nan, np.nan
    return jnp.asarray(o), jnp.asarray(m), jnp.asarray(l)


# (chunks, o rows, T, heads, head dim): dense27's 6 heads at 1 and 5 rows, one head, 16 heads (two row blocks)
CASES = [(5, 16, 2, 6, 128), (1, 8, 8, 1, 64), (32, 8, 1, 6, 256), (33, 32, 5, 6, 256), (3, 32, 2, 16, 64)]


@pytest.mark.parametrize("chunks,rows,t,heads,e", CASES)
def test_interpret_combine_matches_reference_on_random_partials(chunks, rows, t, heads, e):
    o, m, l = _partials(chunks, chunks=chunks, rows=rows, e=e)
    got = np.asarray(ac.combine(o, m, l, chunks=chunks, t=t, heads=heads, dtype=jnp.float32, interpret=True))
    want = np.asarray(ac.reference(o, m, l, chunks=chunks, t=t, heads=heads, dtype=jnp.float32))
    assert got.shape == (2, t, 3 * heads, e) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.abs(got).max() > 0.1
    if t * heads == rows:  # the last row has no keys: exact zeros
        assert np.count_nonzero(got[:, t - 1, -1]) == 0


def test_interpret_combine_rows_are_their_own_whatever_the_rows_beside_them():
    o, m, l = _partials(7, rows=24)
    full = np.asarray(ac.combine(o, m, l, chunks=5, t=4, heads=6, interpret=True)).view(np.uint16)
    for i in range(4):  # row i alone: its partials moved to the front, nothing beside them
        rows = slice(6 * i, 6 * i + 6)
        one = np.asarray(ac.combine(o[:, :, :, rows], m[:, :, :, rows], l[:, :, :, rows], chunks=5, t=1, heads=6,
                                    interpret=True)).view(np.uint16)
        np.testing.assert_array_equal(one[:, 0], full[:, i])


def test_bad_partials_raise_naming_the_value():
    o, m, l = _partials(1)
    with pytest.raises(ValueError, match="power of two"):
        ac.combine(o[:, :, :6], m[:, :, :6], l[:, :, :6], chunks=5, t=2, heads=6, interpret=True)
    with pytest.raises(ValueError, match="chunks=9"):
        ac.combine(o, m, l, chunks=9, t=2, heads=6, interpret=True)
    with pytest.raises(ValueError, match="t=3"):
        ac.combine(o, m, l, chunks=5, t=3, heads=6, interpret=True)


def test_block_e_shrinks_with_the_chunks_and_heads_never_with_the_rows():
    assert [ac.DEFAULT.block_e(cp, 8, 256) for cp in (1, 16, 32, 64, 128)] == [64, 64, 32, 16, 16]
    assert ac.DEFAULT.block_e(16, 16, 256) == 32 and ac.DEFAULT.block_e(1, 8, 32) == 32


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,rows,t,heads,e", CASES + [(33, 48, 8, 6, 256)])
def test_gpu_combine_matches_reference_and_rows_keep_their_bits(chunks, rows, t, heads, e):
    o, m, l = _partials(chunks, chunks=chunks, rows=rows, e=e)
    got = np.asarray(ac.combine(o, m, l, chunks=chunks, t=t, heads=heads, dtype=jnp.float32))
    want = np.asarray(ac.reference(o, m, l, chunks=chunks, t=t, heads=heads, dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    last = slice((t - 1) * heads, t * heads)  # the last row alone: the rows beside it have no say in its bits
    one = np.asarray(ac.combine(o[:, :, :, last], m[:, :, :, last], l[:, :, :, last], chunks=chunks, t=1,
                                heads=heads, dtype=jnp.float32))
    np.testing.assert_array_equal(one[:, 0].view(np.uint32), got[:, t - 1].view(np.uint32))
