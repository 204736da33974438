"""Pallas GPU (Triton) Gated DeltaNet recurrence for lane rounds: decode, verify rows and replay.

Shapes: ``state [B, Hv, Dk, Dv]`` f32, ``q, k [B, T, Hv, Dk]``, ``v [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]``,
``count [B]`` (rows that update each lane's state; replay after acceptance). One step per row, as
`tfjax.models.gated_delta.step`: S <- S * exp(g); S <- S + k (x) beta * (v - k.S); o = q.S.

Grid: (value head, value block, lane). The columns of S evolve independently (column j only needs k, beta,
g and v_j), so a program keeps a [Dk, block_v] slice of one head's state in registers for all T rows: the
state is read and written once per call, where XLA's step reads it about four times a row and writes it
twice. Row invariance: rows run one after another through the same loop body, so a row's result never
depends on how many rows share the call; the loop runs `count` trips (rows past it are zeros).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """A program holds a [Dk, block_v] slice of one head's state; block_v is fixed per shape (row invariance)."""

    block_v: int = 32  # 128 x 32 f32: 32 registers a thread at 4 warps; dense27, 1 lane: 48 x 4 programs
    num_warps: int = 4
    num_stages: int = 1


def supports(dk: int, dv: int) -> bool:
    """Triton blocks are powers of two: head dims 16..256."""
    return all(16 <= d <= 256 and d & (d - 1) == 0 for d in (dk, dv))


def _recurrent_kernel(count_ref, s_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_out, o_ref, *, rows):
    # count_ref [1] i32; s_ref [Dk, bv] f32; q_ref, k_ref [T, Dk]; v_ref [T, bv]; g_ref, b_ref [T]
    count = jnp.minimum(count_ref[0], rows)

    def body(i, s):
        q = q_ref[i, :].astype(jnp.float32)
        k = k_ref[i, :].astype(jnp.float32)
        v = v_ref[i, :].astype(jnp.float32)
        s = s * jnp.exp(g_ref[i].astype(jnp.float32))
        kv = jnp.sum(s * k[:, None], axis=0)  # [Dv]: k.S
        delta = (v - kv) * b_ref[i].astype(jnp.float32)
        s = s + k[:, None] * delta[None, :]
        o_ref[i, :] = jnp.sum(s * q[:, None], axis=0)
        return s

    def zero(i, carry):
        o_ref[i, :] = jnp.zeros((o_ref.shape[1],), jnp.float32)
        return carry

    s_out[...] = lax.fori_loop(0, count, body, s_ref[...])
    lax.fori_loop(count, rows, zero, 0)


def _check(state, q, k, v, g, beta, count):
    if state.ndim != 4 or q.ndim != 4:
        raise ValueError(f"want state [B, Hv, Dk, Dv] and q [B, T, Hv, Dk], got {state.shape=} {q.shape=}")
    b, hv, dk, dv = state.shape
    t = q.shape[1]
    want = {"q": (b, t, hv, dk), "k": (b, t, hv, dk), "v": (b, t, hv, dv), "g": (b, t, hv), "beta": (b, t, hv)}
    for name, arr in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"{name}.shape={tuple(arr.shape)} must be {want[name]} (state {state.shape})")
    if count is not None and tuple(count.shape) != (b,):
        raise ValueError(f"count.shape={tuple(count.shape)} must be ({b},)")
    if not supports(dk, dv):
        raise ValueError(f"head dims {dk=} {dv=} must be powers of 2 in 16..256")


def _check_blocks(bs: BlockSizes):
    if bs.block_v < 16 or bs.block_v & (bs.block_v - 1):
        raise ValueError(f"block_v={bs.block_v} must be a power of 2 >= 16")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def recurrent(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              count: jax.Array | None = None, *, block_sizes: BlockSizes | None = None,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(new state [B, Hv, Dk, Dv] f32, out [B, T, Hv, Dv] f32); with `count`, each lane's first count rows."""
    _check(state, q, k, v, g, beta, count)
    bs = block_sizes or BlockSizes()
    _check_blocks(bs)
    b, hv, dk, dv = state.shape
    t = q.shape[1]
    rows = max(1, 1 << (t - 1).bit_length())  # a power of two; padded rows sit past every count
    bv = min(bs.block_v, dv)
    n = jnp.full((b,), t, jnp.int32) if count is None else jnp.minimum(count.astype(jnp.int32), t)
    if rows != t:
        q, k, v = (jnp.pad(a, ((0, 0), (0, rows - t), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, rows - t), (0, 0))) for a in (g, beta))
    new_state, out = pl.pallas_call(
        functools.partial(_recurrent_kernel, rows=rows),
        grid=(hv, dv // bv, b),
        in_specs=[
            pl.BlockSpec((None, 1), lambda h, j, n: (n, 0)),
            pl.BlockSpec((None, None, dk, bv), lambda h, j, n: (n, h, 0, j)),
            pl.BlockSpec((None, rows, None, dk), lambda h, j, n: (n, 0, h, 0)),
            pl.BlockSpec((None, rows, None, dk), lambda h, j, n: (n, 0, h, 0)),
            pl.BlockSpec((None, rows, None, bv), lambda h, j, n: (n, 0, h, j)),
            pl.BlockSpec((None, rows, None), lambda h, j, n: (n, 0, h)),
            pl.BlockSpec((None, rows, None), lambda h, j, n: (n, 0, h)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, dk, bv), lambda h, j, n: (n, h, 0, j)),
            pl.BlockSpec((None, rows, None, bv), lambda h, j, n: (n, 0, h, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct(state.shape, jnp.float32),
                   jax.ShapeDtypeStruct((b, rows, hv, dv), jnp.float32)],
        input_output_aliases={1: 0},  # the state is updated in place
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="gated_delta_recurrent",
    )(n[:, None], state.astype(jnp.float32), q, k, v, g, beta)
    return new_state, out[:, :t]


def reference(state, q, k, v, g, beta, count=None) -> tuple[jax.Array, jax.Array]:
    """Plain jax.numpy: `tfjax.models.gated_delta.recurrent_reference` (the same step, row by row).

    Rows at or past a lane's count: the state is untouched and the output is zero, as in the kernel."""
    from tfjax.models import gated_delta

    new_state, out = gated_delta.recurrent_reference(state, q, k, v, g, beta, count)
    t = q.shape[1]
    n = jnp.full((q.shape[0],), t, jnp.int32) if count is None else count
    return new_state, jnp.where((jnp.arange(t)[None, :] < n[:, None])[..., None, None], out, 0.0)
