"""DeltaNet forms agree: chunked == recurrent; prefill then steps == one prefill; replay == plain decoding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import geometry, models, ops
from tfjax.models.layers import PROMPT


def _inputs(b=2, t=70, h=4, dk=16, dv=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, h, dk))
    k = jax.random.normal(ks[1], (b, t, h, dk))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv)) * 0.1
    return s0, q, k, v, g, beta


def test_chunked_equals_recurrent():
    s0, *xs = _inputs()
    s_r, o_r = ops.recurrent(s0, *xs)
    s_c, o_c = ops.chunked(s0, *xs, chunk=16)
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), rtol=1e-4, atol=1e-4)


def test_recurrent_with_count_stops_each_lane_at_its_count():
    s0, *xs = _inputs(t=9)
    count = jnp.array([3, 7])
    s_masked, _ = ops.recurrent(s0, *xs, count=count)
    for lane, n in enumerate([3, 7]):
        s_plain, _ = ops.recurrent(s0[lane : lane + 1], *(x[lane : lane + 1, :n] for x in xs))
        np.testing.assert_array_equal(np.asarray(s_masked[lane]), np.asarray(s_plain[0]))


def test_prefill_then_steps_equals_one_prefill_of_the_whole():
    model = models.build(geometry.tiny_dense, seed=4)
    graphdef, params = models.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 37)))
    mode = dataclasses.replace(PROMPT, last_only=False)
    whole, _, _ = models.forward(graphdef, params, tokens, jnp.array([0]), jnp.array([37]), model.init_cache(1, 64), mode)
    cache = model.init_cache(1, 64)
    first, cache, _ = models.forward(graphdef, params, tokens[:, :30], jnp.array([0]), jnp.array([30]), cache, mode)
    rest, _, _ = models.forward(graphdef, params, tokens[:, 30:], jnp.array([30]), jnp.array([7]), cache, mode)
    both = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
    np.testing.assert_allclose(both, np.asarray(whole), rtol=1e-4, atol=1e-4)


def test_padded_prefill_rows_leave_the_state_alone():
    model = models.build(geometry.tiny_dense, seed=5)
    graphdef, params = models.split(model)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 24)))
    exact, c1, _ = models.forward(graphdef, params, tokens[:, :17], jnp.array([0]), jnp.array([17]),
                                  model.init_cache(1, 64), PROMPT)
    padded, c2, _ = models.forward(graphdef, params, tokens, jnp.array([0]), jnp.array([17]),
                                   model.init_cache(1, 64), PROMPT)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(exact), rtol=1e-5, atol=1e-5)
    for a, b in zip(c1.layers, c2.layers, strict=True):
        if hasattr(a, "state"):
            np.testing.assert_allclose(np.asarray(a.state), np.asarray(b.state), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(a.conv), np.asarray(b.conv))
