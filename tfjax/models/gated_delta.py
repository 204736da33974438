"""Gated DeltaNet recurrences (plain jax.numpy): the per-token step, its scan, and the chunked prompt form.

State S [B, Hv, Dk, Dv] is f32. One step at a token with q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv]:
S <- S * exp(g); S <- S + k (x) beta * (v - k.S); o = q.S. Plain decoding, verify rows and replay all use
`step`, so a row's output never depends on how many rows were verified with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
         beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One recurrent step; returns (new state, output [B, Hv, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.sum(state * k[..., :, None], axis=-2)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.sum(state * q[..., :, None], axis=-2)
    return state, out


def recurrent(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              count: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`step` over rows: the Pallas kernel where `ops.delta_kernel` says so, else `recurrent_reference`.

    Rows at or past a lane's `count` leave its state alone; their outputs are not to be read.
    """
    from tfjax import ops

    if ops.delta_kernel():
        from pallas_kernels import gated_delta as gdk

        if gdk.supports(k.shape[-1], v.shape[-1]):
            return gdk.recurrent(state, q, k, v, g, beta, count)
    return recurrent_reference(state, q, k, v, g, beta, count)


def recurrent_qkv(state: jax.Array, qkv: jax.Array, g: jax.Array, beta: jax.Array, count: jax.Array | None = None,
                  *, out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`recurrent` fed by the conv output qkv [B, T, 2 Hk Dk + Hv Dv] (q and k normalised on the way): the fused
    Pallas kernel with kernels on, else `split_qkv` then `recurrent_reference`; out [B, T, Hv, Dv] in out_dtype."""
    from pallas_kernels import gated_delta as gdk
    from tfjax import ops

    _, hv, dk, dv = state.shape
    key_heads = (qkv.shape[-1] - hv * dv) // (2 * dk)
    if ops.delta_kernel() and gdk.supports(dk, dv):
        return gdk.recurrent_qkv(state, qkv, g, beta, count, key_heads=key_heads, out_dtype=out_dtype)
    q, k, v = split_qkv(qkv, key_heads, dk, hv, rows=True)  # lane rounds only: row-tiled norms
    state, out = recurrent_reference(state, q, k, v, g, beta, count)
    return state, out.astype(out_dtype)


def split_qkv(qkv: jax.Array, key_heads: int, dk: int, hv: int, *, rows: bool = False, eps: float = 1e-6):
    """The step inputs from the conv output qkv [B, T, 2 Hk Dk + Hv Dv]: q, k L2-normalised (`ops.row_norm`, in
    fixed row tiles when `rows`; q scaled by Dk^-1/2) and repeated to the value heads, v; all f32 [B, T, Hv, D]."""
    from tfjax import ops

    b, t, _ = qkv.shape
    kd = key_heads * dk
    q = qkv[..., :kd].reshape(b, t, key_heads, dk).astype(jnp.float32)
    k = qkv[..., kd : 2 * kd].reshape(b, t, key_heads, dk).astype(jnp.float32)
    v = qkv[..., 2 * kd :].reshape(b, t, hv, -1).astype(jnp.float32)
    rep = hv // key_heads
    q = jnp.repeat(ops.row_norm(q, kind="l2", eps=eps, rows=rows), rep, axis=2) * (dk**-0.5)
    k = jnp.repeat(ops.row_norm(k, kind="l2", eps=eps, rows=rows), rep, axis=2)
    return q, k, v


def recurrent_reference(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        count: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scan `step` over rows (axis 1 of q, k, v [B, T, Hv, D] and g, beta [B, T, Hv]).

    With `count` [B], only each lane's first count rows update the state (replay after acceptance).
    Lanes run one at a time (fixed shapes), so a lane's arithmetic never depends on how many share the call.
    """
    from tfjax.ops import fenced_map

    b, t = q.shape[:2]
    n = jnp.full((b,), t, jnp.int32) if count is None else count
    return fenced_map(lambda xs: _lane_recurrent(*xs), (state, q, k, v, g, beta, n))


def _lane_recurrent(state, q, k, v, g, beta, count):
    """One lane: `step` over its first `count` rows; on the reference path a loop XLA cannot inline."""
    from tfjax import ops

    t = q.shape[0]
    if ops.use_kernels() and t == 1:  # GPU: never a one-trip loop (XLA would inline and fuse it; see fenced_map)
        state, out = _lane_recurrent(state, *(jnp.concatenate([a, a]) for a in (q, k, v, g, beta)),
                                     jnp.minimum(count, 1))
        return state, out[:1]

    def body(i, carry):
        s, out = carry
        s_new, o = step(s[None], *(jax.lax.dynamic_index_in_dim(a, i, keepdims=True) for a in (q, k, v, g, beta)))
        s = jnp.where(i < count, s_new[0], s)
        return s, jax.lax.dynamic_update_index_in_dim(out, o[0], i, 0)

    out = jnp.zeros((t, *v.shape[1:]), jnp.float32)
    trips = t if ops.use_kernels() else jnp.minimum(ops.opaque_count(count), t)
    return jax.lax.fori_loop(0, trips, body, (state, out))


def chunked(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The prompt form: the Pallas chunked kernel where `ops.delta_chunked_kernel` says so, else
    `chunked_reference`."""
    from tfjax import ops

    if ops.delta_chunked_kernel():
        from pallas_kernels import gated_delta_chunked as gdc

        if gdc.supports(k.shape[-1], v.shape[-1]):
            return gdc.chunked(state, q, k, v, g, beta, block_sizes=gdc.BlockSizes(chunk=chunk))
    return chunked_reference(state, q, k, v, g, beta, chunk)


def chunked_reference(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                      chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The chunked (WY / UT-transform) form for prompts; equals `recurrent` up to rounding."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    n = (t + pad) // chunk
    # [B, H, N, C, D]
    q, k, v = (a.reshape(b, n, chunk, h, -1).transpose(0, 3, 1, 2, 4) for a in (q, k, v))
    g, beta = (a.reshape(b, n, chunk, h).transpose(0, 3, 1, 2) for a in (g, beta))
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # [.., C, C], i >= j
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    a = jnp.where(strict, -(kb @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    # (I - A)^-1 by forward substitution over rows; A is strictly lower triangular.
    eye = jnp.eye(chunk, dtype=a.dtype)
    tinv = jax.scipy.linalg.solve_triangular(eye - a, jnp.broadcast_to(eye, a.shape), lower=True,
                                             unit_diagonal=True)
    u = tinv @ vb  # new values
    w = tinv @ (kb * jnp.exp(cum)[..., None])  # decayed keys that read the old state
    attn = jnp.where(lower, (q @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    qd = q * jnp.exp(cum)[..., None]
    kd = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    last = jnp.exp(cum[..., -1])  # [B, H, N]

    def body(s, xs):
        ui, wi, qi, ki, ai, li = xs
        v_new = ui - wi @ s
        o = qi @ s + ai @ v_new
        s = s * li[..., None, None] + jnp.swapaxes(ki, -1, -2) @ v_new
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qd, kd, attn, last))
    state, out = jax.lax.scan(body, state, xs)  # out [N, B, H, C, Dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, h, dv)[:, :t]
    return state, out
