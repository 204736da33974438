"""quantize="int8": the integer product is what its formula says, close to the float one, row-invariant, and the
engine's contract (drafted == plain, concurrent == alone) holds on an int8 model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import rel_err
from tfjax import geometry, int8, models
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.layers import Embedding, Linear, use_int8

LANES = LaneConfig(capacity=4, width=5, context=192, page_size=16)
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95)


def _random(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("k", [64, 576, 96])
def test_rotation_is_orthogonal_and_its_own_inverse(k):
    x = _random((5, k), 0)
    y = int8.rotate(x)
    assert rel_err(int8.rotate(y), x) < 1e-6
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    assert rel_err(y, x) > 0.5, "the rotation moved nothing"


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_the_product_equals_its_exact_integer_formula(rows):
    x, w = _random((rows, 576), 1, jnp.bfloat16), _random((200, 576), 2)
    codes, scales = int8.quantize_channels(w)
    got = np.asarray(int8.matmul(x, codes, scales, out_dtype=jnp.float32), np.float64)
    np.testing.assert_allclose(got, int8.reference(x, codes, scales), rtol=1e-5, atol=1e-5)


def test_the_product_is_close_to_the_float_product():
    x, w = _random((16, 1536), 3), _random((576, 1536), 4)
    codes, scales = int8.quantize_channels(w)
    err = rel_err(int8.matmul(x, codes, scales), x @ w.T)
    assert err < 0.02, err


def test_a_row_alone_equals_the_same_row_among_others_bit_for_bit():
    x, w = _random((160, 576), 5, jnp.bfloat16), _random((192, 576), 6)
    codes, scales = int8.quantize_channels(w)
    every = np.asarray(int8.matmul(x, codes, scales))
    for n in (1, 3, 8, 9, 33, 64, 100):
        np.testing.assert_array_equal(np.asarray(int8.matmul(x[:n], codes, scales)), every[:n])


def test_use_int8_converts_dense_linears_and_the_embedding_reads_its_rows_back():
    from flax import nnx

    emb = Embedding(50, 128, quant=None, dtype=jnp.float32, rngs=nnx.Rngs(0))
    want = np.asarray(emb(jnp.arange(50)))
    assert use_int8(emb) == 1 and emb.table.layout == "int8" and emb.table.weight.dtype == jnp.int8
    assert rel_err(emb(jnp.arange(50)), want) < 0.01
    four_bit = Linear(64, 32, quant=(4, 32), dtype=jnp.float32, rngs=nnx.Rngs(1))
    assert use_int8(four_bit) == 0 and four_bit.layout == "mlx", "MLX-quantized weights keep their format"


@pytest.fixture(scope="module")
def int8_target():
    model = models.build(geometry.tiny_dense, seed=11)
    assert use_int8(model) > 0
    return model


def _run(target, requests, facts=None):
    engine = Engine(target, LANES, eos_ids=())
    if facts is not None:
        engine.runner.set_facts(facts)
    return engine.run(requests)


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 250, 12).tolist()
    return (rng.integers(0, 250, n - 24).tolist() + span + span)[:n]


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_int8_drafted_equals_plain_and_concurrent_equals_alone(int8_target, params):
    prompts = [_prompt(s) for s in range(3)]
    plain = _run(int8_target, [Request(p, max_tokens=20, draft=False, **params) for p in prompts])
    drafted = _run(int8_target, [Request(p, max_tokens=20, **params) for p in prompts], facts=RoundFacts(copy_match=1))
    alone = [_run(int8_target, [Request(p, max_tokens=20, draft=False, **params)])[0] for p in prompts]
    for a, b, c in zip(plain, drafted, alone, strict=True):
        assert a.token_sha256 == b.token_sha256 == c.token_sha256
    assert sum(r.proposed for r in drafted) > 0, "copies never proposed: the test would not exercise them"


def test_an_unknown_quantize_value_and_int8_with_tp_are_clear_errors(tmp_path):
    from tfjax import api

    with pytest.raises(ValueError, match="quantize='int4' is not one of none, int8"):
        api.LLM(tmp_path, quantize="int4")
    with pytest.raises(ValueError, match="tensor parallel"):
        api.LLM(tmp_path, quantize="int8", tp=1)


def test_fused_projections_in_int8_give_the_unfused_logits_bit_for_bit():
    from tests.helpers import prefill_then_steps
    from tfjax.models.layers import fuse_projections

    tokens = np.random.default_rng(0).integers(0, 250, 12).astype(np.int32)
    plain, fused = models.build(geometry.tiny_dense, seed=3), models.build(geometry.tiny_dense, seed=3)
    assert fuse_projections(fused) > 0
    use_int8(plain), use_int8(fused)
    np.testing.assert_array_equal(prefill_then_steps(fused, tokens, 8), prefill_then_steps(plain, tokens, 8))
