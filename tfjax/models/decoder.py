"""The decoder every family shares: `CausalLM`, `DecoderLayer` and the caches (pages, DeltaNet state and traces).

A forward takes rows `tokens` [B, T] at absolute positions `start[b] + t`, of which `valid[b]` are real, and a
`Cache`. In `ROWS` mode (lane rounds) DeltaNet layers return a `DeltaTrace` so the round can replay the state over
only the committed rows (`replay`). Families (qwen3_5, llama) subclass `DecoderLayer` with their mixers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import ops
from tfjax.config import ModelConfig
from tfjax.models.layers import MLP, Attention, Embedding, KVPages, Linear, Mode, RMSNorm, dtype_of, quant_lookup


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeltaState:
    """One DeltaNet layer's per-lane state: conv tail [B, K-1, C] and recurrent state [B, Hv, Dk, Dv] f32."""

    conv: jax.Array
    state: jax.Array


@dataclasses.dataclass
class DeltaTrace:
    """What replay needs from a verify pass: pre-conv rows [B, T, C] and step inputs (q, k, v, or on the fused
    kernel path the conv output `qkv` [B, T, C], normalised again by the replaying kernel)."""

    mixed: jax.Array
    q: jax.Array | None
    k: jax.Array | None
    v: jax.Array | None
    g: jax.Array
    beta: jax.Array
    qkv: jax.Array | None = None
    kernels: ops.Kernels = ops.REFERENCE  # static: the choice of the pass that made it, which replay runs again
    mesh: object = None  # static: the mesh of that pass (replay loops over heads and lanes as it did)


jax.tree_util.register_dataclass(DeltaTrace, data_fields=["mixed", "q", "k", "v", "g", "beta", "qkv"],
                                 meta_fields=["kernels", "mesh"])


def conv_tail_after(conv_tail: jax.Array, mixed: jax.Array, count: jax.Array) -> jax.Array:
    """The last K-1 conv inputs after appending each lane's first `count` rows."""
    window = jnp.concatenate([conv_tail.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    km1 = conv_tail.shape[1]
    return jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, km1, axis=0))(window, count).astype(
        conv_tail.dtype)


def replay(start: DeltaState, trace: DeltaTrace, count: jax.Array) -> DeltaState:
    """The state after each lane's first `count` rows, recomputed from the round's start state with the trace's
    kernels (those of the verify pass)."""
    with ops.using(trace.kernels), ops.using_mesh(trace.mesh), ops.lanes_over_data(True):
        if trace.qkv is not None:  # the fused kernel path's trace
            state, _ = ops.recurrent_qkv(start.state, trace.qkv, trace.g, trace.beta, count)
        else:
            state, _ = ops.recurrent(start.state, trace.q, trace.k, trace.v, trace.g, trace.beta, count=count)
    return DeltaState(conv_tail_after(start.conv, trace.mixed, count), state)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: token mixer (attention, or a family's `LINEAR_MIXER`), then MLP or a family's `MOE`."""

    LINEAR_MIXER = None  # the module class of "linear_attention" layers (qwen3_5: GatedDeltaNet)
    MOE = None  # the sparse MLP class of MoE configs (qwen3_5: SparseMoE)

    def __init__(self, config: ModelConfig, index: int, quant_for, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        p = f"model.layers.{index}"
        self.kind = c.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = self._family("LINEAR_MIXER")(c, quant_for, f"{p}.linear_attn", rngs=rngs)
        else:
            self.self_attn = Attention(c, quant_for, f"{p}.self_attn", rngs=rngs)
        if c.is_moe:
            self.mlp = self._family("MOE")(c, quant_for, f"{p}.mlp", rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, quant_for, f"{p}.mlp", dtype=dt, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.rms_norm_offset, dtype=dt)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.rms_norm_offset, dtype=dt)

    def _family(self, name: str):
        cls = getattr(self, name)
        if cls is None:
            raise ValueError(f"{type(self).__name__} has no {name}: this family's config asks for one")
        return cls

    def __call__(self, x, pending, positions, valid, layer_cache, page_table, mode: Mode, live=None):
        """x: the residual stream before the previous layer's MLP update `pending` (partial sums; None for the first
        layer). Returns the stream with it (the previous layer's output), the stream before this layer's MLP update,
        that update (partial sums, summed with the add before the next norm: `RMSNorm.add`), the cache and the trace.
        `live` [B, T] bool: the rows before `valid` (an MoE reads no expert for the others)."""
        if pending is None:
            h = self.input_layernorm(x, mode.rows)
        else:
            x, h = self.input_layernorm.add(x, pending, mode.rows)
        x_in, trace = x, None
        if self.kind == "linear_attention":
            o, layer_cache, trace = self.linear_attn(h, layer_cache, valid, mode, project=False)
            out_proj = self.linear_attn.out_proj
        else:
            o, layer_cache = self.self_attn(h, positions, valid, layer_cache, page_table, mode, project=False)
            out_proj = self.self_attn.o_proj
        x, h = self.post_attention_layernorm.add(x, out_proj.partials(o, mode.rows), mode.rows)
        return x_in, x, self.mlp.partials(h, mode.rows, live), layer_cache, trace


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Per-layer caches (KVPages for attention, DeltaState for DeltaNet) and the lanes' page table."""

    layers: list
    page_table: jax.Array  # [B, pages per lane] i32


class CausalLM(nnx.Module):
    """Embeddings, decoder layers, final norm and lm_head (tied or not); shared by every family.

    `kernels` (static, in the graphdef) is the implementation choice its forward traces with (`ops.using`); `mesh`
    (static, set by `tfjax.sharding.shard_model`) the device mesh its row-parallel products shard over."""

    mesh = None

    def __init__(self, config: ModelConfig, layer_cls, *, rngs: nnx.Rngs, kernels: ops.Kernels | None = None):
        c, dt = config, dtype_of(config)
        self.config = c
        self.kernels = kernels or ops.Kernels.default()
        qf = quant_lookup(c)
        self.model = nnx.Dict(
            embed_tokens=Embedding(c.vocab_size, c.hidden_size, quant=qf("model.embed_tokens"), dtype=dt, rngs=rngs),
            layers=nnx.List([layer_cls(c, i, qf, rngs=rngs) for i in range(c.num_hidden_layers)]),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.rms_norm_offset, dtype=dt),
        )
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, quant=qf("lm_head"), dtype=dt, rngs=rngs)

    def init_cache(self, lanes: int, context: int, page_size: int = 16, pages: int | None = None,
                   kv_dtype=None) -> Cache:
        """An empty cache for `lanes` lanes of up to `context` tokens (identity page tables)."""
        c = self.config
        per_lane = -(-context // page_size)
        pages = lanes * per_lane if pages is None else pages
        kv_dtype = kv_dtype or dtype_of(c)
        layers = []
        for kind in c.layer_types:
            if kind == "linear_attention":
                layers.append(DeltaState(
                    jnp.zeros((lanes, c.linear_conv_kernel_dim - 1, c.linear_conv_dim), dtype_of(c)),
                    jnp.zeros((lanes, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
                              jnp.float32)))
            else:
                shape = (pages, page_size, c.num_key_value_heads, c.head_dim)
                layers.append(KVPages(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)))
        table = jnp.arange(lanes * per_lane, dtype=jnp.int32).reshape(lanes, per_lane) % pages
        return Cache(layers, table)

    def __call__(self, tokens: jax.Array, start: jax.Array, valid: jax.Array, cache: Cache, mode: Mode) -> tuple:
        """Logits [B, T, V] f32 (or [B, V] for the last valid row), the new cache, DeltaNet traces; with
        `mode.taps` also the tapped layers' outputs [B, T, len(taps) * D] (the last layer's after the norm)."""
        # a lane round's rows: each device computes its own lanes where the mesh's `data` axis splits them
        with ops.using(self.kernels), ops.using_mesh(self.mesh), ops.lanes_over_data(mode.rows):
            return self._forward(tokens, start, valid, cache, mode)

    def _forward(self, tokens, start, valid, cache, mode):
        b, t = tokens.shape
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        live = jnp.arange(t)[None, :] < valid[:, None]  # rows past `valid` are padding: an MoE skips them
        x = self.model["embed_tokens"](tokens)  # [B, T, D]
        new_layers, traces, tapped, pending = [], [], {}, None
        for i, (layer, lc) in enumerate(zip(self.model["layers"], cache.layers, strict=True)):
            x_in, x, pending, lc, tr = layer(x, pending, positions, valid, lc, cache.page_table, mode, live)
            new_layers.append(lc)
            traces.append(tr)
            if i:
                tapped[i - 1] = x_in  # layer i - 1's output: its MLP update added in layer i's first norm
        _, x = self.model["norm"].add(x, pending, mode.rows)
        tapped[len(new_layers) - 1] = x
        taps = jnp.concatenate([tapped[i] for i in mode.taps], axis=-1) if mode.taps else None
        if mode.last_only:
            x = jnp.take_along_axis(x, jnp.maximum(valid - 1, 0)[:, None, None], axis=1)[:, 0]
        logits = self._logits(x, mode.rows)
        if mode.taps:
            return logits, Cache(new_layers, cache.page_table), traces, taps
        return logits, Cache(new_layers, cache.page_table), traces

    def logits(self, x: jax.Array, rows: bool = False) -> jax.Array:
        """Logits [..., V] f32 of final hidden states x (the tied embedding or lm_head)."""
        with ops.using(self.kernels), ops.using_mesh(self.mesh):
            return self._logits(x, rows)

    def _logits(self, x: jax.Array, rows: bool = False) -> jax.Array:
        head = self.model["embed_tokens"].attend if self.config.tie_word_embeddings else self.lm_head
        logits = head(x, rows).astype(jnp.float32)
        if self.mesh is not None:  # vocab shards gathered: sampling sees whole rows, never a sum across devices
            logits = jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(self.mesh,
                                                                                           jax.sharding.PartitionSpec()))
        return logits


def lanes_cache(cache: Cache, lanes: jax.Array) -> Cache:
    """A view of the lanes `lanes` [B]: their DeltaNet slots and page-table rows (KV pools are shared)."""
    layers = [DeltaState(l.conv[lanes], l.state[lanes]) if isinstance(l, DeltaState) else l for l in cache.layers]
    return Cache(layers, cache.page_table[lanes])


def put_lanes_cache(cache: Cache, sub: Cache, lanes: jax.Array) -> Cache:
    """`cache` with a view's DeltaNet slots written back to `lanes` (KV pools taken from the view; page tables are
    only read by a forward, so `cache`'s stay)."""
    layers = [DeltaState(l.conv.at[lanes].set(s.conv), l.state.at[lanes].set(s.state))
              if isinstance(l, DeltaState) else s for l, s in zip(cache.layers, sub.layers, strict=True)]
    return Cache(layers, cache.page_table)


def lane_cache(cache: Cache, lane: jax.Array) -> Cache:
    """A one-lane view (`lanes_cache` of [lane])."""
    return lanes_cache(cache, jnp.reshape(lane, (1,)))


def put_lane(cache: Cache, sub: Cache, lane: jax.Array) -> Cache:
    """`cache` with a one-lane view written back to `lane` (`put_lanes_cache` of [lane])."""
    return put_lanes_cache(cache, sub, jnp.reshape(lane, (1,)))


def reset_if_first(layer, start):
    """A lane's first chunk starts from zero DeltaNet state (the slot may hold an old request's)."""
    if isinstance(layer, DeltaState):
        first = start == 0
        return DeltaState(jnp.where(first, 0, layer.conv).astype(layer.conv.dtype),
                          jnp.where(first, 0.0, layer.state))
    return layer
