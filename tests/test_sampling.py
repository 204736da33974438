"""Keyed sampling: greedy is argmax, draws depend only on (seed, position, logits), filters are exact."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.sampling import SamplingParams, default_seed, greedy, gumbel_noise, sample, token_sha256

sample_jit = jax.jit(sample)


def _logits(rng: np.random.Generator, shape: tuple[int, ...]) -> jnp.ndarray:
    return jnp.asarray(rng.normal(size=shape).astype(np.float32) * 3)


def _draws(logits_row: np.ndarray, n: int, **params) -> np.ndarray:
    """n sampled tokens for the same logits at positions 0..n-1, one lane, n rows."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (1, n, len(logits_row)))
    positions = jnp.arange(n, dtype=jnp.int32)[None, :]
    return np.asarray(sample_jit(logits, positions, SamplingParams.create(1, **params)))[0]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_equals_argmax():
    rng = np.random.default_rng(0)
    logits = _logits(rng, (3, 4, 50))
    positions = jnp.asarray(rng.integers(0, 1000, (3, 4)), jnp.int32)
    params = SamplingParams.create(3, temperature=0.0, top_k=[0, 3, 1], top_p=[1.0, 0.5, 0.9], seed=[1, 2, 3])
    tokens = sample_jit(logits, positions, params)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_greedy_is_argmax_with_its_ties_and_nans():
    rng = np.random.default_rng(2)
    logits = np.round(rng.normal(size=(3, 4, 64)).astype(np.float32), 1)  # rounded: many ties
    logits[1, 2, [5, 9]] = np.nan  # argmax takes the first NaN
    logits[2, 0] = -np.inf
    got = jax.jit(greedy)(jnp.asarray(logits))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(logits), axis=-1))
    assert got.dtype == jnp.int32 and int(got[1, 2]) == 5


def test_greedy_lanes_beside_sampled_lanes_stay_argmax():
    rng = np.random.default_rng(1)
    logits = _logits(rng, (4, 3, 40))
    positions = jnp.asarray(rng.integers(0, 1000, (4, 3)), jnp.int32)
    params = SamplingParams.create(4, temperature=[0.0, 1.0, 0.0, 0.7], seed=[5, 6, 7, 8])
    tokens = np.asarray(sample_jit(logits, positions, params))
    greedy = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(tokens[[0, 2]], greedy[[0, 2]])


def _numpy_gumbel(seed: int, position: int, vocab: int) -> np.ndarray:
    """The keyed noise written out in numpy: lowbias32 hashes of (seed, position, id) -> 24-bit uniforms."""

    def mix(x):
        x = np.asarray(x, np.uint64) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    base = mix(mix(seed) ^ mix((position * 0x9E3779B9 + 0x632BE5AB) & 0xFFFFFFFF))
    ids = np.arange(vocab, dtype=np.uint64)
    bits = mix(base ^ mix((ids * 0x85EBCA6B + 0xC2B2AE35) & 0xFFFFFFFF))
    u = ((bits >> 8).astype(np.float64) + 0.5) / 2**24
    return (-np.log(-np.log(u))).astype(np.float32)


def test_sampled_token_matches_the_keyed_formula():
    rng = np.random.default_rng(2)
    logits = _logits(rng, (2, 3, 30))
    positions = jnp.asarray(rng.integers(0, 10_000, (2, 3)), jnp.int32)
    params = SamplingParams.create(2, temperature=[0.8, 1.3], seed=[11, 4_000_000_000])
    tokens = np.asarray(sample_jit(logits, positions, params))
    for lane in range(2):
        for row in range(3):
            noise = _numpy_gumbel(int(params.seed[lane]), int(positions[lane, row]), 30)
            assert np.allclose(noise, np.asarray(gumbel_noise(params.seed[lane], positions[lane, row],
                                                               jnp.arange(30))), rtol=1e-5, atol=1e-5)
            expect = np.argmax(np.asarray(logits[lane, row] / params.temperature[lane]) + noise)
            assert tokens[lane, row] == expect


@pytest.mark.parametrize("filters", [{}, {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.05}])
def test_same_seed_position_and_logits_give_same_token_wherever_placed(filters):
    rng = np.random.default_rng(3)
    vocab = 64
    for trial in range(8):
        row = _logits(rng, (vocab,))
        seed, position = int(rng.integers(0, 2**31)), int(rng.integers(0, 100_000))
        alone = sample_jit(
            row[None, None],
            jnp.array([[position]], jnp.int32),
            SamplingParams.create(1, 1.0, seed=seed, **filters),
        )
        lanes, rows = (4, 3) if trial % 2 else (2, 5)  # two batch shapes: few compiles
        lane, slot = int(rng.integers(0, lanes)), int(rng.integers(0, rows))
        batch = np.array(_logits(rng, (lanes, rows, vocab)))
        batch[lane, slot] = np.asarray(row)
        positions = np.asarray(rng.integers(0, 100_000, (lanes, rows)), np.int32)
        positions[lane, slot] = position
        seeds = rng.integers(0, 2**31, lanes)
        seeds[lane] = seed
        kw = {k: [v] * lanes for k, v in filters.items()}
        placed = sample_jit(
            jnp.asarray(batch), jnp.asarray(positions), SamplingParams.create(lanes, 1.0, seed=seeds, **kw)
        )
        assert int(placed[lane, slot]) == int(alone[0, 0])


def test_different_positions_give_different_draws():
    rng = np.random.default_rng(4)
    row = np.zeros(1000, np.float32) + rng.normal(size=1000).astype(np.float32) * 0.01  # near-uniform
    draws = _draws(row, 500, temperature=1.0, seed=9)
    assert len(set(draws.tolist())) > 300
    noise_a = gumbel_noise(jnp.uint32(9), jnp.int32(10), jnp.arange(100))
    noise_b = gumbel_noise(jnp.uint32(9), jnp.int32(11), jnp.arange(100))
    noise_c = gumbel_noise(jnp.uint32(10), jnp.int32(10), jnp.arange(100))
    assert not np.array_equal(noise_a, noise_b) and not np.array_equal(noise_a, noise_c)


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(5)
    logits = _logits(rng, (3, 5, 80))
    positions = jnp.asarray(rng.integers(0, 1000, (3, 5)), jnp.int32)
    tokens = sample_jit(logits, positions, SamplingParams.create(3, temperature=1.5, top_k=1, seed=[1, 2, 3]))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def test_small_top_p_equals_greedy():
    rng = np.random.default_rng(6)
    logits = _logits(rng, (3, 5, 80))
    positions = jnp.asarray(rng.integers(0, 1000, (3, 5)), jnp.int32)
    tokens = sample_jit(
        logits, positions, SamplingParams.create(3, temperature=1.0, top_p=1e-6, seed=[1, 2, 3])
    )
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))


def _check_frequencies(draws: np.ndarray, allowed: np.ndarray, probs: np.ndarray, tol: float = 0.05) -> None:
    assert set(draws.tolist()) <= set(allowed.tolist()), f"drew filtered tokens {set(draws) - set(allowed)}"
    expect = np.zeros_like(probs)
    expect[allowed] = probs[allowed] / probs[allowed].sum()
    freq = np.bincount(draws, minlength=len(probs)) / len(draws)
    np.testing.assert_allclose(freq, expect, atol=tol)


def test_top_k_draws_only_the_top_tokens_with_softmax_frequencies():
    rng = np.random.default_rng(7)
    row = rng.normal(size=8).astype(np.float32)
    draws = _draws(row, 2000, temperature=1.0, top_k=4, seed=123)
    allowed = np.argsort(-row, kind="stable")[:4]
    _check_frequencies(draws, allowed, _softmax(row))


def test_unfiltered_draws_follow_softmax_at_temperature():
    rng = np.random.default_rng(8)
    row = rng.normal(size=6).astype(np.float32)
    draws = _draws(row, 2000, temperature=0.7, seed=77)
    _check_frequencies(draws, np.arange(6), _softmax(row / 0.7))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.05, 0.3, 0.5, 0.15], np.float32)
    row = np.log(probs)
    draws = _draws(row, 2000, temperature=1.0, top_p=0.7, seed=5)  # 0.5, then 0.8 >= 0.7: keep {2, 1}
    _check_frequencies(draws, np.array([1, 2]), probs)


def test_top_p_ties_keep_the_lower_ids():
    row = np.full(4, 0.25, np.float32)
    draws = _draws(row, 2000, temperature=1.0, top_p=0.5, seed=6)  # 0.25 + 0.25 reaches 0.5: ids 0 and 1
    _check_frequencies(draws, np.array([0, 1]), np.full(4, 0.25))


def test_top_p_applies_to_the_top_k_distribution():
    probs = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    # top_k 2 renormalizes to [4/7, 3/7]; top_p 0.5 then keeps only token 0.
    draws = _draws(np.log(probs), 2000, temperature=1.0, top_k=2, top_p=0.5, seed=3)
    assert set(draws.tolist()) == {0}


def test_min_p_filters_tokens_below_its_share_of_the_top():
    probs = np.array([0.15, 0.5, 0.05, 0.3], np.float32)
    draws = _draws(np.log(probs), 2000, temperature=1.0, min_p=0.2, seed=8)  # threshold 0.1: drop 0.05
    _check_frequencies(draws, np.array([0, 1, 3]), probs)


def test_filtered_tokens_never_chosen_at_high_temperature():
    rng = np.random.default_rng(9)
    row = rng.normal(size=16).astype(np.float32)
    draws = _draws(row, 2000, temperature=5.0, top_k=3, seed=10)
    assert set(draws.tolist()) <= set(np.argsort(-row, kind="stable")[:3].tolist())


def test_ties_go_to_the_lower_id():
    row = np.array([1.0, 3.0, 2.0, 3.0, 3.0], np.float32)
    assert set(_draws(row, 500, temperature=0.0).tolist()) == {1}
    assert set(_draws(row, 500, temperature=1.0, top_k=1, seed=2).tolist()) == {1}
    assert set(_draws(row, 500, temperature=1.0, top_k=2, seed=2).tolist()) == {1, 3}


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.create(2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.create(2, top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams.create(2, min_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.create(2, top_k=-3)


def test_sampling_params_are_a_pytree():
    params = SamplingParams.create(3, temperature=0.5, seed=[1, 2, 3])
    leaves = jax.tree_util.tree_leaves(params)
    assert len(leaves) == 5 and all(leaf.shape == (3,) for leaf in leaves)


def test_token_sha256_matches_hashlib():
    ids = [151644, 872, 198, 0, 248319, 7]
    expect = hashlib.sha256(b"".join(i.to_bytes(4, "little", signed=True) for i in ids)).hexdigest()
    assert token_sha256(ids) == expect
    assert token_sha256(np.array(ids, np.int64)) == expect


def test_default_seed_is_a_stable_31_bit_hash_of_the_prompt():
    prompt = [9707, 11, 1879, 0, 42]
    seed = default_seed(prompt)
    digest = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in prompt)).digest()
    assert seed == int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
    assert 0 <= seed < 2**31 and default_seed(prompt + [1]) != seed


def _full_vocabulary_formula(logits, positions, params) -> np.ndarray:
    """The keyed draw over the whole vocabulary: full-sort filter mask, noise for every id."""
    from tfjax.sampling import _keep_mask

    scaled = logits / params.temperature[:, None, None] + 0.0
    keep = _keep_mask(scaled, params.top_k, params.top_p, params.min_p)
    noise = gumbel_noise(params.seed[:, None, None], positions[..., None], jnp.arange(logits.shape[-1]))
    return np.asarray(jnp.argmax(jnp.where(keep, scaled + noise, -jnp.inf), axis=-1))


def test_candidate_path_draws_what_the_full_vocabulary_formula_draws():
    """Lanes with top_k within CANDIDATES sample among lax.top_k candidates: the same token as the formula
    over the whole vocabulary (full-sort filter mask, noise for every id)."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 4, 1000)).astype(np.float32)
    logits[..., 500:520] = logits[..., :20]  # ties across ids
    logits = jnp.asarray(np.round(logits, 1))
    positions = jnp.asarray(rng.integers(0, 5000, (3, 4)), jnp.int32)
    params = SamplingParams.create(3, temperature=[1.0, 0.7, 1.5], top_k=[20, 1, 256], top_p=[0.9, 1.0, 0.5],
                                   min_p=[0.0, 0.0, 0.05], seed=[1, 2, 3])
    tokens = np.asarray(sample_jit(logits, positions, params))
    assert np.array_equal(tokens, _full_vocabulary_formula(logits, positions, params))


def test_top_p_and_min_p_without_top_k_draw_the_full_formulas_token_inside_or_past_the_candidates():
    """A lane with top-p or min-p and no top-k samples among the candidates when its nucleus closes inside them
    (peaked rows), else over the sorted vocabulary (flat rows): either way the full formula's token, with ties."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((4, 6, 1000)).astype(np.float32)
    logits[:, :3] *= 6.0  # peaked rows: a 0.9 nucleus of a few dozen tokens, inside the 256 candidates
    logits[:, 3:] *= 0.05  # flat rows: a 0.9 nucleus of ~900 tokens, past them
    logits[..., 600:640] = logits[..., :40]  # ties across ids
    logits = jnp.asarray(np.round(logits, 2))
    positions = jnp.asarray(rng.integers(0, 5000, (4, 6)), jnp.int32)
    params = SamplingParams.create(4, temperature=[1.0, 0.8, 1.2, 1.0], top_k=0, top_p=[0.9, 0.95, 1.0, 0.5],
                                   min_p=[0.0, 0.0, 0.1, 0.02], seed=[4, 5, 6, 7])
    tokens = np.asarray(sample_jit(logits, positions, params))
    assert np.array_equal(tokens, _full_vocabulary_formula(logits, positions, params))
    assert len(set(tokens[0].tolist())) > 1  # drawn, not argmax
