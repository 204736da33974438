"""The Pallas Gated DeltaNet recurrence equals the reference; rows are independent of how many share a call.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta as gdk
from tests.helpers import rel_err, spy_interpreted


def _case(rng, b, t, h, dk, dv, dtype=jnp.float32):
    """Fresh random state and rows: unit-norm-ish keys, decays g < 0, beta in (0, 1)."""
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, h, dk)) / dk**0.5, dtype)
    k = jnp.asarray(rng.standard_normal((b, t, h, dk)) / dk**0.5, dtype)
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), dtype)
    g = jnp.asarray(-np.abs(rng.standard_normal((b, t, h))) * 0.5, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, t, h)))), jnp.float32)
    return state, q, k, v, g, beta


def _check(args, count, interpret, tol):
    state, out = gdk.recurrent(*args, count, interpret=interpret)
    ref_state, ref_out = gdk.reference(*args, count)
    assert rel_err(state, ref_state) < tol and rel_err(out, ref_out) < tol


# T: one row (decode), 3 (padded to 4), 8 (a verify block); counts: all rows, some, none
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("count", [None, [2, 0]])
def test_interpret_matches_reference(t, count):
    rng = np.random.default_rng(t)
    args = _case(rng, 2, t, 3, 16, 32)
    _check(args, None if count is None else jnp.asarray(count, jnp.int32), True, 1e-6)


def test_interpret_rows_together_equal_rows_one_at_a_time():
    """Verify rows fed in one call give bit-for-bit the outputs and state of feeding them one by one."""
    rng = np.random.default_rng(1)
    state, q, k, v, g, beta = _case(rng, 2, 8, 3, 32, 32)
    together_state, together = gdk.recurrent(state, q, k, v, g, beta, interpret=True)
    s, outs = state, []
    for i in range(8):
        s, o = gdk.recurrent(s, *(a[:, i : i + 1] for a in (q, k, v, g, beta)), interpret=True)
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), together)
    np.testing.assert_array_equal(s, together_state)


def test_interpret_count_replays_only_the_committed_rows():
    """With count c the state is exactly the state after the first c rows alone (replay after a rejection)."""
    rng = np.random.default_rng(2)
    args = _case(rng, 2, 8, 3, 16, 16)
    state, _ = gdk.recurrent(*args, jnp.asarray([3, 8], jnp.int32), interpret=True)
    first3, _ = gdk.recurrent(args[0][:1], *(a[:1, :3] for a in args[1:]), interpret=True)
    whole, _ = gdk.recurrent(args[0][1:], *(a[1:] for a in args[1:]), interpret=True)
    np.testing.assert_array_equal(state[:1], first3)
    np.testing.assert_array_equal(state[1:], whole)


def test_bf16_rows_match_reference():
    rng = np.random.default_rng(3)
    _check(_case(rng, 1, 4, 2, 64, 64, jnp.bfloat16), None, True, 1e-6)


def test_bad_shapes_raise_naming_the_value():
    rng = np.random.default_rng(4)
    state, q, k, v, g, beta = _case(rng, 1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="v.shape"):
        gdk.recurrent(state, q, k, v[..., :8], g, beta, interpret=True)
    with pytest.raises(ValueError, match="count.shape"):
        gdk.recurrent(state, q, k, v, g, beta, jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_v=24"):
        gdk.recurrent(state, q, k, v, g, beta, block_sizes=gdk.BlockSizes(block_v=24), interpret=True)
    with pytest.raises(ValueError, match="powers of 2"):
        gdk.recurrent(state[..., :12], q, k, v[..., :12], g, beta, interpret=True)


def test_model_recurrence_takes_the_kernel_with_kernels_unless_switched_off(monkeypatch):
    """`gated_delta.recurrent` goes to the kernel with kernels on, the reference with TFJAX_DELTA_KERNEL=0."""
    from tfjax import ops
    from tfjax.models import gated_delta

    calls = spy_interpreted(monkeypatch, gdk, "recurrent", lambda args, kw: "kernel")
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    args = _case(np.random.default_rng(5), 2, 3, 2, 16, 16)
    count = jnp.asarray([3, 1], jnp.int32)
    want, _ = gated_delta.recurrent_reference(*args, count)
    got, _ = gated_delta.recurrent(*args, count)
    assert calls == ["kernel"] and rel_err(got, want) < 1e-6
    monkeypatch.setenv("TFJAX_DELTA_KERNEL", "0")
    got, _ = gated_delta.recurrent(*args, count)
    assert calls == ["kernel"] and rel_err(got, want) == 0, "switched off: the reference"


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """The compiled path's Pallas -> Triton lowering at the dense27 shape, checked on the CPU."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    state = jax.ShapeDtypeStruct((2, 48, 128, 128), f32)
    rows = jax.ShapeDtypeStruct((2, 8, 48, 128), bf16)
    gates = jax.ShapeDtypeStruct((2, 8, 48), f32)
    count = jax.ShapeDtypeStruct((2,), jnp.int32)
    text = gdk.recurrent.trace(state, rows, rows, rows, gates, gates, count).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and 'name = "gated_delta_recurrent"' in text


# Compiled on a GPU at the dense27 geometry (48 value heads of 128): `pytest -m gpu tests/test_gated_delta_kernel.py`.
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_matches_reference(t):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(t)
    _check(_case(rng, 2, t, 48, 128, 128, jnp.bfloat16), jnp.asarray([t, 1], jnp.int32), False, 1e-5)


@pytest.mark.gpu
def test_gpu_rows_together_equal_rows_one_at_a_time():
    rng = np.random.default_rng(6)
    state, q, k, v, g, beta = _case(rng, 1, 8, 48, 128, 128, jnp.bfloat16)
    together_state, together = gdk.recurrent(state, q, k, v, g, beta)
    s, outs = state, []
    for i in range(8):
        s, o = gdk.recurrent(s, *(a[:, i : i + 1] for a in (q, k, v, g, beta)))
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), together)
    np.testing.assert_array_equal(s, together_state)
