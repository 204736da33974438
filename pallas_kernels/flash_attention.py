"""Pallas GPU (Triton) causal flash attention for prompt chunks (prefill), GQA.

Shapes: ``q [B, T, H, E]`` (T query rows per lane at absolute ``positions [B, T]``), ``k, v [B, S, G, E]``
(the lane's keys in position order, earlier chunks included). A row at p sees keys 0..p. GQA: query head
``h`` reads KV head ``h // (H // G)``.

Grid: (query head, query block, lane), heads fastest: the ``H // G`` heads of one KV head and neighbouring
query blocks run together and read the same key tiles from L2; query blocks go heaviest (latest) first so
the causal tail is short. A program takes ``block_q`` rows of one head and walks key tiles of ``block_k``:
first the tiles every row of the block sees whole (no mask), then the diagonal tiles up to the block's
last position (masked), keeping an online softmax in float32 (base 2: the scale folds log2(e)).

Not row-invariant: a row's arithmetic depends on the block it shares. Lane-round rows (decode, verify)
use the paged kernel in `attention.py`, which is.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import attention_reference

HEAD_DIMS = (64, 128, 256)
NEG = -1e30  # finite start for the running max: a fully masked tile gives exp2(-inf - NEG) = 0, never NaN
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 128  # query rows (of one head) per program
    block_k: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 2


def _flash_kernel(q_ref, pos_ref, k_ref, v_ref, o_ref, *, block_k, scale):
    # q_ref [bq, E]; pos_ref [bq] i32 (rows in position order); k_ref, v_ref [S, E]; o_ref [bq, E]
    block_q, e = q_ref.shape
    q = q_ref[...]
    pos = pos_ref[...]
    full = (jnp.min(pos) + 1) // block_k  # tiles every row sees whole
    tiles = jnp.max(pos) // block_k + 1  # tiles any row sees at all
    qk_scale = scale * LOG2E

    def body(i, carry, masked):
        acc, m, l = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        k = k_ref[pl.ds(k0, block_k), :]
        v = v_ref[pl.ds(k0, block_k), :]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bq, bk]
        # The mask only selects: a visible score takes the same instructions in a masked tile as in a whole
        # one, so a row's result never depends on which tiles its query block sees whole (chunk invariance).
        seen = (k0 + jnp.arange(block_k))[None, :] <= pos[:, None] if masked else None
        top = jnp.max(jnp.where(seen, s, -jnp.inf) if masked else s, axis=1)
        m_new = jnp.maximum(m, top * qk_scale)  # m in scaled (base-2) units; qk_scale > 0
        p = jnp.exp2(s * qk_scale - m_new[:, None])  # one fused multiply-add per score
        if masked:
            p = jnp.where(seen, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, e), jnp.float32), jnp.full((block_q,), NEG, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), init)
    acc, _, l = lax.fori_loop(full, tiles, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # l >= 1: every row sees key 0


def _check(q, k, v, positions, bs: BlockSizes):
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"want q [B, T, H, E] and k, v [B, S, G, E], got {q.shape=} {k.shape=}")
    b, t, h, e = q.shape
    bk, _, g, ek = k.shape
    if v.shape != k.shape:
        raise ValueError(f"{v.shape=} must equal {k.shape=}")
    if bk != b:
        raise ValueError(f"k's lanes {bk} must equal q's {b=}")
    if ek != e or e not in HEAD_DIMS:
        raise ValueError(f"head dim {e=} (k {ek}) must match and be one of 64, 128, 256")
    if h % g:
        raise ValueError(f"query heads {h=} must be a multiple of KV heads {g=}")
    if positions.shape != (b, t):
        raise ValueError(f"{positions.shape=} must be [B, T]=[{b}, {t}]")
    for name in ("block_q", "block_k"):
        x = getattr(bs, name)
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}={x} must be a power of 2 >= 16")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal GQA attention of q rows at `positions` over the lane's keys: ``[B, T, H, E]`` in ``q.dtype``.

    Rows should come in position order within a lane (a prompt chunk): a block's work is bounded by its
    first and last positions. Every position must be >= 0.
    """
    bs = block_sizes or BlockSizes()
    _check(q, k, v, positions, bs)
    b, t, h, e = q.shape
    _, s, g, _ = k.shape
    r = h // g
    t_pad = pl.cdiv(t, bs.block_q) * bs.block_q
    s_pad = pl.cdiv(s, bs.block_k) * bs.block_k
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    pos = jnp.minimum(positions.astype(jnp.int32), s - 1)  # a row past the keys sees them all
    if t_pad != t:  # padding rows repeat the last position: no extra tiles, finite results, sliced away
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, t_pad - t)), mode="edge")
    if s_pad != s:  # keys past s are never seen (pos <= s - 1) but tiles read them
        k = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    nq = t_pad // bs.block_q
    kernel = functools.partial(_flash_kernel, block_k=bs.block_k, scale=e**-0.5)
    out = pl.pallas_call(
        kernel,
        grid=(h, nq, b),
        in_specs=[
            pl.BlockSpec((None, bs.block_q, None, e), lambda j, i, n: (n, nq - 1 - i, j, 0)),
            pl.BlockSpec((None, bs.block_q), lambda j, i, n: (n, nq - 1 - i)),
            pl.BlockSpec((None, s_pad, None, e), lambda j, i, n: (n, 0, j // r, 0)),
            pl.BlockSpec((None, s_pad, None, e), lambda j, i, n: (n, 0, j // r, 0)),
        ],
        out_specs=pl.BlockSpec((None, bs.block_q, None, e), lambda j, i, n: (n, nq - 1 - i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, h, e), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(q, pos, k, v)
    return out[:, :t]


def reference(q, k, v, positions) -> jax.Array:
    """Plain jax.numpy: `attention.attention_reference` (softmax over keys s <= position)."""
    return attention_reference(q, k, v, positions)
