"""Distilling a DFlash2 drafter on a target's own generations.

Data: prompts run through the engine with `draft: false`, so every sequence is exactly the target's output; the
target's tapped hidden states of each whole sequence are computed once. A step samples anchors in the generated
part of each sequence; each anchor is one block `[token at a, MASK x (B-1)]` at positions a.., seeing the context
features of positions < a and its own rows. Loss: cross-entropy of rows 1..B-1 against the target's tokens,
weighted by exp(-(k-1)/gamma) down the block, plus (DFlash2) the selector's cross-entropy over the top-k
candidates with the true predecessor (the label forced into the candidates).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfjax import models
from tfjax.config import ModelConfig
from tfjax.drafters.dflash2 import DFlashConfig, DFlashDrafter, target_layer_ids
from tfjax.models.layers import PROMPT


def config_for(target: ModelConfig, *, layers: int = 5, block: int = 8, taps: int = 5, mask_token_id: int = 0,
               rank: int = 64, top_k: int = 8, group: int = 16, intermediate: int | None = None,
               dtype: str = "float32") -> DFlashConfig:
    """A DFlash2 drafter shaped for `target`: its hidden size, heads and vocabulary, `layers` Qwen3 layers."""
    return DFlashConfig(hidden_size=target.hidden_size, intermediate_size=intermediate or target.intermediate_size,
                        num_hidden_layers=layers, num_attention_heads=target.num_attention_heads,
                        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                        vocab_size=target.vocab_size, target_layer_ids=target_layer_ids(target.num_hidden_layers, taps),
                        block_size=block, mask_token_id=mask_token_id, num_target_layers=target.num_hidden_layers,
                        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                        layer_types=("full_attention",) * layers, is_causal=False, conv_kernel_size=2,
                        conv_group_size=group, selector_rank=rank, selector_top_k=top_k, dtype=dtype)


def generate(target, prompts: list[list[int]], max_tokens: int, *, lanes: int = 8, temperature: float = 0.0,
             seed: int = 0, eos_ids: tuple[int, ...] = (), progress=None) -> list[list[int]]:
    """The target's own continuations of `prompts` (plain lane rounds, `draft: false`)."""
    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig

    context = max(len(p) for p in prompts) + max_tokens + 2
    engine = Engine(target, LaneConfig(capacity=lanes, width=1, context=-(-context // 16) * 16), eos_ids=eos_ids)
    reqs = [Request(p, max_tokens=max_tokens, temperature=temperature, top_k=40 if temperature else 0,
                    seed=seed + i, draft=False) for i, p in enumerate(prompts)]
    ids = [engine.submit(r) for r in reqs]
    while any(i not in engine.results for i in ids):
        engine.step()
        if progress is not None:
            progress(len(engine.results))
    return [engine.results[i].token_ids for i in ids]


def pack(prompts: list[list[int]], outputs: list[list[int]], length: int) -> dict[str, np.ndarray]:
    """Sequences (prompt + output) in [S, length] with each one's valid length and first generated position."""
    tokens = np.zeros((len(prompts), length), np.int32)
    lengths, starts = np.zeros(len(prompts), np.int32), np.zeros(len(prompts), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        seq = (p + o)[:length]
        tokens[i, : len(seq)] = seq
        lengths[i], starts[i] = len(seq), min(len(p), len(seq))
    return {"tokens": tokens, "lengths": lengths, "starts": starts}


@functools.partial(jax.jit, static_argnames=("target_def", "taps"))
def tap_features(target_def, target_params, tokens: jax.Array, taps: tuple[int, ...]) -> jax.Array:
    """The target's tapped hidden states [S, T, len(taps) * D] of whole sequences tokens [S, T]."""
    target = models.merge(target_def, target_params)
    s, t = tokens.shape
    cache = target.init_cache(s, t)
    mode = dataclasses.replace(PROMPT, last_only=False, taps=taps)
    _, _, _, feats = target(tokens, jnp.zeros((s,), jnp.int32), jnp.full((s,), t, jnp.int32), cache, mode)
    return feats


def block_loss(drafter: DFlashDrafter, target, feats: jax.Array, tokens: jax.Array, lengths: jax.Array,
               starts: jax.Array, key: jax.Array, anchors: int, gamma: float) -> tuple[jax.Array, dict]:
    """Weighted block cross-entropy (+ selector loss) over `anchors` random blocks per sequence."""
    c = drafter.config
    s, t = tokens.shape
    bsz = c.block_size
    lo = jnp.maximum(starts - 1, 0)  # anchors in the generated part: the block's first token is known
    span = jnp.maximum(lengths - 1 - lo, 1)
    a = lo[:, None] + jax.random.randint(key, (s, anchors), 0, 1 << 20) % span[:, None]  # [S, N]
    seq = jnp.repeat(jnp.arange(s), anchors)  # block -> its sequence
    a = a.reshape(-1)  # [S*N]
    offs = jnp.arange(bsz)
    want = jnp.take_along_axis(tokens[seq], jnp.clip(a[:, None] + offs, 0, t - 1), axis=1)  # [S*N, B]
    ok = (a[:, None] + offs < lengths[seq][:, None])[:, 1:]  # labels inside the sequence
    ids = jnp.full((a.shape[0], bsz), c.mask_token_id, jnp.int32).at[:, 0].set(want[:, 0])
    positions = a[:, None] + offs  # [S*N, B]
    ctx = drafter.context(feats)  # [S, T, D]
    cpos = jnp.broadcast_to(jnp.arange(t), (s, t))
    kv = []
    for layer in drafter.layers:
        k, v = layer.self_attn.kv(ctx, cpos)
        kv.append((k[seq], v[seq]))  # [S*N, T, G, E]
    keys = jnp.arange(t)[None, None, :]
    seen = jnp.broadcast_to(keys < a[:, None, None], (a.shape[0], bsz, t))
    h = drafter.run(drafter.embed(target, ids), positions, kv, lambda i: seen)[:, 1:]  # [S*N, B-1, D]
    logits = drafter.logits(target, h)
    labels = want[:, 1:]
    w = jnp.exp(-jnp.arange(bsz - 1) / gamma)[None, :] * ok
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    ce = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == labels) * ok) / jnp.maximum(jnp.sum(ok), 1)
    loss, stats = ce, {"ce": ce, "acc": acc}
    if drafter.candidate_selector is not None:
        sel = drafter.candidate_selector
        unary, cand = jax.lax.top_k(jax.lax.stop_gradient(logits), sel.top_k)  # [S*N, B-1, K]
        hit = cand == labels[..., None]
        cand = jnp.where(jnp.any(hit, -1, keepdims=True), cand, cand.at[..., -1].set(labels))
        unary = jnp.take_along_axis(jax.lax.stop_gradient(logits), cand, axis=-1)
        scores = unary + sel.edges(h, want[:, :-1], cand)
        target_idx = jnp.argmax(cand == labels[..., None], axis=-1)
        sel_nll = -jnp.take_along_axis(jax.nn.log_softmax(scores), target_idx[..., None], axis=-1)[..., 0]
        stats["selector"] = jnp.sum(sel_nll * w) / jnp.maximum(jnp.sum(w), 1.0)
        loss = loss + stats["selector"]
    return loss, stats


def make_step(optimizer, anchors: int, gamma: float):
    """A jitted AdamW step over the drafter's parameters (the target is frozen)."""

    @functools.partial(jax.jit, static_argnames=("drafter_def", "target_def"), donate_argnames=("params", "opt"))
    def step(drafter_def, params, opt, target_def, target_params, batch, key):
        target = models.merge(target_def, target_params)

        def loss_of(p):
            return block_loss(models.merge(drafter_def, p), target, batch["feats"], batch["tokens"], batch["lengths"],
                              batch["starts"], key, anchors, gamma)

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt = optimizer.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss, stats

    return step


def optimizer(lr: float = 1e-3, warmup: int = 20, steps: int = 1000, weight_decay: float = 0.01):
    """AdamW with warmup and cosine decay, gradients clipped to norm 1."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=weight_decay))


def evaluate(drafter_def, params, target_def, target_params, batch, anchors: int, gamma: float, seed: int = 0):
    """Loss and stats on a batch at fixed anchors (no update)."""
    return _eval(drafter_def, params, target_def, target_params, batch, jax.random.key(seed), anchors, gamma)


@functools.partial(jax.jit, static_argnames=("drafter_def", "target_def", "anchors", "gamma"))
def _eval(drafter_def, params, target_def, target_params, batch, key, anchors, gamma):
    return block_loss(models.merge(drafter_def, params), models.merge(target_def, target_params), batch["feats"],
                      batch["tokens"], batch["lengths"], batch["starts"], key, anchors, gamma)
