"""Penalties, logit_bias and logprobs inside the lane round: exact when drafting, bit-identical when off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import models, sampling
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import ROWS

LANES = LaneConfig(capacity=4, width=5, context=160, page_size=16)
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95)
PROCESSED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logprobs=True, top_logprobs=3)


def _prompt(seed: int, n: int = 40) -> list[int]:
    """A prompt with a repeated span, so root copies propose."""
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 250, 12).tolist()
    return (rng.integers(0, 250, n - 24).tolist() + span + span)[:n]


def _bias(seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {int(t): float(v) for t, v in zip(rng.choice(256, 6, replace=False), rng.uniform(-5, 5, 6), strict=True)}


def _run(target, requests, copy_match=0):
    engine = Engine(target, LANES, eos_ids=())
    engine.runner.set_facts(RoundFacts(copy_match=copy_match))
    return engine.run(requests)


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_equals_plain_with_penalties_bias_and_logprobs_beside_plain_lanes(target, params):
    """Copies draft for processed lanes and for lanes that use none, in one engine: every lane's tokens and
    logprobs equal its `draft: false` run alone."""
    reqs = [dict(prompt=_prompt(s), max_tokens=20, logit_bias=_bias(s), **PROCESSED, **params) for s in range(2)]
    reqs += [dict(prompt=_prompt(s + 10), max_tokens=20, **params) for s in range(2)]
    plain = [_run(target, [Request(**r, draft=False)])[0] for r in reqs]
    drafted = _run(target, [Request(**r) for r in reqs], copy_match=1)
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_sha256 == b.token_sha256
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    assert sum(r.proposed for r in drafted[:2]) > 0, "copies never proposed for a processed lane"
    assert plain[0].token_ids != _run(target, [Request(_prompt(0), max_tokens=20, draft=False, **params)])[0].token_ids


def test_processors_that_are_off_leave_tokens_bit_identical(target):
    """Zero penalties, a zero bias and repetition 1 change nothing, beside a lane that uses processors."""
    prompts = [_prompt(s + 30) for s in range(2)]
    none = _run(target, [Request(p, max_tokens=16, **SAMPLED) for p in prompts])
    off = _run(target, [Request(prompts[0], max_tokens=16, presence_penalty=0.0, frequency_penalty=0.0,
                                repetition_penalty=1.0, logit_bias={3: 0.0}, **SAMPLED),
                        Request(prompts[1], max_tokens=16, logit_bias={none[1].token_ids[1]: -100.0}, **SAMPLED)])
    assert off[0].token_ids == none[0].token_ids
    assert off[1].token_ids[:1] == none[1].token_ids[:1] and off[1].token_ids[1] != none[1].token_ids[1]


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(target, params):
    prompt = _prompt(40)
    free = _run(target, [Request(prompt, max_tokens=12, **params)])[0].token_ids
    forced = _run(target, [Request(prompt, max_tokens=12, logit_bias={17: 100.0}, **params)])[0].token_ids
    assert forced == [17] * 12
    common = max(set(free), key=free.count)
    banned = _run(target, [Request(prompt, max_tokens=12, logit_bias={common: -100.0}, **params)])[0].token_ids
    assert common not in banned


def test_logprobs_equal_log_softmax_of_the_models_logits(target):
    prompt = _prompt(50)
    res = _run(target, [Request(prompt, max_tokens=10, top_logprobs=5, **SAMPLED)], copy_match=1)[0]
    seq = jnp.asarray([prompt + res.token_ids[:-1]], jnp.int32)
    graphdef, params = models.split(target)
    cache = target.init_cache(1, LANES.context)
    logits, _, _ = models.forward(graphdef, params, seq, jnp.zeros((1,), jnp.int32), jnp.full((1,), seq.shape[1]),
                                  cache, ROWS)
    ref = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:].astype(jnp.float32), axis=-1))  # [10, V]
    got = np.asarray(res.logprobs)
    np.testing.assert_allclose(got, ref[np.arange(10), res.token_ids], atol=2e-5)
    for row, top in zip(ref, res.top_logprobs, strict=True):
        ids = [i for i, _ in top]
        assert ids == np.argsort(-row, kind="stable")[:5].tolist()
        np.testing.assert_allclose([v for _, v in top], row[ids], atol=2e-5)


def test_row_j_sees_the_proposals_before_it():
    """apply_processors on a verify row equals the formula with the proposals before that row counted."""
    rng = np.random.default_rng(3)
    vocab, rows_n = 32, 4
    logits = jnp.asarray(rng.normal(size=(2, rows_n, vocab)), jnp.float32)
    rows = jnp.asarray(rng.integers(0, vocab, (2, rows_n)), jnp.int32)
    proc = sampling.Processors.for_request(vocab, [1, 2, 3], 0.5, 0.25, 1.5, {7: 2.0})
    counts = np.zeros((1, vocab), np.int32)
    counts[0, [4, 9]] = [2, 1]
    proc = jax.tree.map(lambda a: jnp.concatenate([a, a]), proc)
    proc = type(proc)(**{**proc.__dict__, "counts": jnp.asarray(np.concatenate([counts, counts * 0]))})
    got = np.asarray(sampling.apply_processors(logits, rows, proc))
    for lane in range(2):
        for j in range(rows_n):
            c = (counts[0] if lane == 0 else counts[0] * 0) + np.bincount(np.asarray(rows[lane, 1:j + 1]),
                                                                           minlength=vocab)
            x = np.asarray(logits[lane, j]).copy()
            seen = np.zeros(vocab, bool)
            seen[[1, 2, 3]] = True
            seen |= c > 0
            x = np.where(seen, np.where(x > 0, x / 1.5, x * 1.5), x)
            x = x - 0.25 * c - 0.5 * (c > 0)
            x[7] += 2.0
            np.testing.assert_allclose(got[lane, j], x, rtol=1e-6, atol=1e-6, err_msg=f"{lane=} {j=}")


def test_bad_processor_values_are_clear_errors(target):
    engine = Engine(target, LANES, eos_ids=())
    for kw, word in [(dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency"),
                     (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={10**6: 1.0}), "vocabulary"),
                     (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(top_logprobs=21), "top_logprobs")]:
        with pytest.raises(ValueError, match=word):
            engine.submit(Request(_prompt(1), max_tokens=4, **kw))
