"""Qwen3.5 text models (`qwen3_5` dense, `qwen3_5_moe`) as Flax NNX modules.

Layers follow `config.layer_types`: Gated DeltaNet ("linear_attention") or gated full attention, each
followed by a SwiGLU MLP or the sparse MoE block with its shared expert. A forward takes rows
`tokens` [B, T] at absolute positions `start[b] + t`, of which `valid[b]` are real, and a `Cache`.
In `ROWS` mode (lane rounds) DeltaNet runs the per-token step and returns a `Trace` so the round can
replay the state over only the committed rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import ops
from tfjax.config import ModelConfig
from tfjax.models import gated_delta
from tfjax.models.layers import (
    MLP,
    Attention,
    Embedding,
    KVPages,
    Linear,
    Mode,
    RMSNorm,
    dtype_of,
    projections,
    quant_lookup,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeltaState:
    """One DeltaNet layer's per-lane state: conv tail [B, K-1, C] and recurrent state [B, Hv, Dk, Dv] f32."""

    conv: jax.Array
    state: jax.Array


@jax.tree_util.register_dataclass
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


class GatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * silu(z) per value head (weight initialised to ones)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array, rows: bool = False) -> jax.Array:
        return ops.row_norm(x, self.weight[...], z, kind="gated", eps=self.eps, rows=rows)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear attention: causal conv (width K) over q|k|v, then the gated delta rule."""

    FUSABLE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, config: ModelConfig, quant_for, prefix: str, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        self.c = c
        d, conv_dim = c.hidden_size, c.linear_conv_dim
        hv = c.linear_num_value_heads
        self.in_proj_qkv = Linear(d, conv_dim, quant=quant_for(f"{prefix}.in_proj_qkv"), dtype=dt, rngs=rngs)
        self.in_proj_z = Linear(d, c.linear_value_dim, quant=quant_for(f"{prefix}.in_proj_z"), dtype=dt, rngs=rngs)
        self.in_proj_b = Linear(d, hv, quant=quant_for(f"{prefix}.in_proj_b"), dtype=dt, rngs=rngs)
        self.in_proj_a = Linear(d, hv, quant=quant_for(f"{prefix}.in_proj_a"), dtype=dt, rngs=rngs)
        kw = jax.random.normal(rngs.params(), (conv_dim, c.linear_conv_kernel_dim), jnp.float32) * 0.3
        self.conv1d = nnx.Dict(weight=nnx.Param(kw.astype(dt)))  # HF conv1d.weight [C, 1, K], squeezed
        self.dt_bias = nnx.Param(jnp.ones((hv,), dt))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)).astype(dt))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps, dtype=dt)
        self.out_proj = Linear(c.linear_value_dim, d, quant=quant_for(f"{prefix}.out_proj"), dtype=dt, rngs=rngs)

    def conv(self, window: jax.Array, t: int, rows: bool = False) -> jax.Array:
        """Depthwise causal conv + silu: window [B, K-1+T, C] -> [B, T, C], each row from its own K inputs."""
        w = self.conv1d["weight"][...]  # [C, K]
        taps = jnp.stack([window[:, j : j + t] for j in range(w.shape[1])], axis=2)  # [B, T, K, C]
        return ops.conv_silu(taps, w, rows=rows)

    def step_inputs(self, mixed: jax.Array, conv_tail: jax.Array, g: jax.Array, beta: jax.Array,
                    rows: bool = False) -> DeltaTrace:
        """Conv, split, normalise: the inputs of each row's recurrent step."""
        c = self.c
        b, t, _ = mixed.shape
        window = jnp.concatenate([conv_tail.astype(mixed.dtype), mixed], axis=1)
        qkv = self.conv(window, t, rows)
        q, k, v = gated_delta.split_qkv(qkv, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads,
                                        rows=rows)
        return DeltaTrace(mixed, q, k, v, g, beta)

    def __call__(self, x: jax.Array, cache: DeltaState, valid: jax.Array, mode: Mode,
                 project: bool = True) -> tuple[jax.Array, DeltaState, DeltaTrace | None]:
        """The mixer's output [B, T, D] (`project=False`: before out_proj), the new state, the round's trace."""
        c = self.c
        b, t, _ = x.shape
        mixed, z, b_in, a = projections(self, x, mode.rows)  # mixed [B, T, C]
        z = z.reshape(b, t, c.linear_num_value_heads, -1)
        beta = jax.nn.sigmoid(b_in.astype(jnp.float32))
        a = a.astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        if mode.rows and ops.delta_fused():  # two launches: conv (with the next tail), recurrence (with the norms)
            from pallas_kernels import causal_conv

            qkv, new_conv = causal_conv.conv_silu_window(cache.conv, mixed, self.conv1d["weight"][...], valid)
            state, out = gated_delta.recurrent_qkv(cache.state, qkv, g, beta, out_dtype=x.dtype)
            trace = DeltaTrace(mixed, None, None, None, g, beta, qkv=qkv)
        else:
            tr = self.step_inputs(mixed, cache.conv, g, beta, mode.rows)
            if mode.rows:
                state, out = gated_delta.recurrent(cache.state, tr.q, tr.k, tr.v, tr.g, tr.beta)
                trace = tr
            else:
                live = (jnp.arange(t)[None, :] < valid[:, None])  # padded rows leave the state alone
                m = live[..., None, None]
                state, out = gated_delta.chunked(cache.state, jnp.where(m, tr.q, 0), jnp.where(m, tr.k, 0),
                                                 jnp.where(m, tr.v, 0), jnp.where(live[..., None], g, 0),
                                                 jnp.where(live[..., None], beta, 0))
                trace = None
            new_conv = conv_tail_after(cache.conv, mixed, valid)
        out = self.norm(out.astype(x.dtype), z, mode.rows)
        out = out.reshape(b, t, -1)
        return (self.out_proj(out, mode.rows) if project else out), DeltaState(new_conv, state), trace


def conv_tail_after(conv_tail: jax.Array, mixed: jax.Array, count: jax.Array) -> jax.Array:
    """The last K-1 conv inputs after appending each lane's first `count` rows."""
    window = jnp.concatenate([conv_tail.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    km1 = conv_tail.shape[1]
    return jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, km1, axis=0))(window, count).astype(
        conv_tail.dtype)


def replay(start: DeltaState, trace: DeltaTrace, count: jax.Array) -> DeltaState:
    """The state after each lane's first `count` rows, recomputed from the round's start state."""
    if trace.qkv is not None:  # the fused kernel path's trace
        state, _ = gated_delta.recurrent_qkv(start.state, trace.qkv, trace.g, trace.beta, count)
    else:
        state, _ = gated_delta.recurrent(start.state, trace.q, trace.k, trace.v, trace.g, trace.beta, count=count)
    return DeltaState(conv_tail_after(start.conv, trace.mixed, count), state)


class SparseMoE(nnx.Module):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert."""

    def __init__(self, config: ModelConfig, quant_for, prefix: str, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        self.top_k, self.n_exp = c.num_experts_per_tok, c.num_experts
        self.gate = Linear(c.hidden_size, c.num_experts, quant=quant_for(f"{prefix}.gate"), dtype=dt, rngs=rngs)
        self.experts = Experts(c, quant_for, f"{prefix}.experts", rngs=rngs)
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, quant_for,
                                 f"{prefix}.shared_expert", dtype=dt, rngs=rngs)
        self.shared_expert_gate = Linear(c.hidden_size, 1, quant=quant_for(f"{prefix}.shared_expert_gate"),
                                         dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array, rows: bool = False) -> jax.Array:
        lead, d = x.shape[:-1], x.shape[-1]
        xf = x.reshape(-1, d)
        logits = self.gate(xf, rows).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, top_i = jax.lax.top_k(probs, self.top_k)
        top_p = (top_p / jnp.sum(top_p, axis=-1, keepdims=True)).astype(x.dtype)
        routed = self.experts(xf, top_i, top_p)
        shared = self.shared_expert(xf, rows) * jax.nn.sigmoid(self.shared_expert_gate(xf, rows))
        return (routed + shared).reshape(*lead, d)

    def partials(self, x: jax.Array, rows: bool = False) -> jax.Array:
        return self(x, rows)[None]  # routed and shared experts come summed: one partial


class Experts(nnx.Module):
    """Stacked expert weights [E, out, in] (gate_proj, up_proj, down_proj), dense or MLX-quantized."""

    def __init__(self, config: ModelConfig, quant_for, prefix: str, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.quants = tuple((n, quant_for(f"{prefix}.{n}")) for n in ("gate_proj", "up_proj", "down_proj"))
        q = dict(self.quants)

        def make(out: int, inp: int, quant):
            if quant is None:
                w = jax.random.normal(rngs.params(), (e, out, inp), jnp.float32) * inp**-0.5
                return nnx.Dict(weight=nnx.Param(w.astype(dt)))
            bits, group = quant
            return nnx.Dict(weight=nnx.Param(jax.random.bits(rngs.params(), (e, out, inp * bits // 32), jnp.uint32)),
                            scales=nnx.Param(jnp.full((e, out, inp // group), 0.02 / 2**bits, dt)),
                            biases=nnx.Param(jnp.full((e, out, inp // group), -0.01, dt)))

        self.gate_proj = make(i, d, q["gate_proj"])
        self.up_proj = make(i, d, q["up_proj"])
        self.down_proj = make(d, i, q["down_proj"])

    def stack(self, name: str) -> tuple:
        """One projection's stacked weights: (weight, scales, biases) quantized, (weight,) dense."""
        p = getattr(self, name)
        if dict(self.quants)[name] is None:
            return (p["weight"][...],)
        return p["weight"][...], p["scales"][...], p["biases"][...]

    def __call__(self, x: jax.Array, idx: jax.Array, weight: jax.Array) -> jax.Array:
        """x [N, D], idx/weight [N, k] -> sum_k weight * expert_idx(x) [N, D], reading only the chosen experts."""
        quantized = {q for _, q in self.quants if q is not None}  # a projection may stay dense (in % group)
        if len(quantized) > 1:
            raise ValueError(f"the experts' quantized projections must share one (bits, group), got {self.quants}")
        bits, group = quantized.pop() if quantized else (None, 64)
        return ops.experts(x, idx, weight, self.stack("gate_proj"), self.stack("up_proj"), self.stack("down_proj"),
                           bits=bits, group_size=group)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: token mixer (DeltaNet or attention), then MLP or MoE."""

    def __init__(self, config: ModelConfig, index: int, quant_for, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        p = f"model.layers.{index}"
        self.kind = c.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, quant_for, f"{p}.linear_attn", rngs=rngs)
        else:
            self.self_attn = Attention(c, quant_for, f"{p}.self_attn", rngs=rngs)
        if c.is_moe:
            self.mlp = SparseMoE(c, quant_for, f"{p}.mlp", rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, quant_for, f"{p}.mlp", dtype=dt, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.rms_norm_offset, dtype=dt)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.rms_norm_offset, dtype=dt)

    def __call__(self, x, pending, positions, valid, layer_cache, page_table, mode: Mode):
        """x: the residual stream before the previous layer's MLP update `pending` (partial sums; None for the first
        layer). Returns the stream with it (the previous layer's output), the stream before this layer's MLP update,
        that update (partial sums, summed with the add before the next norm: `RMSNorm.add`), the cache and the trace."""
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
        return x_in, x, self.mlp.partials(h, mode.rows), layer_cache, trace


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    """Per-layer caches (KVPages for attention, DeltaState for DeltaNet) and the lanes' page table."""

    layers: list
    page_table: jax.Array  # [B, pages per lane] i32


class CausalLM(nnx.Module):
    """Embeddings, decoder layers, final norm and lm_head (tied or not); shared by every family."""

    def __init__(self, config: ModelConfig, layer_cls, *, rngs: nnx.Rngs):
        c, dt = config, dtype_of(config)
        self.config = c
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
        b, t = tokens.shape
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        x = self.model["embed_tokens"](tokens)  # [B, T, D]
        new_layers, traces, tapped, pending = [], [], {}, None
        for i, (layer, lc) in enumerate(zip(self.model["layers"], cache.layers, strict=True)):
            x_in, x, pending, lc, tr = layer(x, pending, positions, valid, lc, cache.page_table, mode)
            new_layers.append(lc)
            traces.append(tr)
            if i:
                tapped[i - 1] = x_in  # layer i - 1's output: its MLP update added in layer i's first norm
        _, x = self.model["norm"].add(x, pending, mode.rows)
        tapped[len(new_layers) - 1] = x
        taps = jnp.concatenate([tapped[i] for i in mode.taps], axis=-1) if mode.taps else None
        if mode.last_only:
            x = jnp.take_along_axis(x, jnp.maximum(valid - 1, 0)[:, None, None], axis=1)[:, 0]
        logits = self.logits(x, mode.rows)
        if mode.taps:
            return logits, Cache(new_layers, cache.page_table), traces, taps
        return logits, Cache(new_layers, cache.page_table), traces

    def logits(self, x: jax.Array, rows: bool = False) -> jax.Array:
        if self.config.tie_word_embeddings:
            return self.model["embed_tokens"].attend(x, rows).astype(jnp.float32)
        return self.lm_head(x, rows).astype(jnp.float32)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 dense or MoE text model."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(config, DecoderLayer, rngs=rngs)
