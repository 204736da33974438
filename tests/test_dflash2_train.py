"""Distilling a DFlash2 drafter: a short run lowers the loss, and the trained drafter's blocks get accepted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.test_dflash2 import TARGET
from tfjax import models
from tfjax.drafters import dflash2, dflash2_checkpoint, train
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, its own greedy generations, and a drafter trained on them for 80 steps."""
    target = models.build(TARGET, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(16)]
    outputs = train.generate(target, prompts, 40, lanes=8)
    data = train.pack(prompts, outputs, 52)
    tdef, tparams = models.split(target)
    cfg = train.config_for(TARGET, layers=2, block=4, taps=2, mask_token_id=5, rank=16, top_k=4, intermediate=96)
    data["feats"] = np.asarray(train.tap_features(tdef, tparams, jnp.asarray(data["tokens"]), cfg.target_layer_ids))
    batch = {k: jnp.asarray(v) for k, v in data.items()}
    ddef, params = nnx.split(dflash2.build(cfg, seed=1).bind(TARGET))
    before = float(train.evaluate(ddef, params, tdef, tparams, batch, 8, 4.0)[0])
    opt = train.optimizer(3e-3, 10, 80)
    state = opt.init(params)
    step = train.make_step(opt, anchors=8, gamma=4.0)
    for i in range(80):
        params, state, _, _ = step(ddef, params, state, tdef, tparams, batch, jax.random.key(i))
    after = float(train.evaluate(ddef, params, tdef, tparams, batch, 8, 4.0)[0])
    out = tmp_path_factory.mktemp("drafter")
    dflash2_checkpoint.save(nnx.merge(ddef, params), out, dtype="float32")
    return target, prompts, outputs, before, after, out


def test_a_short_training_run_lowers_the_loss(trained):
    _, _, _, before, after, _ = trained
    assert after < 0.5 * before, f"loss {before:.3f} -> {after:.3f}"


def test_the_exported_trained_drafter_raises_accepted_length_and_stays_exact(trained):
    target, prompts, outputs, _, _, out = trained
    drafter = dflash2_checkpoint.load(out, target=TARGET)
    engine = Engine(target, LaneConfig(capacity=4, width=4, context=128), drafter=drafter, eos_ids=())
    engine.runner.set_facts(RoundFacts(copy_match=0, draft_block=3))  # the drafter's blocks alone
    results = engine.run([Request(p, max_tokens=40) for p in prompts[:4]])
    assert [r.token_ids for r in results] == outputs[:4]
    mean = float(np.mean([r.tokens_per_round for r in results]))
    assert mean > 1.5, f"mean accepted tokens per round {mean:.2f}"


def test_held_out_prompts_are_never_trained_on():
    """train_drafter's held-out loss is over prompts whose answers (every sample of them) are not trained on."""
    from scripts.train_drafter import split_by_prompt

    held, trained = split_by_prompt(sequences=6 * 40, prompts=40, held_prompts=4, seed=0)
    assert len(held) == 6 * 4 and len(trained) == 6 * 36
    assert sorted(np.concatenate([held, trained]).tolist()) == list(range(240))
    assert not set(held % 40) & set(trained % 40)
    with pytest.raises(ValueError, match="held-prompts"):
        split_by_prompt(sequences=10, prompts=5, held_prompts=5, seed=0)


def test_drafter_training_prompts_are_not_benchmark_prompts():
    """The built-in distillation prompts never begin like a prompt the benchmarks measure the drafter on."""
    import re

    import scripts.bench_concurrent as conc
    import scripts.bench_generate as gen
    import scripts.train_drafter as td

    def opening(text: str) -> tuple[str, ...]:
        return tuple(re.findall(r"\w+|[^\w\s]", text.lower())[:6])

    bench = {opening(p) for p in [gen.CODE, gen.CODE_NEW, gen.CHAT[0]["content"], *conc.CODE, *conc.CHAT]}
    training = td.CODE + td.EDIT_PROMPTS + td.CHAT
    assert len(set(training)) == len(training) >= 80
    assert not bench & {opening(p) for p in training}
