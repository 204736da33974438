"""Root copies: propose the tokens that followed the most recent earlier occurrence of a lane's suffix.

A lane's history is its root (prompt plus output so far) in a fixed [S] buffer; positions >= length are
garbage and never read into a match or a proposal. A copy only changes which rows are proposed, never
which tokens are committed, so it cannot break exactness. `copy_match` and the proposal count are static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("copy_match", "max_proposals"))
def propose_copies(
    history: jax.Array, length: jax.Array, copy_match: int, max_proposals: int
) -> tuple[jax.Array, jax.Array]:
    """(proposals [L, P] i32, count [L] i32) from each lane's last `copy_match` tokens; padding is 0."""
    if copy_match < 1:
        raise ValueError(
            f"copy_match={copy_match} must be >= 1 (0 means copies off: resolve it before calling)"
        )
    if max_proposals < 0:
        raise ValueError(f"max_proposals={max_proposals} must be >= 0")
    if history.ndim != 2 or length.shape != history.shape[:1]:
        raise ValueError(f"history {history.shape} must be [L, S] and length {length.shape} must be [L]")
    m, p = copy_match, max_proposals
    _, s = history.shape
    history = history.astype(jnp.int32)  # history: [L, S]
    length = length.astype(jnp.int32)  # length: [L]
    ends = jnp.arange(s, dtype=jnp.int32)  # candidate end e (inclusive) of an earlier occurrence: [S]
    # Left-pad by m so that history[e - k] is a static slice for every k < m; pad slots never match (masked).
    padded = jnp.pad(history, ((0, 0), (m, 0)))  # [L, m + S]
    match = jnp.ones(history.shape, dtype=bool)  # [L, S]
    for k in range(m):
        suffix_k = jnp.take_along_axis(history, jnp.clip(length - 1 - k, 0, s - 1)[:, None], axis=1)  # [L, 1]
        match &= padded[:, m - k : m - k + s] == suffix_k
    valid = (ends[None, :] >= m - 1) & (ends[None, :] < length[:, None] - 1) & (length[:, None] >= m + 1)
    match &= valid
    end = jnp.max(jnp.where(match, ends[None, :], -1), axis=1)  # most recent earlier end, -1 if none: [L]
    count = jnp.where(end >= 0, jnp.minimum(p, length - 1 - end), 0).astype(jnp.int32)  # [L]
    offs = jnp.arange(p, dtype=jnp.int32)  # [P]
    idx = jnp.clip(end[:, None] + 1 + offs[None, :], 0, s - 1)  # [L, P]
    proposals = jnp.take_along_axis(history, idx, axis=1)
    proposals = jnp.where(offs[None, :] < count[:, None], proposals, 0).astype(jnp.int32)  # [L, P]
    return proposals, count


def propose_copies_reference(
    history: np.ndarray, length: np.ndarray, copy_match: int, max_proposals: int
) -> tuple[np.ndarray, np.ndarray]:
    """Plain-loop twin of `propose_copies` for tests."""
    history = np.asarray(history)
    length = np.asarray(length)
    lanes = history.shape[0]
    proposals = np.zeros((lanes, max_proposals), dtype=np.int32)
    count = np.zeros((lanes,), dtype=np.int32)
    for lane in range(lanes):
        n = int(length[lane])
        tokens = [int(t) for t in history[lane, :n]]
        if n < copy_match + 1:
            continue
        suffix = tokens[n - copy_match :]
        for end in range(n - 2, copy_match - 2, -1):  # most recent first
            if tokens[end - copy_match + 1 : end + 1] == suffix:
                follow = tokens[end + 1 : end + 1 + max_proposals]
                proposals[lane, : len(follow)] = follow
                count[lane] = len(follow)
                break
    return proposals, count
