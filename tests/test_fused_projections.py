"""Fused sibling projections (the GPU serving layout) compute what the separate ones do, and keep rows invariant."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import prefill_then_steps, rel_err
from tfjax import geometry, models
from tfjax.config import QuantConfig
from tfjax.models import layers
from tfjax.models.layers import Linear, fuse_projections, use_kernel_layout


def _tokens(n=14, seed=0):
    return np.random.default_rng(seed).integers(0, 250, n).astype(np.int32)


@pytest.mark.parametrize("name,quant", [("tiny_dense", None), ("tiny_dense", QuantConfig(4, 32)), ("tiny_moe", None)],
                         ids=["dense", "dense-4bit", "moe"])
def test_fused_model_gives_the_unfused_logits(name, quant):
    config = getattr(geometry, name)
    config = config if quant is None else config.replace(quantization=quant)
    plain = models.build(config, seed=3)
    fused = models.build(config, seed=3)
    n = fuse_projections(fused)
    layer_count = config.num_hidden_layers
    assert n >= layer_count + (layer_count if name == "tiny_dense" else 0), "every layer's mixer (and MLP) fused"
    assert fuse_projections(fused) == 0, "fusing twice is a no-op"
    if quant is not None:
        use_kernel_layout(plain)
        use_kernel_layout(fused)
    want = prefill_then_steps(plain, _tokens(), 9)
    got = prefill_then_steps(fused, _tokens(), 9)
    assert rel_err(got, want) < 1e-5


def test_biased_linears_fuse_with_their_biases():
    """Qwen2's q/k/v carry biases: the fused Linear adds each part's own."""
    a = Linear(32, 16, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    b = Linear(32, 8, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(1))
    a.bias, b.bias = nnx.Param(jnp.arange(16.0) + 1), nnx.Param(jnp.arange(8.0) - 50)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)), jnp.float32)
    fused = layers.concat_linears([a, b])
    ya, yb = layers.split_outputs(fused(x), fused.splits)
    assert rel_err(ya, a(x)) < 1e-6 and rel_err(yb, b(x)) < 1e-6


def test_linears_that_differ_stay_apart():
    a = Linear(64, 32, dtype=jnp.float32, rngs=nnx.Rngs(0))
    b = Linear(64, 32, quant=(4, 32), dtype=jnp.float32, rngs=nnx.Rngs(1))
    c = Linear(48, 32, dtype=jnp.float32, rngs=nnx.Rngs(2))
    assert layers.concat_linears([a, b]) is None and layers.concat_linears([a, c]) is None
    fused = layers.concat_linears([a, Linear(64, 16, dtype=jnp.float32, rngs=nnx.Rngs(3))])
    assert fused.splits == (32, 16) and fused.weight.shape == (64, 64), "48 rows padded to a column block"
    assert not np.asarray(fused.weight[...][48:]).any()


def test_fused_drafter_drafts_the_unfused_block():
    """A DFlash2 drafter with fused q/k/v and gate/up absorbs and drafts what the unfused one does."""
    from tests.test_dflash2 import TARGET, _our_block, drafter_config
    from tfjax.drafters import dflash2

    target = models.build(TARGET, seed=3)
    make = lambda: dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=4).bind(TARGET)  # noqa: E731
    plain, fused = make(), make()
    assert fuse_projections(fused) == 2 * 2, "each of the 2 layers: attention and MLP"
    taps = np.random.default_rng(2).standard_normal((9, 2 * 64)).astype(np.float32)
    want_logits, want_drafts = _our_block(plain, target, taps, pending=17)
    got_logits, got_drafts = _our_block(fused, target, taps, pending=17)
    assert rel_err(got_logits, want_logits) < 1e-5 and got_drafts.tolist() == want_drafts.tolist()


def test_a_fused_drafter_refuses_to_be_saved_in_the_published_layout(tmp_path):
    from tests.test_dflash2 import TARGET, drafter_config
    from tfjax.drafters import dflash2, dflash2_checkpoint

    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(drafter_config()), seed=4).bind(TARGET)
    fuse_projections(drafter)
    with pytest.raises(ValueError, match="fused"):
        dflash2_checkpoint.save(drafter, tmp_path / "d")
