"""Root copies: the jitted proposer equals the plain reference; the most recent match wins."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax.lanes.copies import propose_copies, propose_copies_reference


def _planted_histories(rng: np.random.Generator, lanes: int, size: int, vocab: int):
    """Random histories, each with a repeated span planted so that many lanes have a match."""
    history = rng.integers(1, vocab, (lanes, size)).astype(np.int32)
    length = rng.integers(1, size + 1, lanes).astype(np.int32)
    for lane in range(lanes):
        n = int(length[lane])
        if n >= 12 and rng.random() < 0.8:
            span = int(rng.integers(2, min(10, n // 2) + 1))
            start = int(rng.integers(0, n - 2 * span + 1))
            history[lane, n - span : n] = history[lane, start : start + span]
    return history, length


@pytest.mark.parametrize("copy_match,max_proposals", [(1, 4), (2, 3), (3, 7), (5, 5)])
def test_jitted_copies_equal_the_reference_on_planted_repeats(copy_match, max_proposals):
    rng = np.random.default_rng(copy_match)
    for vocab in (3, 6, 50):
        history, length = _planted_histories(rng, lanes=9, size=40, vocab=vocab)
        got = propose_copies(jnp.asarray(history), jnp.asarray(length), copy_match, max_proposals)
        want = propose_copies_reference(history, length, copy_match, max_proposals)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])
        assert 0 < want[1].sum(), "the planted repeats should give some lane a proposal"


def test_most_recent_occurrence_wins():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    history = [[7, 8, 1, 2, 9, 7, 8, 3, 4, 5, 7, 8]]
    proposals, count = propose_copies(jnp.asarray(history, jnp.int32), jnp.array([12]), 2, 3)
    assert count.tolist() == [3] and proposals.tolist() == [[3, 4, 5]]  # after positions 5..6, not 0..1


def test_no_proposal_when_the_match_is_shorter_than_copy_match():
    # The earlier [1, 2, 3] is preceded by 4, the suffix's by 5: a 3-token match, not a 4-token one.
    history = np.array([[4, 1, 2, 3, 9, 6, 8, 5, 1, 2, 3]], np.int32)
    length = jnp.array([11])
    assert propose_copies(jnp.asarray(history), length, 3, 4)[1].tolist() == [4]
    proposals, count = propose_copies(jnp.asarray(history), length, 4, 4)
    assert count.tolist() == [0] and proposals.tolist() == [[0, 0, 0, 0]]


def test_proposals_stop_at_the_history_end():
    history = np.array([[5, 6, 1, 2, 5, 6, 99, 99]], np.int32)  # positions >= 6 are garbage
    proposals, count = propose_copies(jnp.asarray(history), jnp.array([6]), 2, 5)
    assert count.tolist() == [4] and proposals.tolist() == [[1, 2, 5, 6, 0]]


def test_garbage_past_the_length_never_matches():
    history = np.array([[3, 4, 1, 2, 3, 4, 8]], np.int32)  # the 3, 4 at 4..5 are past the length 4
    proposals, count = propose_copies(jnp.asarray(history), jnp.array([4]), 2, 3)
    assert count.tolist() == [0]


def test_short_histories_propose_nothing():
    history = np.array([[1, 1, 1, 1], [2, 2, 0, 0], [3, 0, 0, 0]], np.int32)
    proposals, count = propose_copies(jnp.asarray(history), jnp.array([4, 2, 1]), 2, 3)
    assert count.tolist() == [1, 0, 0]  # [1, 1] ends at 2, then one more token before the end


def test_copy_match_zero_is_rejected():
    with pytest.raises(ValueError, match="copy_match"):
        propose_copies(jnp.ones((1, 4), jnp.int32), jnp.array([4]), 0, 3)
