"""The whole model through the GPU dispatch, every kernel in interpret mode on the CPU, against the reference path.

What the GPU test on a real model checks (`test_real_model.py -m gpu`), here for the wiring: a 4-bit Qwen3.5 with
DeltaNet and attention layers, fused and repacked for serving, takes the Mosaic matmul's K-split partials, the row
norms, the conv, the DeltaNet recurrence and the paged attention kernels, and gives the reference path's logits.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.experimental import pallas as pl

from pallas_kernels import qmatmul_mgpu as mg
from tests.helpers import rel_err
from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.models.layers import ROWS, serving_layout

# hidden 256 and head dim 64: every 4-bit linear is whole 256-input tiles (the Mosaic kernel), attention's head dim
# is one the kernel takes
CONFIG = geometry.named("tiny_dense").replace(quantization=QuantConfig(4, 64), dtype="bfloat16", hidden_size=256,
                                              intermediate_size=512, head_dim=64, linear_key_head_dim=32,
                                              linear_value_head_dim=32)


def _prompt_then_step(mode: str):
    """Logits of a 5-row prompt and of one more row on its cache, lane-round rows."""
    ops.set_kernels(mode)
    try:
        model = nnx.merge(*models.random_params(CONFIG, seed=1))
        if mode == "kernel":
            serving_layout(model)
        cache = model.init_cache(1, 64)
        prompt = jnp.array([[3, 7, 11, 19, 5]], jnp.int32)
        first, cache, _ = model(prompt, jnp.array([0]), jnp.array([5]), cache, ROWS)
        step, _, _ = model(jnp.array([[23]], jnp.int32), jnp.array([5]), jnp.array([1]), cache, ROWS)
        return jnp.concatenate([first, step], axis=1)
    finally:
        ops.set_kernels("auto")


def test_whole_model_through_the_gpu_dispatch_gives_the_reference_paths_logits(monkeypatch):
    names, parts = [], []
    pallas_call = pl.pallas_call

    def interpreted(*args, **kwargs):
        names.append(kwargs.get("name"))
        return pallas_call(*args, **{**kwargs, "interpret": True})

    qmatmul_parts = mg.qmatmul_parts

    def parts_interpreted(*args, **kwargs):
        parts.append(args[1].shape)
        return qmatmul_parts(*args, **{**kwargs, "interpret": True})

    monkeypatch.setattr(pl, "pallas_call", interpreted)
    monkeypatch.setattr(mg, "qmatmul_parts", parts_interpreted)
    want = _prompt_then_step("reference")
    assert names == [] and parts == []
    got = _prompt_then_step("kernel")
    assert {"row_norm_rms_offset", "row_norm_gated", "paged_attention"} <= set(names), set(names)
    assert any("conv" in n for n in names) and any("delta" in n for n in names), set(names)
    assert len(parts) >= 4 * CONFIG.num_hidden_layers  # every 4-bit linear, the lm_head too, on the Mosaic kernel
    assert got.shape == want.shape == (1, 6, CONFIG.vocab_size)
    assert rel_err(got, want) < 2e-2  # bf16 activations, other summation orders
    assert (jnp.argmax(got, -1) == jnp.argmax(want, -1)).all()
