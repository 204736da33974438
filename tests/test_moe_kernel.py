"""The Pallas routed-experts kernel equals its reference, reads only the chosen experts, and is row-invariant.

Each case runs in interpret mode on the CPU (default) and compiled on a GPU under `-m gpu`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tfjax import ops, quant

SMALL = moe.BlockSizes(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)


def _experts(rng, e, d, i, bits, group_size, dtype):
    """Fresh random (weight, scales, biases) stacks for gate, up, down."""

    def one(out, inp):
        w, s, b = quant.quantize(jnp.asarray(rng.standard_normal((e, out, inp), np.float32) * 0.05), bits, group_size)
        return w, s.astype(dtype), b.astype(dtype)

    return one(i, d), one(i, d), one(d, i)


def _routing(rng, n, k, e, dtype):
    """Distinct experts per row (as top-k gives) and positive combine weights."""
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    return jnp.asarray(idx), jnp.asarray(rng.random((n, k)) + 0.1, dtype)


def _rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return np.linalg.norm(y - r) / np.linalg.norm(r)


def _by_hand(x, idx, w, stacks, bits, group_size):
    """Each row through each of its experts, one at a time, in float64."""
    deq = [np.asarray(quant.dequantize(*s, bits=bits, group_size=group_size, dtype=jnp.float32), np.float64)
           for s in stacks]
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[n, s])
            g, u = deq[0][e] @ x[n], deq[1][e] @ x[n]
            out[n] += float(w[n, s]) * (deq[2][e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("n,k,e,bits,group_size", [(1, 2, 8, 4, 32), (5, 3, 6, 4, 64), (9, 2, 4, 8, 32)])
def test_interpret_matches_reference_and_both_match_each_expert_by_hand(n, k, e, bits, group_size):
    rng = np.random.default_rng(n)
    stacks = _experts(rng, e, 128, 64, bits, group_size, jnp.float32)
    idx, w = _routing(rng, n, k, e, jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, 128)), jnp.float32)
    y = moe.moe(x, idx, w, *stacks, bits=bits, group_size=group_size, block_sizes=SMALL, interpret=True)
    r = moe.reference(x, idx, w, *stacks, bits=bits, group_size=group_size)
    want = _by_hand(x, idx, w, stacks, bits, group_size)
    assert y.shape == (n, 128) and y.dtype == jnp.float32
    assert _rel_err(y, r) < 1e-5 and _rel_err(r, want) < 1e-5


def test_interpret_matches_reference_in_bf16_with_every_expert_shared_by_many_rows():
    """A prompt-like grouped case: 40 rows, 2 experts each out of 3, so tiles hold many rows of one expert."""
    rng = np.random.default_rng(3)
    stacks = _experts(rng, 3, 128, 64, 4, 64, jnp.bfloat16)
    idx, w = _routing(rng, 40, 2, 3, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((40, 128)), jnp.bfloat16)
    y = moe.moe(x, idx, w, *stacks, block_sizes=dataclasses.replace(SMALL, sort_above=8), interpret=True)
    assert y.dtype == jnp.bfloat16
    assert _rel_err(y, moe.reference(x, idx, w, *stacks)) < 1e-2


def test_placement_puts_every_pair_once_in_a_tile_of_its_own_expert():
    rng = np.random.default_rng(4)
    idx, _ = _routing(rng, 13, 3, 5, jnp.float32)
    idx = idx.at[4].set(-1).at[7, 1].set(-1)  # a padding row and one slot of another: skipped pairs (4 of 39)
    tile_expert, pair_row, row_of_pair = (np.asarray(a) for a in moe.placement(idx, 5, 16))
    assert tile_expert.shape == (-(-39 // 16) + 6,)
    flat = np.asarray(idx).reshape(-1)
    np.testing.assert_array_equal(pair_row[row_of_pair], np.arange(39))
    assert (pair_row >= 0).sum() == 39
    np.testing.assert_array_equal(tile_expert[row_of_pair // 16], flat, err_msg="skipped pairs: skipped tiles only")
    assert (tile_expert[(pair_row.reshape(-1, 16) >= 0).any(axis=1) == 0] == -1).all(), "empty tiles are skipped"


@pytest.mark.parametrize("rows,sort_above", [(False, 128), (False, 4), (True, 128), (True, 4)],
                         ids=["grouped-a-tile-a-pair", "grouped-sorted", "rows-a-tile-a-pair", "rows-sorted"])
def test_skipped_pairs_add_zero_and_leave_the_live_rows_bits_alone(rows, sort_above):
    """Expert -1 (a lane round's padding row, or one slot of a row): the row's other slots keep their bits, a row
    with every slot skipped is exactly 0, and the reference agrees; each placement, both kernel pairs."""
    rng = np.random.default_rng(50)
    stacks = _experts(rng, 6, 256, 128, 4, 32, jnp.float32)
    idx, w = _routing(rng, 5, 2, 6, jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    bs = dataclasses.replace(ROWS_SMALL if rows else SMALL, sort_above=sort_above)
    f = lambda i: np.asarray(moe.moe(x, i, w, *stacks, group_size=32, rows=rows, block_sizes=bs, interpret=True))
    skipped = idx.at[1].set(-1).at[3].set(-1).at[4, 0].set(-1)
    full, got = f(idx), f(skipped)
    np.testing.assert_array_equal(got[[0, 2]], full[[0, 2]])
    assert (got[[1, 3]] == 0).all()
    want = _by_hand(x, skipped, jnp.where(skipped >= 0, w, 0), stacks, 4, 32)  # by hand: skipped pairs weigh 0
    assert _rel_err(got, want) < 1e-5
    ref = np.asarray(moe.reference(x, skipped, w, *stacks, group_size=32))
    assert (ref[[1, 3]] == 0).all() and _rel_err(ref, want) < 1e-5


def _check_rows_invariant(f, d, e, k, dtype, seed, m_values):
    """Row i alone equals row i among m rows whose other rows (and their experts) are fresh, bit for bit."""
    rng = np.random.default_rng(seed)
    x_all = jnp.asarray(rng.standard_normal((max(m_values), d)), dtype)
    idx_all, w_all = _routing(rng, max(m_values), k, e, dtype)
    alone = [np.asarray(f(x_all[i : i + 1], idx_all[i : i + 1], w_all[i : i + 1]))[0] for i in range(max(m_values))]
    for m in m_values:
        x = jnp.asarray(rng.standard_normal((m, d)), dtype)
        idx, w = _routing(rng, m, k, e, dtype)
        for i in range(m):
            batch = np.asarray(f(x.at[i].set(x_all[i]), idx.at[i].set(idx_all[i]), w.at[i].set(w_all[i])))
            np.testing.assert_array_equal(batch[i], alone[i], err_msg=f"row {i} of M={m}")


def test_interpret_rows_bit_identical_alone_and_among_other_rows_and_experts():
    """Alone and among 3 rows: a tile a pair; among 16 rows (32 pairs > sort_above): pairs sorted into tiles."""
    rng = np.random.default_rng(5)
    stacks = _experts(rng, 6, 128, 64, 4, 32, jnp.float32)
    bs = dataclasses.replace(SMALL, sort_above=8)
    f = lambda x, i, w: moe.moe(x, i, w, *stacks, group_size=32, block_sizes=bs, interpret=True)
    _check_rows_invariant(f, 128, 6, 2, jnp.float32, seed=6, m_values=(3, 16))


# Lane-round rows (`moe(..., rows=True)`): tiles x column blocks x K slices, pairs read and written by index.
ROWS_SMALL = moe.RowsBlockSizes(block_n=64, block_k=128, split_gate_up=2, split_down=1)


@pytest.mark.parametrize("n,k,e,bits,group_size", [
    (1, 2, 8, 4, 32), pytest.param(5, 3, 6, 4, 64, marks=pytest.mark.slow), pytest.param(9, 2, 4, 8, 32, marks=pytest.mark.slow),
])  # fmt: skip  (the other two cases, ~15 s each interpreted, run with -m slow)
def test_rows_interpret_matches_reference_and_each_expert_by_hand(n, k, e, bits, group_size):
    """K split 2 ways in kernel 1 (4 at 8 bits: 64-input tiles), both placements (a tile a pair, pairs sorted)."""
    rng = np.random.default_rng(40 + n)
    stacks = _experts(rng, e, 256, 128, bits, group_size, jnp.float32)
    idx, w = _routing(rng, n, k, e, jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, 256)), jnp.float32)
    r = moe.reference(x, idx, w, *stacks, bits=bits, group_size=group_size)
    want = _by_hand(x, idx, w, stacks, bits, group_size)
    bs = ROWS_SMALL if bits == 4 else dataclasses.replace(ROWS_SMALL, block_k=64, split_gate_up=4, split_down=2)
    for sort_above in (128, 2):
        y = moe.moe(x, idx, w, *stacks, bits=bits, group_size=group_size, rows=True, interpret=True,
                    block_sizes=dataclasses.replace(bs, sort_above=sort_above))
        assert y.shape == (n, 256) and y.dtype == jnp.float32
        assert _rel_err(y, r) < 1e-5 and _rel_err(y, want) < 1e-5, sort_above


@pytest.mark.slow  # ~16 s interpreted; the f32 cases run in CI
def test_rows_interpret_matches_reference_in_bf16():
    rng = np.random.default_rng(47)
    stacks = _experts(rng, 16, 256, 128, 4, 64, jnp.bfloat16)
    idx, w = _routing(rng, 6, 4, 16, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16)
    y = moe.moe(x, idx, w, *stacks, rows=True, block_sizes=ROWS_SMALL, interpret=True)
    assert y.dtype == jnp.bfloat16
    assert _rel_err(y, moe.reference(x, idx, w, *stacks)) < 1e-2


def test_rows_interpret_rows_bit_identical_alone_and_among_1_to_16_rows_with_other_experts():
    """A row alone (a tile of its own) equals the same row among 2..16 rows with fresh rows and experts: up to 4
    rows a tile a pair; 5 and more rows (10+ pairs > sort_above) share tiles sorted by expert with other rows."""
    rng = np.random.default_rng(48)
    stacks = _experts(rng, 6, 256, 128, 4, 32, jnp.float32)
    bs = dataclasses.replace(ROWS_SMALL, sort_above=8)
    f = lambda x, i, w: moe.moe(x, i, w, *stacks, group_size=32, rows=True, block_sizes=bs, interpret=True)
    _check_rows_invariant(f, 256, 6, 2, jnp.float32, seed=49, m_values=(2, 3, 5, 16))


def test_fields_first_puts_each_bit_field_against_its_inputs():
    """Tile position f * W + w holds input 8 * w + f (4-bit): what field f of word w multiplies."""
    x = jnp.arange(2 * 512, dtype=jnp.float32).reshape(2, 512)
    p = np.asarray(moe.fields_first(x, 256, 4))
    assert p[1, 256 + 3 * 32 + 5] == 512 + 256 + 8 * 5 + 3
    np.testing.assert_array_equal(np.sort(p, axis=1), np.asarray(x))


def test_rows_block_sizes_split_k_from_the_expert_shape_only():
    """moe35a3 (D 2048, I 512): kernel 1 splits D 4 ways (8 column blocks x 4 = 32 programs an expert), kernel 2 has
    32 column blocks of D already."""
    bs = moe.RowsBlockSizes.for_shapes(2048, 512, 64, 4)
    assert (bs.block_n, bs.block_k, bs.split_gate_up, bs.split_down) == (64, 256, 4, 1)
    assert moe.rows_problem(2048, 512, 4, 64, bs) is None
    assert "words a tile" in moe.rows_problem(2048, 512, 4, 64, moe.RowsBlockSizes(block_k=64))
    assert "block_k * split" in moe.rows_problem(2048, 512, 4, 64, moe.RowsBlockSizes(split_down=4))


def test_pair_tiles_give_each_pair_the_first_row_of_its_own_tile():
    idx = jnp.asarray([[3, 1], [0, 3]], jnp.int32)
    tile_expert, pair_row, row_of_pair = (np.asarray(a) for a in moe.pair_tiles(idx, 16))
    np.testing.assert_array_equal(tile_expert, [3, 1, 0, 3])
    np.testing.assert_array_equal(row_of_pair, [0, 16, 32, 48])
    np.testing.assert_array_equal(pair_row[row_of_pair], np.arange(4))
    assert (pair_row >= 0).sum() == 4


@pytest.mark.parametrize("bits", [4, None], ids=["4bit", "dense"])
def test_reference_path_rows_bit_identical_among_1_to_16_rows(bits):
    """The CPU path the model takes (`ops.experts`): fixed row tiles, so any M gives a row the same bits."""
    rng = np.random.default_rng(7)
    stacks = _experts(rng, 8, 64, 32, 4, 32, jnp.float32)
    if bits is None:
        stacks = tuple((quant.dequantize(*s, bits=4, group_size=32),) for s in stacks)
    f = jax.jit(lambda x, i, w: ops.experts(x, i, w, *stacks, bits=bits, group_size=32))
    _check_rows_invariant(f, 64, 8, 2, jnp.float32, seed=8, m_values=tuple(range(1, 17)))


def test_reference_path_skips_rows_that_are_not_live_and_keeps_the_live_rows_bits():
    """`ops.experts(live=...)` on the CPU: a row not live gets 0 (its loop iteration does no work), the others
    equal their bits with every row live, dense and 4-bit stacks."""
    rng = np.random.default_rng(12)
    stacks = _experts(rng, 8, 64, 32, 4, 32, jnp.float32)
    idx, w = _routing(rng, 6, 2, 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    live = jnp.asarray([True, False, True, True, False, False])
    for bits, st in ((4, stacks), (None, tuple((quant.dequantize(*s, bits=4, group_size=32),) for s in stacks))):
        f = jax.jit(lambda x, i, w, live, st=st, bits=bits: ops.experts(x, i, w, *st, bits=bits, group_size=32,
                                                                       live=live))
        full, got = np.asarray(f(x, idx, w, None)), np.asarray(f(x, idx, w, live))
        np.testing.assert_array_equal(got[[0, 2, 3]], full[[0, 2, 3]])
        assert (got[[1, 4, 5]] == 0).all() and (full[[1, 4, 5]] != 0).all(), bits


def test_reference_path_matches_each_expert_by_hand_for_dense_and_4bit():
    rng = np.random.default_rng(9)
    stacks = _experts(rng, 8, 64, 32, 4, 32, jnp.float32)
    idx, w = _routing(rng, 11, 2, 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((11, 64)), jnp.float32)
    want = _by_hand(x, idx, w, stacks, 4, 32)
    assert _rel_err(ops.experts(x, idx, w, *stacks, bits=4, group_size=32), want) < 1e-5
    dense = tuple((quant.dequantize(*s, bits=4, group_size=32),) for s in stacks)
    assert _rel_err(ops.experts(x, idx, w, *dense, bits=None), want) < 1e-5


def test_reference_reads_only_the_chosen_experts():
    """No op of the reference's program touches a dequantized stack of all E experts."""
    rng = np.random.default_rng(10)
    e, d, i = 48, 64, 32
    stacks = _experts(rng, e, d, i, 4, 32, jnp.float32)
    idx, w = _routing(rng, 2, 2, e, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
    text = jax.jit(lambda *a: ops.experts(*a, *stacks, bits=4, group_size=32)).lower(x, idx, w).as_text()
    assert f"tensor<{e}x{i}x{d}xf32>" not in text and f"tensor<{e}x{d}x{i}xf32>" not in text
    assert f"tensor<2x{i}x{d}xf32>" in text, "one dequantized expert per slot of a row"


def test_bad_shapes_raise_naming_the_value():
    rng = np.random.default_rng(11)
    stacks = _experts(rng, 4, 128, 64, 4, 32, jnp.float32)
    idx, w = _routing(rng, 3, 2, 4, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    call = functools.partial(moe.moe, group_size=32, block_sizes=SMALL, interpret=True)
    with pytest.raises(ValueError, match="x.shape"):
        call(x[:, :64], idx, w, *stacks)
    with pytest.raises(ValueError, match="idx.shape"):
        call(x, idx[:2], w, *stacks)
    with pytest.raises(ValueError, match="bits=3"):
        call(x, idx, w, *stacks, bits=3)
    with pytest.raises(ValueError, match="block_n=48"):
        call(x, idx, w, *stacks, block_sizes=moe.BlockSizes(block_n=48))
    with pytest.raises(ValueError, match="idx must hold integer"):
        call(x, w, w, *stacks)


def test_block_sizes_depend_on_the_expert_shape_only():
    assert moe.BlockSizes.for_shapes(2048, 512, 64) == moe.BlockSizes(block_n=64, block_k=256)
    assert moe.BlockSizes.for_shapes(64, 32, 32).block_k == 32


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """The compiled path's Pallas -> Triton lowering at moe35a3's expert shape (256 x 512 x 2048, 16 rows x 8)."""
    sd = jax.ShapeDtypeStruct
    stack = lambda o, i: (sd((256, o, i // 8), jnp.uint32), sd((256, o, i // 64), jnp.bfloat16),
                          sd((256, o, i // 64), jnp.bfloat16))
    f = jax.jit(functools.partial(moe.moe, bits=4, group_size=64))
    text = f.trace(sd((16, 2048), jnp.bfloat16), sd((16, 8), jnp.int32), sd((16, 8), jnp.bfloat16),
                   stack(512, 2048), stack(512, 2048), stack(2048, 512)).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text and "moe_gate_up" in text and "moe_down" in text
    rows = jax.jit(functools.partial(moe.moe, bits=4, group_size=64, rows=True))
    for n in (1, 16, 64):  # a tile a pair; pairs sorted into tiles
        text = rows.trace(sd((n, 2048), jnp.bfloat16), sd((n, 8), jnp.int32), sd((n, 8), jnp.bfloat16),
                          stack(512, 2048), stack(512, 2048), stack(2048, 512)).lower(lowering_platforms=("cuda",))
        assert "moe_rows_gate_up" in text.as_text() and "moe_rows_down" in text.as_text()


# The same cases compiled on a GPU: `pytest -m gpu tests/test_moe_kernel.py` on the device.
def _moe35a3(rng, e=256):
    return _experts(rng, e, 2048, 512, 4, 64, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [False, True], ids=["grouped", "rows"])
@pytest.mark.parametrize("n", [1, 4, 16, 40])
def test_gpu_matches_reference_at_the_moe35a3_shape(n, rows):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng((50 if rows else 20) + n)
    stacks = _moe35a3(rng)
    idx, w = _routing(rng, n, 8, 256, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((n, 2048)), jnp.bfloat16)
    y = moe.moe(x, idx, w, *stacks, rows=rows)
    assert _rel_err(y, moe.reference(x, idx, w, *stacks)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [False, True], ids=["prompt", "rows"])
def test_gpu_rows_bit_identical_alone_and_among_1_to_16_rows(rows):
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(30)
    stacks = _moe35a3(rng)
    def f(x, i, w):
        with ops.using(ops.PALLAS):
            return ops.experts(x, i, w, *stacks, bits=4, group_size=64, rows=rows)

    # a program a row count, and the compiles are the test's cost on the GPU (neither case finished six counts in 50 s
    # on the H100): the rounds' rows path at a verify round's 8 and 16 rows (one and two lanes of width 8) and an odd 3,
    # the prompt path (the same chunks drafted and plain) at 16
    f = jax.jit(f)
    _check_rows_invariant(f, 2048, 256, 8, jnp.bfloat16, seed=31, m_values=(3, 8, 16) if rows else (16,))


@pytest.mark.gpu
def test_gpu_rows_bit_identical_when_every_row_shares_one_expert():
    """Rows that share experts sit together in a tile (the grouped-GEMM case): still the bits of the row alone."""
    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(32)
    stacks = _moe35a3(rng, e=8)
    for rows in (False, True):
        f = jax.jit(lambda x, i, w, rows=rows: moe.moe(x, i, w, *stacks, rows=rows))
        _check_rows_invariant(f, 2048, 8, 8, jnp.bfloat16, seed=33, m_values=(16, 64))


@pytest.mark.slow  # ~45 s of tracing at moe35a3 shapes; tests/test_linear_shapes.py sends its linears through the dispatch in CI
def test_every_moe35a3_linear_shape_traces_through_the_gpu_dispatch():
    """Each 4-bit Linear shape moe35a3 holds (N=1 shared-expert gate, N=256 router, ...) and its routed experts pass
    the GPU dispatch's shape checks, decode and prompt rows; lm_head is left out (a [248320, 2048] repack on the
    CPU; its N is a multiple of 64, K that of in_proj_qkv)."""
    from flax import nnx

    from tfjax import geometry, models
    from tfjax.config import QuantConfig
    from tfjax.models.layers import Linear, use_kernel_layout

    config = geometry.moe35a3.replace(quantization=QuantConfig(bits=4, group_size=64), num_hidden_layers=4,
                                      layer_types=geometry.moe35a3.layer_types[:4])
    abstract = nnx.eval_shape(lambda: models.build(config))
    shapes = {(path[-1], m.weight.shape[0], m.weight.shape[1] * 8) for path, m in nnx.iter_modules(abstract)
              if isinstance(m, Linear) and m.quant is not None and path[-1] != "lm_head"}
    assert {("shared_expert_gate", 1, 2048), ("gate", 256, 2048)} <= shapes
    with ops.using(ops.PALLAS):
        for name, n, k in sorted(shapes):
            lin = Linear(k, n, quant=(4, 64), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
            use_kernel_layout(lin)
            for rows, m in ((True, 1), (True, 16), (False, 1), (False, 300)):
                y = jax.eval_shape(lambda x, lin=lin, rows=rows: lin(x, rows), jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
                assert y.shape == (m, n), (name, rows, m)
        sd = jax.ShapeDtypeStruct
        stack = lambda o, i: (sd((256, o, i // 8), jnp.uint32), sd((256, o, i // 64), jnp.bfloat16),
                              sd((256, o, i // 64), jnp.bfloat16))
        for m, rows in ((1, True), (16, True), (128, True), (1, False), (16, False), (2048, False)):
            y = jax.eval_shape(functools.partial(ops.experts, bits=4, group_size=64, rows=rows),
                               sd((m, 2048), jnp.bfloat16), sd((m, 8), jnp.int32), sd((m, 8), jnp.bfloat16),
                               stack(512, 2048), stack(512, 2048), stack(2048, 512))
            assert y.shape == (m, 2048)
