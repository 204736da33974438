"""The whole model through the GPU dispatch, every kernel in interpret mode on the CPU, against the reference path.

What the GPU test on a real model checks (`test_real_model.py -m gpu`), here for the wiring: a 4-bit Qwen3.5 with
DeltaNet and attention layers, fused and repacked for serving, takes the Mosaic matmul's K-split partials, the row
norms, the conv, the DeltaNet recurrence and the paged attention kernels, and gives the reference path's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import pallas as pl

from pallas_kernels import attention_mgpu as am
from pallas_kernels import qmatmul_mgpu as mg
from tests.helpers import rel_err, spy_interpreted
from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.models.layers import ROWS, serving_layout

# hidden 256 and head dim 64: every 4-bit linear is whole 256-input tiles (the Mosaic kernel), attention's head dim
# is one the kernel takes
CONFIG = geometry.named("tiny_dense").replace(quantization=QuantConfig(4, 64), dtype="bfloat16", hidden_size=256,
                                              intermediate_size=512, head_dim=64, linear_key_head_dim=32,
                                              linear_value_head_dim=32)


def _prompt_then_step(kernels: ops.Kernels):
    """Logits of a 5-row prompt and of one more row on its cache, lane-round rows."""
    model = nnx.merge(*models.random_params(CONFIG, seed=1))
    model.kernels = kernels
    if kernels.pallas:
        serving_layout(model)
    cache = model.init_cache(1, 64)
    prompt = jnp.array([[3, 7, 11, 19, 5]], jnp.int32)
    first, cache, _ = model(prompt, jnp.array([0]), jnp.array([5]), cache, ROWS)
    step, _, _ = model(jnp.array([[23]], jnp.int32), jnp.array([5]), jnp.array([1]), cache, ROWS)
    return jnp.concatenate([first, step], axis=1)


def test_whole_model_through_the_gpu_dispatch_gives_the_reference_paths_logits(monkeypatch):
    jax.clear_caches()  # kernels an earlier module traced for the GPU (traced, never lowered) must not serve here
    names = []
    pallas_call = pl.pallas_call

    def interpreted(*args, **kwargs):
        names.append(kwargs.get("name"))
        return pallas_call(*args, **{**kwargs, "interpret": True})  # Triton's interpreter: no host callbacks

    monkeypatch.setattr(pl, "pallas_call", interpreted)
    parts = spy_interpreted(monkeypatch, mg, "qmatmul_parts", lambda args, kw: args[1].shape)
    mosaic_attention = spy_interpreted(monkeypatch, am, "paged_attention", lambda args, kw: args[0].shape)
    want = _prompt_then_step(ops.REFERENCE)
    assert names == [] and parts == [] and mosaic_attention == []
    try:
        got = _prompt_then_step(ops.PALLAS)
    finally:
        jax.clear_caches()  # jitted kernels traced with the interpreter inside must not serve later traces
    assert {"row_norm_rms_offset", "row_norm_gated"} <= set(names), set(names)
    assert "paged_attention" not in names and mosaic_attention  # bf16 pages of 16: the Mosaic kernel, not Triton's
    assert any("conv" in n for n in names) and any("delta" in n for n in names), set(names)
    assert len(parts) >= 4 * CONFIG.num_hidden_layers  # every 4-bit linear, the lm_head too, on the Mosaic kernel
    assert got.shape == want.shape == (1, 6, CONFIG.vocab_size)
    assert rel_err(got, want) < 2e-2  # bf16 activations, other summation orders
    assert (jnp.argmax(got, -1) == jnp.argmax(want, -1)).all()


def test_a_lowered_step_holds_one_mosaic_kernel_per_matmul_shape():
    """Each Mosaic matmul is a jitted call, so the lowered step holds a kernel's copy (~100 KB of text) per weight
    shape and entry (partials or summed), not per call site: with `qmatmul_parts` unjitted (9 here, not 6),
    dense27's 257 call sites stopped a decode step compiling within a minute on the H200."""
    import re

    from tfjax.models.layers import Linear

    try:
        model = nnx.merge(*models.random_params(CONFIG, seed=1))
        model.kernels = ops.PALLAS
        serving_layout(model)
        outputs = ("down_proj", "o_proj", "out_proj")  # a layer's outputs leave as partials, the rest summed
        served = [(m.weight.shape, path[-1] in outputs) for path, m in nnx.iter_modules(model)
                  if isinstance(m, Linear) and m.layout == "pairs"]
        graphdef, params = models.split(model)
        cache = model.init_cache(1, 64)

        def step(params, token, pos, cache):
            return models.forward.__wrapped__(graphdef, params, token, pos, jnp.ones_like(pos), cache, ROWS)[0]

        text = jax.jit(step).trace(params, jnp.array([[3]], jnp.int32), jnp.array([4]), cache).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        jax.clear_caches()
    calls = [line for line in text.splitlines() if re.search(r"custom_call @mosaic_gpu", line)]
    attention = sum("paged_attention_mgpu" in line for line in calls)  # one attention kernel per layer shape
    assert attention == 1, attention
    kernels = len(calls) - attention
    assert kernels == len(set(served)) < len(served), (kernels, len(set(served)), len(served))
