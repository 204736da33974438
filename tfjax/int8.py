"""int8 weights and activations (`quantize="int8"`): per-output-channel symmetric int8 weights, each product's input
rows quantized to int8 by their own absolute maximum, an integer dot with int32 accumulation, then both scales.

Both sides are first rotated by a block Hadamard transform along the input axis (x W^T = (x H)(W H)^T, H orthogonal):
it spreads a row's outlier channels over their block, so one scale a row loses less. On SmolLM2 the mean KL against
bf16 went from 0.056 to 0.009 nats (`scripts/probes/quantize_quality.py`; llama.cpp's Q4_1 path: 0.005).

The CPU's fast path: XLA CPU's int8 dot of 8 rows reads half the bytes of bf16 and ran the 210 products of a
SmolLM2 round in 11 ms against 19.6 (docs/benchmarks.md). Integer sums are exact in any order and a row's scale is
its own; the rotation is a dot of each 64-wide block with H, whose sums never cross rows (pinned for 1-160 rows by
`tests/test_int8.py`). So lane rounds, concurrent lanes and drafted == plain hold as on the float path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = 127.0  # symmetric int8: -127..127 (never -128, so negation stays in range)
MIN_ROWS = 8  # XLA CPU's int8 dot of fewer rows takes a slow path (1 row: ~9x the time of 8): pad to this many
BLOCK = 64  # the Hadamard block (or the largest power of two dividing the input size, when smaller)


def hadamard(b: int) -> np.ndarray:
    """The normalized b x b Hadamard matrix (Sylvester's construction; b a power of two)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(b**0.5)


def rotate(a: jax.Array) -> jax.Array:
    """a [..., K] (float32) times the block-diagonal normalized Hadamard matrix (its own inverse) along K."""
    k = a.shape[-1]
    b = min(BLOCK, k & -k)
    blocks = a.reshape(-1, b)  # one small dot for every block of every row (butterflies cost a fusion a stage)
    out = jax.lax.dot_general(blocks, jnp.asarray(hadamard(b)), (((1,), (0,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.reshape(a.shape)


def quantize_channels(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A weight [out, in] -> (int8 codes [out, in], float32 scales [out]): rotate(w) ~= codes * scales[:, None]
    (each output channel quantized as an activation row is)."""
    codes, scale = quantize_rows(w)
    return codes, scale[:, 0]


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
    xq, xs = (np.asarray(a) for a in quantize_rows(jnp.asarray(x).reshape(-1, x.shape[-1])))
    acc = xq.astype(np.int64) @ np.asarray(codes).astype(np.int64).T
    y = acc.astype(np.float64) * xs.astype(np.float64) * np.asarray(scales, np.float64)[None, :]
    return y.reshape(*x.shape[:-1], codes.shape[0])
