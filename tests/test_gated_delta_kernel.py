"""The Pallas Gated DeltaNet recurrence (`recurrent_qkv`, fed by the conv output) equals the reference; rows are
independent of how many share a call.

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


def test_qkv_count_replays_only_the_committed_rows():
    """With count c the state is exactly the state after the first c rows alone (replay after a rejection)."""
    state, qkv, g, beta = _qkv_case(np.random.default_rng(4), 2, 8, 2, 4, 16, 16)
    run = functools.partial(gdk.recurrent_qkv, key_heads=2, interpret=True)
    got, _ = run(state, qkv, g, beta, jnp.asarray([3, 8], jnp.int32))
    first3, _ = run(state[:1], qkv[:1, :3], g[:1, :3], beta[:1, :3])
    whole, _ = run(state[1:], qkv[1:], g[1:], beta[1:])
    np.testing.assert_array_equal(got[:1], first3)
    np.testing.assert_array_equal(got[1:], whole)


def test_qkv_bad_shapes_raise_naming_the_value():
    state, qkv, g, beta = _qkv_case(np.random.default_rng(3), 1, 2, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="qkv.shape"):
        gdk.recurrent_qkv(state, qkv[..., :-16], g, beta, key_heads=2, interpret=True)
    with pytest.raises(ValueError, match="beta.shape"):
        gdk.recurrent_qkv(state, qkv, g, beta[:, :1], key_heads=2, interpret=True)
    with pytest.raises(ValueError, match="count.shape"):
        gdk.recurrent_qkv(state, qkv, g, beta, jnp.zeros((3,), jnp.int32), key_heads=2, interpret=True)
    with pytest.raises(ValueError, match="block_v=24"):
        gdk.recurrent_qkv(state, qkv, g, beta, key_heads=2, block_sizes=gdk.BlockSizes(block_v=24), interpret=True)


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
