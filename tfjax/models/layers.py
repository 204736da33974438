"""Layers shared by every family: norms, (quantized) linears, embeddings, rotary, paged attention, MLP.

Parameter names mirror Hugging Face checkpoint keys (`q_proj.weight`), so loading is a thin mapping.
Shapes: B lanes, T rows per lane, D hidden, H query heads, G kv heads, E head dim, S cache positions.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import int8, ops
from tfjax.config import ModelConfig
from tfjax.ops import KVPages


def dtype_of(config: ModelConfig) -> jnp.dtype:
    return jnp.dtype(config.dtype)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a forward runs: `rows` = lane-round rows (row-invariant, recurrent DeltaNet), else prompt."""

    rows: bool = False
    last_only: bool = False  # logits for each lane's last valid row only
    taps: tuple[int, ...] = ()  # also return these layers' outputs, concatenated (a block drafter's context)


PROMPT = Mode(rows=False, last_only=True)
ROWS = Mode(rows=True)


class RMSNorm(nnx.Module):
    """RMSNorm in f32; `offset` is Qwen3.5's (1 + weight) convention with zero-initialised weight."""

    def __init__(self, dim: int, eps: float, *, offset: bool, dtype, rngs: nnx.Rngs | None = None):
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array, rows: bool = False) -> jax.Array:
        return ops.row_norm(x, self.weight[...], kind=self.kind, eps=self.eps, rows=ops.norm_tiles(rows))

    @property
    def kind(self) -> str:
        return "rms_offset" if self.offset else "rms"

    def add(self, x: jax.Array, parts: jax.Array, rows: bool = False) -> tuple[jax.Array, jax.Array]:
        """The residual x plus an update given as partial sums (`Linear.partials`), and its norm (`ops.add_norm`)."""
        return ops.add_norm(x, parts, self.weight[...], kind=self.kind, eps=self.eps, rows=ops.norm_tiles(rows))


class Linear(nnx.Module):
    """y = x @ W.T (+ b); W [out, in] dense, or MLX affine-quantized (weight/scales/biases).

    `split`, `parts` (static, `tfjax.sharding.plan`): "row" with `parts` fixed K-split partials, "column" with
    `parts` fixed output blocks (split over the mesh) or "blocks" (the same blocks, every device all of them; one
    block for the Linears the plan does not split); `parts` 1 and "row": one product (no mesh)."""

    split, parts = "row", 1

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, quant: tuple[int, int] | None = None,
                 dtype, rngs: nnx.Rngs):
        self.quant = quant
        self.layout = "mlx"  # "kernel"/"pairs" after `use_kernel_layout`, "int8" after `use_int8` (static)
        if quant is None:
            w = jax.random.normal(rngs.params(), (d_out, d_in), jnp.float32) * (1.0 / d_in**0.5)
            self.weight = nnx.Param(w.astype(dtype))
        else:
            bits, group = quant
            self.weight = nnx.Param(jax.random.bits(rngs.params(), (d_out, d_in * bits // 32), jnp.uint32))
            self.scales = nnx.Param(jnp.full((d_out, d_in // group), 0.02 / 2**bits, dtype))
            self.biases = nnx.Param(jnp.full((d_out, d_in // group), -0.01, dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: jax.Array, rows: bool = False) -> jax.Array:
        if self.parts > 1 and self.split == "row":
            return ops.sum_parts(self.partials(x, rows)).astype(x.dtype)
        if self.parts > 1 or self.split == "blocks":
            y = self._blocks(x, rows)
        elif self.layout == "int8":
            y = int8.matmul(x, self.weight[...], self.scales[...])
        elif self.quant is None:
            y = ops.matmul(x, self.weight[...], rows=rows)
        else:
            bits, group = self.quant
            biases = None if self.biases is None else self.biases[...]  # None: packed into scales
            y = ops.qmatmul(x, self.weight[...], self.scales[...], biases, bits=bits,
                            group_size=group, rows=rows, layout=self.layout)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    def partials(self, x: jax.Array, rows: bool = False) -> jax.Array:
        """y as partial sums [S, ..., out] for a consumer that sums them in order (`RMSNorm.add`: with the residual
        add in one XLA fusion): the `parts` fixed K chunks (`ops.row_parallel`, f32, the bias a last partial), else
        the 4-bit kernel's K split; [1, ...] when y comes whole."""
        if self.parts > 1 and self.split == "row":
            return self._chunks(x, rows)
        if self.quant is None or self.bias is not None:
            return self(x, rows)[None]
        bits, group = self.quant
        biases = None if self.biases is None else self.biases[...]
        return ops.qmatmul(x, self.weight[...], self.scales[...], biases, bits=bits, group_size=group, rows=rows,
                           layout=self.layout, parts=True)

    def _weights(self) -> list[jax.Array]:
        if self.layout != "mlx":
            raise ValueError(f"a tensor-parallel Linear needs the MLX layout (chunks in order), got {self.layout!r}")
        return [self.weight[...]] if self.quant is None else [self.weight[...], self.scales[...], self.biases[...]]

    def _product(self, rows: bool, out_dtype=None):
        """fn(x, *weights) of this Linear's kind (dense or quantized), for `ops.row_parallel`/`column_parallel`."""
        if self.quant is None:
            return lambda xc, w: ops.matmul(xc, w, rows=rows, out_dtype=out_dtype)
        bits, group = self.quant
        return lambda xc, w, s, b: ops.qmatmul(xc, w, s, b, bits=bits, group_size=group, rows=rows,
                                               out_dtype=out_dtype).astype(out_dtype or xc.dtype)

    def _blocks(self, x: jax.Array, rows: bool) -> jax.Array:
        return ops.column_parallel(self._product(rows), x, self._weights(), self.parts, self.split == "column")

    def _chunks(self, x: jax.Array, rows: bool) -> jax.Array:
        parts = ops.row_parallel(self._product(rows, jnp.float32), x, self._weights(), self.parts)
        if self.bias is not None:
            bias = jnp.broadcast_to(self.bias[...].astype(jnp.float32), parts.shape[1:])
            parts = jnp.concatenate([parts, bias[None]], axis=0)
        return parts


class Embedding(nnx.Module):
    """Token embedding [V, D], dense or quantized; `attend` reuses it as a tied lm_head."""

    def __init__(self, vocab: int, dim: int, *, quant: tuple[int, int] | None, dtype, rngs: nnx.Rngs):
        self.table = Linear(dim, vocab, quant=quant, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        t = self.table
        if t.layout == "int8":
            return int8.rows_of(jnp.take(t.weight[...], ids, axis=0), jnp.take(t.scales[...], ids)).astype(self.dtype)
        if t.quant is None:
            return jnp.take(t.weight[...], ids, axis=0).astype(self.dtype)
        from tfjax import quant

        bits, group = t.quant
        rows = quant.dequantize(jnp.take(t.weight[...], ids, axis=0), jnp.take(t.scales[...], ids, axis=0),
                                jnp.take(t.biases[...], ids, axis=0), bits=bits, group_size=group,
                                dtype=self.dtype)
        return rows

    def attend(self, x: jax.Array, rows: bool = False) -> jax.Array:
        return self.table(x, rows=rows)


FUSED_ROW_MULTIPLE = 64  # the 4-bit kernels' column block


def concat_linears(parts: list[Linear]) -> Linear | None:
    """One Linear whose output is the parts' outputs side by side (one launch instead of several), padded with
    zero rows to a multiple of `FUSED_ROW_MULTIPLE`, or None when they differ in input size, quantization,
    layout or bias."""
    first = parts[0]
    same = all(p.quant == first.quant and p.layout == first.layout == "mlx" and (p.bias is None) == (first.bias is None)
               and p.weight.shape[1:] == first.weight.shape[1:] for p in parts)
    if not same:
        return None
    rows = sum(int(p.weight.shape[0]) for p in parts)
    pad = -rows % FUSED_ROW_MULTIPLE  # zero rows: whole kernel column blocks (dense27's DeltaNet: 16480 -> 16512)

    def cat(name):
        vals = [getattr(p, name)[...] for p in parts]
        vals += [jnp.zeros((pad, *vals[0].shape[1:]), vals[0].dtype)] if pad else []
        return nnx.Param(jnp.concatenate(vals, axis=0))

    fused = Linear(1, 1, bias=first.bias is not None, dtype=first.weight.dtype, rngs=nnx.Rngs(0))
    fused.quant, fused.weight = first.quant, cat("weight")
    if first.quant is not None:
        fused.scales, fused.biases = cat("scales"), cat("biases")
    if first.bias is not None:
        fused.bias = cat("bias")
    fused.splits = tuple(int(p.weight.shape[0]) for p in parts)
    return fused


def split_outputs(y: jax.Array, splits: tuple[int, ...]) -> list[jax.Array]:
    """A fused Linear's output cut back into its parts' outputs."""
    return jnp.split(y, list(itertools.accumulate(splits)), axis=-1)[: len(splits)]  # the last piece: padding


def fuse_projections(model: nnx.Module) -> int:
    """Fuse sibling projections that read the same input (q/k/v, gate/up, DeltaNet's four in-projections) into
    one Linear each, in place; call after loading and before `use_kernel_layout`. Returns how many fused."""
    done = 0
    for _, m in nnx.iter_modules(model):
        names = getattr(m, "FUSABLE", None)
        if names is None or getattr(m, "fused", None) is not None:
            continue
        fused = concat_linears([getattr(m, n) for n in names])
        if fused is not None:
            m.fused = fused
            for n in names:
                setattr(m, n, None)
            done += 1
    return done


def projections(m: nnx.Module, x: jax.Array, rows: bool) -> list[jax.Array]:
    """The outputs of m's FUSABLE projections of x: one fused call when fused, else one call each."""
    if getattr(m, "fused", None) is not None:
        return split_outputs(m.fused(x, rows), m.fused.splits)
    return [getattr(m, n)(x, rows) for n in m.FUSABLE]


def serving_layout(model: nnx.Module) -> tuple[int, int]:
    """The GPU serving layout, in place, once after loading: fused projections (fewer launches), then the kernel
    packing (both measured faster on the GPU). Returns (projection groups fused, linears repacked)."""
    return fuse_projections(model), use_kernel_layout(model)


def use_int8(model: nnx.Module) -> int:
    """Requantize every dense Linear (the embedding table and lm_head included) to int8 per output channel, in
    place, once after loading (`quantize="int8"`, `tfjax.int8`); MLX-quantized ones keep their format. Returns
    how many were converted."""
    done = 0
    for _, m in nnx.iter_modules(model):
        if not isinstance(m, Linear) or m.quant is not None or m.layout != "mlx":
            continue
        if m.parts > 1 or m.split != "row":
            raise ValueError("quantize='int8' does not run tensor parallel yet: load with tp=None")
        codes, scales = int8.quantize_channels(m.weight[...])
        m.weight, m.scales, m.layout = nnx.Param(codes), nnx.Param(scales), "int8"
        done += 1
    return done


def use_kernel_layout(model: nnx.Module) -> int:
    """Repack every quantized Linear (not embedding tables) for the kernels once, in place: 4-bit ones into
    `quant.to_pair_layout` (the bf16 pair unpack beat the kernel layout's: dense27 decode 31.5 -> 38.1 tok/s on the
    H200), the rest into `quant.to_kernel_layout`.

    Call after loading, before `nnx.split`; returns how many were repacked. Linears whose K is not a
    multiple of the layout's tile keep the MLX layout (and its path). Pair-layout bf16 scales and biases are
    packed into one uint32 `scales` (`biases` None: one load a column for both, the Mosaic kernel's input).
    """
    from tfjax import quant

    tables = {id(m.table) for _, m in nnx.iter_modules(model) if isinstance(m, Embedding)}
    done = 0
    for _, m in nnx.iter_modules(model):
        if not isinstance(m, Linear) or m.quant is None or m.layout != "mlx" or id(m) in tables:
            continue
        bits, group = m.quant
        k = m.weight.shape[1] * 32 // bits
        if m.weight.shape[0] % 16:
            continue
        if bits == 4 and k % quant.pair_tile(group) == 0:
            m.layout, repack = "pairs", quant.to_pair_layout
        elif k % quant.kernel_tile(bits, group) == 0:
            m.layout, repack = "kernel", quant.to_kernel_layout
        else:
            continue
        w, s, b = repack(m.weight[...], m.scales[...], m.biases[...], bits, group)
        m.weight, m.scales, m.biases = nnx.Param(w), nnx.Param(s), nnx.Param(b)
        if m.layout == "pairs" and s.dtype == jnp.bfloat16:
            m.scales, m.biases = nnx.Param(quant.pack_scale_bias(s, b)), None
        done += 1
    return done


def rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate the first `rotary_dim` dims of x [B, T, N, E] (half-split convention) at `positions` [B, T]."""
    half = rotary_dim // 2
    inv = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, half]
    cos = jnp.cos(ang).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(ang).astype(x.dtype)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def write_pages(pages: KVPages, k: jax.Array, v: jax.Array, page_table: jax.Array,
                positions: jax.Array) -> KVPages:
    """Store k, v [B, T, G, E] at absolute `positions` [B, T] through `page_table` [B, n]."""
    page = pages.k.shape[1]
    slot = jnp.clip(positions // page, 0, page_table.shape[1] - 1)
    pid = jnp.take_along_axis(page_table, slot, axis=1)  # [B, T]
    # Positions past the lane's pages go to an out-of-range page and are dropped.
    pid = jnp.where(positions // page < page_table.shape[1], pid, pages.k.shape[0])
    off = positions % page
    kk = pages.k.at[pid, off].set(k.astype(pages.k.dtype), mode="drop")
    vv = pages.v.at[pid, off].set(v.astype(pages.v.dtype), mode="drop")
    return KVPages(kk, vv)


class Attention(nnx.Module):
    """GQA attention with optional q/k norms, partial rotary and sigmoid output gate (Qwen3.5)."""

    FUSABLE = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: ModelConfig, quant_for, prefix: str, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attn_output_gate
        self.rotary_dim, self.theta = c.rotary_dim, c.rope_theta
        q_out = c.num_attention_heads * c.head_dim * (2 if self.gated else 1)
        kv_out = c.num_key_value_heads * c.head_dim
        bias = c.qkv_bias or c.attention_bias
        self.q_proj = Linear(c.hidden_size, q_out, bias=bias, quant=quant_for(f"{prefix}.q_proj"), dtype=dt, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, kv_out, bias=bias, quant=quant_for(f"{prefix}.k_proj"), dtype=dt, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, kv_out, bias=bias, quant=quant_for(f"{prefix}.v_proj"), dtype=dt, rngs=rngs)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias,
                             quant=quant_for(f"{prefix}.o_proj"), dtype=dt, rngs=rngs)
        if c.model_type in ("qwen3_5", "qwen3_5_moe"):
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=True, dtype=dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=True, dtype=dt)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, positions: jax.Array, valid: jax.Array, pages: KVPages, page_table: jax.Array,
                 mode: Mode, project: bool = True) -> tuple[jax.Array, KVPages]:
        """The attention output [B, T, D] (`project=False`: before o_proj, [B, T, H*E]) and the new pages."""
        b, t, _ = x.shape
        q, k, v = projections(self, x, mode.rows)
        if self.gated:
            q = q.reshape(b, t, self.heads, 2 * self.head_dim)
            q, gate = q[..., : self.head_dim], q[..., self.head_dim :]
            gate = gate.reshape(b, t, -1)
        else:
            q = q.reshape(b, t, self.heads, self.head_dim)
        k = k.reshape(b, t, self.kv_heads, self.head_dim)
        v = v.reshape(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, mode.rows), self.k_norm(k, mode.rows)
        q = rotary(q, positions, self.rotary_dim, self.theta)
        k = rotary(k, positions, self.rotary_dim, self.theta)
        live = jnp.arange(t)[None, :] < valid[:, None]  # padded prompt rows must not overwrite real keys
        pages = write_pages(pages, k, v, page_table, jnp.where(live, positions, jnp.iinfo(jnp.int32).max // 2))
        o = ops.paged_attention(q, pages, page_table, positions, mode.rows, valid).reshape(b, t, -1)  # [B, T, H*E]
        if self.gated:
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        return (self.o_proj(o, mode.rows) if project else o), pages


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    FUSABLE = ("gate_proj", "up_proj")

    def __init__(self, d: int, hidden: int, quant_for, prefix: str, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, hidden, quant=quant_for(f"{prefix}.gate_proj"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, hidden, quant=quant_for(f"{prefix}.up_proj"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(hidden, d, quant=quant_for(f"{prefix}.down_proj"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rows: bool = False) -> jax.Array:
        return self.down_proj(self._hidden(x, rows), rows)

    def _hidden(self, x: jax.Array, rows: bool) -> jax.Array:
        gate, up = projections(self, x, rows)
        return jax.nn.silu(gate) * up

    def partials(self, x: jax.Array, rows: bool = False, live: jax.Array | None = None) -> jax.Array:
        """The output as the down projection's partial sums (`Linear.partials`); `live` unused (a dense MLP reads its
        weights once for any number of rows)."""
        return self.down_proj.partials(self._hidden(x, rows), rows)


def quant_lookup(config: ModelConfig):
    """A function module-path -> (bits, group) or None, from the config's quantization section."""
    q = config.quantization

    def lookup(path: str) -> tuple[int, int] | None:
        if q is None:
            return None
        return q.for_layer(path)

    return lookup
