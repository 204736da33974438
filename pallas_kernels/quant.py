"""MLX affine quantization: pack, unpack, quantize, dequantize and a plain quantized matmul.

Format (bit-compatible with ``mlx.core.quantize(w, group_size, bits)``, mode "affine"):
- ``weight`` uint32 ``[..., out, in * bits // 32]``: element ``j`` of each run of ``32 // bits`` input
  values sits at bits ``[bits * j, bits * j + bits)`` of its word (little-endian along the input dim).
- ``scales`` and ``biases`` ``[..., out, in // group_size]`` in the model dtype; ``w = scales * q + biases``.

Quantization follows MLX's CPU kernel (mlx/backend/cpu/quantized.cpp, ``quantize``): in float32,
``scale = max((max - min) / (2^bits - 1), 1e-7)``, signed so that the edge of larger magnitude
(``min`` or ``max``) is hit exactly by an integer ``q0 = rint(edge / scale)``; then
``scale = edge / q0``, ``bias = edge`` (``bias = 0`` when ``q0 == 0``), and
``q = clip(rint((w - bias) / scale), 0, 2^bits - 1)`` with the float32 scale and bias.

All functions take numpy or jax arrays (numpy in, numpy out) and allow leading batch dims
such as experts ``[E, out, in]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"{bits=} is not supported; use one of {BITS}")


def _check_group(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{group_size=} is not supported; use one of {GROUP_SIZES}")


def pack(q, bits: int):
    """Packs unsigned ints ``q [..., in]`` (each < 2^bits) into uint32 ``[..., in * bits // 32]``."""
    _check_bits(bits)
    xp = _xp(q)
    per_word = 32 // bits
    if q.shape[-1] % per_word:
        raise ValueError(f"last dim {q.shape[-1]=} must be a multiple of {per_word} for {bits=}")
    q = xp.asarray(q).astype(xp.uint32).reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    shifts = xp.arange(per_word, dtype=xp.uint32) * xp.uint32(bits)
    # Fields do not overlap, so a sum is a bitwise or.
    return (q << shifts).sum(axis=-1, dtype=xp.uint32)


def unpack(packed, bits: int):
    """Inverse of ``pack``: uint32 ``[..., in * bits // 32]`` to uint32 ``[..., in]``."""
    _check_bits(bits)
    xp = _xp(packed)
    if packed.dtype != xp.uint32:
        raise ValueError(f"packed weights must be uint32, got {packed.dtype=}")
    per_word = 32 // bits
    shifts = xp.arange(per_word, dtype=xp.uint32) * xp.uint32(bits)
    q = (packed[..., None] >> shifts) & xp.uint32((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def quantize(w, bits: int = 4, group_size: int = 64):
    """Quantizes ``w [..., out, in]`` to ``(weight uint32, scales, biases)`` exactly as MLX does."""
    _check_bits(bits)
    _check_group(group_size)
    xp = _xp(w)
    if w.ndim < 2:
        raise ValueError(f"weight must be at least 2D [..., out, in], got {w.shape=}")
    if w.shape[-1] % group_size:
        raise ValueError(f"input dim {w.shape[-1]=} must be a multiple of {group_size=}")
    n_bins = float((1 << bits) - 1)
    wg = w.astype(xp.float32).reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    w_min = wg.min(axis=-1, keepdims=True)
    w_max = wg.max(axis=-1, keepdims=True)
    use_min = xp.abs(w_min) > xp.abs(w_max)
    scale = xp.maximum((w_max - w_min) / xp.float32(n_bins), xp.float32(1e-7))
    scale = xp.where(use_min, scale, -scale)
    edge = xp.where(use_min, w_min, w_max)
    q0 = xp.round(edge / scale)  # round half to even, as std::rint
    nonzero = q0 != 0
    scale = xp.where(nonzero, edge / xp.where(nonzero, q0, xp.float32(1)), scale)
    bias = xp.where(nonzero, edge, xp.float32(0))
    q = xp.clip(xp.round((wg - bias) / scale), 0, n_bins).astype(xp.uint32)
    weight = pack(q.reshape(w.shape), bits)
    return weight, scale[..., 0].astype(w.dtype), bias[..., 0].astype(w.dtype)


def dequantize(weight, scales, biases, bits: int = 4, group_size: int = 64, dtype=None):
    """``weight [..., out, in*bits/32]`` back to ``w [..., out, in]``: float32 ``scale * q + bias``, cast."""
    _check_bits(bits)
    _check_group(group_size)
    xp = _xp(weight)
    dtype = scales.dtype if dtype is None else dtype
    k = weight.shape[-1] * 32 // bits
    if k % group_size:
        raise ValueError(f"input dim {k=} (from {weight.shape=}) must be a multiple of {group_size=}")
    want = (*weight.shape[:-1], k // group_size)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{scales.shape=} and {biases.shape=} must both be {want} for {weight.shape=}")
    q = unpack(weight, bits).astype(xp.float32).reshape(*want, group_size)
    w = q * scales.astype(xp.float32)[..., None] + biases.astype(xp.float32)[..., None]
    return w.reshape(*weight.shape[:-1], k).astype(dtype)


def qmatmul_reference(x: jax.Array, weight, scales, biases, bits: int = 4, group_size: int = 64):
    """``x [..., in] @ dequantize(weight).T -> [..., out]`` in ``x.dtype``, float32 accumulation."""
    w = dequantize(jnp.asarray(weight), jnp.asarray(scales), jnp.asarray(biases), bits, group_size, x.dtype)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"{x.shape[-1]=} does not match the weight's input dim {w.shape[-1]}")
    y = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# --- The kernel layout: made once at load time, read by `pallas_kernels.qmatmul.qmatmul_tiled` ---
# Within each K tile of ``T = (32 // bits) * group_size`` inputs, word ``i`` (0..group_size-1) holds in
# bit field ``j`` the input ``j * group_size + i`` of the tile, so field ``j`` of the tile's words is exactly
# group ``j`` of the tile: a kernel unpacks with one shift and mask per field and meets one scale per output
# and field, never a reshape. Scales and biases are stored transposed, ``[K // group_size, N]``, so the
# scales of one group are one contiguous row. Same bytes as MLX; the checkpoint layout stays MLX.


def kernel_tile(bits: int, group_size: int) -> int:
    """Inputs per K tile of the kernel layout (a K that is not a multiple keeps the MLX layout)."""
    return (32 // bits) * group_size


def to_kernel_layout(weight, scales, biases, bits: int = 4, group_size: int = 64):
    """MLX ``(weight [N, K*bits/32], scales, biases [N, K/g])`` -> kernel layout (weight same shape, s/b ``[K/g, N]``)."""
    _check_bits(bits)
    _check_group(group_size)
    xp = _xp(weight)
    n, kw = weight.shape
    per_word, k = 32 // bits, kw * 32 // bits
    if k % kernel_tile(bits, group_size):
        raise ValueError(f"K={k} must be a multiple of {kernel_tile(bits, group_size)=} for the kernel layout")
    q = unpack(weight, bits).reshape(n, k // (per_word * group_size), per_word, group_size)
    q = q.swapaxes(-1, -2).reshape(n, k)  # word i of a tile now holds inputs i, g + i, 2g + i, ...
    return pack(q, bits), xp.asarray(scales).T, xp.asarray(biases).T


def from_kernel_layout(weight, scales, biases, bits: int = 4, group_size: int = 64):
    """Inverse of ``to_kernel_layout``."""
    n, kw = weight.shape
    per_word, k = 32 // bits, kw * 32 // bits
    q = unpack(weight, bits).reshape(n, k // (per_word * group_size), group_size, per_word)
    return pack(q.swapaxes(-1, -2).reshape(n, k), bits), scales.T, biases.T


def dequantize_kernel_layout(weight, scales, biases, bits: int = 4, group_size: int = 64, dtype=None):
    """``dequantize`` for weights in the kernel layout (one fused unpack, no repack)."""
    xp = _xp(weight)
    n, kw = weight.shape
    per_word, k = 32 // bits, kw * 32 // bits
    q = unpack(weight, bits).reshape(n, k // (per_word * group_size), group_size, per_word).swapaxes(-1, -2)
    q = q.reshape(n, k // group_size, group_size).astype(xp.float32)
    w = q * scales.T.astype(xp.float32)[..., None] + biases.T.astype(xp.float32)[..., None]
    return w.reshape(n, k).astype(scales.dtype if dtype is None else dtype)


# --- The pair layout (4-bit): the kernel layout's sibling for ``qmatmul_tiled(unpack="pairs")`` ---
# Within each K tile of ``4 * group_size`` inputs (``group_size // 2`` words a row), word ``i`` holds in
# field ``j`` (0..3) the input ``j * group_size + 2i`` of the tile and in field ``j + 4`` the input
# ``j * group_size + 2i + 1``. Fields j and j + 4 sit at bits 4j and 16 + 4j, so one shift, AND and OR of a
# word gives two bf16 halves ``128 + q``, neighbours in K of one group, in the MMA operand's order.
# Scales and biases transposed, ``[K // group_size, N]``, as in the kernel layout.


def pair_tile(group_size: int) -> int:
    """Inputs per K tile of the pair layout."""
    return 4 * group_size


def to_pair_layout(weight, scales, biases, bits: int = 4, group_size: int = 64):
    """MLX 4-bit ``(weight [N, K/8], scales, biases [N, K/g])`` -> pair layout (weight same shape, s/b ``[K/g, N]``)."""
    _check_group(group_size)
    if bits != 4:
        raise ValueError(f"the pair layout holds 4-bit weights only, got {bits=}")
    xp = _xp(weight)
    n, kw = weight.shape
    k = kw * 8
    if k % pair_tile(group_size):
        raise ValueError(f"K={k} must be a multiple of {pair_tile(group_size)=} for the pair layout")
    q = unpack(weight, 4).reshape(n, k // pair_tile(group_size), 4, group_size // 2, 2)
    q = q.transpose(0, 1, 3, 4, 2).reshape(n, k)  # [tile, word i, half, j]: field 4 * half + j
    return pack(q, 4), xp.asarray(scales).T, xp.asarray(biases).T


def from_pair_layout(weight, scales, biases, bits: int = 4, group_size: int = 64):
    """Inverse of ``to_pair_layout``."""
    n, kw = weight.shape
    k = kw * 8
    q = unpack(weight, 4).reshape(n, k // pair_tile(group_size), group_size // 2, 2, 4)
    return pack(q.transpose(0, 1, 4, 2, 3).reshape(n, k), 4), scales.T, biases.T


def dequantize_pair_layout(weight, scales, biases, bits: int = 4, group_size: int = 64, dtype=None):
    """``dequantize`` for weights in the pair layout."""
    w, s, b = from_pair_layout(weight, scales, biases, bits, group_size)
    return dequantize(w, s, b, bits, group_size, dtype)


def pack_scale_bias(scales, biases):
    """bf16 ``scales, biases`` -> one uint32 array of their bits (scale low, bias high): one load for both."""
    xp = _xp(scales)
    if scales.dtype != biases.dtype or str(scales.dtype) != "bfloat16":
        raise ValueError(f"packing needs bf16 scales and biases, got {scales.dtype} and {biases.dtype}")
    lo = xp.asarray(scales).view(xp.uint16).astype(xp.uint32)
    hi = xp.asarray(biases).view(xp.uint16).astype(xp.uint32)
    return lo | (hi << 16)


def unpack_scale_bias(packed):
    """Inverse of ``pack_scale_bias``: ``(scales, biases)`` in bf16."""
    xp = _xp(packed)
    bf16 = jnp.bfloat16
    lo = (packed & 0xFFFF).astype(xp.uint16).view(bf16)
    hi = (packed >> 16).astype(xp.uint16).view(bf16)
    return lo, hi
