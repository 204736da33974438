"""The MoE router's top-k: the same experts and probabilities as `lax.top_k`, ties included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.models.qwen3_5 import top_k_by_argmax


def test_top_k_by_argmax_equals_lax_top_k_on_fresh_router_probabilities():
    rng = np.random.default_rng(0)
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((13, 256)), jnp.float32), axis=-1)
    got, want = top_k_by_argmax(p, 8), jax.lax.top_k(p, 8)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_top_k_by_argmax_takes_the_lower_index_on_ties_as_lax_top_k_does():
    p = jnp.asarray([[0.1, 0.3, 0.3, 0.2, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]], jnp.bfloat16)
    got, want = top_k_by_argmax(p, 4), jax.lax.top_k(p, 4)
    assert np.asarray(got[1]).tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]] == np.asarray(want[1]).tolist()
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
