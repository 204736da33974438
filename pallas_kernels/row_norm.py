"""Pallas GPU (Triton) row norms for lane rounds: RMSNorm (plain, Qwen3.5's 1 + w, gated by silu(z)) and L2.

Why a kernel: on the reference path a lane round normalises rows in fixed tiles inside a loop, so a row's
reduction never sees how many rows share the call; on the GPU that loop costs several launches per norm
(a decode step of the dense 27B has ~350 of them). Here one program normalises one row with the same code
whatever M is: row-invariant by construction, one launch per norm.

A fused residual step (the matmul's K-split partials summed, added and normalised in this kernel's launch) was
measured slower on the H200 than XLA's sum and add plus this kernel at every split (one program a row reads all
partials on one SM; docs/benchmarks.md, 2026-12-04 eighth run) and removed; `tfjax.ops.add_norm` does the sum and add.

Triton blocks are powers of two, so a row of D values is read as D's binary pieces (576 = 512 + 64,
5120 = 4096 + 1024): the sum of squares adds the pieces in a fixed order, then each piece is scaled and
written. Arithmetic mirrors the reference formulas below (f32 statistics, the casts where they cast).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

KINDS = ("rms", "rms_offset", "gated", "l2")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """One row per program; warps by row length (never by M, which keeps rows invariant)."""

    num_warps: int = 0  # 0: 1 warp up to 512 values, 4 above

    def warps(self, d: int) -> int:
        return self.num_warps or (1 if d <= 512 else 4)


def pieces(d: int, cap: int = 0) -> tuple[tuple[int, int], ...]:
    """(offset, size) power-of-two pieces covering [0, d), largest first (none over `cap`, a power of 2, if set)."""
    out, off = [], 0
    while cap and d - off > cap:
        out.append((off, cap))
        off += cap
    rest = d - off
    for bit in reversed(range(rest.bit_length())):
        if rest >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return tuple(out)


def _normalised(xs, ws, zs, *, kind: str, eps: float, d: int, dtype) -> list:
    """The norm of a row given as its pieces (with the weight's and gate's pieces): the outputs, piece by piece."""
    ss = jnp.float32(0.0)
    for x in xs:
        xf = x.astype(jnp.float32)
        ss = ss + jnp.sum(xf * xf)
    denom = jnp.sqrt(ss + eps) if kind == "l2" else jnp.sqrt(ss / d + eps)
    out = []
    for x, w, z in zip(xs, ws, zs, strict=True):
        xf = x.astype(jnp.float32) / denom
        if kind == "l2":
            y = xf.astype(dtype)
        elif kind == "rms_offset":
            y = (xf * (1.0 + w.astype(jnp.float32))).astype(dtype)
        else:  # weight times the normalised row in the row's dtype, as the reference rounds it
            wx = jnp.result_type(w.dtype, x.dtype)
            y = (w.astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)).astype(wx)
            if kind == "gated":
                zf = z.astype(jnp.float32)
                y = (y.astype(jnp.float32) * (zf * jax.nn.sigmoid(zf))).astype(dtype)
            else:
                y = y.astype(dtype)
        out.append(y)
    return out


def _row_norm_kernel(*refs, kind: str, eps: float, d: int):
    # x_ref [D]; w_ref [D] (not for l2); z_ref [D] (gated only); o_ref [D]
    x_ref, o_ref = refs[0], refs[-1]
    w_ref = refs[1] if kind != "l2" else None
    z_ref = refs[2] if kind == "gated" else None
    parts = pieces(d)
    # every load first, each piece once: the weight's and gate's reads overlap the row's (one DRAM wait, not three)
    xs = [x_ref[pl.ds(off, size)] for off, size in parts]
    ws = [w_ref[pl.ds(off, size)] for off, size in parts] if w_ref is not None else [None] * len(parts)
    zs = [z_ref[pl.ds(off, size)] for off, size in parts] if z_ref is not None else [None] * len(parts)
    for (off, size), y in zip(parts, _normalised(xs, ws, zs, kind=kind, eps=eps, d=d, dtype=o_ref.dtype),
                              strict=True):
        o_ref[pl.ds(off, size)] = y


def _check(x, weight, z, kind):
    if kind not in KINDS:
        raise ValueError(f"{kind=} must be one of {KINDS}")
    if x.ndim != 2:
        raise ValueError(f"want rows x [M, D], got {x.shape=}")
    if (kind == "l2") != (weight is None):
        raise ValueError(f"{kind=} {'takes no' if kind == 'l2' else 'needs a'} weight")
    if weight is not None and weight.shape != (x.shape[1],):
        raise ValueError(f"{weight.shape=} must be ({x.shape[1]},)")
    if (kind == "gated") != (z is not None):
        raise ValueError(f"{kind=} {'needs' if kind == 'gated' else 'takes no'} gate z")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"{z.shape=} must equal {x.shape=}")


@functools.partial(jax.jit, static_argnames=("kind", "eps", "block_sizes", "interpret"))
def row_norm(x: jax.Array, weight: jax.Array | None = None, z: jax.Array | None = None, *, kind: str, eps: float,
             block_sizes: BlockSizes = BlockSizes(), interpret: bool = False) -> jax.Array:
    """Normalise each row of x [M, D] (see `reference` for each kind); out [M, D] in x's dtype."""
    _check(x, weight, z, kind)
    m, d = x.shape
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    whole = pl.BlockSpec((d,), lambda i: (0,))
    args = [x] + ([weight] if weight is not None else []) + ([z] if z is not None else [])
    specs = [row] + ([whole] if weight is not None else []) + ([row] if z is not None else [])
    return pl.pallas_call(
        functools.partial(_row_norm_kernel, kind=kind, eps=float(eps), d=d),
        grid=(m,),
        in_specs=specs,
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct((m, d), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.warps(d), num_stages=1),
        interpret=interpret,
        name=f"row_norm_{kind}",
    )(*args)


def reference(x: jax.Array, weight: jax.Array | None = None, z: jax.Array | None = None, *, kind: str,
              eps: float) -> jax.Array:
    """The models' norms in plain jax.numpy (statistics in f32)."""
    xf = x.astype(jnp.float32)
    if kind == "l2":
        return (xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    xf = xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if kind == "rms_offset":
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    y = weight * xf.astype(x.dtype)
    if kind == "gated":
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    return y.astype(x.dtype)
