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
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tfjax import models, ops
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
             seed: int = 0, eos_ids: tuple[int, ...] = (), progress=None, temperatures: list[float] | None = None,
             deadline: float | None = None) -> list[list[int] | None]:
    """The target's own continuations of `prompts` (plain lane rounds, `draft: false`).

    `temperatures` gives each prompt its own (0 greedy; sampled ones take top-k 40); past `deadline`
    (time.monotonic) no new request is admitted and the unfinished ones come back as None."""
    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig

    temps = temperatures if temperatures is not None else [temperature] * len(prompts)
    context = max(len(p) for p in prompts) + max_tokens + 2
    engine = Engine(target, LaneConfig(capacity=lanes, width=1, context=-(-context // 16) * 16), eos_ids=eos_ids)
    reqs = [Request(p, max_tokens=max_tokens, temperature=t, top_k=40 if t else 0, seed=seed + i, draft=False)
            for i, (p, t) in enumerate(zip(prompts, temps, strict=True))]
    ids, queued = [], iter(reqs)
    while True:  # keep 2x the lanes submitted, so a deadline leaves little half-done work
        while len(ids) - len(engine.results) < 2 * lanes and (deadline is None or time.monotonic() < deadline):
            r = next(queued, None)
            if r is None:
                break
            ids.append(engine.submit(r))
        if all(i in engine.results for i in ids):
            if len(ids) == len(reqs) or (deadline is not None and time.monotonic() >= deadline):
                break
            continue
        engine.step()
        if progress is not None:
            progress(len(engine.results))
    done = [engine.results[i].token_ids for i in ids]
    return done + [None] * (len(reqs) - len(done))


def acceptance(target, drafter, prompts: list[list[int]], max_tokens: int, *, lanes: int = 16,
               eos_ids: tuple[int, ...] = (), context: int | None = None) -> tuple[float, list[float]]:
    """Tokens a round of the drafter's blocks alone (copies off) in the real lane round, greedy, over `prompts`:
    committed tokens over rounds, all prompts together, and each prompt's own."""
    from tfjax.engine import Engine, Request
    from tfjax.lanes.config import LaneConfig
    from tfjax.lanes.drafter import RoundFacts

    block = drafter.config.block_size
    context = context or -(-(max(len(p) for p in prompts) + max_tokens + block + 2) // 16) * 16
    engine = Engine(target, LaneConfig(capacity=lanes, width=block, context=context), drafter=drafter, eos_ids=eos_ids)
    engine.runner.set_facts(RoundFacts(copy_match=0, draft_block=block - 1))
    results = engine.run([Request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts])
    total = sum(len(r.token_ids) for r in results) / max(sum(r.rounds for r in results), 1)
    return total, [r.tokens_per_round for r in results]


def pack(prompts: list[list[int]], outputs: list[list[int]], length: int) -> dict[str, np.ndarray]:
    """Sequences (prompt + output) in [S, length] with each one's valid length and first generated position."""
    tokens = np.zeros((len(prompts), length), np.int32)
    lengths, starts = np.zeros(len(prompts), np.int32), np.zeros(len(prompts), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        seq = (p + o)[:length]
        tokens[i, : len(seq)] = seq
        lengths[i], starts[i] = len(seq), min(len(p), len(seq))
    return {"tokens": tokens, "lengths": lengths, "starts": starts}


def taps_of(target, tokens: jax.Array, taps: tuple[int, ...]) -> jax.Array:
    """The target's tapped hidden states [S, T, len(taps) * D] of whole sequences tokens [S, T]."""
    s, t = tokens.shape
    cache = target.init_cache(s, t)
    mode = dataclasses.replace(PROMPT, last_only=False, taps=taps)
    _, _, _, feats = target(tokens, jnp.zeros((s,), jnp.int32), jnp.full((s,), t, jnp.int32), cache, mode)
    return feats


@functools.partial(jax.jit, static_argnames=("target_def", "taps"))
def tap_features(target_def, target_params, tokens: jax.Array, taps: tuple[int, ...]) -> jax.Array:
    """`taps_of`, jitted over the target's (graphdef, params)."""
    return taps_of(models.merge(target_def, target_params), tokens, taps)


def cast(params, dtype):
    """Floating leaves of a parameter tree in `dtype` (the compute copy of float32 master weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


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


def make_step(optimizer, anchors: int, gamma: float, compute_dtype=None):
    """A jitted AdamW step over the drafter's parameters (the target is frozen).

    A batch holds `feats` (tapped states), or only tokens: then the target's taps are computed in the step. With
    `compute_dtype` the forward and backward run on a cast of the (float32 master) parameters: the drafter only
    proposes, so its precision changes what is accepted, never what is output."""

    @functools.partial(jax.jit, static_argnames=("drafter_def", "target_def"), donate_argnames=("params", "opt"))
    def step(drafter_def, params, opt, target_def, target_params, batch, key, scale=1.0):
        target = models.merge(target_def, target_params)
        feats = batch.get("feats")
        if feats is None:
            feats = jax.lax.stop_gradient(taps_of(target, batch["tokens"],
                                                  models.merge(drafter_def, params).config.target_layer_ids))

        def loss_of(p):
            p = p if compute_dtype is None else cast(p, compute_dtype)
            with ops.training():
                return block_loss(models.merge(drafter_def, p), target, feats, batch["tokens"], batch["lengths"],
                                  batch["starts"], key, anchors, gamma)

        (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt = optimizer.update(grads, opt, params)
        updates = jax.tree.map(lambda u: scale * u, updates)  # the host's learning rate with `unit_optimizer`
        return optax.apply_updates(params, updates), opt, loss, stats

    return step


def optimizer(lr: float = 1e-3, warmup: int = 20, steps: int = 1000, weight_decay: float = 0.01):
    """AdamW with warmup and cosine decay, gradients clipped to norm 1."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=weight_decay))


def unit_optimizer(weight_decay: float = 0.01):
    """AdamW at learning rate 1, gradients clipped to norm 1: a step's `scale` is the learning rate (set by the
    host from `learning_rate`, so a run bounded by time still decays)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1.0, weight_decay=weight_decay))


def learning_rate(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warmup over the first `warmup` of the run, then cosine decay to `floor` x peak at progress 1."""
    if progress < warmup:
        return peak * progress / warmup
    t = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return float(peak * (floor + (1.0 - floor) * 0.5 * (1.0 + np.cos(np.pi * t))))


def evaluate(drafter_def, params, target_def, target_params, batch, anchors: int, gamma: float, seed: int = 0,
             compute_dtype=None):
    """Loss and stats on a batch at fixed anchors (no update); tapped states computed when the batch has none."""
    return _eval(drafter_def, params, target_def, target_params, batch, jax.random.key(seed), anchors, gamma,
                 compute_dtype)


@functools.partial(jax.jit, static_argnames=("drafter_def", "target_def", "anchors", "gamma", "compute_dtype"))
def _eval(drafter_def, params, target_def, target_params, batch, key, anchors, gamma, compute_dtype):
    target = models.merge(target_def, target_params)
    drafter = models.merge(drafter_def, params if compute_dtype is None else cast(params, compute_dtype))
    feats = batch.get("feats")
    if feats is None:
        feats = taps_of(target, batch["tokens"], drafter.config.target_layer_ids)
    return block_loss(drafter, target, feats, batch["tokens"], batch["lengths"], batch["starts"], key, anchors, gamma)
