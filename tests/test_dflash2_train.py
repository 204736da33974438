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
    """A tiny target, its own greedy generations, and a drafter trained on them for 80 steps (the target's taps
    computed inside each step, the learning rate set by the host, as train_drafter.py runs)."""
    target = models.build(TARGET, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 12).tolist() for _ in range(16)]
    outputs = train.generate(target, prompts, 40, lanes=8)
    data = train.pack(prompts, outputs, 52)
    tdef, tparams = models.split(target)
    cfg = train.config_for(TARGET, layers=2, block=4, taps=2, mask_token_id=5, rank=16, top_k=4, intermediate=96)
    batch = {k: jnp.asarray(v) for k, v in data.items()}
    ddef, params = nnx.split(dflash2.build(cfg, seed=1).bind(TARGET))
    before = float(train.evaluate(ddef, params, tdef, tparams, batch, 8, 4.0)[0])
    opt = train.unit_optimizer()
    state = opt.init(params)
    step = train.make_step(opt, anchors=8, gamma=4.0)
    for i in range(80):
        params, state, _, _ = step(ddef, params, state, tdef, tparams, batch, jax.random.key(i),
                                   train.learning_rate(i / 80, 3e-3, warmup=0.125))
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


def test_data_file_round_trips_with_its_held_out_rows(trained, tmp_path):
    """train_drafter's data.npz: every prompt greedy, the sampled share of training prompts again; written once,
    read back equal on a rerun; held-out rows are exactly the held-out prompts' answers."""
    from argparse import Namespace

    from scripts.train_drafter import build_data
    from tfjax.drafters.corpus import Prompt

    target, prompts, _, _, _, _ = trained
    meta = [Prompt("code", f"stdlib/m{i}.py", held=i % 4 == 0, text="") for i in range(8)]
    args = Namespace(seed=0, sampled=0.5, temperature=0.8, max_tokens=40, lanes=8, max_prompt_tokens=12)
    data = build_data(args, tmp_path, target, meta, prompts[:8], (), deadline=float("inf"))
    assert len(data["tokens"]) == 8 + 3 and (data["temperature"] > 0).sum() == 3
    assert set(data["prompt"][data["held"]].tolist()) == {0, 4}
    assert not data["held"][data["temperature"] > 0].any()
    again = build_data(args, tmp_path, None, meta, prompts[:8], (), deadline=0.0)  # read, not generated
    assert set(again) == set(data) and all(np.array_equal(again[k], data[k]) for k in data)


def test_held_out_acceptance_is_measured_by_the_real_round(trained):
    """train_drafter's score: tokens a round of the exported drafter's blocks alone in the lane round, greedy, on
    prompts it never saw (at least the one token every round commits)."""
    target, _, _, _, _, out = trained
    unseen = [np.random.default_rng(1).integers(0, 256, 12).tolist() for _ in range(4)]
    rate, each = train.acceptance(target, dflash2_checkpoint.load(out, target=TARGET), unseen, 40, lanes=4,
                                  context=128)
    assert len(each) == 4 and rate >= 1.0 and min(each) >= 1.0


def test_learning_rate_warms_up_then_decays():
    lr = [train.learning_rate(p, 1.0) for p in np.linspace(0, 1, 101)]
    assert lr[0] == 0.0 and max(lr) == pytest.approx(1.0, abs=0.01) and lr[-1] == pytest.approx(0.1)
    peak = int(np.argmax(lr))
    assert all(a <= b for a, b in zip(lr[:peak], lr[1 : peak + 1], strict=True))
    assert all(a >= b for a, b in zip(lr[peak:], lr[peak + 1 :], strict=False))
