"""The one dispatch point for heavy ops: a Pallas kernel on GPU, the jax.numpy reference elsewhere.

Row invariance: on the reference path a matmul over "rows" is computed in fixed tiles of `ROW_TILE`
rows, so a row's result depends only on its own values and the weight's shape, never on how many
rows share the call or where it sits among them.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

ROW_TILE = 8
GPU_ROW_TILE = 64  # rows per tile on GPU, where a tile is one loop iteration of its own (see `fenced_map`)
KERNEL_MAX_ROWS = 64

_FORCE = os.environ.get("TFJAX_KERNELS", "auto")  # auto | kernel | reference


def use_kernels() -> bool:
    """True when the Pallas kernels should run (GPU backend, unless forced off)."""
    if _FORCE == "reference":
        return False
    if _FORCE == "kernel":
        return True
    return jax.default_backend() == "gpu"


def flash_prompts() -> bool:
    """Prompt chunks through the flash kernel on GPU (default; `TFJAX_FLASH=0` keeps them on the paged kernel)."""
    return os.environ.get("TFJAX_FLASH", "1") != "0"


def norm_kernel() -> bool:
    """Lane-round row norms and DeltaNet's conv through one-row-per-program Pallas kernels on GPU (default;
    `TFJAX_NORM_KERNEL=0` keeps the fixed-tile loops)."""
    return use_kernels() and os.environ.get("TFJAX_NORM_KERNEL", "1") != "0"


def dense_kernel() -> bool:
    """Lane-round rows of dense (unquantized) weights through the fixed-tile Pallas matmul on GPU (default;
    `TFJAX_DENSE_KERNEL=0` keeps the 64-row tile loop)."""
    return use_kernels() and os.environ.get("TFJAX_DENSE_KERNEL", "1") != "0"


def fuse_projections() -> bool:
    """Sibling projections fused into one matmul in the GPU serving layout (default; `TFJAX_FUSE=0` keeps them apart)."""
    return use_kernels() and os.environ.get("TFJAX_FUSE", "1") != "0"


def delta_kernel() -> bool:
    """Gated DeltaNet rows through the Pallas recurrence on GPU (default since it beat XLA's loop on the H200,
    dense27 decode 29.4 -> 31.0 tok/s; `TFJAX_DELTA_KERNEL=0` keeps XLA's)."""
    return use_kernels() and os.environ.get("TFJAX_DELTA_KERNEL", "1") != "0"


def delta_chunked_kernel() -> bool:
    """Prompt chunks' DeltaNet through the chunked Pallas kernel on GPU, two launches a layer (`TFJAX_DELTA_CHUNKED=1`;
    off until a GPU shows it beats XLA's scan: `scripts/bench_graph.py --sections base,delta_prompt,prefill`)."""
    return use_kernels() and os.environ.get("TFJAX_DELTA_CHUNKED", "0") == "1"


def delta_fused() -> bool:
    """Lane-round DeltaNet rows through the two fused kernels on GPU (`causal_conv.conv_silu_window`, then
    `gated_delta.recurrent_qkv`: conv tail, taps, norms, head repeats and casts inside them; default);
    `TFJAX_DELTA_FUSED=0` keeps the separate conv, norms and recurrence."""
    return delta_kernel() and norm_kernel() and os.environ.get("TFJAX_DELTA_FUSED", "1") != "0"


def pair_layout() -> bool:
    """4-bit Linears repacked into `quant.to_pair_layout` for the tiled kernel's bf16 pair unpack on GPU (default
    since it beat the kernel layout's I2F unpack on the H200, dense27 decode 31.5 -> 38.1 tok/s; `TFJAX_PAIRS=0`
    keeps the kernel layout)."""
    return use_kernels() and os.environ.get("TFJAX_PAIRS", "1") != "0"


def pack_scales() -> bool:
    """Pair-layout Linears keep bf16 scales and biases as one uint32 array (`quant.pack_scale_bias`): one load a
    column for both, 100 -> 85 registers in the kernel (default; `TFJAX_PACK_SCALES=0` keeps them apart)."""
    return os.environ.get("TFJAX_PACK_SCALES", "1") != "0"


def mgpu_qmatmul() -> bool:
    """Packed pair-layout Linears through the Mosaic GPU kernel (`pallas_kernels.qmatmul_mgpu`; default) instead
    of the Triton one (`TFJAX_QMATMUL_MGPU=0`): 23.3 against 31.6 us at 17408x5120 on the H200."""
    return os.environ.get("TFJAX_QMATMUL_MGPU", "1") == "1"


def mgpu_attention() -> bool:
    """Lane-round attention through the Mosaic GPU paged kernel (`pallas_kernels.attention_mgpu`, TMA-fed key
    tiles) where it serves the shape, else the Triton one (`TFJAX_ATTENTION_MGPU=0` forces Triton). On by
    measurement: 1.4-1.9x the Triton kernel at 2k-64k with its combine kernel (H100, docs/benchmarks.md, twelfth
    run)."""
    return os.environ.get("TFJAX_ATTENTION_MGPU", "1") == "1"


def attention_interleave() -> bool:
    """The Mosaic GPU attention's key chunks dealt round-robin to a fixed set of programs (default), so a short
    context in a wide page table runs on every SM, instead of chunks sized by the span (`TFJAX_ATTENTION_INTERLEAVE=0`):
    2k keys in a 64k span 15.9 us against 65.7, dense27 decode there 8.21 ms against 9.00; 0-4% slower at a span
    the context fills (H100, docs/benchmarks.md, thirteenth run)."""
    return os.environ.get("TFJAX_ATTENTION_INTERLEAVE", "1") == "1"


def set_kernels(mode: str) -> None:
    """Force `kernel`, `reference` or `auto` dispatch (takes effect for new traces)."""
    global _FORCE
    if mode not in ("auto", "kernel", "reference"):
        raise ValueError(f"kernel mode must be auto, kernel or reference, got {mode!r}")
    _FORCE = mode


def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out, in].T with f32 accumulation, result in x.dtype."""
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def opaque_count(n: jax.Array | int) -> jax.Array:
    """A loop bound XLA cannot fold on the reference path (see `fenced_map`); the plain value with kernels."""
    n = jnp.asarray(n, jnp.int32)
    return n if use_kernels() else jax.lax.optimization_barrier(n)


def fenced_map(fn, xs):
    """`lax.map` whose trip count XLA cannot see (reference path): one iteration stays a loop body of its own.

    XLA inlines a loop it knows runs once and then fuses its body with the neighbours, which changes the
    arithmetic of reductions; a row computed alone would then differ from the same row among others.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    if use_kernels():  # GPU: a known trip count (no host syncs), never 1, so XLA keeps the body a loop of its own
        if n >= 2:
            return jax.lax.map(fn, xs)
        twice = jax.tree.map(lambda a: jnp.concatenate([a, a]), xs)
        return jax.tree.map(lambda a: a[:n], jax.lax.map(fn, twice))
    first = jax.eval_shape(fn, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs))
    out = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), first)
    trips = opaque_count(n)

    def body(i, out):
        y = fn(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))
        return jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), out, y)

    return jax.lax.fori_loop(0, trips, body, out)


def row_tiled(fn, x: jax.Array, tile: int | None = None) -> jax.Array:
    """Apply fn (rows [tile, in] -> [tile, out]) over fixed row tiles, so each row's arithmetic is fixed."""
    tile = tile or (GPU_ROW_TILE if use_kernels() else ROW_TILE)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d)
    m = rows.shape[0]
    pad = (-m) % tile
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
    tiles = rows.reshape(-1, tile, d)
    out = fenced_map(fn, tiles)
    out = out.reshape(-1, out.shape[-1])[:m]
    return out.reshape(*lead, out.shape[-1])


def rowwise(fn, x: jax.Array, rows: bool) -> jax.Array:
    """fn over the last axis; with `rows`, in fixed row tiles (reductions never see M)."""
    if rows:
        return row_tiled(fn, x)
    return fn(x)


def row_norm(x: jax.Array, weight: jax.Array | None = None, z: jax.Array | None = None, *, kind: str, eps: float,
             rows: bool = False) -> jax.Array:
    """RMSNorm / gated RMSNorm / L2 norm over the last axis (`pallas_kernels.row_norm` names the kinds).

    Lane-round rows take the one-row-per-program kernel on GPU (row-invariant, one launch); elsewhere the
    reference, in fixed row tiles when `rows` (a gate rides beside its row so one loop does both)."""
    from pallas_kernels import row_norm as rn

    d = x.shape[-1]
    if rows and norm_kernel():
        flat = (lambda a: None if a is None else a.reshape(-1, d))
        return rn.row_norm(flat(x), weight, flat(z), kind=kind, eps=eps).reshape(x.shape)
    if z is None:
        return rowwise(lambda r: rn.reference(r, weight, kind=kind, eps=eps), x, rows)
    xz = jnp.concatenate([x, z.astype(x.dtype)], axis=-1)
    return rowwise(lambda r: rn.reference(r[..., :d], weight, r[..., d:], kind=kind, eps=eps), xz, rows)


def add_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, *, kind: str, eps: float,
             rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """The residual stream's step: x + the update given as partial sums parts [S, ..., D] (`qmatmul(parts=True)`),
    and its RMSNorm; returns both: the sum in order and the add through XLA (one fusion that reads the partials
    with many blocks), then `row_norm`."""
    update = parts[0]
    for p in parts[1:]:  # fixed order, elementwise: the same for every row
        update = update + p
    nx = x + update.astype(x.dtype)
    return nx, row_norm(nx, weight, kind=kind, eps=eps, rows=rows)


def conv_silu(taps: jax.Array, weight: jax.Array, *, rows: bool = False) -> jax.Array:
    """DeltaNet's depthwise causal conv + silu: taps [..., K, C], weight [C, K] -> [..., C].

    Lane-round rows take the one-row-per-program kernel on GPU; elsewhere the reference, in fixed row tiles
    when `rows`."""
    from pallas_kernels import causal_conv as cc

    *lead, k, c = taps.shape
    if rows and norm_kernel():
        return cc.conv_silu(taps.reshape(-1, k, c), weight).reshape(*lead, c)
    return rowwise(lambda r: cc.reference(r.reshape(*r.shape[:-1], k, c), weight), taps.reshape(*lead, k * c), rows)


def matmul(x: jax.Array, w: jax.Array, *, rows: bool = False) -> jax.Array:
    """x [..., in] @ w[out, in].T; `rows` asks for row-invariant arithmetic (lane rounds)."""
    if rows:
        from pallas_kernels import matmul as mm

        if dense_kernel() and mm.supports(*w.shape):
            return mm.matmul(x, w)  # one launch; tiles fixed by the weight's shape
        return row_tiled(lambda t: _dot_t(t, w), x)
    return _dot_t(x, w)


def qmatmul(x: jax.Array, weight: jax.Array, scales: jax.Array, biases: jax.Array | None, *, bits: int,
            group_size: int, rows: bool = False, layout: str = "mlx", parts: bool = False) -> jax.Array:
    """x [..., in] @ dequant(weight)[out, in].T for MLX affine weights, in the MLX, kernel or pair layout.

    Kernel or pair layout (`quant.to_kernel_layout`, `quant.to_pair_layout`): on GPU the row-invariant tiled
    kernel for lane-round rows (any count) and for up to `KERNEL_MAX_ROWS` prompt rows; XLA's
    dequantize-then-dot elsewhere. `biases=None`: `scales` holds both (`quant.pack_scale_bias`).
    `parts`: the product as partial sums [S, ..., out] for the consumer to sum in order (`add_norm`): the Mosaic
    kernel's K-split partials (f32), else the product itself as S = 1.
    """
    lead = x.shape[:-1]
    done = (lambda y: y[None]) if parts else (lambda y: y)  # one partial sum: the product
    if layout in ("kernel", "pairs"):
        if use_kernels() and (rows or math.prod(lead) <= KERNEL_MAX_ROWS):
            from pallas_kernels import qmatmul as qk

            if biases is None and mgpu_qmatmul():
                from pallas_kernels import qmatmul_mgpu

                if qmatmul_mgpu.BlockSizes.serves(weight.shape[0], x.shape[-1], group_size):
                    if parts:
                        return qmatmul_mgpu.qmatmul_parts(x, weight, scales)
                    return qmatmul_mgpu.qmatmul_pairs(x, weight, scales)
            bs = qk.TiledBlockSizes.for_layout(weight.shape[0], x.shape[-1], bits, group_size, layout)
            return done(qk.qmatmul_tiled(x, weight, scales, biases, bits=bits, group_size=group_size, block_sizes=bs))
        from tfjax import quant

        if biases is None:
            scales, biases = quant.unpack_scale_bias(scales)
        unpacked = quant.dequantize_kernel_layout if layout == "kernel" else quant.dequantize_pair_layout
        w = unpacked(weight, scales, biases, bits=bits, group_size=group_size, dtype=x.dtype)
        return done(matmul(x, w, rows=rows))
    if use_kernels() and math.prod(lead) <= KERNEL_MAX_ROWS and weight.shape[0] % 16 == 0:  # N=1: shared expert gate
        from pallas_kernels import qmatmul as qk

        y = qk.qmatmul(x.reshape(-1, x.shape[-1]), weight, scales, biases, bits=bits, group_size=group_size)
        return done(y.reshape(*lead, y.shape[-1]))
    from tfjax import quant

    w = quant.dequantize(weight, scales, biases, bits=bits, group_size=group_size, dtype=x.dtype)
    return done(matmul(x, w, rows=rows))


def experts(x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple, down: tuple, *,
            bits: int | None, group_size: int = 64) -> jax.Array:
    """Routed SwiGLU experts: x [N, D], idx/weights [N, k] -> sum_s weights[:, s] * expert_idx[:, s](x), [N, D].

    gate/up/down are (weight, scales, biases) stacks [E, out, ...] in the MLX layout, or (weight,) dense (`bits`
    is the quantized stacks' width; None when all are dense). Only the chosen experts are read: on GPU the grouped Pallas kernel (`pallas_kernels.moe`) for
    quantized stacks it serves; elsewhere its reference one row a loop iteration (row-invariant)."""
    from pallas_kernels import moe

    d, i = x.shape[-1], gate[0].shape[1]
    if use_kernels() and bits is not None and all(len(s) == 3 for s in (gate, up, down)):
        bs = moe.BlockSizes.for_shapes(d, i, group_size)
        if d % bs.block_n == 0 and i % bs.block_n == 0 and d % bs.block_k == 0 and i % bs.block_k == 0:
            return moe.moe(x, idx, weights, gate, up, down, bits=bits, group_size=group_size, block_sizes=bs)
    # one row a loop iteration: a tile of padding rows would gather and dequantize k experts each for nothing
    one = lambda t: moe.reference(t[0][None], t[1][None], t[2][None], gate, up, down, bits=bits, group_size=group_size)
    return fenced_map(lambda t: one(t)[0], (x, idx, weights))
