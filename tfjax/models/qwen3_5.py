"""Qwen3.5 text models (`qwen3_5` dense, `qwen3_5_moe`) as Flax NNX modules.

Layers follow `config.layer_types`: Gated DeltaNet ("linear_attention") or gated full attention, each
followed by a SwiGLU MLP or the sparse MoE block with its shared expert. The decoder, caches and
replay they share with every family are in `tfjax.models.decoder`; in `ROWS` mode (lane rounds) DeltaNet runs the
per-token step and returns a `DeltaTrace`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import ops
from tfjax.config import ModelConfig
from tfjax.models.decoder import (  # noqa: F401  (Cache, DeltaState, replay: the lane round's names for them)
    Cache,
    CausalLM,
    DecoderLayer,
    DeltaState,
    DeltaTrace,
    conv_tail_after,
    replay,
)
from tfjax.models.layers import MLP, Linear, Mode, dtype_of, projections


class GatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * silu(z) per value head (weight initialised to ones)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array, rows: bool = False) -> jax.Array:
        # x, z [..., H, Dv]: under a mesh each device normalises its own value heads (`ops.rowwise`)
        return ops.row_norm(x, self.weight[...], z, kind="gated", eps=self.eps, rows=rows, heads=x.ndim - 2)


def gates(b_in: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """DeltaNet's decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b): [B, T, H] f32.

    Under a mesh in fixed row tiles (`ops.rowwise`, each device its own lanes): XLA's elementwise exp takes another
    code path on a handful of elements, so left to the partitioner a device's share of the lanes changed the bits."""
    a_log, dt_bias = a_log.astype(jnp.float32), dt_bias.astype(jnp.float32)
    a, b_in, h = a.astype(jnp.float32), b_in.astype(jnp.float32), a.shape[-1]
    if ops.active_mesh() is None:  # one device: elementwise, as always
        return -jnp.exp(a_log) * jax.nn.softplus(a + dt_bias), jax.nn.sigmoid(b_in)

    def tile(ab: jax.Array) -> jax.Array:  # [rows, 2H]: a | b -> g | beta
        return jnp.concatenate([-jnp.exp(a_log) * jax.nn.softplus(ab[:, :h] + dt_bias), jax.nn.sigmoid(ab[:, h:])], -1)

    out = ops.rowwise(tile, jnp.concatenate([a, b_in], -1), True)
    # cut inside `shard_map` too: left to XLA's partitioner, the halves came to each device's heads by collective-permute
    return ops.whole(lambda o: (o[..., :h], o[..., h:]), out, lanes=True)


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
        q, k, v = ops.split_qkv(qkv, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads,
                                        rows=rows)
        return DeltaTrace(mixed, q, k, v, g, beta)

    def __call__(self, x: jax.Array, cache: DeltaState, valid: jax.Array, mode: Mode,
                 project: bool = True) -> tuple[jax.Array, DeltaState, DeltaTrace | None]:
        """The mixer's output [B, T, D] (`project=False`: before out_proj), the new state, the round's trace."""
        c = self.c
        b, t, _ = x.shape
        mixed, z, b_in, a = projections(self, x, mode.rows)  # mixed [B, T, C]
        z = z.reshape(b, t, c.linear_num_value_heads, -1)
        g, beta = gates(b_in, a, self.A_log[...], self.dt_bias[...])
        kernels = ops.active()
        if mode.rows and ops.delta_fused():  # two launches: conv (with the next tail), recurrence (with the norms)
            qkv, new_conv = ops.conv_silu_window(cache.conv, mixed, self.conv1d["weight"][...], valid)
            state, out = ops.recurrent_qkv(cache.state, qkv, g, beta, out_dtype=x.dtype)
            trace = DeltaTrace(mixed, None, None, None, g, beta, qkv=qkv, kernels=kernels, mesh=ops.active_mesh())
        else:
            tr = self.step_inputs(mixed, cache.conv, g, beta, mode.rows)
            if mode.rows:
                state, out = ops.recurrent(cache.state, tr.q, tr.k, tr.v, tr.g, tr.beta)
                trace = dataclasses.replace(tr, kernels=kernels, mesh=ops.active_mesh())
            else:
                live = (jnp.arange(t)[None, :] < valid[:, None])  # padded rows leave the state alone
                m = live[..., None, None]
                state, out = ops.chunked(cache.state, jnp.where(m, tr.q, 0), jnp.where(m, tr.k, 0),
                                                 jnp.where(m, tr.v, 0), jnp.where(live[..., None], g, 0),
                                                 jnp.where(live[..., None], beta, 0))
                trace = None
            new_conv = conv_tail_after(cache.conv, mixed, valid)
        out = self.norm(out.astype(x.dtype), z, mode.rows)
        out = out.reshape(b, t, -1)
        return (self.out_proj(out, mode.rows) if project else out), DeltaState(new_conv, state), trace


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

    def __call__(self, x: jax.Array, rows: bool = False, live: jax.Array | None = None) -> jax.Array:
        """`live` (x's leading shape, bool): the real rows; the others' routed experts are skipped (they add 0)."""
        lead, d = x.shape[:-1], x.shape[-1]
        xf = x.reshape(-1, d)
        logits = self.gate(xf, rows).astype(jnp.float32)
        k = self.top_k

        def route(logits: jax.Array) -> jax.Array:  # [N, E] -> [N, 2k]: normalised top-k probabilities, their ids
            top_p, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
            return jnp.concatenate([top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_i.astype(jnp.float32)], -1)

        gate = self.shared_expert_gate(xf, rows)
        if ops.active_mesh() is not None:  # fixed row tiles: a device's share of the lanes never changes the shapes
            routing, gate = ops.rowwise(route, logits, True), ops.rowwise(jax.nn.sigmoid, gate, True)
        else:
            routing, gate = route(logits), jax.nn.sigmoid(gate)
        top_p, top_i = routing[:, :k].astype(x.dtype), routing[:, k:].astype(jnp.int32)
        routed = self.experts(xf, top_i, top_p, rows, None if live is None else live.reshape(-1))
        shared = self.shared_expert(xf, rows) * gate
        return (routed + shared).reshape(*lead, d)

    def partials(self, x: jax.Array, rows: bool = False, live: jax.Array | None = None) -> jax.Array:
        return self(x, rows, live)[None]  # routed and shared experts come summed: one partial


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

    def __call__(self, x: jax.Array, idx: jax.Array, weight: jax.Array, rows: bool = False,
                 live: jax.Array | None = None) -> jax.Array:
        """x [N, D], idx/weight [N, k] -> sum_k weight * expert_idx(x) [N, D], reading only the chosen experts;
        `rows`: lane-round rows (the row-invariant decode kernels on GPU); `live` [N]: rows not live read none."""
        quantized = {q for _, q in self.quants if q is not None}  # a projection may stay dense (in % group)
        if len(quantized) > 1:
            raise ValueError(f"the experts' quantized projections must share one (bits, group), got {self.quants}")
        bits, group = quantized.pop() if quantized else (None, 64)
        return ops.experts(x, idx, weight, self.stack("gate_proj"), self.stack("up_proj"), self.stack("down_proj"),
                           bits=bits, group_size=group, rows=rows, live=live)


class Qwen3_5DecoderLayer(DecoderLayer):
    """A Qwen3.5 layer: Gated DeltaNet or gated attention, then SwiGLU or the sparse MoE."""

    LINEAR_MIXER = GatedDeltaNet
    MOE = SparseMoE


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 dense or MoE text model."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, kernels: ops.Kernels | None = None):
        super().__init__(config, Qwen3_5DecoderLayer, rngs=rngs, kernels=kernels)
