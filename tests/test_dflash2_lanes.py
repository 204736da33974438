"""A DFlash2 block drafter in lane rounds: whatever it proposes, drafted == plain, alone and beside other lanes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.test_call_rounds import _staggered
from tests.test_dflash2 import drafter_config
from tests.test_lanes import LANES, SAMPLED, _repetitive_prompt
from tfjax import geometry, models
from tfjax.drafters import dflash2
from tfjax.engine import Engine, Request


@pytest.fixture(scope="module")
def drafter():
    raw = drafter_config(vocab_size=geometry.tiny_dense.vocab_size)
    raw["dflash_config"].update(block_size=5, target_layer_ids=[0, 2, 3])
    return dflash2.build(dflash2.DFlashConfig.from_dict(raw), seed=12).bind(geometry.tiny_dense)


def _run(target, requests, drafter=None):
    return Engine(target, LANES, drafter=drafter, eos_ids=()).run(requests)


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_equals_plain_with_a_random_block_drafter(target, drafter, params):
    prompts = [_repetitive_prompt(s + 30) for s in range(2)]
    plain = _run(target, [Request(p, max_tokens=20, draft=False, **params) for p in prompts])
    drafted = _run(target, [Request(p, max_tokens=20, **params) for p in prompts], drafter=drafter)
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids
        assert a.token_sha256 == b.token_sha256
    assert all(r.proposed > 0 for r in drafted), "the block never reached the verify rows"


def test_four_staggered_lanes_with_a_block_drafter_equal_plain_alone(target, drafter):
    reqs = [dict(prompt=_repetitive_prompt(40 + i, 30 + 7 * i), max_tokens=10 + 5 * i,
                 **(SAMPLED if i % 2 else {})) for i in range(4)]
    alone = [_run(target, [Request(**r, draft=False)])[0].token_ids for r in reqs]
    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    ids = []
    for r in reqs:  # one arrival per step, while others are mid-decode
        ids.append(engine.submit(Request(**r)))
        engine.step()
    while any(i not in engine.results for i in ids):
        engine.step()
    for i, expected in zip(ids, alone, strict=True):
        assert engine.results[i].token_ids == expected


def test_block_drafter_facts_reach_the_round(target, drafter):
    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    assert engine.runner.spec.facts.draft_block == 4
    assert engine.runner.spec.facts.copy_match == 5  # not the dense 27B: the target's own match
    assert np.asarray(engine.runner.state.block).shape == (4, 4)


def test_drafter_context_after_rounds_equals_a_fresh_prefill_of_the_committed_tokens(target, drafter):
    """After rounds the drafter sees the committed tokens exactly as if the whole history were a prompt."""
    import jax.numpy as jnp

    from tfjax.drafters import train

    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    engine.submit(Request(_repetitive_prompt(50), max_tokens=60))
    for _ in range(6):
        engine.step()
    state = engine.runner.state
    n = int(state.length[0])
    history = jnp.asarray(state.history[0, : n - 1])[None]
    feats = train.tap_features(*models.split(target), history, drafter.config.target_layer_ids)
    fresh = drafter.absorb(feats, jnp.array([0]), jnp.array([n - 1]), drafter.init_cache(1, LANES.context, 16))
    pending, start = state.history[0, n - 1][None], jnp.array([n - 1])
    ours = drafter.block_hidden(target, pending, start, dataclasses.replace(
        state.draft_cache, page_table=state.draft_cache.page_table[:1]))
    ref = drafter.block_hidden(target, pending, start, fresh)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-3, atol=2e-3)


def test_a_round_whose_next_plan_is_a_copy_skips_the_block_and_stays_exact(target, drafter):
    """When the lane's next round takes a root copy the block would go unused: it is not drafted (kept as
    it was), it is drafted otherwise, and the tokens still equal plain decoding."""
    from tfjax.lanes.copies import propose_copies

    prompt = _repetitive_prompt(60)
    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    engine.runner.set_facts(dataclasses.replace(engine.runner.spec.facts, copy_match=1))  # copies land often
    rid = engine.submit(Request(prompt, max_tokens=40))
    engine.step()  # admission, prefill and the first block
    skipped = drafted = 0
    while rid not in engine.results:
        before = np.asarray(engine.runner.state.block[0])
        engine.step()
        if rid in engine.results:
            break
        state = engine.runner.state
        _, copied = propose_copies(state.history, state.length, engine.runner.spec.facts.copy_match, LANES.width - 1)
        after = np.asarray(state.block[0])
        if int(copied[0]) > 0:
            np.testing.assert_array_equal(after, before)
            skipped += 1
        else:
            drafted += int(not np.array_equal(after, before))
    assert skipped > 0 and drafted > 0, (skipped, drafted)
    plain = _run(target, [Request(prompt, max_tokens=40, draft=False)])[0]
    assert engine.results[rid].token_ids == plain.token_ids


def test_block_drafter_prompt_chunks_run_plains_compiled_program(target, drafter):
    """A drafted engine's prompt chunks compile nothing plain's did not: the target's chunk is plain's program itself
    (every layer's output among its outputs) and the drafter picks its taps in a program apart. Any other program
    for the target's chunk (taps as extra outputs, the absorb inside) gave other bits on the GPU (issue 34)."""
    from tfjax.lanes import round as lane_round

    prompt = np.asarray(_repetitive_prompt(41, 70), np.int32)
    plain = Engine(target, LANES, eos_ids=()).runner
    assert len(list(plain._chunks(prompt, 0))) > 1
    logits, plain.state.cache = plain._prefill_model(0, plain.target_def, plain.target_params, plain.state.cache, 0,
                                                     prompt, 0, None, {})
    compiled = lane_round.prefill_chunk._cache_size()
    runner = Engine(target, LANES, drafter=drafter, eos_ids=()).runner
    drafted = runner._prefill_with_taps(0, prompt, 0, None, {})
    assert lane_round.prefill_chunk._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(drafted), np.asarray(logits))


def test_four_rounds_a_call_with_a_block_drafter_equal_plain(target, drafter):
    """A block drafter absorbs and drafts inside every round of a call: staggered lanes, greedy and sampled, give
    the plain tokens of one round a call."""
    reqs = [dict(prompt=_repetitive_prompt(50 + i, 30 + 7 * i), max_tokens=9 + 5 * i,
                 **(SAMPLED if i % 2 else {})) for i in range(2)]
    plain = _run(target, [Request(**r, draft=False) for r in reqs])
    drafted, _ = _staggered(target, dataclasses.replace(LANES, rounds=4), [Request(**r) for r in reqs], drafter,
                            facts=None)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert all(r.proposed > 0 for r in drafted), "the block never reached the verify rows"
