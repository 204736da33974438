"""The Pallas Gated DeltaNet recurrence equals the reference; rows are independent of how many share a call.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import functools

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


def test_model_recurrence_takes_the_kernel_with_kernels_and_the_reference_without(monkeypatch):
    """`ops.recurrent` goes to the kernel with kernels on and to the reference with them off."""
    from tfjax import ops

    calls = spy_interpreted(monkeypatch, gdk, "recurrent", lambda args, kw: "kernel")
    args = _case(np.random.default_rng(5), 2, 3, 2, 16, 16)
    count = jnp.asarray([3, 1], jnp.int32)
    want, _ = gdk.recurrent_reference(*args, count)
    with ops.using(ops.REFERENCE):
        got, _ = ops.recurrent(*args, count)
    assert calls == [] and rel_err(got, want) == 0, "kernels off: the reference"
    with ops.using(ops.PALLAS):
        got, _ = ops.recurrent(*args, count)
    assert calls == ["kernel"] and rel_err(got, want) < 1e-6


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


def _qkv_case(rng, b, t, key_heads, hv, dk, dv, dtype=jnp.float32):
    """Fresh random state, conv outputs [B, T, 2 Hk Dk + Hv Dv] and gates."""
    state = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), jnp.float32)
    qkv = jnp.asarray(rng.standard_normal((b, t, 2 * key_heads * dk + hv * dv)), dtype)
    g = jnp.asarray(-np.abs(rng.standard_normal((b, t, hv))) * 0.5, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, t, hv)))), jnp.float32)
    return state, qkv, g, beta


# key heads 2 of 4 value heads (GQA), 1 of 2; T 1, 3 (padded to 4), 8; counts: all, some, none; f32 and bf16 out
@pytest.mark.parametrize("t,key_heads,hv,count,dtype", [(3, 2, 4, [2, 0], jnp.float32), (1, 2, 6, None, jnp.bfloat16),
                                                        (8, 1, 2, [8, 5], jnp.bfloat16)])
def test_qkv_interpret_matches_split_norm_repeat_then_reference(t, key_heads, hv, count, dtype):
    rng = np.random.default_rng(t)
    args = _qkv_case(rng, 2, t, key_heads, hv, 16, 32, dtype)
    count = None if count is None else jnp.asarray(count, jnp.int32)
    state, out = gdk.recurrent_qkv(*args, count, key_heads=key_heads, out_dtype=dtype, interpret=True)
    ref_state, ref_out = gdk.qkv_reference(*args, count, key_heads=key_heads, out_dtype=dtype)
    assert out.dtype == dtype and out.shape == (2, t, hv, 32)
    assert rel_err(state, ref_state) < 1e-6 and rel_err(out, ref_out) < (1e-6 if dtype == jnp.float32 else 1e-2)


def test_qkv_rows_together_equal_rows_one_at_a_time():
    rng = np.random.default_rng(2)
    state, qkv, g, beta = _qkv_case(rng, 1, 5, 2, 4, 16, 16, jnp.bfloat16)
    run = functools.partial(gdk.recurrent_qkv, key_heads=2, out_dtype=jnp.bfloat16, interpret=True)
    together_state, together = run(state, qkv, g, beta)
    s, outs = state, []
    for i in range(5):
        s, o = run(s, qkv[:, i : i + 1], g[:, i : i + 1], beta[:, i : i + 1])
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), together)
    np.testing.assert_array_equal(s, together_state)


def test_qkv_bad_shapes_raise_naming_the_value():
    state, qkv, g, beta = _qkv_case(np.random.default_rng(3), 1, 2, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="qkv.shape"):
        gdk.recurrent_qkv(state, qkv[..., :-16], g, beta, key_heads=2, interpret=True)
    with pytest.raises(ValueError, match="beta.shape"):
        gdk.recurrent_qkv(state, qkv, g, beta[:, :1], key_heads=2, interpret=True)


def test_qkv_lowers_to_triton_for_cuda_without_a_gpu():
    """dense27's DeltaNet: 16 key heads, 48 value heads of 128, conv width 10240; bf16 out."""
    sds = jax.ShapeDtypeStruct
    gates = sds((1, 1, 48), jnp.float32)
    text = gdk.recurrent_qkv.trace(sds((1, 48, 128, 128), jnp.float32), sds((1, 1, 10240), jnp.bfloat16), gates,
                                   gates, sds((1,), jnp.int32), key_heads=16, out_dtype=jnp.bfloat16).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and 'name = "gated_delta_recurrent_qkv"' in text


def test_model_rows_take_the_fused_kernels_and_replay_through_them(monkeypatch):
    """With kernels on, a DeltaNet layer's lane rows go through the window conv and the qkv recurrence (two
    launches) and give the reference path's outputs, next conv tail and state; replay re-runs the fused kernel."""
    from pallas_kernels import causal_conv as cc
    from pallas_kernels import matmul as mm
    from pallas_kernels import row_norm as rn
    from tfjax import geometry, models, ops
    from tfjax.models.layers import ROWS
    from tfjax.models.qwen3_5 import DeltaState, GatedDeltaNet, replay

    c = geometry.tiny_dense
    model = models.build(c, seed=1)
    layer = next(m for _, m in models.nnx.iter_modules(model) if isinstance(m, GatedDeltaNet))
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((2, 3, c.hidden_size)), jnp.float32)
    start = DeltaState(jnp.asarray(rng.standard_normal((2, c.linear_conv_kernel_dim - 1, c.linear_conv_dim)), jnp.float32),
                       jnp.asarray(rng.standard_normal((2, c.linear_num_value_heads, c.linear_key_head_dim,
                                                        c.linear_value_head_dim)) * 0.1, jnp.float32))
    valid, count = jnp.asarray([3, 3], jnp.int32), jnp.asarray([1, 3], jnp.int32)
    want, want_cache, want_trace = layer(x, start, valid, ROWS)
    want_replay = replay(start, want_trace, count)
    convs = spy_interpreted(monkeypatch, cc, "conv_silu_window", lambda args, kw: "conv")
    recurrences = spy_interpreted(monkeypatch, gdk, "recurrent_qkv", lambda args, kw: "recurrence")
    spy_interpreted(monkeypatch, rn, "row_norm", lambda args, kw: "norm")
    monkeypatch.setattr(ops, "_FORCE", "kernel")
    spy_interpreted(monkeypatch, mm, "matmul", lambda args, kw: "matmul")  # projections: the dense kernel
    got, got_cache, got_trace = layer(x, start, valid, ROWS)
    assert got_trace.qkv is not None and got_trace.q is None
    got_replay = replay(start, got_trace, count)
    assert convs == ["conv"] and recurrences == ["recurrence", "recurrence"]
    assert rel_err(got, want) < 1e-5 and rel_err(got_cache.state, want_cache.state) < 1e-5
    np.testing.assert_array_equal(got_cache.conv, want_cache.conv)
    assert rel_err(got_replay.state, want_replay.state) < 1e-5
    np.testing.assert_array_equal(got_replay.conv, want_replay.conv)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_qkv_matches_reference_and_rows_together_equal_one_at_a_time(t):
    assert jax.default_backend() == "gpu"
    state, qkv, g, beta = _qkv_case(np.random.default_rng(t), 2, t, 16, 48, 128, 128, jnp.bfloat16)
    count = jnp.asarray([t, 1], jnp.int32)
    run = functools.partial(gdk.recurrent_qkv, key_heads=16, out_dtype=jnp.bfloat16)
    got_state, got = run(state, qkv, g, beta, count)
    ref_state, ref = gdk.qkv_reference(state, qkv, g, beta, count, key_heads=16, out_dtype=jnp.bfloat16)
    assert rel_err(got_state, ref_state) < 1e-5 and rel_err(got, ref) < 1e-2
    s, outs = state[:1], []
    for i in range(t):
        s, o = run(s, qkv[:1, i : i + 1], g[:1, i : i + 1], beta[:1, i : i + 1])
        outs.append(o)
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), got[:1])
    np.testing.assert_array_equal(s, got_state[:1])
