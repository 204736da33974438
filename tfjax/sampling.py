"""Keyed exact sampling: the token at absolute position p depends only on (logits, params, seed, p).

Sampled token = argmax(logits / T + gumbel(seed, p)) over the tokens that survive top-k, then top-p, then
min-p (filtered tokens are -inf); ties go to the lower id. Greedy (T == 0) is plain argmax(logits). The
noise for (seed, p) is a pure function of (seed, p, token id), never of the row, lane or batch size, so a
drafted position samples the same token as a plain one given the same logits: that is exactness.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "seed"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-lane sampling arrays, all [L]: off values are top_k 0, top_p 1, min_p 0; temperature 0 = greedy."""

    temperature: jax.Array  # f32 [L]
    top_k: jax.Array  # i32 [L]
    top_p: jax.Array  # f32 [L]
    min_p: jax.Array  # f32 [L]
    seed: jax.Array  # u32 [L]

    @classmethod
    def create(
        cls,
        lanes: int,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        min_p: float | Sequence[float] = 0.0,
        seed: int | Sequence[int] = 0,
    ) -> SamplingParams:
        """Host-side constructor: scalars broadcast to all lanes; values are checked here, not under jit."""

        def col(name: str, value, dtype) -> np.ndarray:
            arr = np.broadcast_to(np.asarray(value), (lanes,))
            if name == "seed":
                if np.any(arr < 0) or np.any(arr >= 2**32):
                    raise ValueError(f"seed values {arr} must be in [0, 2**32)")
            return np.asarray(arr, dtype=dtype)

        t = col("temperature", temperature, np.float32)
        k = col("top_k", top_k, np.int32)
        p = col("top_p", top_p, np.float32)
        m = col("min_p", min_p, np.float32)
        s = col("seed", seed, np.uint32)
        if np.any(t < 0) or not np.all(np.isfinite(t)):
            raise ValueError(f"temperature {t} must be finite and >= 0")
        if np.any(k < 0):
            raise ValueError(f"top_k {k} must be >= 0 (0: off)")
        if np.any(p <= 0) or np.any(p > 1):
            raise ValueError(f"top_p {p} must be in (0, 1] (1: off)")
        if np.any(m < 0) or np.any(m > 1):
            raise ValueError(f"min_p {m} must be in [0, 1] (0: off)")
        return cls(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), jnp.asarray(m), jnp.asarray(s))


def gumbel_noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [V] for one (seed, absolute position): the only source of randomness in sampling."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), position)
    return jax.random.gumbel(key, (vocab,), dtype=jnp.float32)


CANDIDATES = 256  # a lane with 0 < top_k <= this filters among its top candidates only (no full-vocab sort)


def _keep_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
               candidates: int = 0) -> jax.Array:
    """Tokens that survive top-k, top-p (on the top-k distribution) and min-p: bool [L, R, V].

    Every filter keeps a prefix of the order (value descending, id ascending), so the survivors are the
    first c tokens of that order, c = min(c_k, c_p, c_m) >= 1; a token is kept iff it sorts at or before
    the c-th one. With `candidates`, only that many leading tokens are ordered (`lax.top_k`, ties to the
    lower id); exact for lanes whose top_k is within them.
    """
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)  # [L, R, V]
    if candidates:
        vals, ids_sorted = jax.lax.top_k(scaled, candidates)  # [L, R, n]
    else:
        neg_sorted, ids_sorted = jax.lax.sort((-scaled, ids), dimension=scaled.ndim - 1, num_keys=2)
        vals = -neg_sorted  # descending values, ties by ascending id: [L, R, V]
    n = vals.shape[-1]
    rank = jax.lax.broadcasted_iota(jnp.int32, vals.shape, vals.ndim - 1)
    k = top_k[:, None]  # [L, 1]
    c_k = jnp.where(k > 0, jnp.minimum(k, n), n)  # [L, 1]
    probs = jax.nn.softmax(jnp.where(rank < c_k[..., None], vals, -jnp.inf), axis=-1)  # [L, R, n]
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
    inside = (before < top_p[:, None, None]) | (rank == 0)
    c_p = jnp.where(jnp.all(inside, axis=-1), n, jnp.argmin(inside, axis=-1))  # first outside: [L, R]
    c_p = jnp.where(top_p[:, None] >= 1.0, n, c_p)
    threshold = vals[..., :1] + jnp.log(min_p)[:, None, None]  # log(0) = -inf keeps everything
    c_m = jnp.sum(vals >= threshold, axis=-1)  # [L, R]
    c = jnp.minimum(jnp.minimum(c_k, c_p), c_m)  # [L, R] (c_m >= 1: the top always passes)
    last_val = jnp.take_along_axis(vals, c[..., None] - 1, axis=-1)  # [L, R, 1]
    last_id = jnp.take_along_axis(ids_sorted, c[..., None] - 1, axis=-1)
    return (scaled > last_val) | ((scaled == last_val) & (ids <= last_id))


def sample(logits: jax.Array, positions: jax.Array, params: SamplingParams) -> jax.Array:
    """Tokens [L, R] i32 for logits [L, R, V] at absolute positions [L, R] (the position being chosen)."""
    if logits.ndim != 3 or positions.shape != logits.shape[:2]:
        raise ValueError(f"logits {logits.shape} must be [L, R, V] and positions {positions.shape} [L, R]")
    if params.temperature.shape != logits.shape[:1]:
        raise ValueError(f"params have {params.temperature.shape} lanes, logits {logits.shape[0]}")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy_lane = params.temperature == 0  # [L]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [L, R]

    def sampled(_: None) -> jax.Array:
        t = jnp.where(greedy_lane, 1.0, params.temperature)[:, None, None]
        scaled = logits / t + 0.0  # + 0.0 turns -0.0 into 0.0 so sort and compare agree on ties
        filtering = ~greedy_lane & ((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0))
        # A lane's filter depends only on its own top_k: within CANDIDATES, a top_k over the candidates;
        # otherwise the full sort. Each is computed only when some lane needs it.
        n = min(CANDIDATES, vocab)
        short = (params.top_k > 0) & (params.top_k <= n)  # [L]
        everything = jnp.ones(scaled.shape, dtype=bool)
        full = jax.lax.cond(jnp.any(filtering & ~short),
                            lambda: _keep_mask(scaled, params.top_k, params.top_p, params.min_p), lambda: everything)
        cand = jax.lax.cond(jnp.any(filtering & short),
                            lambda: _keep_mask(scaled, params.top_k, params.top_p, params.min_p, n),
                            lambda: everything)
        keep = jnp.where(short[:, None, None], cand, full)
        noise = jax.vmap(jax.vmap(gumbel_noise, in_axes=(None, 0, None)), in_axes=(0, 0, None))(
            params.seed, positions, vocab
        )  # [L, R, V]
        drawn = jnp.argmax(jnp.where(keep, scaled, -jnp.inf) + noise, axis=-1).astype(jnp.int32)
        return jnp.where(greedy_lane[:, None], greedy_tokens, drawn)

    return jax.lax.cond(jnp.all(greedy_lane), lambda _: greedy_tokens, sampled, None)


def default_seed(prompt_ids: Sequence[int] | np.ndarray) -> int:
    """The seed a request gets when it names none: 31 bits of sha256 over the prompt's int32 bytes."""
    digest = hashlib.sha256(np.asarray(prompt_ids, dtype="<i4").tobytes()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def token_sha256(ids: Sequence[int] | np.ndarray) -> str:
    """Hex sha256 of token ids as little-endian int32 bytes: the exactness receipt in every reply."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()
