"""A GPU lane round holds no loop outside its kernels: on the GPU a loop is a while thunk, and XLA ends the round's
CUDA graph before it and starts another after it (an 8-layer MoE round launched 9 graphs, H100 2026-12-07). Traced
with the GPU dispatch on the CPU: bf16 and 4-bit dense, 4-bit MoE, root copies and a DFlash2 block drafter, rounds
without processors."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_dflash2 import drafter_config
from tests.test_lanes import LANES
from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.drafters import dflash2
from tfjax.engine import Engine
from tfjax.lanes import round as lane_round
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import serving_layout
from tfjax.profiling import structure

# head dim 64: the attention kernels' (the tiny geometries' 32 falls back to the reference, which loops over heads)
DENSE = geometry.tiny_dense.replace(head_dim=64, dtype="bfloat16")
TARGET = DENSE.replace(quantization=QuantConfig(4, 64))
# 4-bit MoE (whole 64-input groups): its shared expert's gate (N=1) once looped; a bf16 MoE's experts still loop over
# rows (no row-invariant kernel for dense stacks), so it is not here
MOE = geometry.tiny_moe.replace(head_dim=64, dtype="bfloat16", quantization=QuantConfig(4, 64),
                                moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.mark.parametrize("config,drafting", [(DENSE, "plain"), (TARGET, "plain"), (TARGET, "copies"),
                                             (TARGET, "dflash2"), (MOE, "plain")],
                         ids=["dense-bf16", "dense-4bit", "copies", "dflash2", "moe-4bit"])
def test_a_gpu_lane_round_holds_no_loop_outside_its_kernels(config, drafting):
    target = models.build(config, seed=1, kernels=ops.PALLAS)
    serving_layout(target)
    drafter = None
    if drafting == "dflash2":
        raw = drafter_config(vocab_size=TARGET.vocab_size)
        raw["dflash_config"].update(block_size=5, target_layer_ids=[0, 2, 3])
        drafter = dflash2.build(dflash2.DFlashConfig.from_dict(raw), seed=13).bind(TARGET)
        drafter.kernels = ops.PALLAS  # a GPU's default, fixed when it is built
    r = Engine(target, LANES, drafter=drafter, eos_ids=()).runner
    r.set_facts(RoundFacts(copy_match=3 if drafting == "copies" else 0, draft_block=r.spec.facts.draft_block))
    spec = dataclasses.replace(r.spec, processors=False)  # processors (logprobs) trace only when a lane wants them
    with ops.using(ops.PALLAS):
        traced = lane_round.lane_round.trace(r.target_def, r.target_params, r.drafter_def, r.drafter_params,
                                             r.state, spec)
    got = structure(traced.jaxpr)
    assert got["loops"] == 0 and got["pallas_call"] > 0, got
