"""Every linear of every served shape has a GPU path: the dispatch picks a kernel whose shape checks accept it, or
the reference (e.g. a 4-bit N=1 linear, the MoE shared-expert gate, which once raised "N=1 must be a multiple of
block_n=64" on the GPU). Shapes only: the served models are built abstractly (`nnx.eval_shape`), each distinct linear
traced abstractly (`jax.eval_shape`) through `ops` with kernels on and every kernel in interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pallas_kernels import matmul as mm
from pallas_kernels import qmatmul as qk
from pallas_kernels import qmatmul_mgpu as mg
from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.models.layers import Linear, serving_layout

KERNELS = {(mg, "qmatmul_parts"): "mosaic", (mg, "qmatmul_pairs"): "mosaic", (qk, "qmatmul_tiled"): "tiled",
           (qk, "qmatmul"): "mlx", (mm, "matmul"): "dense"}
ROWS = ((1, True), (8, True), (256, False))  # decode, verify rows, a prompt chunk


def _served(config):
    """(graphdef, abstract state) of `config` in the GPU serving layout: fused projections, kernel packing."""
    def build():
        model = models.build(config, kernels=ops.PALLAS)
        serving_layout(model)
        return model

    return nnx.split(nnx.eval_shape(build))


@pytest.fixture
def spies(monkeypatch):
    """Kernels run in interpret mode; each call records its path name."""
    calls = []
    def spy_on(kernel, path):
        def spy(*args, **kwargs):
            calls.append(path)
            return kernel(*args, **{**kwargs, "interpret": True})

        return spy

    for (module, name), path in KERNELS.items():
        monkeypatch.setattr(module, name, spy_on(getattr(module, name), path))
    yield calls
    jax.clear_caches()  # no trace with interpreted spies inside outlives the test


def _config(name: str, quant):
    c = geometry.named(name).replace(dtype="bfloat16")
    kinds = tuple(dict.fromkeys(c.layer_types))  # one layer of each kind: the same linear shapes, a fraction of the build
    first = [c.layer_types.index(k) for k in kinds]
    c = c.replace(num_hidden_layers=len(first), layer_types=tuple(c.layer_types[i] for i in sorted(first)))
    if quant is None:
        return c
    if name == "tiny_moe":  # MLX groups of 32 or more: the tiny expert widths (32, 48) made whole groups
        c = c.replace(moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return c.replace(quantization=quant)


@pytest.mark.parametrize("quant", [None, QuantConfig(4, 64)], ids=["bf16", "4bit"])
@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe", "dense27", "moe35a3"])
def test_every_linear_shape_takes_a_kernel_that_accepts_it_or_the_reference(spies, name, quant):
    graphdef, state = _served(_config(name, quant))
    model = nnx.merge(graphdef, state)
    seen, paths = set(), {}
    for path, lin in nnx.iter_modules(model):
        if not isinstance(lin, Linear):
            continue
        packed = lin.quant is not None and lin.biases is None
        key = (tuple(lin.weight.shape), lin.quant, lin.layout, packed)
        if key in seen:
            continue
        seen.add(key)
        sub_def, sub_state = nnx.split(lin)
        k = lin.weight.shape[1] * (32 // lin.quant[0] if lin.quant else 1)
        for m, rows in ROWS:
            spies.clear()
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)

            def call(st, x, rows=rows, use_parts=lin.quant is not None, sub_def=sub_def):
                lin = nnx.merge(sub_def, st)
                with ops.using(ops.PALLAS):
                    return lin.partials(x, rows) if use_parts else lin(x, rows)

            out = jax.eval_shape(call, sub_state, x)  # raises where a kernel refuses the shape
            n = lin.weight.shape[0]
            assert out.shape[-1] == n and out.shape[-2] == m, (path, out.shape)
            paths[(key, m)] = spies[0] if spies else "reference"
    assert paths, "no linear found"
    if quant is not None and not name.startswith("tiny"):  # the served 4-bit linears: most take the Mosaic kernel
        assert sum(p == "mosaic" for p in paths.values()) >= len(paths) // 3, paths
    if name == "tiny_moe" or name == "moe35a3":
        gate = {m: p for (key, m), p in paths.items() if key[0][0] == 1}  # the shared-expert gate, N=1
        # lane-round rows: the dense kernel on N padded to 16 (a row-tile loop split the round's CUDA graph)
        assert gate[1] == gate[8] == "dense" and gate[256] in ("reference", "dense"), gate


def test_a_narrow_rows_linear_takes_the_dense_kernel_padded_to_16_and_keeps_each_rows_bits(spies):
    """N=1 (the MoE shared-expert gate) in lane-round rows: the dense kernel on the weight padded with zero rows, its
    one column equal to the reference's product, and a row alone the same bits as among other rows."""
    import numpy as np

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    with ops.using(ops.PALLAS):
        together = ops.matmul(x, w, rows=True)
        alone = ops.matmul(x[2:3], w, rows=True)
    assert spies == ["dense", "dense"] and together.shape == (5, 1)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(together, np.float32), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(together[2:3]))
