"""The dispatch point's GPU branch, checked on the CPU by forcing `kernel` dispatch (no kernel is launched)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import qmatmul as qk
from pallas_kernels import qmatmul_mgpu as mg
from tests.helpers import rel_err, spy_interpreted
from tfjax import ops, quant
from tfjax.models import layers


@pytest.fixture
def kernel_dispatch():
    with ops.using(ops.PALLAS):
        yield
    jax.clear_caches()  # no trace made with the GPU dispatch forced (and interpreted spies inside) outlives the test


def _loop_trips(jaxpr) -> list[int]:
    """Trip counts of the scans in a jaxpr (lax.map lowers to scan)."""
    return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_gpu_fenced_map_never_traces_a_one_trip_loop_and_returns_the_rows_it_was_given(kernel_dispatch):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5)), jnp.float32)
    fn = lambda r: r * jnp.sum(r)  # noqa: E731
    assert _loop_trips(jax.make_jaxpr(lambda a: ops.fenced_map(fn, a))(x).jaxpr) == [2]
    np.testing.assert_array_equal(ops.fenced_map(fn, x), jax.vmap(fn)(x))
    three = jnp.concatenate([x, 2 * x, 3 * x])
    assert _loop_trips(jax.make_jaxpr(lambda a: ops.fenced_map(fn, a))(three).jaxpr) == [3]


def test_gpu_rowwise_runs_rows_in_fixed_tiles_whatever_their_count(kernel_dispatch):
    fn = lambda t: t / jnp.sqrt(jnp.mean(t * t, axis=-1, keepdims=True))  # noqa: E731
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, 16)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda a: ops.rowwise(fn, a, rows=True))(x).jaxpr
    assert _loop_trips(jaxpr) == [2], "18 rows fit one GPU tile, run as a two-trip loop"
    np.testing.assert_allclose(ops.rowwise(fn, x, rows=True), fn(x), rtol=1e-6)


def test_paged_attention_falls_back_to_the_reference_for_head_dims_the_kernel_lacks(kernel_dispatch):
    rng = np.random.default_rng(2)
    pages = ops.KVPages(*(jnp.asarray(rng.standard_normal((4, 8, 2, 32)), jnp.float32) for _ in range(2)))
    table = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 3, 4, 32)), jnp.float32)
    positions = jnp.asarray([[5, 6, 7]], jnp.int32)
    got = ops.paged_attention(q, pages, table, positions)
    with ops.using(ops.REFERENCE):
        np.testing.assert_array_equal(got, ops.paged_attention(q, pages, table, positions))


@pytest.mark.parametrize("n,want", [(128, "mgpu"), (96, "triton")], ids=["column-blocks", "ragged-n"])
def test_packed_pair_linears_take_the_mosaic_kernel_for_whole_column_blocks(kernel_dispatch, monkeypatch, n, want):
    """Packed pair-layout 4-bit rows go to the Mosaic GPU kernel when N is whole 64-row blocks, else Triton's."""
    calls = {"mgpu": spy_interpreted(monkeypatch, mg, "qmatmul_pairs", lambda a, kw: a[0].shape),
             "triton": spy_interpreted(monkeypatch, qk, "qmatmul_tiled", lambda a, kw: a[0].shape)}
    rng = np.random.default_rng(n)
    w = rng.integers(0, 2**32, (n, 512 // 8), dtype=np.uint32)
    s = jnp.asarray(rng.uniform(0.001, 0.01, (n, 8)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.05, (n, 8)), jnp.bfloat16)
    pw, ps, pb = quant.to_pair_layout(jnp.asarray(w), s, b, 4, 64)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    got = ops.qmatmul(x, pw, quant.pack_scale_bias(ps, pb), None, bits=4, group_size=64, rows=True, layout="pairs")
    assert calls[want] == [(3, 512)] and all(not c for k, c in calls.items() if k != want)
    assert rel_err(got, quant.qmatmul_reference(x, jnp.asarray(w), s, b, 4, 64)) < 1e-2


def test_partials_of_a_mosaic_linear_summed_by_the_norm_give_the_unfused_residual(kernel_dispatch, monkeypatch):
    """`Linear.partials` hands the Mosaic kernel's K-split partials to `RMSNorm.add` (XLA's sum and add, then the
    norm kernel): the residual comes out with the bits of `x + linear(h)`, the norm within one bf16 rounding of its
    norm."""
    from pallas_kernels import row_norm as rn

    calls = {"parts": spy_interpreted(monkeypatch, mg, "qmatmul_parts", lambda a, kw: a[0].shape),
             "pairs": spy_interpreted(monkeypatch, mg, "qmatmul_pairs", lambda a, kw: a[0].shape),
             "norm": spy_interpreted(monkeypatch, rn, "row_norm", lambda a, kw: a[0].shape)}
    rng = np.random.default_rng(21)
    lin = layers.Linear(1024, 128, quant=(4, 64), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lin.weight[...] = jnp.asarray(rng.integers(0, 2**32, (128, 1024 // 8), dtype=np.uint32))
    lin.scales[...] = jnp.asarray(rng.uniform(0.001, 0.01, (128, 16)), jnp.bfloat16)
    lin.biases[...] = jnp.asarray(rng.normal(0, 0.05, (128, 16)), jnp.bfloat16)
    layers.use_kernel_layout(lin)
    norm = layers.RMSNorm(128, 1e-6, offset=True, dtype=jnp.bfloat16)
    norm.weight[...] = jnp.asarray(rng.standard_normal(128) * 0.2, jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((2, 1, 1024)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 1, 128)), jnp.bfloat16)
    parts = lin.partials(h, rows=True)
    assert parts.shape == (4, 2, 1, 128)  # 1024 inputs: 4 tiles, split 4
    assert parts.dtype == jnp.float32 and calls["parts"] == [(2, 1, 1024)]
    nx, y = norm.add(x, parts, rows=True)
    want_nx = x + lin(h, rows=True)
    np.testing.assert_array_equal(np.asarray(nx, np.float32), np.asarray(want_nx, np.float32))
    assert rel_err(y, norm(want_nx, rows=True)) < 1e-2 and len(calls["norm"]) == 2


def test_a_models_kernels_are_in_its_graphdef_so_a_change_recompiles():
    from tfjax import geometry, models

    model = models.build(geometry.tiny_dense, seed=0, kernels=ops.REFERENCE)
    a, _ = models.split(model)
    model.kernels = ops.Kernels(pallas=False, delta_chunked=True)
    b, _ = models.split(model)
    model.kernels = ops.REFERENCE
    c, _ = models.split(model)
    assert a != b and a == c and hash(a) == hash(c)


def test_a_forward_traces_with_its_models_kernels_whatever_is_active_around_it():
    from tfjax import geometry, models
    from tfjax.models.layers import ROWS

    model = models.build(geometry.tiny_dense, seed=0, kernels=ops.REFERENCE)
    cache = model.init_cache(1, 32)
    tokens = jnp.asarray([[3, 5]], jnp.int32)
    with ops.using(ops.PALLAS):
        jaxpr = jax.make_jaxpr(lambda t: model(t, jnp.array([0]), jnp.array([2]), cache, ROWS)[0])(tokens)
    assert "pallas_call" not in str(jaxpr)
    assert ops.active() == ops.Kernels.default()  # the scope ended with the trace


@pytest.mark.parametrize("layout", ["mlx", "pairs"])
def test_a_prompt_products_dequantization_waits_for_its_input(layout):
    """XLA's dequantize-then-dot reads the packed weight only through a barrier with x: a weight depends on
    parameters alone, so without it the GPU scheduler may dequantize every layer's weights before the first layer
    runs (a 30 GiB temp for a dense27 prompt chunk, issue 28)."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)  # K: one pair-layout tile
    qw, s, b = quant.quantize(w, bits=4, group_size=64)
    if layout == "pairs":
        qw, s, b = quant.to_pair_layout(qw, s, b, 4, 64)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)  # a prompt chunk's rows: XLA's path
    with ops.using(ops.PALLAS):
        assert ops.qmatmul_path(64, 256, bits=4, group_size=64, layout=layout, packed=False, row_count=256,
                                rows=False) == "reference"
        jaxpr = jax.make_jaxpr(lambda x_, w_: ops.qmatmul(x_, w_, s, b, bits=4, group_size=64, layout=layout))(x, qw)
    x_var, w_var = jaxpr.jaxpr.invars
    readers = [e for e in jaxpr.jaxpr.eqns if w_var in e.invars]
    assert [e.primitive.name for e in readers] == ["optimization_barrier"]
    assert x_var in readers[0].invars


def test_prompt_products_take_the_mosaic_kernel_up_to_a_whole_chunk_and_the_triton_kernels_up_to_64_rows():
    """The Mosaic kernel beats XLA's dequantize-then-dot at 128 and 256 prompt rows on dense27 (H100); the Triton
    kernels lost to it past 64 rows, and a product of more rows than a chunk holds goes to XLA's dot."""
    def path(n, k, count, packed=True, rows=False):
        return ops.qmatmul_path(n, k, bits=4, group_size=64, layout="pairs", packed=packed, row_count=count,
                                rows=rows, kernels=ops.PALLAS)

    assert [path(5120, 5120, c) for c in (1, 64, 128, ops.MOSAIC_MAX_ROWS)] == ["mosaic"] * 4
    assert path(5120, 5120, ops.MOSAIC_MAX_ROWS + 1) == "reference"
    assert path(5120, 5120, 4096, rows=True) == "mosaic"  # a lane round's rows, whatever their count
    assert [path(5120, 5120, c, packed=False) for c in (64, 65)] == ["tiled", "reference"]  # unpacked: Triton
    assert [path(96, 5120, c) for c in (64, 128)] == ["tiled", "reference"]  # a shape Mosaic does not serve


def test_a_cpu_product_of_few_rows_takes_a_row_tile_and_never_widens_the_weight():
    """XLA CPU widens a 16-bit weight to f32 for a dot of one row (a prompt's last-row logits): the reference takes
    one padded row tile instead, the lane rounds' own product."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((384, 64)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    with ops.using(ops.REFERENCE):
        few = jax.jit(lambda a, b: ops.matmul(a, b))
        np.testing.assert_array_equal(few(x, w), jax.jit(lambda a, b: ops.matmul(a, b, rows=True))(x, w))
        assert "f32[384,64]" not in few.lower(x, w).compile().as_text()
