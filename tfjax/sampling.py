"""Keyed exact sampling: the token at absolute position p depends only on (logits, params, seed, p).

Sampled token = argmax(logits / T + gumbel(seed, p, id)) over the tokens that survive top-k, then top-p,
then min-p (filtered tokens are -inf); ties go to the lower id. Greedy (T == 0) is plain argmax(logits). The
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

from tfjax import ops


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


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche (lowbias32), uint32 in and out."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seed: jax.Array, position: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise for token `ids` at (seed, absolute position): a pure function of (seed, position, id).

    Counter-based, so the noise of any subset of ids (a lane's top candidates) costs only that subset.
    seed, position and ids broadcast together; 24-bit uniforms, never 0 or 1.
    """
    u32 = jnp.uint32
    base = _mix32(_mix32(seed.astype(u32)) ^ _mix32(position.astype(u32) * u32(0x9E3779B9) + u32(0x632BE5AB)))
    bits = _mix32(base ^ _mix32(ids.astype(u32) * u32(0x85EBCA6B) + u32(0xC2B2AE35)))
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / 2**24)
    return -jnp.log(-jnp.log(uniform))


CANDIDATES = 256  # a lane with 0 < top_k <= this samples among its top candidates only (no full-vocab work)


def _cutoff(vals: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
            log_norm: jax.Array) -> jax.Array:
    """How many leading tokens of the order (value descending, id ascending) survive: c [L, R] >= 1.

    Every filter keeps a prefix of that order: c = min(c_k, c_p, c_m), top-p on the top-k distribution (a lane
    without top-k: on the whole vocabulary's, normalised by `log_norm` [L, R, 1], its logsumexp).
    `vals` [L, R, n] are the leading n values of the order (n = V, or the candidates).
    """
    n = vals.shape[-1]
    rank = jax.lax.broadcasted_iota(jnp.int32, vals.shape, vals.ndim - 1)
    k = top_k[:, None]  # [L, 1]
    c_k = jnp.where(k > 0, jnp.minimum(k, n), n)  # [L, 1]
    truncated = jax.nn.softmax(jnp.where(rank < c_k[..., None], vals, -jnp.inf), axis=-1)  # [L, R, n]
    probs = jnp.where(k[..., None] > 0, truncated, jnp.exp(vals - log_norm))
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
    inside = (before < top_p[:, None, None]) | (rank == 0)
    c_p = jnp.where(jnp.all(inside, axis=-1), n, jnp.argmin(inside, axis=-1))  # first outside: [L, R]
    c_p = jnp.where(top_p[:, None] >= 1.0, n, c_p)
    threshold = vals[..., :1] + jnp.log(min_p)[:, None, None]  # log(0) = -inf keeps everything
    c_m = jnp.sum(vals >= threshold, axis=-1)  # [L, R]
    return jnp.minimum(jnp.minimum(c_k, c_p), c_m)  # (c_m >= 1: the top always passes)


def _keep_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Tokens that survive top-k, top-p and min-p over the whole vocabulary (one full sort): bool [L, R, V]."""
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)  # [L, R, V]
    neg_sorted, ids_sorted = jax.lax.sort((-scaled, ids), dimension=scaled.ndim - 1, num_keys=2)
    vals = -neg_sorted  # descending values, ties by ascending id
    c = _cutoff(vals, top_k, top_p, min_p, _log_norm(scaled))
    last_val = jnp.take_along_axis(vals, c[..., None] - 1, axis=-1)  # [L, R, 1]
    last_id = jnp.take_along_axis(ids_sorted, c[..., None] - 1, axis=-1)
    return (scaled > last_val) | ((scaled == last_val) & (ids <= last_id))


def _log_norm(scaled: jax.Array) -> jax.Array:
    """The whole vocabulary's logsumexp [L, R, 1]: top-p's normaliser for lanes without top-k."""
    return jax.nn.logsumexp(scaled, axis=-1, keepdims=True)


def _first_best(score: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:
    """The id with the highest score, the lower id on ties: [L, R] i32."""
    best = jnp.max(score, axis=-1, keepdims=True)
    return jnp.min(jnp.where(score == best, ids, vocab), axis=-1).astype(jnp.int32)


def greedy(logits: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first best id, or the first NaN), i32: a max, then the first id holding
    it, two vectorised passes where XLA CPU's (value, id) reduce is one slow one (2x at [1, 8, 49k])."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    best = jnp.max(logits, axis=-1, keepdims=True)  # NaN when any is: then the first NaN
    hit = (logits == best) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1)


def sample(logits: jax.Array, positions: jax.Array, params: SamplingParams) -> jax.Array:
    """Tokens [L, R] i32 for logits [L, R, V] at absolute positions [L, R] (the position being chosen)."""
    if logits.ndim != 3 or positions.shape != logits.shape[:2]:
        raise ValueError(f"logits {logits.shape} must be [L, R, V] and positions {positions.shape} [L, R]")
    if params.temperature.shape != logits.shape[:1]:
        raise ValueError(f"params have {params.temperature.shape} lanes, logits {logits.shape[0]}")
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy_lane = params.temperature == 0  # [L]
    greedy_tokens = greedy(logits)  # [L, R]
    seed, pos = params.seed[:, None, None], positions[..., None]

    def sampled(_: None) -> jax.Array:
        t = jnp.where(greedy_lane, 1.0, params.temperature)[:, None, None]
        scaled = logits / t + 0.0  # + 0.0 turns -0.0 into 0.0 so sort and compare agree on ties
        filtering = ~greedy_lane & ((params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0))
        n = min(CANDIDATES, vocab)
        # A row's path depends only on its own lane's filters and logits, so its token never depends on its
        # neighbours: a top-k within the candidates always takes them; top-p or min-p alone take them when the
        # nucleus closes inside them (its cutoff short of n), else the full sort.
        short = filtering & (params.top_k > 0) & (params.top_k <= n)  # [L]
        tried = short | (filtering & (params.top_k == 0))
        zeros = jnp.zeros(greedy_tokens.shape, jnp.int32)

        def among_candidates() -> tuple[jax.Array, jax.Array]:
            # [L, R, n], ties to the lower id; the barrier keeps XLA CPU from rewriting top_k into a full
            # sort when the cutoff's cumsum follows (measured 74 ms vs 1.7 ms at 9 x 49k)
            # (one barrier per output: a barrier over top_k's tuple crashed XLA's SPMD partitioner under a mesh)
            vals, ids = (jax.lax.optimization_barrier(a) for a in jax.lax.top_k(scaled, n))
            rank = jax.lax.broadcasted_iota(jnp.int32, vals.shape, vals.ndim - 1)
            c = _cutoff(vals, params.top_k, params.top_p, params.min_p, _log_norm(scaled))  # [L, R]
            score = jnp.where(rank < c[..., None], vals + gumbel_noise(seed, pos, ids), -jnp.inf)
            closed = tried[:, None] & (short[:, None] | (c < n))  # [L, R]: the cutoff fell inside the candidates
            return _first_best(score, ids, vocab), closed

        def over_vocabulary() -> jax.Array:
            ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
            keep = jax.lax.cond(jnp.any(filtering[:, None] & ~closed),
                                lambda: _keep_mask(scaled, params.top_k, params.top_p, params.min_p),
                                lambda: jnp.ones(scaled.shape, dtype=bool))
            score = jnp.where(keep, scaled + gumbel_noise(seed, pos, ids), -jnp.inf)
            return _first_best(score, ids, vocab)

        cand, closed = jax.lax.cond(jnp.any(tried), among_candidates,
                                    lambda: (zeros, jnp.zeros(greedy_tokens.shape, bool)))
        full = jax.lax.cond(jnp.any(~greedy_lane[:, None] & ~closed), over_vocabulary, lambda: zeros)
        drawn = jnp.where(closed, cand, full)
        return jnp.where(greedy_lane[:, None], greedy_tokens, drawn)

    return jax.lax.cond(jnp.all(greedy_lane), lambda _: greedy_tokens, sampled, None)


def default_seed(prompt_ids: Sequence[int] | np.ndarray) -> int:
    """The seed a request gets when it names none: 31 bits of sha256 over the prompt's int32 bytes."""
    digest = hashlib.sha256(np.asarray(prompt_ids, dtype="<i4").tobytes()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def token_sha256(ids: Sequence[int] | np.ndarray) -> str:
    """Hex sha256 of token ids as little-endian int32 bytes: the exactness receipt in every reply."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


BIAS_LIMIT = 300  # OpenAI's cap on logit_bias entries
TOP_LOGPROBS = 20  # the most alternatives a reply may ask for (static: the round always computes this many)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["presence", "frequency", "repetition", "bias", "prompt_seen", "counts", "used", "logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Processors:
    """Per-lane logit processors (data, not static): penalties, logit_bias and the counts they read.

    Row j of a round sees `counts` (the lane's output so far, the pending token included) plus the round's
    proposals 0..j-1, so a verify row gets exactly the logits the plain path would: that keeps drafting exact.
    """

    presence: jax.Array  # f32 [L], OpenAI presence_penalty (0: off)
    frequency: jax.Array  # f32 [L], OpenAI frequency_penalty (0: off)
    repetition: jax.Array  # f32 [L], HF/vLLM repetition_penalty over prompt + output (1: off)
    bias: jax.Array  # f32 [L, V], logit_bias added (0: none)
    prompt_seen: jax.Array  # bool [L, V], tokens of the prompt (for the repetition penalty)
    counts: jax.Array  # i32 [L, V], output tokens so far
    used: jax.Array  # bool [L], any processor on (lanes without leave logits bit for bit)
    logprobs: jax.Array  # bool [L], the reply wants log-probabilities

    @classmethod
    def create(cls, lanes: int, vocab: int) -> Processors:
        """Every processor off for `lanes` lanes."""
        return cls(jnp.zeros((lanes,), jnp.float32), jnp.zeros((lanes,), jnp.float32), jnp.ones((lanes,), jnp.float32), jnp.zeros((lanes, vocab), jnp.float32),
                   jnp.zeros((lanes, vocab), bool), jnp.zeros((lanes, vocab), jnp.int32), jnp.zeros((lanes,), bool),
                   jnp.zeros((lanes,), bool))

    @classmethod
    def for_request(cls, vocab: int, prompt: Sequence[int], presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                    logit_bias: dict[int, float] | None = None, logprobs: bool = False) -> Processors:
        """One lane's processors before its first token (checked here, on the host)."""
        for name, value, lo, hi in (("presence_penalty", presence_penalty, -2.0, 2.0),
                                    ("frequency_penalty", frequency_penalty, -2.0, 2.0)):
            if not np.isfinite(value) or not lo <= value <= hi:
                raise ValueError(f"{name} {value} must be in [{lo}, {hi}]")
        if not np.isfinite(repetition_penalty) or repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty {repetition_penalty} must be > 0 (1: off)")
        bias = np.zeros((1, vocab), np.float32)
        logit_bias = dict(logit_bias or {})
        if len(logit_bias) > BIAS_LIMIT:
            raise ValueError(f"logit_bias has {len(logit_bias)} entries; at most {BIAS_LIMIT} are allowed")
        for tok, value in logit_bias.items():
            if not 0 <= int(tok) < vocab:
                raise ValueError(f"logit_bias token {tok} is outside the vocabulary of {vocab}")
            if not np.isfinite(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias value {value} for token {tok} must be in [-100, 100]")
            bias[0, int(tok)] = value
        seen = np.zeros((1, vocab), bool)
        seen[0, np.asarray(prompt, np.int64)] = True
        used = presence_penalty != 0 or frequency_penalty != 0 or repetition_penalty != 1 or bool(np.any(bias))
        return cls(jnp.float32([presence_penalty]), jnp.float32([frequency_penalty]),
                   jnp.float32([repetition_penalty]), jnp.asarray(bias), jnp.asarray(seen),
                   jnp.zeros((1, vocab), jnp.int32), jnp.asarray([used]), jnp.asarray([bool(logprobs)]))


def _row_counts(counts: jax.Array, rows: jax.Array) -> jax.Array:
    """Counts [L, R, V] seen by each row: the lane's counts plus rows 1..j (proposals before row j)."""
    vocab = counts.shape[-1]
    onehot = (rows[..., None] == jnp.arange(vocab, dtype=rows.dtype)).astype(jnp.int32)  # [L, R, V]
    before = jnp.cumsum(onehot, axis=1) - onehot[:, :1]  # row 0 (the pending token) is counted already
    return counts[:, None, :] + before


def apply_processors(logits: jax.Array, rows: jax.Array, proc: Processors) -> jax.Array:
    """Logits [L, R, V] f32 after repetition, frequency/presence penalties and logit_bias (that order).

    `rows` [L, R] are the round's verify rows (pending token, proposals). Lanes with no processor on keep
    their logits bit for bit, and a round where no lane uses one skips the work.
    """
    def processed(x: jax.Array) -> jax.Array:
        counts = _row_counts(proc.counts, rows)  # [L, R, V]
        seen = proc.prompt_seen[:, None, :] | (counts > 0)
        rep = proc.repetition[:, None, None]
        y = jnp.where(seen & (rep != 1), jnp.where(x > 0, x / rep, x * rep), x)
        pen = proc.frequency[:, None, None] * counts + proc.presence[:, None, None] * (counts > 0)
        y = jnp.where(counts > 0, y - pen, y)
        bias = proc.bias[:, None, :]
        y = jnp.where(bias != 0, y + bias, y)
        return jnp.where(proc.used[:, None, None], y, x)

    return jax.lax.cond(jnp.any(proc.used), processed, lambda x: x, logits)


def add_tokens(proc: Processors, tokens: jax.Array, keep: jax.Array) -> Processors:
    """Count committed tokens [L, W] (where `keep`) into the lanes' output counts."""
    vocab = proc.counts.shape[-1]
    lanes = jnp.arange(tokens.shape[0])[:, None]
    counts = proc.counts.at[lanes, jnp.where(keep, tokens, vocab)].add(1, mode="drop")
    return dataclasses.replace(proc, counts=counts)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["logprob", "top_ids", "top_logprobs"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """The chosen tokens' log-probabilities [L, R] and the top TOP_LOGPROBS alternatives [L, R, K]."""

    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def logprobs(logits: jax.Array, chosen: jax.Array, wanted: jax.Array) -> Logprobs:
    """Log-softmax of the model's raw logits (before penalties, bias, grammar and temperature, as vLLM's
    default) at the chosen tokens, plus the top alternatives; zeros when no lane wants them.

    One row [V] a loop iteration (`ops.fenced_map`): XLA's reduction over the vocabulary rounds differently at other
    shapes ([L, R, V] against a device's half of the lanes under a `data` axis, or a prefill's [1, 1, V]), so a
    row's logprobs never depend on how many rows share the call, nor on the mesh."""
    n_lanes, rows, vocab = logits.shape
    k = min(TOP_LOGPROBS, vocab)

    def one(row: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        x, c = row  # x [V], c the chosen id
        lp = jax.nn.log_softmax(x.astype(jnp.float32))
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return jax.lax.dynamic_index_in_dim(lp, c, keepdims=False), top_ids.astype(jnp.int32), top_lp

    def compute(_: None) -> Logprobs:
        lp, top_ids, top_lp = ops.fenced_map(one, (logits.reshape(-1, vocab), chosen.reshape(-1)))
        return Logprobs(lp.reshape(n_lanes, rows), top_ids.reshape(n_lanes, rows, k), top_lp.reshape(n_lanes, rows, k))

    def none(_: None) -> Logprobs:
        return Logprobs(jnp.zeros((n_lanes, rows), jnp.float32), jnp.zeros((n_lanes, rows, k), jnp.int32),
                        jnp.zeros((n_lanes, rows, k), jnp.float32))

    return jax.lax.cond(jnp.any(wanted), compute, none, None)
