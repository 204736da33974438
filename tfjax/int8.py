"""int8 weights and activations (`quantize="int8"`): per-output-channel symmetric int8 weights, each product's input
rows quantized to int8 by their own absolute maximum, an integer dot with int32 accumulation, then both scales.

Both sides are first rotated by a block Hadamard transform along the input axis (x W^T = (x H)(W H)^T, H orthogonal):
it spreads a row's outlier channels over their block, so one scale a row loses less. On SmolLM2 it cut the mean KL
against bf16 from 0.056 to 0.013 nats (`scripts/probes/quantize_quality.py`). The transform is butterflies of adds
and subtractions (elementwise), so it never mixes rows.

The CPU's fast path: XLA CPU's int8 dot of 8 rows reads half the bytes of bf16 and ran the 210 products of a
SmolLM2 round in half the time (docs/benchmarks.md). Integer sums are exact in any order, and a row's scale is its
own, so every output row depends only on its own input row: row-invariant by construction (lane rounds, concurrent
lanes and drafted == plain hold as on the float path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LEVELS = 127.0  # symmetric int8: -127..127 (never -128, so negation stays in range)
MIN_ROWS = 8  # XLA CPU's int8 dot of fewer rows takes a slow path (1 row: ~9x the time of 8): pad to this many
BLOCK = 64  # the Hadamard block (or the largest power of two dividing the input size, when smaller)


def rotate(a: jax.Array) -> jax.Array:
    """a [..., K] (float32) times the block-diagonal normalized Hadamard matrix (its own inverse) along K."""
    k = a.shape[-1]
    b = min(BLOCK, k & -k)
    lead = a.shape[:-1]
    h = 1
    while h < b:  # butterflies: [.., pairs, 2, h] -> (x + y, x - y)
        v = a.reshape(*lead, k // (2 * h), 2, h)
        a = jnp.stack([v[..., 0, :] + v[..., 1, :], v[..., 0, :] - v[..., 1, :]], axis=-2).reshape(*lead, k)
        h *= 2
    return a * (1.0 / b**0.5)


def quantize_channels(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A weight [out, in] -> (int8 codes [out, in], float32 scales [out]): rotate(w) ~= codes * scales[:, None]."""
    wf = rotate(w.astype(jnp.float32))
    scale = jnp.max(jnp.abs(wf), axis=1) / LEVELS
    codes = jnp.round(wf / jnp.where(scale == 0, 1.0, scale)[:, None])
    return codes.astype(jnp.int8), scale


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations [..., in] -> (int8 codes of rotate(x) [..., in], float32 scales [..., 1]), each row by its own
    maximum."""
    xf = rotate(x.astype(jnp.float32))
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / LEVELS
    return jnp.round(xf / jnp.where(scale == 0, 1.0, scale)).astype(jnp.int8), scale


def matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ w.T -> [..., out] in out_dtype (default x.dtype), for w's (codes, scales) from
    `quantize_channels`."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if n < MIN_ROWS:  # padding rows are zeros: their codes are zeros, the real rows' sums unchanged
        flat = jnp.pad(flat, ((0, MIN_ROWS - n), (0, 0)))
    xq, xs = quantize_rows(flat)
    acc = jax.lax.dot_general(xq, codes, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc[:n].astype(jnp.float32) * xs[:n] * scales[None, :]
    return y.astype(out_dtype or x.dtype).reshape(*lead, codes.shape[0])


def rows_of(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """The weight's rows (an embedding table's) back in float32: rotated back (H is its own inverse)."""
    return rotate(codes.astype(jnp.float32) * scales[..., None])


def reference(x: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    """The same product in float64 numpy terms (tests): the exact integer sum, then the scales."""
    import numpy as np

    xq, xs = (np.asarray(a) for a in quantize_rows(jnp.asarray(x).reshape(-1, x.shape[-1])))
    acc = xq.astype(np.int64) @ np.asarray(codes).astype(np.int64).T
    y = acc.astype(np.float64) * xs.astype(np.float64) * np.asarray(scales, np.float64)[None, :]
    return y.reshape(*x.shape[:-1], codes.shape[0])
