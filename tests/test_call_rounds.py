"""Several rounds in one call (`LaneConfig.rounds`) give every request the tokens one-round calls give it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfjax import geometry, models
from tfjax.engine import Engine, Request
from tfjax.engine.runner import Runner
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts

ONE = LaneConfig(capacity=4, width=5, context=192, page_size=16)
FOUR = dataclasses.replace(ONE, rounds=4)
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95)
COPIES = RoundFacts(copy_match=1)


def _prompt(seed: int, n: int) -> list[int]:
    """A prompt with a repeated span, so root copies find matches."""
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 250, 12).tolist()
    return (rng.integers(0, 250, n - 24).tolist() + span + span)[:n]


def _staggered(target, lanes, requests, drafter=None, facts=COPIES):
    """Each request submitted a step after the one before (arrivals mid-call), run to the end: (results, engine).
    `facts` None keeps the engine's own (a block drafter's)."""
    engine = Engine(target, lanes, drafter=drafter, eos_ids=())
    if facts is not None:
        engine.runner.set_facts(facts)
    ids = []
    for r in requests:
        ids.append(engine.submit(r))
        engine.step()
    while any(i not in engine.results for i in ids):
        engine.step()
    return [engine.results.pop(i) for i in ids], engine


def _requests(stop_ids=()):
    # lengths apart, so lanes end inside a call and the live lanes' bucket shrinks; greedy and sampled
    return [Request(_prompt(40 + i, 30 + 5 * i), max_tokens=7 + 6 * i, stop_ids=stop_ids,
                    **(SAMPLED if i % 2 else {})) for i in range(4)]


def test_four_rounds_a_call_give_the_tokens_of_one_round_calls_with_copies(target):
    one, _ = _staggered(target, ONE, _requests())
    four, engine = _staggered(target, FOUR, _requests())
    assert [r.token_ids for r in four] == [r.token_ids for r in one]
    assert [len(r.token_ids) for r in four] == [7, 13, 19, 25]
    assert sum(r.proposed for r in four) > 0, "copies never proposed: the test would not exercise them"
    assert engine.rounds > 4 * 3, "too few rounds for calls of four to have run"


def test_a_stop_inside_a_call_cuts_the_reply_where_one_round_calls_cut_it(target):
    plain, _ = _staggered(target, ONE, _requests())
    stop = plain[3].token_ids[9]  # the longest request stops at its tenth token, inside some call's rounds
    one, _ = _staggered(target, ONE, _requests(stop_ids=(stop,)))
    four, _ = _staggered(target, FOUR, _requests(stop_ids=(stop,)))
    assert [r.token_ids for r in four] == [r.token_ids for r in one]
    assert one[3].token_ids[-1] == stop and len(one[3].token_ids) <= 10


@pytest.mark.slow  # ~45 s on 2 cores; the block drafter's (tests/test_dflash2_lanes.py) runs in CI
def test_four_rounds_a_call_with_a_draft_model_equal_plain(target):
    drafter = models.build(geometry.tiny_dense.replace(num_hidden_layers=2, layer_types=(
        "linear_attention", "full_attention")), seed=12)
    plain, _ = _staggered(target, ONE, [dataclasses.replace(r, draft=False) for r in _requests()],
                          facts=RoundFacts(copy_match=0))
    drafted, _ = _staggered(target, FOUR, _requests(), drafter=drafter, facts=RoundFacts(copy_match=0))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert all(r.proposed > 0 for r in drafted)


def test_a_lane_stops_at_its_last_token_inside_a_call(target):
    """The call's later rounds leave a lane that has all its tokens as it was (no token past its pages)."""
    engine = Engine(target, FOUR, eos_ids=())
    engine.runner.set_facts(RoundFacts(copy_match=0))
    prompt = _prompt(7, 30)
    engine.submit(Request(prompt, max_tokens=2))  # a token from the prompt, one round, then three rounds idle
    engine.step()
    out = engine.runner.dispatch()  # a second call while the first is in flight: four more rounds for the lane
    engine.step()
    tokens, count, _ = engine.runner.collect(out)
    assert tokens.shape[0] == 4
    assert count[:, 0].tolist() == [0, 0, 0, 0]
    assert int(engine.runner.state.length[0]) == len(prompt) + 2


def _alternating_grammar(vocab: int):
    """A token grammar whose mask changes every token: even ids, then odd ids, and so on."""
    from tfjax.grammar import TokenGrammar

    table = np.full((2, vocab), -1, np.int32)
    table[0, 0::2], table[1, 1::2] = 1, 0
    return TokenGrammar("even-odd", table, 0)


def test_lanes_with_processors_and_a_grammar_run_four_rounds_a_call_with_the_tokens_of_one(target, monkeypatch):
    """Penalties, logit_bias, logprobs and a grammar move on every round of a call, beside a plain lane, in a bucket
    of the lanes (two live of four): the tokens, logprobs and alternatives of one round a call."""
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 3.0, 7: -100.0},
                     logprobs=True, top_logprobs=2, **SAMPLED)

    def requests():
        return [Request(_prompt(60, 32), max_tokens=13, **penalties),
                Request(_prompt(61, 30), max_tokens=11, grammar=_alternating_grammar(target.config.vocab_size))]

    one, _ = _staggered(target, ONE, requests())
    calls, collect = [], Runner.collect
    monkeypatch.setattr(Runner, "collect", staticmethod(
        lambda out: calls.append((out.packed.shape[0], out.logprobs is not None)) or collect(out)))
    four, _ = _staggered(target, FOUR, requests())
    assert (4, True) in calls and {k for k, _ in calls} == {4}, calls
    for a, b in zip(one, four, strict=True):
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)
    assert [t % 2 for t in four[1].token_ids] == [i % 2 for i in range(11)]


@pytest.mark.slow  # ~70 s on 2 cores: a mesh's compiles of every lane bucket
def test_four_rounds_a_call_on_a_tensor_parallel_mesh_equal_one_device(target):
    """The scan of rounds under a (data=2, model=2) mesh: the tokens of one device at one round a call."""
    from tfjax import sharding

    sharded = models.build(geometry.tiny_dense, seed=11)
    sharding.shard_model(sharded, sharding.make_mesh(2, 2))
    one, _ = _staggered(target, ONE, _requests())
    four, _ = _staggered(sharded, FOUR, _requests())
    assert [r.token_ids for r in four] == [r.token_ids for r in one]


@pytest.mark.parametrize("lanes,calls", [(ONE, 11), (FOUR, 3)], ids=["one round a call", "four rounds a call"])
def test_a_reply_that_ends_at_its_budget_costs_no_call_after_its_last(target, lanes, calls):
    """The engine dispatches no call that the one in flight leaves nothing to do for (12 tokens: the prompt's one,
    then 11 rounds of one token, plain)."""
    engine = Engine(target, lanes, eos_ids=())
    dispatch, dispatched = engine.runner.dispatch, []
    engine.runner.dispatch = lambda: dispatched.append(1) or dispatch()
    result = engine.run([Request(_prompt(3, 30), max_tokens=12, draft=False)])[0]
    assert len(result.token_ids) == 12 and result.finish_reason == "length"
    assert len(dispatched) == calls
