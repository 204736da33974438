"""The Pallas row norms equal their reference; a row's result never depends on the other rows in the call.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import row_norm as rn
from tests.helpers import rel_err, spy_interpreted


def _case(rng, m, d, kind, dtype=jnp.float32):
    """Fresh random rows (scaled away from 1), weight and gate for `kind`."""
    x = jnp.asarray(rng.standard_normal((m, d)) * 3.0 + 0.5, dtype)
    w = None if kind == "l2" else jnp.asarray(rng.standard_normal(d) * 0.2 + (0.0 if kind == "rms_offset" else 1.0),
                                               dtype)
    z = jnp.asarray(rng.standard_normal((m, d)), dtype) if kind == "gated" else None
    return x, w, z


def test_pieces_cover_the_row_in_powers_of_two():
    assert rn.pieces(576) == ((0, 512), (512, 64))
    assert rn.pieces(5120) == ((0, 4096), (4096, 1024))
    assert rn.pieces(128) == ((0, 128),)
    assert rn.pieces(7) == ((0, 4), (4, 2), (6, 1))


# D: a power of two (head dims), SmolLM2's 576 and a ragged 200 (three pieces); M = 1 and a few rows
@pytest.mark.parametrize("kind", rn.KINDS)
@pytest.mark.parametrize("m,d", [(1, 128), (5, 576), (3, 200)])
def test_interpret_matches_reference(kind, m, d):
    x, w, z = _case(np.random.default_rng(d + m), m, d, kind)
    got = rn.row_norm(x, w, z, kind=kind, eps=1e-6, interpret=True)
    want = rn.reference(x, w, z, kind=kind, eps=1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("kind", ["rms", "rms_offset", "gated"])
def test_bf16_rows_match_reference_within_one_rounding(kind):
    x, w, z = _case(np.random.default_rng(9), 4, 576, kind, jnp.bfloat16)
    got = rn.row_norm(x, w, z, kind=kind, eps=1e-5, interpret=True)
    want = rn.reference(x, w, z, kind=kind, eps=1e-5)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2


def test_interpret_each_row_equals_the_row_alone():
    """Row invariance: rows normalised together are bit-identical to each row normalised alone."""
    x, w, z = _case(np.random.default_rng(3), 6, 576, "gated")
    together = rn.row_norm(x, w, z, kind="gated", eps=1e-6, interpret=True)
    for i in range(6):
        alone = rn.row_norm(x[i : i + 1], w, z[i : i + 1], kind="gated", eps=1e-6, interpret=True)
        np.testing.assert_array_equal(alone[0], together[i])


def test_bad_arguments_raise_naming_the_value():
    x, w, z = _case(np.random.default_rng(4), 2, 64, "gated")
    with pytest.raises(ValueError, match="kind="):
        rn.row_norm(x, w, kind="layer", eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="weight.shape"):
        rn.row_norm(x, w[:32], kind="rms", eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="gate z"):
        rn.row_norm(x, w, kind="gated", eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="takes no weight"):
        rn.row_norm(x, w, kind="l2", eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="rows x"):
        rn.row_norm(x[0], w, kind="rms", eps=1e-6, interpret=True)


def test_model_rows_take_the_kernel_only_with_kernels(monkeypatch):
    """`ops.row_norm` sends lane-round rows to the kernel when kernels are on; prompts and the CPU stay on jnp."""
    from tfjax import ops

    calls = spy_interpreted(monkeypatch, rn, "row_norm", lambda args, kw: kw["kind"])
    x, w, _ = _case(np.random.default_rng(5), 12, 96, "rms")
    x = x.reshape(2, 3, 2, 96)
    want = rn.reference(x, w, kind="rms", eps=1e-6)
    assert rel_err(ops.row_norm(x, w, kind="rms", eps=1e-6, rows=True), want) < 1e-6 and calls == []
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    assert rel_err(ops.row_norm(x, w, kind="rms", eps=1e-6, rows=False), want) < 1e-6 and calls == []
    got = ops.row_norm(x, w, kind="rms", eps=1e-6, rows=True)
    assert calls == ["rms"] and got.shape == x.shape and rel_err(got, want) < 1e-6


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """The compiled path's Pallas -> Triton lowering at dense27's hidden size, checked on the CPU."""
    x = jax.ShapeDtypeStruct((8, 5120), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5120,), jnp.bfloat16)
    text = jax.jit(lambda x, w: rn.row_norm(x, w, kind="rms_offset", eps=1e-6)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "row_norm_rms_offset" in text


def _add_case(rng, splits, m, d, parts_dtype=jnp.float32, dtype=jnp.bfloat16):
    """A residual row block, an update as `splits` partial sums (fresh random, scaled away from zero) and a weight."""
    x = jnp.asarray(rng.standard_normal((m, d)) * 2.0 + 0.3, dtype)
    parts = jnp.asarray(rng.standard_normal((splits, m, d)), parts_dtype)
    w = jnp.asarray(rng.standard_normal(d) * 0.2, dtype)
    return x, parts, w


def test_add_norm_sums_partials_in_order_then_normalises_with_the_row_kernel(monkeypatch):
    """`ops.add_norm`: the update's partial sums added in order (the same bits on every path), then one norm: the
    fixed-tile reference off the kernels, the row kernel on them."""
    from tfjax import ops

    norms = spy_interpreted(monkeypatch, rn, "row_norm", lambda args, kw: args[0].shape)
    x, parts, w = _add_case(np.random.default_rng(14), 4, 6, 96)
    x, parts = x.reshape(2, 3, 96), parts.reshape(4, 2, 3, 96)
    want_nx = (x + (parts[0] + parts[1] + parts[2] + parts[3]).astype(x.dtype))
    want_y = rn.reference(want_nx, w, kind="rms", eps=1e-6)
    nx, y = ops.add_norm(x, parts, w, kind="rms", eps=1e-6, rows=True)
    assert norms == [] and (nx == want_nx).all() and rel_err(y, want_y) < 1e-2
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    nx, y = ops.add_norm(x, parts, w, kind="rms", eps=1e-6, rows=True)
    assert norms == [(6, 96)] and nx.shape == y.shape == x.shape
    assert (nx == want_nx).all() and rel_err(y, want_y) < 1e-2


# The same cases compiled on a GPU: `pytest -m gpu tests/test_row_norm_kernel.py` on the device.
@pytest.mark.gpu
@pytest.mark.parametrize("kind", rn.KINDS)
@pytest.mark.parametrize("m,d", [(1, 128), (40, 576), (3, 5120)])
def test_gpu_matches_reference(kind, m, d):
    assert jax.default_backend() == "gpu"
    x, w, z = _case(np.random.default_rng(d + m), m, d, kind)
    assert rel_err(rn.row_norm(x, w, z, kind=kind, eps=1e-6), rn.reference(x, w, z, kind=kind, eps=1e-6)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("d", [256, 5120])
def test_gpu_each_row_equals_the_row_alone(d):
    assert jax.default_backend() == "gpu"
    x, w, z = _case(np.random.default_rng(6), 64, d, "gated", jnp.bfloat16)
    together = rn.row_norm(x, w, z, kind="gated", eps=1e-6)
    for i in (0, 17, 63):
        alone = rn.row_norm(x[i : i + 1], w, z[i : i + 1], kind="gated", eps=1e-6)
        np.testing.assert_array_equal(alone[0], together[i])
