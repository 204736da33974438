"""The decoder every family shares (`tfjax.models.decoder`), its public lane-cache helpers, and the drafter's kind
declared in its Facts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_dflash2 import TARGET, drafter_config
from tfjax import geometry, models
from tfjax.drafters import dflash2
from tfjax.engine.runner import Runner
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import Facts
from tfjax.models import decoder
from tfjax.models.layers import ROWS


def test_every_family_builds_on_the_shared_decoder():
    for config in (geometry.tiny_dense, geometry.tiny_moe, TARGET):
        model = models.build(config, seed=1)
        assert isinstance(model, decoder.CausalLM)
        assert all(isinstance(layer, decoder.DecoderLayer) for layer in model.model["layers"])


def test_a_lane_view_written_back_changes_only_that_lanes_delta_state():
    model = models.build(geometry.tiny_dense, seed=1)
    rng = np.random.default_rng(4)
    cache = model.init_cache(3, 32)
    cache.layers = [decoder.DeltaState(jnp.asarray(rng.standard_normal(l.conv.shape), l.conv.dtype),
                                       jnp.asarray(rng.standard_normal(l.state.shape), jnp.float32))
                    if isinstance(l, decoder.DeltaState) else l for l in cache.layers]
    sub = decoder.lane_cache(cache, jnp.int32(1))
    assert sub.page_table.shape == (1, cache.page_table.shape[1])
    sub = decoder.Cache([decoder.reset_if_first(l, jnp.int32(0)) for l in sub.layers], sub.page_table)
    out = decoder.put_lane(cache, sub, jnp.int32(1))
    for before, after in zip(cache.layers, out.layers, strict=True):
        if isinstance(before, decoder.DeltaState):
            assert not np.asarray(after.state[1]).any() and not np.asarray(after.conv[1]).any()
            np.testing.assert_array_equal(np.asarray(after.state)[[0, 2]], np.asarray(before.state)[[0, 2]])


def test_a_block_drafter_declares_its_kind_and_the_runner_reads_it():
    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=0).bind(TARGET)
    assert drafter.facts.kind == "block"
    target = models.build(TARGET, seed=3)
    lanes = LaneConfig(capacity=1, width=4, context=32)
    assert Runner(target, lanes, drafter=drafter).block_drafter
    assert not Runner(target, lanes, drafter=models.build(TARGET, seed=4)).block_drafter  # a draft model: chain


def test_an_unknown_drafter_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="Facts.kind='tree' must be 'chain' or 'block'"):
        Facts(kind="tree")


def test_split_params_are_a_flat_tuple_that_merges_back_to_the_same_logits():
    model = models.build(geometry.tiny_dense, seed=3)
    graphdef, params = models.split(model)
    assert isinstance(params, tuple) and len(params) == graphdef.treedef.num_leaves
    tokens = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
    start, valid = jnp.zeros((1,), jnp.int32), jnp.full((1,), 4, jnp.int32)
    nested_def, nested = nnx.split(model)  # the State as nnx gives it: the tuple must hold the same leaves in order
    want, _, _ = models.forward(nested_def, nested, tokens, start, valid, model.init_cache(1, 32), ROWS)
    got, _, _ = models.forward(graphdef, params, tokens, start, valid, model.init_cache(1, 32), ROWS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert models.split(models.merge(graphdef, params))[0] == graphdef  # the same static key: no recompile
