"""A cost model of resumed turns under two rules for a prompt's last prefill call (docs/prefix_cache.md, "The chunk").

  python3 scripts/probes/tail_rule_model.py [--fixed 57 --row 1.38 --row-key 0.0025 --chunk 64]

Rule "grid": chunks of C from 0, the last one cut at the prompt's end (what the runner does). Rule "2C tail": chunks of
C up to the grid point before the last, then one call of up to 2C tokens. A call costs `fixed + row * rows + row_key
* rows * keys` with rows padded as the runner pads them (a power of two from 16) and keys to a power of two of pages;
the defaults are SmolLM2's on the shared CPU at load ~5 after the one-row-dot fix. A turn resumes at the deepest
grid point that both the earlier turn cached and the new turn's calls start at. Printed: the bench chat's turns
(prompt tokens, resume point, calls, cost / the 61-token one-message request) and the mean of 2000 random chats.
"""

from __future__ import annotations

import argparse
import random

CHAT = [61, 104, 142, 182, 221, 263, 303, 342]  # scripts/bench_prefix.py's prompt lengths (SmolLM2, 8-token replies)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def last_start(length: int, chunk: int, tail: int) -> int:
    """Where the last call starts: `tail` 1 for the grid, 2 for a last call of up to 2C tokens."""
    return chunk * max(0, -(-length // chunk) - tail)


def cached(length: int, chunk: int, tail: int) -> int:
    """The end of the prompt's full C-chunk calls (what a later turn may resume from)."""
    t = last_start(length, chunk, tail)
    return t + chunk if length - t == chunk else t


def calls(length: int, resume: int, chunk: int, tail: int) -> list[tuple[int, int]]:
    t = last_start(length, chunk, tail)
    return [(s, chunk) for s in range(resume, t, chunk)] + [(t, length - t)]


def cost(cs, chunk: int, page: int, a) -> float:
    total = 0.0
    for s, n in cs:
        rows = max(16, pow2(n))
        keys = pow2(-(-(s + rows) // page)) * page
        total += a.fixed + a.row * rows + a.row_key * rows * keys
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixed", type=float, default=57.0, help="ms a call")
    ap.add_argument("--row", type=float, default=1.38, help="ms a padded row")
    ap.add_argument("--row-key", type=float, default=0.0025, help="ms a padded row and key")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    c = a.chunk
    for tail, name in ((1, "grid"), (2, "2C tail")):
        one = cost(calls(CHAT[0], 0, c, tail), c, a.page, a)
        cells = []
        for i, n in enumerate(CHAT):
            r = 0 if i == 0 else min(cached(CHAT[i - 1], c, tail), last_start(n, c, tail))
            cs = calls(n, r, c, tail)
            cells.append(f"{n}: at {r}, {len(cs)} calls, {cost(cs, c, a.page, a) / one:.2f}")
        rng, total, turns = random.Random(0), 0.0, 0
        for _ in range(2000):
            prev = rng.randint(40, 80)
            for _ in range(7):
                n = prev + rng.randint(30, 60)
                total += cost(calls(n, min(cached(prev, c, tail), last_start(n, c, tail)), c, tail), c, a.page, a)
                turns, prev = turns + 1, n
        print(f"{name}: one message {one:.0f} ms; chat {'; '.join(cells)}; random chats: mean {total / turns:.0f} ms")


if __name__ == "__main__":
    main()
