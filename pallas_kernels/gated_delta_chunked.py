"""Pallas GPU (Triton) Gated DeltaNet for prompts: the chunked (WY / UT-transform) form in one or two launches.

Shapes: ``state [B, Hv, Dk, Dv]`` f32, ``q, k [B, T, Hv, Dk]`` (q scaled, both L2-normalised), ``v [B, T, Hv, Dv]``,
``g, beta [B, T, Hv]``: the inputs of `reference` (XLA's scan over chunks, below), this kernel's reference. Rows a
prompt does not fill come in as zeros (g = beta = 0), which leave the state alone.

Per chunk of C rows (XLA's form is a `scan` over chunks whose every trip is several batched launches):
  cum = cumsum(g);  D[i, j] = exp(cum_i - cum_j) for i >= j;  A = -(beta k k^T) * D strictly below the diagonal
  T = (I - A)^-1, inverted block by block: the b-row diagonal blocks' inverses give the 2b-row ones, T2 A21 T1
      below the diagonal (log2(C) steps of two tensor-core dots; stable where the series (I + A)(I + A^2)...
      is not: near-equal keys make A^32's entries ~1e17 while T's stay below 1)
  U = T (beta v),  W = T (beta e^cum k)                                    (no state: every chunk at once)
  V' = U - W S;  o = (e^cum q) S + (q k^T * D) V';  S <- e^cum_C S + (e^(cum_C - cum) k)^T V'   (in order)
`split` (default): a first launch, grid (chunk, head, lane), computes every chunk's U and W at once; a second,
grid (value head, value block, lane), keeps a [Dk, block_v] state slice in registers and walks the chunks with
three dots a chunk. One launch: the walk computes each chunk's triangle itself, on Hv x Dv / block_v programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gated_delta as recurrence

supports = recurrence.supports  # the recurrence kernel's head dims: powers of two, 16..256

PRECISIONS = {  # the dots' input precision on the GPU (interpret mode computes in f32 on the CPU)
    "ieee": lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Chunk rows (the triangle is [chunk, chunk]), value columns a program, and the dots' precision."""

    chunk: int = 64
    block_v: int = 32  # split: 4 programs a head walk the chunks (one launch: 128, the triangle once a head)
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"  # XLA's f32 dots on the GPU take tf32 inputs; x3 keeps f32's accuracy
    split: bool = True  # every chunk's triangle, U and W at once first, then the walk (two launches)


def _dots(precision):
    """a @ b, a @ b^T and a^T @ b in f32 at the given precision."""

    def dot(a, b, ca, cb):
        return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    return (lambda a, b: dot(a, b, 1, 0)), (lambda a, b: dot(a, b, 1, 1)), (lambda a, b: dot(a, b, 0, 0))


class _Chunk:
    """A chunk's masks (C x C) and dots, built once a program."""

    def __init__(self, chunk: int, precision):
        self.mm, self.mm_t, self.t_mm = _dots(precision)
        self.row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        self.col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        self.lower, self.strict = self.row >= self.col, self.row > self.col
        self.chunk = chunk

    def gates(self, g):
        """(cum [C] the inclusive cumsum of g, total = its last entry, decay [C, C] = exp(cum_i - cum_j), i >= j)."""
        cum = jnp.sum(jnp.where(self.lower, g[None, :], 0.0), axis=1)
        decay = jnp.where(self.lower, jnp.exp(jnp.where(self.lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
        # the last entry itself, not sum(g): another summation order would make e^(total - cum) at the last row
        # 1 + a few ulps of |cum| (~1e-5 at cum = -200: a prompt of strong decays), an error the scan has not
        total = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (self.chunk,), 0) == self.chunk - 1, cum, 0.0))
        return cum, total, decay

    def wy(self, k, v, beta, cum, decay):
        """(U = T (beta v) [C, bv], W = T (beta e^cum k) [C, Dk]) with T = (I - A)^-1, A = -(beta k k^T) * decay
        below the diagonal, inverted by doubling diagonal blocks: [[T1, 0], [A21, T2]] has T2 A21 T1 below."""
        mm, row, col = self.mm, self.row, self.col
        a = jnp.where(self.strict, -beta[:, None] * self.mm_t(k, k) * decay, 0.0)
        t = (row == col).astype(jnp.float32)
        for b in (1 << i for i in range(self.chunk.bit_length() - 1)):
            below = (row // (2 * b) == col // (2 * b)) & ((row // b) % 2 == 1) & ((col // b) % 2 == 0)
            t = t + mm(mm(t, jnp.where(below, a, 0.0)), t)
        return mm(t, v * beta[:, None]), mm(t, k * (beta * jnp.exp(cum))[:, None])

    def advance(self, s, q, k, u, w, cum, total, decay):
        """The chunk against the state: (out [C, bv], the state after it)."""
        mm = self.mm
        v_new = u - mm(w, s)
        attn = jnp.where(self.lower, self.mm_t(q, k) * decay, 0.0)
        out = mm(q * jnp.exp(cum)[:, None], s) + mm(attn, v_new)
        return out, s * jnp.exp(total) + self.t_mm(k * jnp.exp(total - cum)[:, None], v_new)


def _f32(a):
    return a.astype(jnp.float32)


def _chunked_kernel(s_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_out, o_ref, *, chunks, chunk, precision):
    # one launch: s_ref [Dk, bv] f32; q_ref, k_ref [Tp, Dk]; v_ref [Tp, bv]; g_ref, b_ref [Tp]; o_ref [Tp, bv]
    c = _Chunk(chunk, precision)

    def body(n, s):
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        q, k = _f32(q_ref[rows, :]), _f32(k_ref[rows, :])
        cum, total, decay = c.gates(_f32(g_ref[rows]))
        u, w = c.wy(k, _f32(v_ref[rows, :]), _f32(b_ref[rows]), cum, decay)
        out, s = c.advance(s, q, k, u, w, cum, total, decay)
        o_ref[rows, :] = out.astype(o_ref.dtype)
        return s

    s_out[...] = lax.fori_loop(0, chunks, body, s_ref[...])


def _prepare_kernel(k_ref, v_ref, g_ref, b_ref, u_ref, w_ref, *, chunk, precision):
    # split, first launch, every chunk at once: k_ref [C, Dk], v_ref [C, Dv], g_ref, b_ref [C] -> U, W
    c = _Chunk(chunk, precision)
    k = _f32(k_ref[...])
    cum, _, decay = c.gates(_f32(g_ref[...]))
    u, w = c.wy(k, _f32(v_ref[...]), _f32(b_ref[...]), cum, decay)
    u_ref[...], w_ref[...] = u, w


def _state_kernel(s_ref, q_ref, k_ref, g_ref, u_ref, w_ref, s_out, o_ref, *, chunks, chunk, precision):
    # split, second launch, the chunks in order: s_ref [Dk, bv]; q_ref, k_ref, w_ref [Tp, Dk]; u_ref [Tp, bv]
    c = _Chunk(chunk, precision)

    def body(n, s):
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        cum, total, decay = c.gates(_f32(g_ref[rows]))
        out, s = c.advance(s, _f32(q_ref[rows, :]), _f32(k_ref[rows, :]), u_ref[rows, :], w_ref[rows, :], cum,
                           total, decay)
        o_ref[rows, :] = out.astype(o_ref.dtype)
        return s

    s_out[...] = lax.fori_loop(0, chunks, body, s_ref[...])


def _check(state, q, k, v, g, beta, bs: BlockSizes):
    recurrence.check_rows(state, q, k, v, g, beta)  # the recurrence kernel's shapes and head dims
    if bs.chunk < 16 or bs.chunk & (bs.chunk - 1) or bs.block_v < 16 or bs.block_v & (bs.block_v - 1):
        raise ValueError(f"chunk={bs.chunk} and block_v={bs.block_v} must be powers of 2 >= 16")
    if bs.precision not in PRECISIONS:
        raise ValueError(f"precision={bs.precision!r} must be one of {sorted(PRECISIONS)}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def chunked(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
            block_sizes: BlockSizes | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(new state [B, Hv, Dk, Dv] f32, out [B, T, Hv, Dv] f32): `reference` in two launches
    (`split`) or one."""
    bs = block_sizes or BlockSizes()
    _check(state, q, k, v, g, beta, bs)
    b, hv, dk, dv = state.shape
    t = q.shape[1]
    chunk, bv = bs.chunk, min(bs.block_v, dv)
    padded = pl.cdiv(t, chunk) * chunk  # whole chunks (zero rows leave the state alone); loads are chunk-sized
    if padded != t:
        q, k, v = (jnp.pad(a, ((0, 0), (0, padded - t), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, padded - t), (0, 0))) for a in (g, beta))
    keys = pl.BlockSpec((None, padded, None, dk), lambda h, j, n: (n, 0, h, 0))
    values = pl.BlockSpec((None, padded, None, bv), lambda h, j, n: (n, 0, h, j))
    gate = pl.BlockSpec((None, padded, None), lambda h, j, n: (n, 0, h))
    state_block = pl.BlockSpec((None, None, dk, bv), lambda h, j, n: (n, h, 0, j))
    precision = lax.Precision.HIGHEST if interpret else PRECISIONS[bs.precision]
    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    walk = dict(chunks=padded // chunk, chunk=chunk, precision=precision)
    if bs.split:
        rows = lambda d: pl.BlockSpec((None, chunk, None, d), lambda n, h, i: (i, n, h, 0))
        rows_gate = pl.BlockSpec((None, chunk, None), lambda n, h, i: (i, n, h))
        u, w = pl.pallas_call(
            functools.partial(_prepare_kernel, chunk=chunk, precision=precision),
            grid=(padded // chunk, hv, b),
            in_specs=[rows(dk), rows(dv), rows_gate, rows_gate],
            out_specs=[rows(dv), rows(dk)],
            out_shape=[f32(b, padded, hv, dv), f32(b, padded, hv, dk)],
            compiler_params=params,
            interpret=interpret,
            name="gated_delta_chunked_prepare",
        )(k, v, g, beta)
        kernel, inputs, name = functools.partial(_state_kernel, **walk), (q, k, g, u, w), "gated_delta_chunked_state"
        in_specs = [keys, keys, gate, values, keys]
    else:
        kernel, inputs, name = functools.partial(_chunked_kernel, **walk), (q, k, v, g, beta), "gated_delta_chunked"
        in_specs = [keys, keys, values, gate, gate]
    new_state, out = pl.pallas_call(
        kernel,
        grid=(hv, dv // bv, b),
        in_specs=[state_block, *in_specs],
        out_specs=[state_block, values],
        out_shape=[f32(*state.shape), f32(b, padded, hv, dv)],
        input_output_aliases={0: 0},  # the state is updated in place
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(state.astype(jnp.float32), *inputs)
    return new_state, out[:, :t]


def reference(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                      chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The chunked (WY / UT-transform) form for prompts; equals `gated_delta.recurrent_reference` up to rounding."""
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
