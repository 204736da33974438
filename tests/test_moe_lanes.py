"""A tiny 4-bit MoE target in lane rounds, through the routed-experts path (`ops.experts`): drafted == plain."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_dflash2 import drafter_config
from tests.test_lanes import LANES, SAMPLED, _repetitive_prompt
from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.drafters import dflash2
from tfjax.engine import Engine, Request
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import ROWS

MOE = geometry.tiny_moe.replace(quantization=QuantConfig(bits=4, group_size=32), shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def moe_target():
    return models.build(MOE, seed=21)


def _run(target, requests, drafter=None, facts=None):
    engine = Engine(target, LANES, drafter=drafter, eos_ids=())
    if facts is not None:
        engine.runner.set_facts(facts)
    return engine.run(requests)


def test_rows_past_valid_reach_the_experts_as_not_live_and_the_live_rows_keep_their_logits(moe_target, monkeypatch):
    """A lane round's padding rows (past a lane's proposals; every row of an idle lane) read no expert."""
    seen = []
    experts = ops.experts
    monkeypatch.setattr(ops, "experts", lambda *a, **kw: seen.append(kw["live"]) or experts(*a, **kw))
    tokens = jnp.asarray([[5, 9, 14], [3, 3, 3]], jnp.int32)
    start, cache = jnp.asarray([0, 0], jnp.int32), moe_target.init_cache(2, 32)
    padded, _, _ = moe_target(tokens, start, jnp.asarray([2, 0], jnp.int32), cache, ROWS)
    assert len(seen) == MOE.num_hidden_layers
    np.testing.assert_array_equal(np.asarray(seen[0]), [True, True, False, False, False, False])
    full, _, _ = moe_target(tokens, start, jnp.asarray([3, 3], jnp.int32), cache, ROWS)
    np.testing.assert_array_equal(np.asarray(padded)[0, :2], np.asarray(full)[0, :2])


def test_moe_drafted_equals_plain_with_copies_when_sampled(moe_target):
    prompts = [_repetitive_prompt(s + 60) for s in range(2)]
    plain = _run(moe_target, [Request(p, max_tokens=16, draft=False, **SAMPLED) for p in prompts])
    drafted = _run(moe_target, [Request(p, max_tokens=16, **SAMPLED) for p in prompts], facts=RoundFacts(copy_match=1))
    assert all(r.finish_reason != "error" for r in plain + drafted)
    assert [r.token_sha256 for r in drafted] == [r.token_sha256 for r in plain]
    assert sum(r.proposed for r in drafted) > 0, "copies never proposed: the test would not exercise them"


def test_moe_drafted_equals_plain_with_a_dflash2_block_drafter(moe_target):
    raw = drafter_config(vocab_size=MOE.vocab_size)
    raw["dflash_config"].update(block_size=5, target_layer_ids=[0, 2, 3])
    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(raw), seed=13).bind(MOE)
    assert drafter.facts.copy_match == 0, "DFlash2 keeps the target's copy match off the dense 27B shape"
    prompts = [_repetitive_prompt(s + 70) for s in range(2)]
    plain = _run(moe_target, [Request(p, max_tokens=16, draft=False) for p in prompts])
    drafted = _run(moe_target, [Request(p, max_tokens=16) for p in prompts], drafter=drafter)
    assert all(r.finish_reason != "error" for r in plain + drafted)
    assert [r.token_sha256 for r in drafted] == [r.token_sha256 for r in plain]
    assert all(r.proposed > 0 for r in drafted), "the block never reached the verify rows"
