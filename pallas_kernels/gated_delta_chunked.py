"""Pallas GPU (Triton) Gated DeltaNet for prompts: the chunked (WY / UT-transform) form in one launch.

Shapes: ``state [B, Hv, Dk, Dv]`` f32, ``q, k [B, T, Hv, Dk]`` (q scaled, both L2-normalised), ``v [B, T, Hv, Dv]``,
``g, beta [B, T, Hv]``: the inputs of `tfjax.models.gated_delta.chunked`, which is this kernel's reference. Rows a
prompt does not fill come in as zeros (g = beta = 0), which leave the state alone.

Grid: (value head, value block, lane). A program keeps a [Dk, block_v] slice of one head's state in registers and
walks the prompt a chunk of C rows at a time (XLA's form: a `scan` whose every trip is several batched launches):
  cum = cumsum(g);  D[i, j] = exp(cum_i - cum_j) for i >= j;  A = -(beta k k^T) * D strictly below the diagonal
  T = (I - A)^-1, inverted block by block: the b-row diagonal blocks' inverses give the 2b-row ones, T2 A21 T1
      below the diagonal (log2(C) steps of two tensor-core dots; stable where the series (I + A)(I + A^2)...
      is not: near-equal keys make A^32's entries ~1e17 while T's stay below 1)
  V' = T (beta v) - T (beta e^cum k) S;  o = (e^cum q) S + (q k^T * D) V';  S <- e^cum_C S + (e^(cum_C - cum) k)^T V'
The triangle (A and T) depends on the head only, so a program of a head with Dv / block_v value blocks computes
it once per block: block_v = Dv (the default) computes it once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

PRECISIONS = {  # the dots' input precision on the GPU (interpret mode computes in f32 on the CPU)
    "ieee": lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Chunk rows (the triangle is [chunk, chunk]), value columns a program, and the dots' precision."""

    chunk: int = 64
    block_v: int = 128
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32x3"  # XLA's f32 dots on the GPU take tf32 inputs; x3 keeps f32's accuracy


def supports(dk: int, dv: int) -> bool:
    """Triton blocks are powers of two: head dims 16..256."""
    return all(16 <= d <= 256 and d & (d - 1) == 0 for d in (dk, dv))


def _dots(precision):
    """a @ b, a @ b^T and a^T @ b in f32 at the given precision."""

    def dot(a, b, ca, cb):
        return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    return (lambda a, b: dot(a, b, 1, 0)), (lambda a, b: dot(a, b, 1, 1)), (lambda a, b: dot(a, b, 0, 0))


def _chunked_kernel(s_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_out, o_ref, *, chunks, chunk, precision):
    # s_ref [Dk, bv] f32; q_ref, k_ref [Tp, Dk]; v_ref [Tp, bv]; g_ref, b_ref [Tp]; o_ref [Tp, bv]
    mm, mm_t, t_mm = _dots(precision)
    f32 = lambda a: a.astype(jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    lower, strict = row >= col, row > col
    eye = (row == col).astype(jnp.float32)

    def body(n, s):
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        q, k, v = f32(q_ref[rows, :]), f32(k_ref[rows, :]), f32(v_ref[rows, :])
        g, beta = f32(g_ref[rows]), f32(b_ref[rows])
        cum = jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1)  # inclusive cumsum, [C]
        total = jnp.sum(g)  # cum at the chunk's last row
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
        a = jnp.where(strict, -beta[:, None] * mm_t(k, k) * decay, 0.0)
        t = eye  # (I - A)^-1 by doubling diagonal blocks: [[T1, 0], [A21, .]] -> T2 A21 T1 below, b rows each
        for b in (1 << i for i in range(chunk.bit_length() - 1)):
            below = (row // (2 * b) == col // (2 * b)) & ((row // b) % 2 == 1) & ((col // b) % 2 == 0)
            t = t + mm(mm(t, jnp.where(below, a, 0.0)), t)
        v_new = mm(t, v * beta[:, None]) - mm(mm(t, k * (beta * jnp.exp(cum))[:, None]), s)
        attn = jnp.where(lower, mm_t(q, k) * decay, 0.0)
        o_ref[rows, :] = (mm(q * jnp.exp(cum)[:, None], s) + mm(attn, v_new)).astype(o_ref.dtype)
        return s * jnp.exp(total) + t_mm(k * jnp.exp(total - cum)[:, None], v_new)

    s_out[...] = lax.fori_loop(0, chunks, body, s_ref[...])


def _check(state, q, k, v, g, beta, bs: BlockSizes):
    if state.ndim != 4 or q.ndim != 4:
        raise ValueError(f"want state [B, Hv, Dk, Dv] and q [B, T, Hv, Dk], got {state.shape=} {q.shape=}")
    b, hv, dk, dv = state.shape
    t = q.shape[1]
    want = {"q": (b, t, hv, dk), "k": (b, t, hv, dk), "v": (b, t, hv, dv), "g": (b, t, hv), "beta": (b, t, hv)}
    for name, arr in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"{name}.shape={tuple(arr.shape)} must be {want[name]} (state {state.shape})")
    if not supports(dk, dv):
        raise ValueError(f"head dims {dk=} {dv=} must be powers of 2 in 16..256")
    if bs.chunk < 16 or bs.chunk & (bs.chunk - 1) or bs.block_v < 16 or bs.block_v & (bs.block_v - 1):
        raise ValueError(f"chunk={bs.chunk} and block_v={bs.block_v} must be powers of 2 >= 16")
    if bs.precision not in PRECISIONS:
        raise ValueError(f"precision={bs.precision!r} must be one of {sorted(PRECISIONS)}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def chunked(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
            block_sizes: BlockSizes | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(new state [B, Hv, Dk, Dv] f32, out [B, T, Hv, Dv] f32): `tfjax.models.gated_delta.chunked` in one launch."""
    bs = block_sizes or BlockSizes()
    _check(state, q, k, v, g, beta, bs)
    b, hv, dk, dv = state.shape
    t = q.shape[1]
    chunk, bv = bs.chunk, min(bs.block_v, dv)
    padded = max(chunk, 1 << (t - 1).bit_length())  # Triton's blocks are powers of two; the loop stops at t
    if padded != t:
        q, k, v = (jnp.pad(a, ((0, 0), (0, padded - t), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, padded - t), (0, 0))) for a in (g, beta))
    keys = pl.BlockSpec((None, padded, None, dk), lambda h, j, n: (n, 0, h, 0))
    values = pl.BlockSpec((None, padded, None, bv), lambda h, j, n: (n, 0, h, j))
    gate = pl.BlockSpec((None, padded, None), lambda h, j, n: (n, 0, h))
    state_block = pl.BlockSpec((None, None, dk, bv), lambda h, j, n: (n, h, 0, j))
    kernel = functools.partial(_chunked_kernel, chunks=pl.cdiv(t, chunk), chunk=chunk,
                               precision=lax.Precision.HIGHEST if interpret else PRECISIONS[bs.precision])
    new_state, out = pl.pallas_call(
        kernel,
        grid=(hv, dv // bv, b),
        in_specs=[state_block, keys, keys, values, gate, gate],
        out_specs=[state_block, values],
        out_shape=[jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct((b, padded, hv, dv),
                                                                                        jnp.float32)],
        input_output_aliases={0: 0},  # the state is updated in place
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="gated_delta_chunked",
    )(state.astype(jnp.float32), q, k, v, g, beta)
    return new_state, out[:, :t]


def reference(state, q, k, v, g, beta, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """Plain jax.numpy: `tfjax.models.gated_delta.chunked` (XLA's scan over chunks)."""
    from tfjax.models import gated_delta

    return gated_delta.chunked_reference(state, q, k, v, g, beta, chunk)
