"""The one dispatch point for heavy ops: a Pallas kernel on GPU, the jax.numpy reference elsewhere.

Which one runs is a frozen `Kernels` config, a model's static attribute (part of its graphdef, so of every jitted
entry point's compile key: a change recompiles instead of reusing a trace). A model's forward makes its `Kernels`
the active one for the ops it traces (`using`); nothing here reads the environment while tracing.

Row invariance: on the reference path a matmul over "rows" is computed in fixed tiles of rows
(`pallas_kernels.fenced`), so a row's result depends only on its own values and the weight's shape, never on how
many rows share the call or where it sits among them. Every kernel is row-invariant by construction.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp

from pallas_kernels import attention as pk
from pallas_kernels import attention_mgpu as mgpu_attn
from pallas_kernels import causal_conv as cc
from pallas_kernels import fenced, moe, qmatmul_mgpu, quant
from pallas_kernels import flash_attention as fa
from pallas_kernels import gated_delta as gdk
from pallas_kernels import gated_delta_chunked as gdc
from pallas_kernels import matmul as mm
from pallas_kernels import qmatmul as qk
from pallas_kernels import row_norm as rn
from pallas_kernels.attention import KVPages, gather_pages  # noqa: F401  (the models' cache pages)

MAX_TP = 8  # the largest degree served (`tfjax.sharding`): fixed blocks and partials are counted from it
KERNEL_MAX_ROWS = 64  # prompt rows up to which a 4-bit product takes a Triton kernel (XLA's dot beyond)
# Prompt rows up to which a packed-pair product takes the Mosaic kernel: a dense27 prompt call (16 layers, H100)
# is 11.6 ms at 128 rows and 19.1 at 256 on it against 27.0 and 29.4 on XLA's dequantize-then-dot (docs/benchmarks.md)
MOSAIC_MAX_ROWS = 256


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation choices, one field per real choice; the defaults are the measured winners
    (docs/benchmarks.md).

    pallas: the Pallas kernels (a GPU, or the interpreter in tests) where they serve the shape, else the jax.numpy
        references; losing kernel variants were deleted, so this is the one switch for the GPU path.
    delta_chunked: prompt chunks' DeltaNet through the chunked Pallas kernel (two launches a layer) instead of
        XLA's scan over chunks; experimental, off until a GPU shows it wins
        (`scripts/bench_graph.py --sections base,delta_prompt,prefill`).
    """

    pallas: bool = False
    delta_chunked: bool = False

    @classmethod
    def default(cls) -> Kernels:
        """Kernels on a GPU backend, references elsewhere; `TFJAX_KERNELS=reference|kernel` forces either (read once,
        when this module loads)."""
        if _FORCE not in ("auto", "kernel", "reference"):
            raise ValueError(f"TFJAX_KERNELS must be auto, kernel or reference, got {_FORCE!r}")
        if _FORCE == "auto":
            return cls(pallas=jax.default_backend() == "gpu")
        return cls(pallas=_FORCE == "kernel")


_FORCE = os.environ.get("TFJAX_KERNELS", "auto")
REFERENCE = Kernels(pallas=False)
PALLAS = Kernels(pallas=True)
_ACTIVE: contextvars.ContextVar[Kernels | None] = contextvars.ContextVar("tfjax_kernels", default=None)
_MESH: contextvars.ContextVar = contextvars.ContextVar("tfjax_mesh", default=None)
_LANES: contextvars.ContextVar[bool] = contextvars.ContextVar("tfjax_lanes", default=False)
_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("tfjax_training", default=False)
MODEL_AXIS = "model"  # the mesh axis of tensor parallelism (`tfjax.sharding`)
DATA_AXIS = "data"  # the mesh axis the lanes split over


def active() -> Kernels:
    """The Kernels of the forward being traced (`using`); `Kernels.default()` outside one."""
    k = _ACTIVE.get()
    return Kernels.default() if k is None else k


@contextlib.contextmanager
def using(kernels: Kernels):
    """Make `kernels` the active choice for the ops traced inside (a model's forward: `CausalLM.__call__`)."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"want an ops.Kernels, got {kernels!r}")
    token = _ACTIVE.set(kernels)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh():
    """The `jax.sharding.Mesh` of the forward being traced (`using_mesh`), None on one device."""
    return _MESH.get()


@contextlib.contextmanager
def using_mesh(mesh):
    """Make `mesh` (a model's static `mesh`, or None) the one its row-parallel products shard over."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


@contextlib.contextmanager
def lanes_over_data(split: bool):
    """Inside, activations' leading axis is the lanes (a lane round's rows): the ops' `shard_map`s split it over the
    mesh's `data` axis where dp divides it, so each device computes only its own lanes (rows are tile-invariant and
    lanes independent, so a lane's arithmetic is the same as on one device); outside, lanes are whole everywhere."""
    token = _LANES.set(split)
    try:
        yield
    finally:
        _LANES.reset(token)


def _lanes(a: jax.Array) -> bool:
    """Whether `a`'s leading axis (its lanes) splits over `data` in the ops' `shard_map`s (`lanes_over_data`)."""
    mesh = active_mesh()
    dp = 1 if mesh is None else dict(mesh.shape).get(DATA_AXIS, 1)
    return _LANES.get() and dp > 1 and a.ndim > 0 and a.shape[0] % dp == 0


def own_kernels(method):
    """A module method traced with its module's `kernels` attribute active (a drafter's entry points)."""

    @functools.wraps(method)
    def traced(self, *args, **kwargs):
        with using(self.kernels):
            return method(self, *args, **kwargs)

    return traced


def _gpu() -> bool:
    return active().pallas


def norm_tiles(rows: bool) -> bool:
    """Whether a model's RMSNorm runs in fixed row tiles: lane-round rows, and every row on the reference path (the
    CPU's), where XLA sums a small [M, D] (f32, under ~4k elements) in another order than a large one, so a prompt
    row's bits would depend on the rows of its call (docs/prefix_cache.md "Resuming at a page"); never in `training`."""
    return rows or not (_gpu() or _TRAINING.get())


@contextlib.contextmanager
def training():
    """Trace a forward to differentiate (a drafter's training loss): prompt norms in one reduction, since the row
    tiles' loops have dynamic bounds that reverse-mode autodiff refuses; row invariance is an inference property."""
    token = _TRAINING.set(True)
    try:
        yield
    finally:
        _TRAINING.reset(token)


# --- row-invariant loops (`pallas_kernels.fenced`) with the active choice ---


def opaque_count(n: jax.Array | int) -> jax.Array:
    """A loop bound XLA cannot fold on the reference path; the plain value with kernels."""
    return fenced.opaque_count(n, gpu=_gpu())


def fenced_map(fn, xs):
    """`lax.map` whose single iteration XLA never inlines (`fenced.fenced_map`)."""
    return fenced.fenced_map(fn, xs, gpu=_gpu())


def row_tiled(fn, x: jax.Array, tile: int | None = None) -> jax.Array:
    """Apply fn (rows [tile, in] -> [tile, out]) over fixed row tiles, so each row's arithmetic is fixed."""
    return fenced.row_tiled(fn, x, gpu=_gpu(), tile=tile)


def rowwise(fn, x: jax.Array, rows: bool, heads: int | None = None) -> jax.Array:
    """fn over the last axis; with `rows` or under a mesh, in fixed row tiles (reductions never see M, nor how many
    heads a device holds). Under a mesh, with `heads` (the axis of x's heads, split over `model` where the degree
    divides them) each device tiles only its own heads' rows inside `shard_map` (no collective); else the rows are
    gathered whole first, so XLA's partitioner never splits a tile."""
    mesh = active_mesh()
    tiled = lambda x: fenced.rowwise(fn, x, rows or mesh is not None, gpu=_gpu())  # noqa: E731
    if mesh is None:
        return tiled(x)
    if heads is not None and _splits(x.shape[heads]):
        return heads_per_shard(lambda x: (tiled(x),), [x], [heads], [heads])[0]
    return whole(tiled, x, lanes=True)


def _sharded(mesh) -> bool:
    return mesh is not None and mesh.size > 1


def _splits(n: int) -> bool:
    """Whether n heads (or fixed blocks) split over the active mesh's `model` axis: a mesh of several devices whose
    degree divides n."""
    mesh = active_mesh()
    return _sharded(mesh) and n % mesh.shape[MODEL_AXIS] == 0


def fixed_blocks(n: int) -> int:
    """The count of fixed blocks n is cut into whatever the degree: `MAX_TP`, halved until it divides n (every degree
    that divides n divides it too)."""
    p = MAX_TP
    while p > 1 and n % p:
        p //= 2
    return p


def _spec(nd: int, axis: int | None, lanes: int | None = None) -> jax.sharding.PartitionSpec:
    """The spec of an array split over `model` at `axis` (None: whole) and over `data` at `lanes` (None: whole)."""
    return jax.sharding.PartitionSpec(*[MODEL_AXIS if i == axis else DATA_AXIS if i == lanes else None
                                        for i in range(nd)])


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` manual over every mesh axis: the arrays split over `model`, and over `data` only by their
    lanes (`lanes_over_data`: each device its own lanes' rows in whole row tiles), so XLA's partitioner never splits
    a row tile or a head's lanes over `data` behind our back (its arithmetic would follow the device's share of the
    rows: a dot over 4 rows, or an exp over a handful of elements, rounds differently)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(mesh.axis_names),
                         check_vma=False)


def whole(fn, *args, lanes: bool = False):
    """fn(*args) with every array (args may be pytrees) whole on every device (the same arithmetic as one device)
    under a mesh; with `lanes` (fn rowwise over arrays whose leading axis is the lanes) split by lanes over `data`
    where `lanes_over_data` says so."""
    mesh = active_mesh()
    if not _sharded(mesh):
        return fn(*args)
    out = jax.eval_shape(fn, *args)
    split = lanes and all(_lanes(a) for a in jax.tree.leaves(args))
    spec = lambda a: _spec(a.ndim, None, 0 if split else None)  # noqa: E731
    return _shard_map(fn, mesh, jax.tree.map(spec, args), jax.tree.map(spec, out))(*args)


def heads_per_shard(fn, args: list, axes: list, out_axes: list, lanes: list | None = None,
                    out_ndim: list | None = None) -> tuple:
    """fn(*args) -> a tuple of arrays, on each device's own heads inside `shard_map` (no collective): each arg split
    over `model` at `axes[i]` (None: whole), each output at `out_axes[i]`; over its own lanes too (the leading axis
    of the args `lanes` marks, default all) where `lanes_over_data` splits them; `out_ndim`: the outputs' ranks, for
    fn that only traces inside `shard_map` (a collective). fn itself where no mesh splits.
    For fn whose arithmetic for a head never depends on how many heads share the call (a loop over heads, a kernel
    with one head a program, fixed row tiles), so TP=N computes what TP=1 does."""
    mesh = active_mesh()
    if not _sharded(mesh):
        return fn(*args)
    lanes = [True] * len(args) if lanes is None else lanes
    out_nd = out_ndim or [o.ndim for o in jax.eval_shape(fn, *args)]
    ln = 0 if all(_lanes(a) for a, is_lane in zip(args, lanes, strict=True) if is_lane) else None
    in_specs = tuple(_spec(a.ndim, ax, ln if is_lane else None) for a, ax, is_lane in zip(args, axes, lanes,
                                                                                           strict=True))
    return _shard_map(fn, mesh, in_specs, tuple(_spec(n, ax, ln) for n, ax in zip(out_nd, out_axes, strict=True)))(
        *args)


def per_head(fn, args: list, axes: list, out_axes: list):
    """fn over one head at a time (each arg with a size-1 head axis at `axes[i]`; None: passed whole), a fenced loop
    whose iteration is the same whatever the head count, so a head's arithmetic never depends on how many heads a
    device holds (XLA's reductions round differently at other shapes). Under a mesh each device loops over its own
    heads inside `shard_map` (no collective), and over its own lanes (every arg's leading axis) where
    `lanes_over_data` splits them (`heads_per_shard`). Returns fn's outputs with their head axes at `out_axes`."""
    headed = [i for i, ax in enumerate(axes) if ax is not None]

    def local(*xs):
        stacked = tuple(jnp.moveaxis(xs[i], axes[i], 0) for i in headed)

        def one(hs):
            full = list(xs)
            for i, h in zip(headed, hs, strict=True):
                full[i] = jnp.expand_dims(h, axes[i])
            return tuple(jnp.squeeze(o, ax) for o, ax in zip(fn(*full), out_axes, strict=True))

        return tuple(jnp.moveaxis(o, 0, ax) for o, ax in zip(fenced_map(one, stacked), out_axes, strict=True))

    return heads_per_shard(local, args, axes, out_axes)


# --- norms and conv ---


def row_norm(x: jax.Array, weight: jax.Array | None = None, z: jax.Array | None = None, *, kind: str, eps: float,
             rows: bool = False, heads: int | None = None) -> jax.Array:
    """RMSNorm / gated RMSNorm / L2 norm over the last axis (`pallas_kernels.row_norm` names the kinds).

    Lane-round rows take the one-row-per-program kernel (row-invariant, one launch); elsewhere the reference, in
    fixed row tiles when `rows` (a gate rides beside its row so one loop does both). `heads`: the axis of x's (and
    z's) heads; under a mesh each device normalises its own heads' rows (`rowwise`), no collective."""
    d = x.shape[-1]
    if rows and _gpu():
        flat = (lambda a: None if a is None else a.reshape(-1, d))
        kernel = lambda x, z=None: rn.row_norm(flat(x), weight, flat(z), kind=kind, eps=eps).reshape(x.shape)  # noqa: E731
        if active_mesh() is None:
            return kernel(x, z)
        # inside `shard_map`: each device its own lanes (one row a program, so a row's bits never depend on its company)
        xs = [x] if z is None else [x, z]
        if heads is not None and _splits(x.shape[heads]):  # and its own heads
            return heads_per_shard(lambda *a: (kernel(*a),), xs, [heads] * len(xs), [heads])[0]
        return whole(kernel, *xs, lanes=True)
    if z is None:
        return rowwise(lambda r: rn.reference(r, weight, kind=kind, eps=eps), x, rows, heads)
    xz = jnp.concatenate([x, z.astype(x.dtype)], axis=-1)
    return rowwise(lambda r: rn.reference(r[..., :d], weight, r[..., d:], kind=kind, eps=eps), xz, rows, heads)


def add_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, *, kind: str, eps: float,
             rows: bool = False) -> tuple[jax.Array, jax.Array]:
    """The residual stream's step: x + the update given as partial sums parts [S, ..., D] (`qmatmul(parts=True)`),
    and its RMSNorm; returns both: the sum in order and the add through XLA (one fusion that reads the partials
    with many blocks), then `row_norm`."""
    nx = x + sum_parts(parts).astype(x.dtype)  # fixed order, elementwise: the same for every row
    return nx, row_norm(nx, weight, kind=kind, eps=eps, rows=rows)


def conv_silu(taps: jax.Array, weight: jax.Array, *, rows: bool = False) -> jax.Array:
    """DeltaNet's depthwise causal conv + silu: taps [..., K, C], weight [C, K] -> [..., C]; the reference, in fixed
    row tiles when `rows` (with kernels, lane-round rows take `conv_silu_window` instead: `delta_fused`).

    Under a mesh, in `fixed_blocks(C)` channel blocks, one loop iteration each (row tiles inside), every device its
    own blocks (the channels of its in_proj_qkv columns and conv1d rows, split over `model`; no collective): a
    channel's arithmetic is the same block-shaped iteration at every degree."""
    *lead, k, c = taps.shape
    if active_mesh() is None:
        return rowwise(lambda r: cc.reference(r.reshape(*r.shape[:-1], k, c), weight), taps.reshape(*lead, k * c),
                       rows)
    nb = fixed_blocks(c)

    def local(taps, weight):  # taps [..., K, C/tp], weight [C/tp, K] -> [..., C/tp]
        n, cb = nb * taps.shape[-1] // c, c // nb
        tb = jnp.moveaxis(taps.reshape(*taps.shape[:-1], n, cb), -2, 0)  # [n, ..., K, cb]
        out = fenced_map(lambda a: fenced.rowwise(lambda r: cc.reference(r.reshape(*r.shape[:-1], k, cb), a[1]),
                                                  a[0].reshape(*a[0].shape[:-2], k * cb), True, gpu=_gpu()),
                         (tb, weight.reshape(n, cb, k)))  # [n, ..., cb]
        return (jnp.moveaxis(out, 0, -2).reshape(*taps.shape[:-2], n * cb),)

    if not _splits(nb):  # every block on every device (the same iterations)
        return heads_per_shard(local, [taps, weight], [None, None], [None], [True, False])[0]
    return heads_per_shard(local, [taps, weight], [taps.ndim - 1, 0], [taps.ndim - 2], [True, False])[0]


# --- Gated DeltaNet ---


def delta_fused() -> bool:
    """Whether lane-round DeltaNet rows take the two fused kernels (`conv_silu_window`, then `recurrent_qkv`: conv
    tail, taps, norms, head repeats and casts inside them), which beat the separate conv, norms and recurrence (H200,
    dense27 decode 9.22 against 9.66 ms a step; the separate kernels were deleted): with kernels, always."""
    return _gpu()


def conv_silu_window(tail: jax.Array, rows: jax.Array, weight: jax.Array, count: jax.Array):
    """The fused conv of lane-round rows [B, T, C] after the tail [B, K-1, C]: (conv out [B, T, C], the next tail).

    Under a mesh each device runs the kernel on its own channels (tail, rows and weight split over `model`, no
    collective), in programs of a channel block fixed by C (a divisor of its `fixed_blocks`), so a channel's program
    is the same at every degree."""
    if active_mesh() is None:
        return cc.conv_silu_window(tail, rows, weight, count)
    c = rows.shape[-1]
    bs = cc.BlockSizes(channels=math.gcd(cc.BlockSizes.channels, c // fixed_blocks(c)))
    kernel = lambda *a: cc.conv_silu_window(*a, block_sizes=bs)  # noqa: E731
    split = 2 if _splits(fixed_blocks(c)) else None
    return heads_per_shard(kernel, [tail, rows, weight, count], [split, split, None if split is None else 0, None],
                           [split, split],
                           [True, True, False, True])


def split_qkv(qkv: jax.Array, key_heads: int, dk: int, hv: int, *, rows: bool = False, eps: float = 1e-6):
    """The recurrent step's q, k, v [B, T, Hv, D] from the conv output (`gated_delta.split_qkv`), norms through
    `row_norm`.

    Under a mesh each device builds only its own value heads' q, k, v inside `shard_map` (split over `model`): one
    all-gather brings the conv output's channels whole (its column shards are not head-aligned), then it takes its
    heads' columns, each value head its key head's q and k (normalised after the repeat: one row each, in fixed row
    tiles, so a row's bits never depend on how many heads a device holds)."""
    mesh = active_mesh()
    if mesh is None:
        return gdk.split_qkv(qkv, key_heads, dk, hv, eps=eps,
                             l2_norm=lambda a, eps: row_norm(a, kind="l2", eps=eps, rows=rows))
    b, t, c = qkv.shape
    kd, rep = key_heads * dk, hv // key_heads
    tp = mesh.shape[MODEL_AXIS] if _splits(hv) and _splits(c) else 1
    norm = lambda a: fenced.rowwise(lambda r: rn.reference(r, kind="l2", eps=eps), a, True, gpu=_gpu())  # noqa: E731

    def local(qkv):  # qkv [B', T, C/tp] -> q, k [B', T, Hv/tp, Dk], v [B', T, Hv/tp, Dv]: this device's value heads
        if tp > 1:
            qkv = jax.lax.all_gather(qkv, MODEL_AXIS, axis=2, tiled=True)  # the one collective
        first = jax.lax.axis_index(MODEL_AXIS) * (hv // tp) if tp > 1 else 0
        heads = first + jnp.arange(hv // tp)
        lb = qkv.shape[0]
        q, k = (jnp.take(qkv[..., i * kd:(i + 1) * kd].reshape(lb, t, key_heads, dk), heads // rep, axis=2)
                .astype(jnp.float32) for i in (0, 1))
        v = jax.lax.dynamic_slice_in_dim(qkv[..., 2 * kd:].reshape(lb, t, hv, -1), first, hv // tp, axis=2)
        return norm(q) * (dk**-0.5), norm(k), v.astype(jnp.float32)

    split = 2 if tp > 1 else None
    return heads_per_shard(local, [qkv], [split], [split] * 3, out_ndim=[4] * 3)


def recurrent(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              count: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The recurrent step over split rows: the reference (with kernels, lane-round rows take `recurrent_qkv`).

    Rows at or past a lane's `count` leave its state alone; their outputs are not to be read.
    """
    if active_mesh() is not None:  # one head at a time: the same arithmetic at every TP degree
        if count is None:
            return per_head(lambda *a: gdk.recurrent_reference(*a, None, gpu=_gpu()), [state, q, k, v, g, beta],
                            [1, 2, 2, 2, 2, 2], [1, 2])
        return per_head(lambda *a: gdk.recurrent_reference(*a, gpu=_gpu()), [state, q, k, v, g, beta, count],
                        [1, 2, 2, 2, 2, 2, None], [1, 2])
    return gdk.recurrent_reference(state, q, k, v, g, beta, count, gpu=_gpu())


def recurrent_qkv(state: jax.Array, qkv: jax.Array, g: jax.Array, beta: jax.Array, count: jax.Array | None = None,
                  *, out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """`recurrent` fed by the conv output qkv [B, T, 2 Hk Dk + Hv Dv] (q and k normalised on the way): the fused
    kernel with kernels on, else `split_qkv` then the reference; out [B, T, Hv, Dv] in out_dtype."""
    _, hv, dk, dv = state.shape
    key_heads = (qkv.shape[-1] - hv * dv) // (2 * dk)
    if _gpu() and gdk.supports(dk, dv):
        mesh = active_mesh()
        if _sharded(mesh) and key_heads % mesh.shape[MODEL_AXIS] == 0:
            return _recurrent_qkv_per_shard(state, qkv, g, beta, count, key_heads, out_dtype)
        return gdk.recurrent_qkv(state, qkv, g, beta, count, key_heads=key_heads, out_dtype=out_dtype)
    q, k, v = split_qkv(qkv, key_heads, dk, hv, rows=True)  # lane rounds only: row-tiled norms
    state, out = recurrent(state, q, k, v, g, beta, count)
    return state, out.astype(out_dtype)


def _recurrent_qkv_per_shard(state: jax.Array, qkv: jax.Array, g: jax.Array, beta: jax.Array, count: jax.Array | None,
                             key_heads: int, out_dtype) -> tuple[jax.Array, jax.Array]:
    """The fused recurrence kernel on each device's own value heads inside `shard_map` (no collective): the state split
    by value head; qkv [B, T, C] and the gates whole on every device, each device slicing its key heads' q and k
    columns, its value heads' v columns and gates. The kernel runs one (value head, v block, lane) a program, so a
    head's arithmetic is the same whatever heads share the call: TP=N equals TP=1 bit for bit."""
    mesh = active_mesh()
    tp = mesh.shape[MODEL_AXIS]
    b, hv, dk, dv = state.shape
    kh, vh = key_heads // tp, hv // tp  # a device's key and value heads (value head h reads key head h // (hv / Hk))
    count = jnp.full((b,), qkv.shape[1], jnp.int32) if count is None else count.astype(jnp.int32)

    def local(state, qkv, g, beta, count):  # state [B, Hv/tp, Dk, Dv]; qkv [B, T, C], g/beta [B, T, Hv] whole
        i = jax.lax.axis_index(MODEL_AXIS)
        cols = lambda a, start, n: jax.lax.dynamic_slice_in_dim(a, start, n, axis=a.ndim - 1)  # noqa: E731
        mine = jnp.concatenate([cols(qkv, i * kh * dk, kh * dk), cols(qkv, (key_heads + i * kh) * dk, kh * dk),
                                cols(qkv, 2 * key_heads * dk + i * vh * dv, vh * dv)], axis=-1)
        return gdk.recurrent_qkv(state, mine, cols(g, i * vh, vh), cols(beta, i * vh, vh), count, key_heads=kh,
                                 out_dtype=out_dtype)

    ln = 0 if all(_lanes(a) for a in (state, qkv, g, beta, count)) else None
    return _shard_map(local, mesh, (_spec(4, 1, ln), _spec(3, None, ln), _spec(3, None, ln), _spec(3, None, ln),
                                    _spec(1, None, ln)), (_spec(4, 1, ln), _spec(4, 2, ln)))(state, qkv, g, beta, count)


def chunked(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The prompt form: the chunked Pallas kernel when `Kernels.delta_chunked` (experimental), else XLA's scan
    over chunks (`gated_delta_chunked.reference`)."""
    kn = active()
    if kn.pallas and kn.delta_chunked and gdc.supports(k.shape[-1], v.shape[-1]):
        kernel = lambda *a: gdc.chunked(*a, block_sizes=gdc.BlockSizes(chunk=chunk))  # noqa: E731
        if active_mesh() is None:
            return kernel(state, q, k, v, g, beta)
        # each device its own value heads (one head a program: a head's bits are the same at every degree)
        split = 2 if _splits(state.shape[1]) else None
        head = None if split is None else 1
        return heads_per_shard(kernel, [state, q, k, v, g, beta], [head, split, split, split, split, split],
                               [head, split])
    if active_mesh() is not None:  # one head at a time: the same arithmetic at every TP degree
        return per_head(lambda *a: gdc.reference(*a, chunk), [state, q, k, v, g, beta], [1, 2, 2, 2, 2, 2], [1, 2])
    return gdc.reference(state, q, k, v, g, beta, chunk)


# --- attention ---


def mosaic_attention_serves(head_dim: int, page: int, q_dtype, kv_dtype) -> bool:
    """Whether lane-round rows take the Mosaic GPU attention (TMA-fed key tiles; 1.4-1.9x the Triton kernel at
    2k-64k keys, H100): q and pages of one dtype the kernel serves."""
    return q_dtype == kv_dtype and mgpu_attn.supports(head_dim, page, q_dtype)


def paged_attention(q: jax.Array, pages: KVPages, page_table: jax.Array, positions: jax.Array,
                    rows: bool = False, valid: jax.Array | None = None) -> jax.Array:
    """Attention of q rows over a lane's pages.

    With kernels, a prompt chunk takes the causal flash kernel through the lane's table (6-10x the paged kernel on
    the H200); lane-round rows (decode, verify) take the row-invariant Mosaic GPU paged kernel, or the Triton one
    for dtypes and page sizes it lacks (f32, tests); head dims no kernel takes fall back to the reference. A prompt
    chunk's flash kernel and its reference (the CPU's, `paged_prompt_reference`) walk key tiles up to its last row,
    so they read the keys the chunk reaches whatever the table's width (`prompt_reads_its_keys`); a mesh's
    reference gathers them, one head at a time. Under a mesh the kernel runs on each device's own heads
    (`_kernel_per_shard`). `valid` [B]: each lane's real rows (the first ones); the CPU's lane-round rows skip the
    others (zeros), the kernels compute them and nobody reads them.
    """
    if _gpu() and (kernel := _attention_kernel(q, pages, page_table, rows)) is not None:
        return _kernel_per_shard(kernel, q, pages, page_table, positions)
    if rows and not _gpu():  # the CPU: each row reads only the key tiles up to its position
        if active_mesh() is None:
            return pk.paged_rows_reference(q, pages, page_table, positions, valid=valid)
        return _paged_rows_per_head(q, pages, page_table, positions)
    if not rows and active_mesh() is None:  # a prompt chunk no kernel takes: only the key tiles up to its last row
        return pk.paged_prompt_reference(q, pages, page_table, positions)
    k, v = gather_pages(pages, page_table)
    if active_mesh() is not None:  # one q head (with its kv head) at a time: the same arithmetic at every degree
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        return per_head(lambda *a: (pk.attention_reference(*a, positions, rows, gpu=_gpu()),), [q, k, v],
                        [2, 2, 2], [2])[0]
    return pk.attention_reference(q, k, v, positions, rows, gpu=_gpu())


def prompt_reads_its_keys(kernels: Kernels, head_dim: int, mesh) -> bool:
    """Whether a prompt chunk's attention reads only the key tiles up to its last row, so a lane's whole table costs
    no more than the pages it reaches (one program a row count): the flash kernel's head dims, and the reference
    without a mesh."""
    return (kernels.pallas and head_dim in fa.HEAD_DIMS) or mesh is None


def _attention_kernel(q: jax.Array, pages: KVPages, page_table: jax.Array, rows: bool):
    """The kernel serving these shapes as fn(q, k pages, v pages, table, positions) over any share of the heads, or
    None. Its key split is planned from the whole model's KV heads (`pages`), never a device's share, so each head's
    chunks, hence its bits, are the same at every degree."""
    e, page, g = q.shape[-1], pages.k.shape[1], pages.k.shape[2]
    if not rows and e in fa.HEAD_DIMS:
        return fa.flash_attention  # one head a program, through the table: no plan to fix
    if mosaic_attention_serves(e, page, q.dtype, pages.k.dtype):
        per_head = max(1, mgpu_attn.DEFAULT.chunk_programs // g)  # programs a KV head at the whole model's heads

        def mosaic(q, k_pages, v_pages, table, pos):
            if k_pages.shape[2] == g:
                return mgpu_attn.paged_attention(q, k_pages, v_pages, table, pos)
            bs = dataclasses.replace(mgpu_attn.DEFAULT, chunk_programs=per_head * k_pages.shape[2])
            return mgpu_attn.paged_attention(q, k_pages, v_pages, table, pos, block_sizes=bs)

        return mosaic
    if pk.supports(e):
        chunk_k = pk.DEFAULT.chunk_for(page_table.shape[1] * page, g)  # keys a program at the whole model's heads

        def triton(q, k_pages, v_pages, table, pos):
            if k_pages.shape[2] == g:
                return pk.paged_attention(q, k_pages, v_pages, table, pos)
            bs = dataclasses.replace(pk.DEFAULT, chunk_programs=0, chunk_k=chunk_k)
            return pk.paged_attention(q, k_pages, v_pages, table, pos, block_sizes=bs)

        return triton
    return None


def _kernel_per_shard(kernel, q: jax.Array, pages: KVPages, page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """kernel (`_attention_kernel`) on each device's own q heads inside `shard_map` (no collective): KV pages split by
    KV head where the degree divides them; else whole, each device passing the kernel only its heads' KV heads (one,
    where the degree is a multiple of the KV heads; a copy of that head's pages, until the kernels take a KV head
    offset)."""
    mesh = active_mesh()
    if not _sharded(mesh):
        return kernel(q, pages.k, pages.v, page_table, positions)
    tp, h, g = mesh.shape[MODEL_AXIS], q.shape[2], pages.k.shape[2]
    r, kv_split = h // g, g % tp == 0

    def local(q, k, v, table, pos):  # q [B, T, H/tp, E], k/v [n, page, G/tp or G, E]
        if not kv_split:
            first = jax.lax.axis_index(MODEL_AXIS) * q.shape[2]  # this device's first q head
            if tp % g == 0:  # its heads share one KV head
                k, v = (jax.lax.dynamic_slice_in_dim(a, first // r, 1, axis=2) for a in (k, v))
            else:
                kv = (first + jnp.arange(q.shape[2])) // r
                k, v = jnp.take(k, kv, axis=2), jnp.take(v, kv, axis=2)
        return kernel(q, k, v, table, pos)

    kv = _spec(4, 2 if kv_split else None)  # the pages serve every lane: whole over `data`
    ln = 0 if _lanes(q) and _lanes(page_table) and _lanes(positions) else None
    return _shard_map(local, mesh, (_spec(4, 2, ln), kv, kv, _spec(2, None, ln), _spec(2, None, ln)),
                      _spec(4, 2, ln))(q, pages.k, pages.v, page_table, positions)


def _paged_rows_per_head(q: jax.Array, pages: KVPages, page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """Lane-round rows' CPU attention under a mesh: one q head a loop iteration against its KV head
    (`paged_rows_reference(kv_head=)`), each device over its own q heads inside `shard_map` (KV pages by KV head, or
    whole where the degree does not divide them), so a head's arithmetic is the same at every degree."""
    mesh = active_mesh()
    tp, h, g = mesh.shape[MODEL_AXIS], q.shape[2], pages.k.shape[2]
    r, kv_split = h // g, g % tp == 0

    def local(q, k, v, table, pos):  # q [B, T, H/tp, E], k/v [n, page, G/tp or G, E]
        heads = jnp.arange(q.shape[2])  # local q heads; their KV heads among the local pages:
        if not kv_split:  # the pages whole: this device's heads start at its index x H/tp
            heads = heads + jax.lax.axis_index(MODEL_AXIS) * q.shape[2]

        def one(xs):
            qh, kv = xs  # qh [B, T, E]
            return pk.paged_rows_reference(qh[:, :, None], KVPages(k, v), table, pos, kv_head=kv)[:, :, 0]

        return jnp.moveaxis(fenced_map(one, (jnp.moveaxis(q, 2, 0), heads // r)), 0, 2)

    if not _sharded(mesh):
        return local(q, pages.k, pages.v, page_table, positions)
    kv = _spec(4, 2 if kv_split else None)  # the pages serve every lane: whole over `data`
    ln = 0 if _lanes(q) and _lanes(page_table) and _lanes(positions) else None
    return _shard_map(local, mesh, (_spec(4, 2, ln), kv, kv, _spec(2, None, ln), _spec(2, None, ln)),
                      _spec(4, 2, ln))(q, pages.k, pages.v, page_table, positions)


# --- linears ---


def _dot_t(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in].T with f32 accumulation, result in out_dtype (default x.dtype)."""
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def matmul(x: jax.Array, w: jax.Array, *, rows: bool = False, out_dtype=None) -> jax.Array:
    """x [..., in] @ w[out, in].T; `rows` asks for row-invariant arithmetic (lane rounds): the fixed-tile Pallas
    matmul with kernels (one launch; tiles fixed by the weight's shape), else fixed row tiles of XLA dots.
    `out_dtype`: the result's dtype (a row-parallel partial keeps f32), default x.dtype."""
    if rows:
        # any N (the MoE gate's 1) in one launch: a row-tile loop on the GPU would split the round's CUDA graph
        if _gpu() and mm.supports(*w.shape):
            return mm.matmul(x, w).astype(out_dtype or x.dtype)
        return row_tiled(lambda t: _dot_t(t, w, out_dtype), x)
    if not _gpu() and math.prod(x.shape[:-1]) < fenced.ROW_TILE:
        # XLA CPU has no 16-bit product of so few rows: it widens the whole weight to f32 each call (a prompt's
        # last-row logits: 110 ms of SmolLM2's 49k x 576 table); one padded row tile takes the rows' product
        return row_tiled(lambda t: _dot_t(t, w, out_dtype), x)
    return _dot_t(x, w, out_dtype)


def row_parallel(fn, x: jax.Array, weights: list[jax.Array], parts: int) -> jax.Array:
    """A row-parallel product as `parts` fixed K-split partials [parts, ..., out]: fn(x chunk, *weight chunks) over
    chunk c of x's last axis and of each weight's last axis (weight [out, K'], K' a multiple of parts).

    Exact across TP degree by construction: the chunks are fixed by the weight's shape, each is the same loop
    iteration (`fenced_map`) whatever the degree; under a mesh each device computes its own parts / N chunks inside
    `shard_map` (kernels per shard), and one all-gather brings the partials back in chunk order, for the consumer
    to sum in that order (`add_norm`, `sum_parts`), never a psum whose order depends on N."""
    mesh = active_mesh()
    tp = 1 if mesh is None else mesh.shape[MODEL_AXIS]

    def local(x, *ws):  # x [..., K/tp], ws [out, K'/tp] -> [parts/tp, ..., out]
        n = parts // tp
        xs = jnp.moveaxis(x.reshape(*x.shape[:-1], n, x.shape[-1] // n), -2, 0)
        wc = [jnp.moveaxis(w.reshape(w.shape[0], n, w.shape[1] // n), 1, 0) for w in ws]
        return fenced_map(lambda a: fn(a[0], *a[1:]), (xs, *wc))

    if not _sharded(mesh):
        return local(x, *weights)

    def sharded(x, *ws):
        parts = local(x, *ws)
        return parts if tp == 1 else jax.lax.all_gather(parts, MODEL_AXIS, axis=0, tiled=True)  # the one collective

    ln = 0 if _lanes(x) else None
    return _shard_map(sharded, mesh, (_spec(x.ndim, x.ndim - 1, ln), *[_spec(2, 1)] * len(weights)),
                      _spec(x.ndim + 1, None, None if ln is None else 1))(x, *weights)


def column_parallel(fn, x: jax.Array, weights: list[jax.Array], parts: int, shard: bool = True) -> jax.Array:
    """A column-parallel product in `parts` fixed output blocks: fn(x, *weight blocks) -> [..., out / parts] over
    block c of each weight's first axis, concatenated to [..., out].

    The blocks are fixed by the weight's shape and each is the same loop iteration (`fenced_map`), so a column's
    arithmetic never depends on how many columns a device holds (XLA's dot rounds differently at other widths);
    under a mesh (`shard`) each device computes its parts / N blocks inside `shard_map` and keeps them (the output
    split over `model`, no collective)."""
    mesh = active_mesh()
    tp = mesh.shape[MODEL_AXIS] if shard and mesh is not None else 1
    axis = MODEL_AXIS if tp > 1 else None

    def local(x, *ws):  # ws [out/tp, ...] -> [..., out/tp]
        n = parts // tp
        wc = tuple(w.reshape(n, w.shape[0] // n, *w.shape[1:]) for w in ws)
        ys = fenced_map(lambda a: fn(x, *a), wc)  # [n, ..., out/parts]
        return jnp.moveaxis(ys, 0, -2).reshape(*ys.shape[1:-1], n * ys.shape[-1])

    if not _sharded(mesh):
        return local(x, *weights)
    ln = 0 if _lanes(x) else None
    return _shard_map(local, mesh, (_spec(x.ndim, None, ln), *[_spec(w.ndim, 0 if axis else None) for w in weights]),
                      _spec(x.ndim, x.ndim - 1 if axis else None, ln))(x, *weights)


def sum_parts(parts: jax.Array) -> jax.Array:
    """Partial sums [S, ...] added in index order (elementwise: the same for every row and every TP degree)."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def qmatmul_path(n: int, k: int, *, bits: int, group_size: int, layout: str, packed: bool, row_count: int,
                 rows: bool, kernels: Kernels | None = None) -> str:
    """Which implementation `qmatmul` takes for a weight [N, K] in `layout` (what the dispatch decides from shapes
    alone): "mosaic" (packed 4-bit pairs, whole column blocks: the winner), "tiled" (the Triton kernel for the
    kernel and pair layouts it does not serve), "mlx" (the Triton kernel on MLX words), or "reference" (XLA's
    dequantize-then-dot)."""
    kn = kernels or active()
    if not kn.pallas:
        return "reference"
    if layout in ("kernel", "pairs"):
        if packed and qmatmul_mgpu.BlockSizes.serves(n, k, group_size) and (rows or row_count <= MOSAIC_MAX_ROWS):
            return "mosaic"
        return "tiled" if rows or row_count <= KERNEL_MAX_ROWS else "reference"
    if row_count <= KERNEL_MAX_ROWS and qk.supports(n, k, bits, group_size):  # prompts: XLA's dot is faster
        return "mlx"
    return "reference"


def qmatmul(x: jax.Array, weight: jax.Array, scales: jax.Array, biases: jax.Array | None, *, bits: int,
            group_size: int, rows: bool = False, layout: str = "mlx", parts: bool = False,
            out_dtype=None) -> jax.Array:
    """x [..., in] @ dequant(weight)[out, in].T for MLX affine weights, in the MLX, kernel or pair layout.

    Kernel or pair layout (`quant.to_kernel_layout`, `quant.to_pair_layout`): the row-invariant kernels for
    lane-round rows (any count) and for up to `MOSAIC_MAX_ROWS` (Mosaic) or `KERNEL_MAX_ROWS` (Triton) prompt rows
    (`qmatmul_path`); XLA's dequantize-then-dot elsewhere. `biases=None`: `scales` holds both (`quant.pack_scale_bias`).
    `parts`: the product as partial sums [S, ..., out] for the consumer to sum in order (`add_norm`): the Mosaic
    kernel's K-split partials (f32), else the product itself as S = 1. `out_dtype`: the reference path's result
    dtype (default x.dtype; the kernels' results come in x.dtype).
    """
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    done = (lambda y: y[None]) if parts else (lambda y: y)  # one partial sum: the product
    path = qmatmul_path(n, k, bits=bits, group_size=group_size, layout=layout, packed=biases is None,
                        row_count=math.prod(lead), rows=rows)
    if path == "mosaic":
        if parts:
            return qmatmul_mgpu.qmatmul_parts(x, weight, scales)
        return qmatmul_mgpu.qmatmul_pairs(x, weight, scales)
    if path == "tiled":
        bs = qk.TiledBlockSizes.for_layout(n, k, bits, group_size, layout)
        return done(qk.qmatmul_tiled(x, weight, scales, biases, bits=bits, group_size=group_size, block_sizes=bs))
    if path == "mlx":
        y = qk.qmatmul(x.reshape(-1, k), weight, scales, biases, bits=bits, group_size=group_size)
        return done(y.reshape(*lead, y.shape[-1]))
    # XLA's dequantize-then-dot. The barrier makes the dequantization wait for x, so a prompt's forward holds one
    # product's bf16 weight at a time: unordered, the GPU scheduler may dequantize every layer's weights up front
    # (they depend on parameters only): the suspect of a dense27 prompt chunk's 30 GiB temp (issue 28).
    x, weight, scales, biases = jax.lax.optimization_barrier((x, weight, scales, biases))
    if layout in ("kernel", "pairs"):
        if biases is None:
            scales, biases = quant.unpack_scale_bias(scales)
        unpacked = quant.dequantize_kernel_layout if layout == "kernel" else quant.dequantize_pair_layout
        w = unpacked(weight, scales, biases, bits=bits, group_size=group_size, dtype=x.dtype)
    else:
        w = quant.dequantize(weight, scales, biases, bits=bits, group_size=group_size, dtype=x.dtype)
    return done(matmul(x, w, rows=rows, out_dtype=out_dtype))


def _experts_per_shard(kernel, x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple,
                       down: tuple) -> jax.Array:
    """The MoE kernel on each device's own experts inside `shard_map` (the stacks split by expert): a device runs the
    kernel on the (row, slot) pairs of its own experts (the others' expert id is -1: skipped, slot 0); one
    all-gather brings every device's slots, each slot is taken from its expert's device (a select, never a sum
    across devices), and the slots are summed in order 0..k-1 as on one device (`moe.combine`). A pair's arithmetic
    depends only on its row and expert (row invariance), so TP=N equals TP=1 bit for bit."""
    mesh = active_mesh()
    tp, e = mesh.shape[MODEL_AXIS], gate[0].shape[0]
    local_e = e // tp

    def local(x, idx, weights, gate, up, down):  # stacks [E/tp, ...]
        first = jax.lax.axis_index(MODEL_AXIS) * local_e
        mine = (idx >= first) & (idx < first + local_e)
        y = kernel(x, jnp.where(mine, idx - first, -1), weights, gate, up, down, slots=True)
        return jax.lax.all_gather(y, MODEL_AXIS)  # [tp, N, k, D]: other devices' and skipped pairs' slots are 0

    ln = 0 if _lanes(x) and _lanes(idx) and _lanes(weights) else None
    stacks = jax.tree.map(lambda a: _spec(a.ndim, 0), (gate, up, down))
    ys = _shard_map(local, mesh, (_spec(2, None, ln), _spec(2, None, ln), _spec(2, None, ln), *stacks),
                    _spec(4, None, None if ln is None else 1))(x, idx, weights, gate, up, down)
    owner = jnp.maximum(idx, 0) // local_e  # [N, k]: the device holding each slot's expert (skipped: 0 everywhere)
    y = jnp.take_along_axis(ys, owner[None, :, :, None], axis=0)[0]  # [N, k, D]
    return moe.combine(y, x.dtype)


def experts(x: jax.Array, idx: jax.Array, weights: jax.Array, gate: tuple, up: tuple, down: tuple, *,
            bits: int | None, group_size: int = 64, rows: bool = False, live: jax.Array | None = None) -> jax.Array:
    """Routed SwiGLU experts: x [N, D], idx/weights [N, k] -> sum_s weights[:, s] * expert_idx[:, s](x), [N, D].

    `live` [N] bool: rows that are real; the others (a lane round's padding rows, idle lanes) read no expert and
    get 0 (their pairs' expert id becomes -1, which every path skips), while a live row's arithmetic is unchanged.

    gate/up/down are (weight, scales, biases) stacks [E, out, ...] in the MLX layout, or (weight,) dense (`bits`
    is the quantized stacks' width; None when all are dense). Only the chosen experts are read: on GPU the Pallas
    kernels (`pallas_kernels.moe`) for quantized stacks they serve, lane-round `rows` (decode, verify) the K-split
    kernels and prompts the grouped GEMM; elsewhere the reference one row a loop iteration (row-invariant)."""
    d, i = x.shape[-1], gate[0].shape[1]
    mesh = active_mesh()
    if live is not None:
        idx = jnp.where(live[:, None], idx, -1)
    if _gpu() and bits is not None and all(len(s) == 3 for s in (gate, up, down)):
        per_shard = _sharded(mesh) and gate[0].shape[0] % mesh.shape[MODEL_AXIS] == 0
        rows_bs = moe.RowsBlockSizes.for_shapes(d, i, group_size, bits) if rows else None
        if rows and moe.rows_problem(d, i, bits, group_size, rows_bs) is None:  # lane rounds: the K-split kernels
            kernel = functools.partial(moe.moe, bits=bits, group_size=group_size, block_sizes=rows_bs, rows=True)
            # per shard only where the down kernel weighs its slots itself (one K slice): otherwise the one-device
            # program's weight multiply fuses with the slot sum and rounds differently, so whole stacks everywhere
            if per_shard and rows_bs.split_down == 1:
                return _experts_per_shard(kernel, x, idx, weights, gate, up, down)
            return kernel(x, idx, weights, gate, up, down)
        bs = moe.BlockSizes.for_shapes(d, i, group_size)
        if d % bs.block_n == 0 and i % bs.block_n == 0 and d % bs.block_k == 0 and i % bs.block_k == 0:
            kernel = functools.partial(moe.moe, bits=bits, group_size=group_size, block_sizes=bs)
            if per_shard:
                return _experts_per_shard(kernel, x, idx, weights, gate, up, down)
            return kernel(x, idx, weights, gate, up, down)
    # one row a loop iteration: a tile of padding rows would gather and dequantize k experts each for nothing; a row
    # with no expert (not live) skips its iteration's work
    def rowwise_experts(x, idx, weights, gate, up, down):
        def one(t):
            run = lambda t: moe.reference(t[0][None], t[1][None], t[2][None], gate, up, down, bits=bits,  # noqa: E731
                                          group_size=group_size)[0]
            return jax.lax.cond(jnp.any(t[1] >= 0), run, lambda t: jnp.zeros_like(t[0]), t)

        return fenced_map(one, (x, idx, weights))

    if not (_sharded(mesh) and _lanes(x) and _lanes(idx)):
        return rowwise_experts(x, idx, weights, gate, up, down)
    # rows split by lanes over `data`, manual: each device loops over its own rows (left to XLA's partitioner, the
    # loop body's products were split over `data` too and rounded differently); `model` stays automatic (the stacks
    # split by expert, each row reading its chosen experts wherever they lie)
    lanes, stacks = jax.sharding.PartitionSpec(DATA_AXIS), jax.sharding.PartitionSpec()
    specs = jax.tree.map(lambda _: stacks, (gate, up, down))
    return jax.shard_map(rowwise_experts, mesh=mesh, in_specs=(lanes, lanes, lanes, *specs), out_specs=lanes,
                         axis_names={DATA_AXIS}, check_vma=False)(x, idx, weights, gate, up, down)
