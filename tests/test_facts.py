"""Facts and the copy policy: the target alone copies after 5 tokens; DFlash2 on the 27B needs 20."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import geometry
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.copies import propose_copies
from tfjax.lanes.drafter import (
    Drafted,
    Facts,
    ModelFacts,
    RoundFacts,
    copy_match_for,
    effective_copy_match,
)


@dataclasses.dataclass
class _Backend:
    facts: ModelFacts


@dataclasses.dataclass
class _Drafter:
    facts: Facts


def _history_with_match(rng: np.random.Generator, matching: int, size: int = 64) -> tuple[np.ndarray, int]:
    """A history whose last `matching` tokens (and no more) occurred earlier, followed by 3 tokens."""
    tokens = rng.permutation(np.arange(100, 1000))[:size].astype(np.int32)  # all distinct
    n = size
    start = 5
    tokens[n - matching : n] = tokens[start : start + matching]
    tokens[n - matching - 1] = 7  # differs from tokens[start - 1]: the match is exactly `matching` long
    return tokens[None, :], n


def _proposes(copy_match: int, matching: int, seed: int = 0) -> bool:
    history, n = _history_with_match(np.random.default_rng(seed), matching)
    if copy_match == 0:
        return False
    _, count = propose_copies(jnp.asarray(history), jnp.array([n]), copy_match, 4)
    return int(count[0]) > 0


def test_target_alone_enters_copies_after_five_matching_tokens():
    match = effective_copy_match(ModelFacts(), None)
    assert match == 5
    assert _proposes(match, 5)
    assert not _proposes(match, 4)
    assert Drafted(_Backend(ModelFacts()), None).facts == RoundFacts(copy_match=5, draft_block=0)


def test_drafter_copy_match_zero_keeps_the_targets():
    assert effective_copy_match(ModelFacts(), Facts(copy_match=0)) == 5
    facts = Drafted(_Backend(ModelFacts()), _Drafter(Facts(copy_match=0, block=15))).facts
    assert facts.copy_match == 5 and facts.draft_block == 15
    assert _proposes(facts.copy_match, 5)


def test_drafter_copy_match_twenty_replaces_the_targets():
    facts = Drafted(_Backend(ModelFacts()), _Drafter(Facts(copy_match=20))).facts
    assert facts.copy_match == 20
    assert _proposes(facts.copy_match, 20)
    assert not _proposes(facts.copy_match, 19)
    assert not _proposes(facts.copy_match, 5)


def test_copies_off_when_the_target_or_drafter_has_no_root_copies():
    assert effective_copy_match(ModelFacts(root_copies=False), None) == 0
    assert effective_copy_match(ModelFacts(root_copies=False), Facts(copy_match=20)) == 0
    assert effective_copy_match(ModelFacts(), Facts(root_copies=False)) == 0
    assert not Drafted(_Backend(ModelFacts(root_copies=False)), None).facts.copies


def test_dflash2_copy_match_is_long_match_on_the_dense_27b_only():
    assert copy_match_for(geometry.dense27) == 20
    assert copy_match_for(geometry.dense27, long_match=32) == 32
    assert copy_match_for(geometry.dense27.replace(dtype="float16")) == 20  # every format of the 27B
    assert copy_match_for(geometry.moe35a3) == 0
    assert copy_match_for(geometry.tiny_dense) == 0


def test_drafted_facts_are_hashable_and_equal_for_equal_inputs():
    a = Drafted(_Backend(ModelFacts()), _Drafter(Facts(copy_match=20, block=15))).facts
    b = Drafted(_Backend(ModelFacts()), _Drafter(Facts(copy_match=20, block=15))).facts
    c = Drafted(_Backend(ModelFacts()), _Drafter(Facts(copy_match=0, block=15))).facts
    assert a == b and hash(a) == hash(b) and a != c
    assert len({a, b, c}) == 2


def test_drafted_rejects_objects_without_facts():
    with pytest.raises(TypeError, match="ModelFacts"):
        Drafted(object(), None)
    with pytest.raises(TypeError, match="Facts"):
        Drafted(_Backend(ModelFacts()), object())


def test_facts_reject_negative_values():
    with pytest.raises(ValueError, match="copy_match"):
        Facts(copy_match=-1)
    with pytest.raises(ValueError, match="enter_match"):
        ModelFacts(enter_match=0)


def test_lane_config_validates_and_derives_max_proposals():
    lanes = LaneConfig(capacity=8, width=16, context=4096)
    assert lanes.max_proposals == 15 and lanes.enter_match == 5 and lanes.long_match == 20
    assert lanes.pages_per_lane == 256
    hash(lanes)
    with pytest.raises(ValueError, match="width"):
        LaneConfig(capacity=8, width=0, context=4096)
    with pytest.raises(ValueError, match="long_match"):
        LaneConfig(capacity=8, width=4, context=4096, enter_match=6, long_match=5)
    with pytest.raises(TypeError, match="capacity"):
        LaneConfig(capacity=8.0, width=4, context=4096)
