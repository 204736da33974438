"""The DFlash / DFlash2 block drafter as Flax NNX modules.

A small Qwen3-style stack that shares the target's embedding and lm_head. The target's hidden states at
`target_layer_ids` (each the output of that decoder layer) are concatenated and fused (`fc` + `hidden_norm`)
into context features; every layer projects them to keys/values placed before the block's own. One forward
over `[pending, MASK x (B-1)]` at positions start..start+B-1 drafts B-1 tokens; attention inside the block is
non-causal. DFlash2 adds a two-tap grouped dynamic convolution around each sublayer (`attention_conv`,
`mlp_conv`) and a low-rank candidate selector that walks the top-k candidates of each position.

Context keys/values live in paged pools by absolute position (the lane's page table); only committed rows are
ever written, and a block reads only positions < its start, so rejected rows never leak into a draft.
Parameter names mirror the published checkpoint keys (`layers.0.self_attn.q_proj.weight`, `fc.weight`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import ops
from tfjax.config import ModelConfig, QuantConfig
from tfjax.lanes.drafter import Facts, copy_match_for
from tfjax.models.decoder import Cache
from tfjax.models.layers import MLP, Embedding, Linear, RMSNorm, projections, rotary, write_pages
from tfjax.ops import KVPages, gather_pages

DROP = 2**30  # a position no page holds: writes there are dropped


class DrafterMismatch(ValueError):
    """A drafter checkpoint that does not fit the target it is attached to."""


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash(2) drafter's geometry; `dflash_config` keys first, top-level keys as fallback."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 8
    mask_token_id: int = 0
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    dtype: str = "bfloat16"
    quantization: QuantConfig | None = None

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size > 0 and self.selector_rank > 0

    def causal(self, layer: int) -> bool:
        """In-block causality of a layer (the reference: sliding layers causal unless `is_causal` says)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Build from a DFlash(2) config.json dict (unknown keys dropped)."""
        inner = dict(raw.get("dflash_config") or {})
        d = {**raw, **inner}
        if "target_layer_ids" not in d:
            raise DrafterMismatch("drafter config.json has no dflash_config.target_layer_ids")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        d.setdefault("rope_theta", rope.get("rope_theta", 1_000_000.0))
        d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        d["target_layer_ids"] = tuple(int(i) for i in d["target_layer_ids"])
        d["layer_types"] = tuple(d.get("layer_types") or ("full_attention",) * d["num_hidden_layers"])
        if len(d["layer_types"]) != d["num_hidden_layers"]:
            raise DrafterMismatch(f"layer_types has {len(d['layer_types'])} entries for {d['num_hidden_layers']} layers")
        unknown = set(d["layer_types"]) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DrafterMismatch(f"unsupported drafter layer_types {sorted(unknown)}")
        if "sliding_attention" in d["layer_types"] and not d.get("sliding_window"):
            raise DrafterMismatch("sliding_attention layers need sliding_window in the drafter config")
        if "torch_dtype" in d and "dtype" not in raw:
            d["dtype"] = d["torch_dtype"]
        d["dtype"] = str(d.get("dtype") or "bfloat16")
        quant = d.get("quantization") or d.get("quantization_config")
        d["quantization"] = QuantConfig.from_dict(quant) if quant else None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        """The published config.json layout (`dflash_config` holds the drafter-specific keys)."""
        inner = {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                 "target_layer_ids": list(self.target_layer_ids)}
        if self.dflash2:
            inner.update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                         selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        if self.output_multiplier != 1.0:
            inner["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            inner["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            inner["input_embedding_scale"] = self.input_embedding_scale
        d = {"architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"], "model_type": "qwen3",
             "dflash_config": inner, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
             "rms_norm_eps": self.rms_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
             "attention_bias": self.attention_bias, "layer_types": list(self.layer_types), "dtype": self.dtype,
             "hidden_act": "silu", "tie_word_embeddings": False}
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        return d


def check_fits(drafter: DFlashConfig, target: ModelConfig) -> None:
    """Raise DrafterMismatch naming the value when a drafter does not fit the target."""
    if drafter.hidden_size != target.hidden_size:
        raise DrafterMismatch(f"drafter hidden_size={drafter.hidden_size} != target hidden_size={target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise DrafterMismatch(f"drafter vocab_size={drafter.vocab_size} != target vocab_size={target.vocab_size}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise DrafterMismatch(f"drafter taps target layers {bad}, but the target has {target.num_hidden_layers} layers")
    if drafter.num_target_layers is not None and drafter.num_target_layers != target.num_hidden_layers:
        raise DrafterMismatch(f"drafter was trained on a {drafter.num_target_layers}-layer target, "
                              f"this target has {target.num_hidden_layers} layers")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise DrafterMismatch(f"drafter mask_token_id={drafter.mask_token_id} is outside the target's vocabulary")


def facts_for(drafter: DFlashConfig, target: ModelConfig, long_match: int = 20) -> Facts:
    """DFlash2's facts beside `target`: copy match `long_match` on the dense 27B (0 elsewhere), B-1 proposals."""
    return Facts(copy_match=copy_match_for(target, long_match), block=drafter.block_size - 1, kind="block")


def _quant_for(config: DFlashConfig):
    q = config.quantization
    return lambda path: None if q is None else q.for_layer(path)


def grouped_conv(h: jax.Array, dyn: jax.Array, base: jax.Array, group: int) -> jax.Array:
    """Causal grouped conv over rows: h [N, T, D], dyn [N, T, K, G] per group, base [K, D] per channel."""
    n, t, d = h.shape
    k, g = base.shape[0], d // group
    blocks = h.reshape(n, t, g, group)
    out = jnp.zeros_like(blocks)
    for o in range(k):
        shifted = jnp.pad(blocks, ((0, 0), (o, 0), (0, 0), (0, 0)))[:, :t]  # row r sees row r - o
        out = out + base[o].reshape(g, group).astype(h.dtype) * shifted
        out = out + dyn[:, :, o, :, None].astype(h.dtype) * shifted
    return out.reshape(n, t, d)


class GroupedConv(nnx.Module):
    """DFlash2's two-tap grouped dynamic conv: `prepare` before a sublayer, `finish` after it."""

    def __init__(self, d: int, kernel: int, group: int, quant, *, dtype, rngs: nnx.Rngs):
        self.kernel, self.group = kernel, group
        self.base_kernel = nnx.Param((jax.random.normal(rngs.params(), (2, kernel, d)) * 0.3).astype(dtype))
        self.kernel_projection = Linear(d, 2 * kernel * (d // group), quant=quant, dtype=dtype, rngs=rngs)

    def prepare(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        dyn = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.kernel, h.shape[-1] // self.group)
        return grouped_conv(h, dyn[..., 0, :, :], self.base_kernel[0], self.group), dyn[..., 1, :, :]

    def finish(self, h: jax.Array, dyn: jax.Array) -> jax.Array:
        return grouped_conv(h, dyn, self.base_kernel[1], self.group)


class DraftAttention(nnx.Module):
    """GQA attention of block rows over [context keys, block keys], q/k RMSNorm and full rotary."""

    def __init__(self, c: DFlashConfig, prefix: str, quant_for, *, rngs: nnx.Rngs):
        dt, d = jnp.dtype(c.dtype), c.hidden_size
        self.heads, self.kv_heads, self.head_dim, self.theta = (c.num_attention_heads, c.num_key_value_heads,
                                                                c.head_dim, c.rope_theta)
        kv = c.num_key_value_heads * c.head_dim
        b = c.attention_bias
        self.q_proj = Linear(d, c.num_attention_heads * c.head_dim, bias=b, quant=quant_for(f"{prefix}.q_proj"),
                             dtype=dt, rngs=rngs)
        self.k_proj = Linear(d, kv, bias=b, quant=quant_for(f"{prefix}.k_proj"), dtype=dt, rngs=rngs)
        self.v_proj = Linear(d, kv, bias=b, quant=quant_for(f"{prefix}.v_proj"), dtype=dt, rngs=rngs)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, d, bias=b, quant=quant_for(f"{prefix}.o_proj"),
                             dtype=dt, rngs=rngs)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=False, dtype=dt)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=False, dtype=dt)

    FUSABLE = ("q_proj", "k_proj", "v_proj")

    def qkv(self, x: jax.Array, positions: jax.Array, want_q: bool = True) -> tuple:
        """Queries [N, T, H*E] (raw; None unless wanted or fused), keys (normed, rotated) and values [N, T, G, E]
        of rows x [N, T, D] at `positions` [N, T]."""
        n, t, _ = x.shape
        if getattr(self, "fused", None) is not None:  # one launch; the queries come along
            q, k, v = projections(self, x, False)
        else:
            q, k, v = self.q_proj(x) if want_q else None, self.k_proj(x), self.v_proj(x)
        k = self.k_norm(k.reshape(n, t, self.kv_heads, self.head_dim))
        return q, rotary(k, positions, self.head_dim, self.theta), v.reshape(n, t, self.kv_heads, self.head_dim)

    def kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (normed, rotated) and values [N, T, G, E] of rows x [N, T, D] at `positions` [N, T]."""
        return self.qkv(x, positions, want_q=False)[1:]

    def __call__(self, h: jax.Array, positions: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                 visible: jax.Array, causal: bool) -> jax.Array:
        """h [N, B, D] block rows; ctx_k/v [N, S, G, E]; visible [N, B, S] which context keys each row sees."""
        n, b, _ = h.shape
        q, k, v = self.qkv(h, positions)
        q = rotary(self.q_norm(q.reshape(n, b, self.heads, self.head_dim)), positions, self.head_dim, self.theta)
        keys = jnp.concatenate([ctx_k.astype(q.dtype), k], axis=1)  # [N, S+B, G, E]
        vals = jnp.concatenate([ctx_v.astype(q.dtype), v], axis=1)
        inner = jnp.tril(jnp.ones((b, b), bool)) if causal else jnp.ones((b, b), bool)
        mask = jnp.concatenate([visible, jnp.broadcast_to(inner, (n, b, b))], axis=-1)  # [N, B, S+B]
        g = self.kv_heads
        qg = q.reshape(n, b, g, self.heads // g, self.head_dim)
        s = jnp.einsum("nbgre,nsge->ngrbs", qg, keys, preferred_element_type=jnp.float32) * self.head_dim**-0.5
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("ngrbs,nsge->nbgre", p.astype(q.dtype), vals, preferred_element_type=jnp.float32)
        return self.o_proj(o.reshape(n, b, -1).astype(h.dtype))


class DraftLayer(nnx.Module):
    """Pre-norm residual block; DFlash2 wraps attention and MLP in `attention_conv` / `mlp_conv`."""

    def __init__(self, c: DFlashConfig, index: int, quant_for, *, rngs: nnx.Rngs):
        dt, p = jnp.dtype(c.dtype), f"layers.{index}"
        self.causal = c.causal(index)
        self.self_attn = DraftAttention(c, f"{p}.self_attn", quant_for, rngs=rngs)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, quant_for, f"{p}.mlp", dtype=dt, rngs=rngs)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=False, dtype=dt)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=False, dtype=dt)
        if c.dflash2:
            conv = (c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.attention_conv = GroupedConv(*conv, quant_for(f"{p}.attention_conv.kernel_projection"), dtype=dt,
                                              rngs=rngs)
            self.mlp_conv = GroupedConv(*conv, quant_for(f"{p}.mlp_conv.kernel_projection"), dtype=dt, rngs=rngs)
        else:
            self.attention_conv = self.mlp_conv = None

    def __call__(self, x, positions, ctx_k, ctx_v, visible):
        h = self.input_layernorm(x)
        kern = None
        if self.attention_conv is not None:
            h, kern = self.attention_conv.prepare(h)
        h = self.self_attn(h, positions, ctx_k, ctx_v, visible, self.causal)
        x = x + (h if kern is None else self.attention_conv.finish(h, kern))
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, kern = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        return x + (h if self.mlp_conv is None else self.mlp_conv.finish(h, kern))


class CandidateSelector(nnx.Module):
    """Greedy walk over each position's top-k candidates: logit + <pred_code[prev] * proj(h), succ_code[cand]>."""

    def __init__(self, c: DFlashConfig, quant_for, *, rngs: nnx.Rngs):
        dt, r = jnp.dtype(c.dtype), c.selector_rank
        self.top_k = c.selector_top_k
        self.predecessor_codebook = Embedding(c.vocab_size, r, quant=quant_for("candidate_selector.predecessor_codebook"),
                                              dtype=dt, rngs=rngs)
        self.successor_codebook = Embedding(c.vocab_size, r, quant=quant_for("candidate_selector.successor_codebook"),
                                            dtype=dt, rngs=rngs)
        self.hidden_projection = Linear(c.hidden_size, r, quant=quant_for("candidate_selector.hidden_projection"),
                                        dtype=dt, rngs=rngs)

    def edges(self, hidden: jax.Array, prev: jax.Array, cand: jax.Array) -> jax.Array:
        """Transition scores [N, T, K] of candidates cand [N, T, K] after tokens prev [N, T]."""
        h = self.hidden_projection(hidden).astype(jnp.float32)  # [N, T, r]
        a = self.predecessor_codebook(prev).astype(jnp.float32) * h
        return jnp.einsum("ntr,ntkr->ntk", a, self.successor_codebook(cand).astype(jnp.float32))

    def select(self, hidden: jax.Array, logits: jax.Array, anchor: jax.Array) -> jax.Array:
        """Tokens [N, T] for hidden [N, T, D], logits [N, T, V] f32, the block's first token anchor [N]."""
        # [N, T, K], ties to the lower id; the barriers keep XLA CPU from turning top_k into a full sort of the
        # vocabulary (143 of a drafted SmolLM2 round's ~270 ms), as in `sampling.sample`
        unary, cand = (jax.lax.optimization_barrier(a) for a in jax.lax.top_k(logits, self.top_k))
        prev, path = anchor, []
        for i in range(hidden.shape[1]):
            scores = unary[:, i] + self.edges(hidden[:, i : i + 1], prev[:, None], cand[:, i : i + 1])[:, 0]
            prev = jnp.take_along_axis(cand[:, i], jnp.argmax(scores, axis=-1)[:, None], axis=1)[:, 0]
            path.append(prev)
        return jnp.stack(path, axis=1).astype(jnp.int32)


class DFlashDrafter(nnx.Module):
    """The block drafter; `bind(target_config)` checks the fit and sets its `facts`."""

    def __init__(self, config: DFlashConfig, *, rngs: nnx.Rngs):
        c, dt, qf = config, jnp.dtype(config.dtype), _quant_for(config)
        self.config = c
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, quant=qf("fc"), dtype=dt, rngs=rngs)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=False, dtype=dt)
        self.layers = nnx.List([DraftLayer(c, i, qf, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, offset=False, dtype=dt)
        self.candidate_selector = CandidateSelector(c, qf, rngs=rngs) if c.dflash2 else None
        self.facts = Facts(block=c.block_size - 1, kind="block")
        self.kernels = ops.Kernels.default()  # static: its entry points trace with it (`ops.own_kernels`)

    def bind(self, target: ModelConfig, long_match: int = 20) -> DFlashDrafter:
        check_fits(self.config, target)
        self.facts = facts_for(self.config, target, long_match)
        return self

    def init_cache(self, lanes: int, context: int, page_size: int = 16, pages: int | None = None,
                   kv_dtype=None) -> Cache:
        """Empty paged context K/V for every layer (identity page tables)."""
        c = self.config
        kv_dtype = kv_dtype or c.dtype
        per_lane = -(-context // page_size)
        pages = lanes * per_lane if pages is None else pages
        shape = (pages, page_size, c.num_key_value_heads, c.head_dim)
        layers = [KVPages(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)) for _ in range(c.num_hidden_layers)]
        return Cache(layers, jnp.arange(lanes * per_lane, dtype=jnp.int32).reshape(lanes, per_lane) % pages)

    @ops.own_kernels
    def context(self, taps: jax.Array) -> jax.Array:
        """Fused context features [N, T, D] from tapped target states [N, T, n_taps * D]."""
        return self.hidden_norm(self.fc(taps.astype(self.config.dtype)))

    @ops.own_kernels
    def absorb(self, taps: jax.Array, start: jax.Array, count: jax.Array, cache: Cache) -> Cache:
        """Write context K/V for the first `count` [N] of rows taps [N, T, nD] at positions start + t."""
        t = taps.shape[1]
        c = self.context(taps)
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        where = jnp.where(jnp.arange(t)[None, :] < count[:, None], positions, DROP)
        layers = []
        for layer, pages in zip(self.layers, cache.layers, strict=True):
            k, v = layer.self_attn.kv(c, positions)
            layers.append(write_pages(pages, k, v, cache.page_table, where))
        return Cache(layers, cache.page_table)

    def embed(self, target, ids: jax.Array) -> jax.Array:
        return target.model["embed_tokens"](ids) * self.config.input_embedding_scale

    @ops.own_kernels
    def run(self, x: jax.Array, positions: jax.Array, ctx: list, visible) -> jax.Array:
        """The stack over block rows x [N, B, D]; ctx per layer (k, v); visible(layer) -> [N, B, S]."""
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, *ctx[i], visible(i))
        return self.norm(x)

    def logits(self, target, h: jax.Array) -> jax.Array:
        """Draft logits [.., V] f32 through the target's head, scaled and soft-capped as configured."""
        logits = target.logits(h) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return jnp.tanh(logits / cap) * cap if cap else logits

    @ops.own_kernels
    def block_hidden(self, target, pending: jax.Array, start: jax.Array, cache: Cache) -> jax.Array:
        """Hidden [N, B, D] of the block [pending, MASK...] at positions start.. over context < start."""
        c, n = self.config, pending.shape[0]
        ids = jnp.full((n, c.block_size), c.mask_token_id, jnp.int32).at[:, 0].set(pending)
        positions = start[:, None] + jnp.arange(c.block_size, dtype=jnp.int32)[None, :]
        ctx = [gather_pages(pages, cache.page_table) for pages in cache.layers]  # each [N, S, G, E]
        keys = jnp.arange(ctx[0][0].shape[1])[None, None, :]

        def visible(i):
            seen = (keys < start[:, None, None]) & (positions[:, :, None] >= 0)  # [N, B, S]
            w = c.window(i)
            return seen if w is None else seen & (positions[:, :, None] - keys < w)

        return self.run(self.embed(target, ids), positions, ctx, visible)

    @ops.own_kernels
    def propose(self, target, pending: jax.Array, start: jax.Array, cache: Cache) -> jax.Array:
        """B-1 draft tokens [N, B-1] for the positions after `pending` (at `start`)."""
        h = self.block_hidden(target, pending, start, cache)[:, 1:]
        logits = self.logits(target, h)
        if self.candidate_selector is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return self.candidate_selector.select(h, logits, pending)


def build(config: DFlashConfig, *, seed: int = 0) -> DFlashDrafter:
    """A randomly initialised drafter (load a checkpoint into it to draft well)."""
    return DFlashDrafter(config, rngs=nnx.Rngs(seed))


def target_layer_ids(num_target_layers: int, taps: int) -> tuple[int, ...]:
    """The published default taps: evenly spaced from layer 1 to layer L-3 (the middle one for a single tap)."""
    if taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (taps - 1))) for i in range(taps))
