"""Lane rounds keep the contract: drafted == plain, concurrent == alone, replay == plain decoding."""

from __future__ import annotations

import numpy as np
import pytest

from tfjax import geometry, models
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import Facts, RoundFacts

LANES = LaneConfig(capacity=4, width=5, context=192, page_size=16)


@pytest.fixture(scope="module")
def drafter():
    return models.build(geometry.tiny_dense.replace(num_hidden_layers=2, layer_types=("linear_attention",
                                                                                      "full_attention")), seed=12)


def _repetitive_prompt(seed: int, n: int = 40) -> list[int]:
    """A prompt with a repeated span, so root copies find matches."""
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 250, 12).tolist()
    return (rng.integers(0, 250, n - 24).tolist() + span + span)[:n]


SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95)


def _run(target, requests, drafter=None, facts=None):
    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    if facts is not None:
        engine.runner.set_facts(facts)
    return engine.run(requests)


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_equals_plain_with_copies(target, params):
    prompts = [_repetitive_prompt(s) for s in range(2)]
    plain = _run(target, [Request(p, max_tokens=24, draft=False, **params) for p in prompts])
    drafted = _run(target, [Request(p, max_tokens=24, draft=True, **params) for p in prompts],
                   facts=RoundFacts(copy_match=1))
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids
        assert a.token_sha256 == b.token_sha256
    assert sum(r.proposed for r in drafted) > 0, "copies never proposed: the test would not exercise them"


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_equals_plain_with_a_draft_model(target, drafter, params):
    prompts = [_repetitive_prompt(s + 5) for s in range(2)]
    plain = _run(target, [Request(p, max_tokens=20, draft=False, **params) for p in prompts])
    drafted = _run(target, [Request(p, max_tokens=20, draft=True, **params) for p in prompts], drafter=drafter)
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids
    assert all(r.proposed > 0 for r in drafted)


def test_draft_model_that_is_the_target_is_accepted_in_full(target):
    prompt = _repetitive_prompt(9)
    plain = _run(target, [Request(prompt, max_tokens=20, draft=False)])[0]
    drafted = _run(target, [Request(prompt, max_tokens=20)], drafter=target, facts=RoundFacts(copy_match=0))[0]
    assert drafted.token_ids == plain.token_ids
    assert drafted.tokens_per_round > 3.0, f"a perfect drafter should fill rounds: {drafted.tokens_per_round}"


def test_concurrent_equals_alone_with_staggered_arrivals(target):
    reqs = [dict(prompt=_repetitive_prompt(20 + i, 30 + 7 * i), max_tokens=10 + 5 * i, **(SAMPLED if i % 2 else {}))
            for i in range(4)]
    alone = [_run(target, [Request(**r)], facts=RoundFacts(copy_match=1))[0].token_ids for r in reqs]
    engine = Engine(target, LANES, eos_ids=())
    engine.runner.set_facts(RoundFacts(copy_match=1))
    ids = []
    for r in reqs:  # one arrival per step, while others are mid-decode
        ids.append(engine.submit(Request(**r)))
        engine.step()
    while any(i not in engine.results for i in ids):
        engine.step()
    for i, expected in zip(ids, alone, strict=True):
        assert engine.results[i].token_ids == expected


def test_changing_facts_recompiles_and_same_facts_reuse_the_round(target):
    from tfjax.lanes import round as r

    engine = Engine(target, LANES, eos_ids=())
    engine.run([Request(_repetitive_prompt(1), max_tokens=6)])
    size = r.lane_round._cache_size()
    engine.run([Request(_repetitive_prompt(2), max_tokens=6)])
    assert r.lane_round._cache_size() == size
    engine.runner.set_facts(RoundFacts(copy_match=20))
    engine.run([Request(_repetitive_prompt(3), max_tokens=6)])
    assert r.lane_round._cache_size() == size + 1


def test_seed_facts_replace_the_targets_copy_match():
    from tfjax.lanes.drafter import Drafted, ModelFacts

    class Backend:
        facts = ModelFacts(root_copies=True, enter_match=5)

    class Drafter:
        def __init__(self, n):
            self.facts = Facts(copy_match=n)

    assert Drafted(Backend(), None).facts.copy_match == 5
    assert Drafted(Backend(), Drafter(0)).facts.copy_match == 5
    assert Drafted(Backend(), Drafter(20)).facts.copy_match == 20


@pytest.mark.parametrize("name,fused", [("tiny_dense", False), ("tiny_moe", False), ("tiny_dense", True)],
                         ids=["tiny_dense", "tiny_moe", "tiny_dense-fused"])
def test_row_logits_are_bit_identical_alone_among_verify_rows_and_beside_other_lanes(name, fused):
    """A row's logits equal those of the row computed alone (1 lane, 1 row), whatever T and the lane count
    (also with sibling projections fused, the GPU serving layout)."""
    import jax.numpy as jnp

    from tfjax.models.layers import PROMPT, ROWS, KVPages, fuse_projections
    from tfjax.models.qwen3_5 import Cache, DeltaState

    model = models.build(getattr(geometry, name), seed=11)
    if fused:
        assert fuse_projections(model) > 0
    graphdef, params = models.split(model)
    rng = np.random.default_rng(0)
    history = jnp.asarray(rng.integers(0, 256, (1, 9)), jnp.int32)
    one = model.init_cache(1, 64)
    _, one, _ = models.forward(graphdef, params, history, jnp.zeros((1,), jnp.int32), jnp.full((1,), 9), one, PROMPT)

    def row0_logits(lanes, width):
        """Lane 0's first row after the same 9-token history, beside `lanes - 1` lanes with other histories' rows."""
        tile = lambda a: jnp.tile(a, (lanes,) + (1,) * (a.ndim - 1))  # noqa: E731
        layers = [DeltaState(tile(c.conv), tile(c.state)) if isinstance(c, DeltaState) else KVPages(tile(c.k), tile(c.v))
                  for c in one.layers]
        cache = Cache(layers, model.init_cache(lanes, 64).page_table)
        rows = jnp.asarray(rng.integers(0, 256, (lanes, width)), jnp.int32).at[0, 0].set(7)
        out, _, _ = models.forward(graphdef, params, rows, jnp.full((lanes,), 9, jnp.int32), jnp.full((lanes,), width),
                                   cache, ROWS)
        return np.asarray(out[0, 0])

    alone = row0_logits(1, 1)
    for lanes, width in [(1, 2), (1, 9), (2, 1), (4, 5), (16, 1), (16, 9)]:
        assert np.array_equal(row0_logits(lanes, width), alone), f"{lanes=} {width=}"


def test_a_request_whose_callback_fails_ends_alone_and_the_others_are_unchanged(target):
    reqs = [dict(prompt=_repetitive_prompt(40 + i), max_tokens=12, **(SAMPLED if i else {})) for i in range(2)]
    alone = [_run(target, [Request(**r)])[0].token_ids for r in reqs]

    def explode(tokens):
        raise RuntimeError("callback failed")

    finished = []
    engine = Engine(target, LANES, eos_ids=())
    bad = Request(_repetitive_prompt(50), max_tokens=12, on_tokens=explode, on_finish=finished.append)
    waiting = [Request(_repetitive_prompt(60 + i), max_tokens=4, on_finish=finished.append) for i in range(4)]
    ids = [engine.submit(Request(**r)) for r in reqs[:1]] + [engine.submit(bad)]
    ids += [engine.submit(Request(**r)) for r in reqs[1:]]
    for w in waiting:  # four more than the lanes hold: the last waits, and is cancelled while it waits
        engine.submit(w)
    engine.step()
    engine.cancel(waiting[-1].id)
    while engine.busy:
        engine.step()
    by_id = {r.request_id: r for r in finished}
    assert by_id[bad.id].finish_reason == "error" and "callback failed" in by_id[bad.id].error
    assert by_id[waiting[-1].id].finish_reason == "cancelled" and by_id[waiting[-1].id].token_ids == []
    assert bad.id not in engine.results, "a request with on_finish gets its Result there, not in results"
    assert [engine.results[i].token_ids for i in (ids[0], ids[2])] == alone


def test_a_failing_round_ends_live_requests_with_an_error_and_the_engine_recovers(target):
    engine = Engine(target, LANES, eos_ids=())
    prompt = _repetitive_prompt(70)
    expected = engine.run([Request(prompt, max_tokens=8)])[0].token_ids
    real_dispatch, real_collect = engine.runner.dispatch, engine.runner.collect

    def broken_dispatch():
        engine.runner.state.cache = None  # as if donated buffers were lost mid-call
        raise RuntimeError("device call failed")

    def broken_collect(out):
        raise RuntimeError("round failed on the device")

    for attr, broken, message in [("dispatch", broken_dispatch, "device call failed"),
                                  ("collect", broken_collect, "round failed on the device")]:
        setattr(engine.runner, attr, broken)
        failed = engine.run([Request(prompt, max_tokens=8)])[0]
        assert failed.finish_reason == "error" and message in failed.error
        engine.runner.dispatch, engine.runner.collect = real_dispatch, real_collect
        assert engine.run([Request(prompt, max_tokens=8)])[0].token_ids == expected


def test_the_next_round_is_dispatched_before_the_last_one_is_read(target):
    """One round in flight: each step enqueues a round, then reads the one before, and the tokens are unchanged."""
    prompt = _repetitive_prompt(75)
    expected = _run(target, [Request(prompt, max_tokens=10)])[0]
    engine = Engine(target, LANES, eos_ids=())
    calls = []
    dispatch, collect = engine.runner.dispatch, engine.runner.collect
    engine.runner.dispatch = lambda: calls.append("dispatch") or dispatch()
    engine.runner.collect = lambda out: calls.append("collect") or collect(out)
    got = engine.run([Request(prompt, max_tokens=10)])[0]
    assert got.token_ids == expected.token_ids and got.rounds == expected.rounds
    assert calls[:4] == ["dispatch", "dispatch", "collect", "dispatch"]
    # the round that fills the reply's budget is the last dispatched: none runs after the reply's end unread
    assert calls.count("dispatch") == calls.count("collect") and calls[-1] == "collect"
    assert not engine.busy


def test_a_finished_sampled_request_leaves_its_lane_greedy(target):
    """Idle lanes must not keep a top-k: `sample` sorts every row of the round while any lane filters."""
    engine = Engine(target, LANES, eos_ids=())
    engine.run([Request(_repetitive_prompt(80 + i), max_tokens=4, seed=i, **SAMPLED) for i in range(LANES.capacity)])
    params = engine.runner.state.sampling
    assert not np.asarray(params.temperature).any() and not np.asarray(params.top_k).any()
    assert np.all(np.asarray(params.top_p) == 1.0)


def test_a_result_times_its_first_token_and_its_decode_apart(target, monkeypatch):
    """ttft_s runs from submit through the prefill; decode_s from the first token to the round that ended the
    request: a fake clock advanced 5 s by the prefill and 1 s by each round read gives exactly those."""
    import types

    from tfjax.engine import engine as engine_mod

    now = [100.0]
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    engine = Engine(target, LANES, eos_ids=())
    prefill, collect = engine.runner.prefill, engine.runner.collect

    def slow_prefill(*a, **k):
        now[0] += 5.0
        return prefill(*a, **k)

    def slow_collect(out):
        now[0] += 1.0
        return collect(out)

    engine.runner.prefill, engine.runner.collect = slow_prefill, slow_collect
    got = engine.run([Request(_repetitive_prompt(81), max_tokens=6)])[0]
    assert got.ttft_s == 5.0
    assert got.decode_s == float(got.rounds) and got.rounds >= 1  # one read a round, each the next one's tokens
    assert len(got.token_ids) == 6


def test_a_rounds_packed_output_unpacks_to_its_tokens_counts_and_proposals():
    import jax.numpy as jnp

    from tfjax.lanes.round import RoundOut

    tokens = jnp.asarray([[7, 8, -1], [9, -1, -1]], jnp.int32)
    out = RoundOut.of(tokens, jnp.asarray([2, 1]), jnp.asarray([3, 0]))
    got_tokens, count, proposed = RoundOut.unpack(np.asarray(out.packed))
    np.testing.assert_array_equal(got_tokens, np.asarray(tokens))
    np.testing.assert_array_equal(count, [2, 1])
    np.testing.assert_array_equal(proposed, [3, 0])
