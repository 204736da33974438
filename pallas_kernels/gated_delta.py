"""Pallas GPU (Triton) Gated DeltaNet recurrence for lane rounds: decode, verify rows and replay.

Shapes: ``state [B, Hv, Dk, Dv]`` f32, ``q, k [B, T, Hv, Dk]``, ``v [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]``,
``count [B]`` (rows that update each lane's state; replay after acceptance). One step per row, as
`step`: S <- S * exp(g); S <- S + k (x) beta * (v - k.S); o = q.S.

Grid: (value head, value block, lane). The columns of S evolve independently (column j only needs k, beta,
g and v_j), so a program keeps a [Dk, block_v] slice of one head's state in registers for all T rows: the
state is read and written once per call, where XLA's step reads it about four times a row and writes it
twice. Row invariance: rows run one after another through the same loop body, so a row's result never
depends on how many rows share the call; the loop runs `count` trips (rows past it are zeros).

`recurrent_qkv` reads q, k and v where the conv wrote them (one [B, T, C] array), L2-normalises q and k in the
kernel and maps each value head to its key head, and writes the output in the model's dtype: one launch where the
decode step had eight (the split, two norms, two repeats, the cast). The kernel over split q, k, v it replaced lost
with the rest of the unfused DeltaNet rows (H200, dense27 decode 9.66 against 9.22 ms a step pipelined,
docs/benchmarks.md sixth run) and was deleted in issue 27; `recurrent_reference` is the CPU path's recurrence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fenced
from pallas_kernels import row_norm as rn


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """A program holds a [Dk, block_v] slice of one head's state; block_v is fixed per shape (row invariance)."""

    block_v: int = 32  # 128 x 32 f32: 32 registers a thread at 4 warps; dense27, 1 lane: 48 x 4 programs
    num_warps: int = 4
    num_stages: int = 1


def supports(dk: int, dv: int) -> bool:
    """Triton blocks are powers of two: head dims 16..256."""
    return all(16 <= d <= 256 and d & (d - 1) == 0 for d in (dk, dv))


def _rows(count_ref, s_ref, s_out, o_ref, rows, inputs):
    """Run the step over the first `count` rows (inputs(i) gives row i's f32 q, k, v, g, beta); zeros after them."""
    count = jnp.minimum(count_ref[0], rows)

    def body(i, s):
        q, k, v, g, beta = inputs(i)
        s = s * jnp.exp(g)
        kv = jnp.sum(s * k[:, None], axis=0)  # [Dv]: k.S
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o_ref[i, :] = jnp.sum(s * q[:, None], axis=0).astype(o_ref.dtype)
        return s

    def zero(i, carry):
        o_ref[i, :] = jnp.zeros((o_ref.shape[1],), o_ref.dtype)
        return carry

    s_out[...] = lax.fori_loop(0, count, body, s_ref[...])
    lax.fori_loop(count, rows, zero, 0)


def _qkv_kernel(count_ref, s_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_out, o_ref, *, rows, scale, eps):
    # count_ref [1] i32; s_ref [Dk, bv] f32; q_ref, k_ref [T, Dk] the key head's raw conv outputs, normalised here;
    # v_ref [T, bv]; g_ref, b_ref [T]
    f32 = lambda a: a.astype(jnp.float32)

    def unit(x):  # the model's L2 norm (`row_norm` kind "l2"): x / sqrt(sum(x^2) + eps), in f32
        return x / jnp.sqrt(jnp.sum(x * x) + eps)

    _rows(count_ref, s_ref, s_out, o_ref, rows,
          lambda i: (unit(f32(q_ref[i, :])) * scale, unit(f32(k_ref[i, :])), f32(v_ref[i, :]), f32(g_ref[i]),
                     f32(b_ref[i])))


def _call(kernel, rows_in, state, rows: int, bv: int, out_dtype, bs: BlockSizes, interpret: bool, name: str):
    """The recurrence's pallas_call: grid (value head, value block, lane); count, state, the three row inputs
    (`rows_in`: q, k, v specs), g and beta in; the state (updated in place) and the rows' outputs out."""
    b, hv, dk, dv = state.shape
    gate = pl.BlockSpec((None, rows, None), lambda h, j, n: (n, 0, h))
    state_block = pl.BlockSpec((None, None, dk, bv), lambda h, j, n: (n, h, 0, j))
    return pl.pallas_call(
        kernel,
        grid=(hv, dv // bv, b),
        in_specs=[pl.BlockSpec((None, 1), lambda h, j, n: (n, 0)), state_block, *rows_in, gate, gate],
        out_specs=[state_block, pl.BlockSpec((None, rows, None, bv), lambda h, j, n: (n, 0, h, j))],
        out_shape=[jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct((b, rows, hv, dv), out_dtype)],
        input_output_aliases={1: 0},  # the state is updated in place
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name=name,
    )


@functools.partial(jax.jit, static_argnames=("key_heads", "eps", "out_dtype", "block_sizes", "interpret"))
def recurrent_qkv(state: jax.Array, qkv: jax.Array, g: jax.Array, beta: jax.Array, count: jax.Array | None = None,
                  *, key_heads: int, eps: float = 1e-6, out_dtype=jnp.float32, block_sizes: BlockSizes | None = None,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The recurrence fed by the conv's output qkv [B, T, C] (C = 2 * key_heads * Dk + Hv * Dv: q, k, then v); with
    `count`, each lane's first count rows update its state (rows past it: zeros).

    q and k are L2-normalised per key head (q also scaled by Dk^-1/2); value head h reads key head
    h // (Hv / key_heads). Returns (new state, out [B, T, Hv, Dv] in `out_dtype`)."""
    bs = block_sizes or BlockSizes()
    _check_blocks(bs)
    b, hv, dk, dv = state.shape
    t, c = qkv.shape[1], qkv.shape[2]
    if qkv.ndim != 3 or c != 2 * key_heads * dk + hv * dv or hv % key_heads or not supports(dk, dv):
        raise ValueError(f"qkv.shape={tuple(qkv.shape)} must be [B, T, 2 * {key_heads} * {dk} + {hv} * {dv}] with "
                         f"power-of-2 head dims and Hv a multiple of key_heads (state {state.shape})")
    for name, arr in (("g", g), ("beta", beta)):
        if tuple(arr.shape) != (b, t, hv):
            raise ValueError(f"{name}.shape={tuple(arr.shape)} must be {(b, t, hv)}")
    if count is not None and tuple(count.shape) != (b,):
        raise ValueError(f"count.shape={tuple(count.shape)} must be ({b},)")
    rows = max(1, 1 << (t - 1).bit_length())
    bv = min(bs.block_v, dv)
    rep, kd = hv // key_heads, key_heads * dk
    n = jnp.full((b,), t, jnp.int32) if count is None else jnp.minimum(count.astype(jnp.int32), t)
    if rows != t:
        qkv = jnp.pad(qkv, ((0, 0), (0, rows - t), (0, 0)))
        g, beta = (jnp.pad(a, ((0, 0), (0, rows - t), (0, 0))) for a in (g, beta))
    rows_in = [pl.BlockSpec((None, rows, dk), lambda h, j, n: (n, 0, h // rep)),
               pl.BlockSpec((None, rows, dk), lambda h, j, n: (n, 0, key_heads + h // rep)),
               pl.BlockSpec((None, rows, bv), lambda h, j, n: (n, 0, 2 * kd // bv + h * (dv // bv) + j))]
    new_state, out = _call(functools.partial(_qkv_kernel, rows=rows, scale=dk**-0.5, eps=eps), rows_in, state,
                           rows, bv, out_dtype, bs, interpret, "gated_delta_recurrent_qkv")(
        n[:, None], state.astype(jnp.float32), qkv, qkv, qkv, g, beta)
    return new_state, out[:, :t]


def qkv_reference(state, qkv, g, beta, count=None, *, key_heads: int, eps: float = 1e-6, out_dtype=jnp.float32):
    """`recurrent_qkv` in plain jax.numpy: `split_qkv`, then `reference`."""
    q, k, v = split_qkv(qkv, key_heads, state.shape[2], state.shape[1], eps=eps)
    new_state, out = reference(state, q, k, v, g, beta, count)
    return new_state, out.astype(out_dtype)


def check_rows(state, q, k, v, g, beta, count=None):
    """Raise naming the value whose shape does not fit state [B, Hv, Dk, Dv] (the chunked kernel's check)."""
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


def reference(state, q, k, v, g, beta, count=None) -> tuple[jax.Array, jax.Array]:
    """Plain jax.numpy: `recurrent_reference` (the same step, row by row).

    Rows at or past a lane's count: the state is untouched and the output is zero, as in the kernel."""
    new_state, out = recurrent_reference(state, q, k, v, g, beta, count)
    t = q.shape[1]
    n = jnp.full((q.shape[0],), t, jnp.int32) if count is None else count
    return new_state, jnp.where((jnp.arange(t)[None, :] < n[:, None])[..., None, None], out, 0.0)


# --- The recurrence in plain jax.numpy (what the model runs off the GPU, and replay's arithmetic) ---
# State S [B, Hv, Dk, Dv] is f32. One step at a token with q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv]:
# S <- S * exp(g); S <- S + k (x) beta * (v - k.S); o = q.S. Plain decoding, verify rows and replay all use
# `step`, so a row's output never depends on how many rows were verified with it.


def step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
         beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One recurrent step; returns (new state, output [B, Hv, Dv])."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.sum(state * k[..., :, None], axis=-2)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.sum(state * q[..., :, None], axis=-2)
    return state, out


def split_qkv(qkv: jax.Array, key_heads: int, dk: int, hv: int, *, eps: float = 1e-6, l2_norm=None):
    """The step inputs from the conv output qkv [B, T, 2 Hk Dk + Hv Dv]: q, k L2-normalised (by `l2_norm(a, eps)`,
    default the plain `row_norm.reference`; q scaled by Dk^-1/2) and repeated to the value heads, v; all f32
    [B, T, Hv, D]."""
    norm = l2_norm or (lambda a, eps: rn.reference(a, kind="l2", eps=eps))
    b, t, _ = qkv.shape
    kd = key_heads * dk
    q = qkv[..., :kd].reshape(b, t, key_heads, dk).astype(jnp.float32)
    k = qkv[..., kd : 2 * kd].reshape(b, t, key_heads, dk).astype(jnp.float32)
    v = qkv[..., 2 * kd :].reshape(b, t, hv, -1).astype(jnp.float32)
    rep = hv // key_heads
    q = jnp.repeat(norm(q, eps), rep, axis=2) * (dk**-0.5)
    k = jnp.repeat(norm(k, eps), rep, axis=2)
    return q, k, v


def recurrent_reference(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        count: jax.Array | None = None, *, gpu: bool = False) -> tuple[jax.Array, jax.Array]:
    """Scan `step` over rows (axis 1 of q, k, v [B, T, Hv, D] and g, beta [B, T, Hv]).

    With `count` [B], only each lane's first count rows update the state (replay after acceptance).
    Lanes run one at a time (fixed shapes, `fenced.fenced_map`), so a lane's arithmetic never depends on how many
    share the call.
    """
    b, t = q.shape[:2]
    n = jnp.full((b,), t, jnp.int32) if count is None else count
    return fenced.fenced_map(lambda xs: _lane_recurrent(*xs, gpu=gpu), (state, q, k, v, g, beta, n), gpu=gpu)


def _lane_recurrent(state, q, k, v, g, beta, count, *, gpu: bool):
    """One lane: `step` over its first `count` rows; on the CPU a loop XLA cannot inline."""
    t = q.shape[0]
    if gpu and t == 1:  # never a one-trip loop (XLA would inline and fuse it; see `fenced`)
        state, out = _lane_recurrent(state, *(jnp.concatenate([a, a]) for a in (q, k, v, g, beta)),
                                     jnp.minimum(count, 1), gpu=gpu)
        return state, out[:1]

    def body(i, carry):
        s, out = carry
        s_new, o = step(s[None], *(jax.lax.dynamic_index_in_dim(a, i, keepdims=True) for a in (q, k, v, g, beta)))
        s = jnp.where(i < count, s_new[0], s)
        return s, jax.lax.dynamic_update_index_in_dim(out, o[0], i, 0)

    out = jnp.zeros((t, *v.shape[1:]), jnp.float32)
    trips = t if gpu else jnp.minimum(fenced.opaque_count(count, gpu=False), t)
    return jax.lax.fori_loop(0, trips, body, (state, out))
