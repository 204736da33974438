"""The Pallas chunked DeltaNet (prompts) equals XLA's chunked form and the row-by-row recurrence.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta as gdk
from pallas_kernels import gated_delta_chunked as gdc
from tests.helpers import rel_err, spy_interpreted


def _case(rng, b, t, h, dk, dv, dtype=jnp.float32):
    """Fresh random state and prompt rows as the model feeds them: unit keys, q scaled, g < 0, beta in (0, 1)."""
    state = jnp.asarray(rng.standard_normal((b, h, dk, dv)) * 0.5, jnp.float32)
    q, k = (rng.standard_normal((b, t, h, dk)) for _ in range(2))
    q = jnp.asarray(q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5, dtype)
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), dtype)
    v = jnp.asarray(rng.standard_normal((b, t, h, dv)), dtype)
    g = jnp.asarray(-np.abs(rng.standard_normal((b, t, h))) * 0.3, jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((b, t, h)))), jnp.float32)
    return state, q, k, v, g, beta


def _recurrence_errors(args, bs, interpret=True):
    """(out, state) relative errors of the kernel against the row-by-row recurrence on the same inputs."""
    state, out = gdc.chunked(*args, block_sizes=bs, interpret=interpret)
    rec_state, rec_out = gdk.reference(*args)
    return rel_err(out, rec_out), rel_err(state, rec_state)


# T: one row, a chunk + 1, a chunk exactly, several chunks with a ragged last one; two value blocks at block_v 16;
# two launches (split) and one
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
@pytest.mark.parametrize("t,chunk,block_v", [(1, 16, 32), (17, 16, 32), (32, 32, 32), (45, 16, 16)])
def test_interpret_matches_xla_chunked_and_the_recurrence(t, chunk, block_v, split):
    rng = np.random.default_rng(t)
    args = _case(rng, 2, t, 3, 16, 32)
    bs = gdc.BlockSizes(chunk=chunk, block_v=block_v, split=split)
    state, out = gdc.chunked(*args, block_sizes=bs, interpret=True)
    xla_state, xla_out = gdc.reference(*args, chunk=chunk)
    rec_state, rec_out = gdk.reference(*args)
    assert out.shape == (2, t, 3, 32) and state.shape == args[0].shape
    assert rel_err(out, xla_out) < 1e-5 and rel_err(state, xla_state) < 1e-5
    assert rel_err(out, rec_out) < 1e-4 and rel_err(state, rec_state) < 1e-4


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
def test_interpret_64_row_chunks_of_dense27_head_dims_match_the_recurrence(split):
    """The default chunk (six doubling steps of the triangle's inverse) at Dk = Dv = 128, bf16 rows."""
    args = _case(np.random.default_rng(7), 1, 100, 2, 128, 128, jnp.bfloat16)
    out_err, state_err = _recurrence_errors(args, gdc.BlockSizes(split=split))
    assert out_err < 1e-4 and state_err < 1e-4


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
def test_interpret_near_equal_keys_stay_accurate(split):
    """A repeated token: near-equal keys, beta near 1, no decay. The triangle's inverse stays below 1 while the
    powers of A that a series inverse would sum reach ~1e17 (that form lost every digit here)."""
    rng = np.random.default_rng(9)
    state, q, _, v, _, _ = _case(rng, 1, 128, 2, 32, 32)
    base = rng.standard_normal(32)
    k = base + 0.01 * rng.standard_normal((1, 128, 2, 32))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    g = jnp.full((1, 128, 2), -1e-3, jnp.float32)
    beta = jnp.full((1, 128, 2), 0.99, jnp.float32)
    out_err, state_err = _recurrence_errors((state, q, k, v, g, beta), gdc.BlockSizes(block_v=32, split=split))
    assert out_err < 1e-4 and state_err < 1e-4


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
def test_interpret_strong_decays_stay_accurate(split):
    """Strong decays (g down to about -20, cum near -300 in a chunk) with the prompt ending inside the chunk: the state's
    last factor e^(cum_C - cum_i) reads cum_C itself (summing g again in another order put its state 2.5e-5 off)."""
    state, q, k, v, g, beta = _case(np.random.default_rng(1), 2, 61, 2, 16, 16)
    out_err, state_err = _recurrence_errors((state, q, k, v, g * 20, beta), gdc.BlockSizes(block_v=16, split=split))
    assert out_err < 1e-5 and state_err < 5e-6


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
def test_zero_rows_past_the_prompt_leave_the_state_alone(split):
    """The model zeroes rows past a lane's prompt: the state equals the shorter prompt's, bit for bit."""
    state, q, k, v, g, beta = _case(np.random.default_rng(3), 1, 40, 2, 16, 16)
    bs = gdc.BlockSizes(chunk=16, block_v=16, split=split)
    short_state, short_out = gdc.chunked(state, *(a[:, :30] for a in (q, k, v, g, beta)), block_sizes=bs,
                                         interpret=True)
    live = (jnp.arange(40) < 30)[None, :, None]
    masked = [jnp.where(live[..., None], a, 0) for a in (q, k, v)] + [jnp.where(live, a, 0) for a in (g, beta)]
    long_state, long_out = gdc.chunked(state, *masked, block_sizes=bs, interpret=True)
    np.testing.assert_array_equal(long_state, short_state)
    np.testing.assert_array_equal(long_out[:, :30], short_out)


def test_bad_shapes_and_blocks_raise_naming_the_value():
    state, q, k, v, g, beta = _case(np.random.default_rng(4), 1, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="v.shape"):
        gdc.chunked(state, q, k, v[..., :8], g, beta, interpret=True)
    with pytest.raises(ValueError, match="chunk=24"):
        gdc.chunked(state, q, k, v, g, beta, block_sizes=gdc.BlockSizes(chunk=24), interpret=True)
    with pytest.raises(ValueError, match="precision='fp8'"):
        gdc.chunked(state, q, k, v, g, beta, block_sizes=gdc.BlockSizes(precision="fp8"), interpret=True)
    with pytest.raises(ValueError, match="powers of 2"):
        gdc.chunked(state[..., :12], q, k, v[..., :12], g, beta, interpret=True)


def test_model_chunked_takes_the_kernel_only_when_switched_on(monkeypatch):
    """`ops.chunked` stays on XLA's scan with kernels on, and goes to the kernel with `Kernels.delta_chunked`."""
    from tfjax import ops

    calls = spy_interpreted(monkeypatch, gdc, "chunked", lambda args, kw: kw["block_sizes"].chunk)
    args = _case(np.random.default_rng(5), 1, 20, 2, 16, 16)
    want_state, want = gdc.reference(*args, 16)
    with ops.using(ops.PALLAS):
        ops.chunked(*args, chunk=16)
    assert calls == []
    with ops.using(ops.Kernels(pallas=True, delta_chunked=True)):
        got_state, got = ops.chunked(*args, chunk=16)
    assert calls == [16] and rel_err(got, want) < 1e-5 and rel_err(got_state, want_state) < 1e-5


@pytest.mark.parametrize("split,names", [(True, ["gated_delta_chunked_prepare", "gated_delta_chunked_state"]),
                                         (False, ["gated_delta_chunked"])], ids=["split", "one-launch"])
def test_lowers_to_triton_for_cuda_without_a_gpu(split, names):
    """The compiled path's Pallas -> Triton lowering at dense27's DeltaNet shape (48 heads of 128), a prompt of
    2100 rows (33 chunks, not a power of two)."""
    sds = jax.ShapeDtypeStruct
    rows = sds((1, 2100, 48, 128), jnp.float32)
    gates = sds((1, 2100, 48), jnp.float32)
    text = gdc.chunked.trace(sds((1, 48, 128, 128), jnp.float32), rows, rows, rows, gates, gates,
                             block_sizes=gdc.BlockSizes(split=split)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and all(f'name = "{n}"' in text for n in names)


# Compiled on a GPU at the dense27 geometry: `pytest -m gpu tests/test_gated_delta_chunked_kernel.py`.
@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "one-launch"])
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("t", [64, 300])
def test_gpu_matches_the_recurrence(t, precision, split):
    assert jax.default_backend() == "gpu"
    args = _case(np.random.default_rng(t), 1, t, 48, 128, 128)
    out_err, state_err = _recurrence_errors(args, gdc.BlockSizes(precision=precision, split=split), interpret=False)
    assert out_err < 1e-4 and state_err < 1e-4


def test_model_prompt_layer_takes_the_kernel_and_gives_the_scans_outputs(monkeypatch):
    """A DeltaNet layer's prompt chunk (PROMPT mode, 70 rows with 61 valid in one lane) through the kernel gives
    XLA's scan's outputs, next state and conv tail."""
    from tfjax import geometry, models, ops
    from tfjax.models.layers import PROMPT
    from tfjax.models.qwen3_5 import DeltaState, GatedDeltaNet

    c = geometry.tiny_dense
    layer = next(m for _, m in models.nnx.iter_modules(models.build(c, seed=2)) if isinstance(m, GatedDeltaNet))
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2, 70, c.hidden_size)), jnp.float32)
    start = DeltaState(jnp.asarray(rng.standard_normal((2, c.linear_conv_kernel_dim - 1, c.linear_conv_dim)), jnp.float32),
                       jnp.asarray(rng.standard_normal((2, c.linear_num_value_heads, c.linear_key_head_dim,
                                                        c.linear_value_head_dim)) * 0.1, jnp.float32))
    valid = jnp.asarray([70, 61], jnp.int32)
    want, want_cache, _ = layer(x, start, valid, PROMPT)
    calls = spy_interpreted(monkeypatch, gdc, "chunked", lambda args, kw: "kernel")
    with ops.using(ops.Kernels(pallas=True, delta_chunked=True)):
        got, got_cache, _ = layer(x, start, valid, PROMPT)
    assert calls == ["kernel"]
    assert rel_err(got[1, :61], want[1, :61]) < 1e-5 and rel_err(got[0], want[0]) < 1e-5
    assert rel_err(got_cache.state, want_cache.state) < 1e-5
    np.testing.assert_array_equal(got_cache.conv, want_cache.conv)
