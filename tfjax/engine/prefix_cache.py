"""The prefix cache: plain Python bookkeeping over the KV page pool (no jax here).

Invariants:
- A page is free, owned by lanes (refcount > 0), or cached and idle (refcount 0, in the LRU). Only idle
  pages are ever evicted, so no page is handed to a new request while a lane reads it.
- A cached page is keyed by a chained hash: sha256 of the previous page's key and its own tokens, so a key
  names the whole prefix up to the page's end, never just the page's tokens.
- Only pages a prefill wrote inside full prompt chunks on the absolute grid (multiples of `chunk` from
  position 0) are cached; a resume starts on that grid, so it runs exactly the chunks a fresh prefill runs.
  Where the prompt path is row-invariant (a row's bits never depend on the call holding it: the CPU's reference
  path for attention-only models, `Runner.grain`), the grain is the page instead: every full page of a prompt is
  cached and a resume starts at any page boundary.
- Hybrid models (`snapshots` > 0 slots): a grid boundary is resumable only where a snapshot of the lanes'
  recurrent state sits on the page ending there; the snapshot goes when that page is evicted, or earlier
  when the slots are full and it is the least recently used one. A prefill saves one at every multiple of
  `snapshot_every` tokens and at its prompt's last boundary (where the next turn of a chat resumes), not at
  every chunk boundary: dense27's snapshot is ~37x the KV pages of a 64-token chunk (`budget`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np


def chain_keys(tokens: list[int], page_size: int, pages: int) -> list[bytes]:
    """The chained keys of the first `pages` full pages of `tokens`."""
    keys, prev = [], b""
    arr = np.asarray(tokens[: pages * page_size], np.int64)
    for i in range(pages):
        prev = hashlib.sha256(prev + arr[i * page_size : (i + 1) * page_size].tobytes()).digest()
        keys.append(prev)
    return keys


def prefill_calls(length: int, chunk: int, resume: int = 0, grain: int | None = None) -> list[tuple[int, int]]:
    """A prompt's prefill calls from `resume` (a multiple of `grain`, by default the chunk), as (start, tokens):
    chunks of `chunk` tokens from `resume`, the last one cut at the prompt's end. On the chunk grid they follow from
    the length alone, so a resumed prompt runs exactly the calls of a fresh one from its resume point (the runner
    pads each by its start and size alone); at a finer grain a resumed prompt's calls are other calls over the same
    rows, exact only where the prompt path is row-invariant (`Runner.grain`)."""
    grain = grain or chunk
    if resume % grain or not 0 <= resume < length:
        raise ValueError(f"resume={resume} must be a multiple of the grain {grain} below the prompt's {length} tokens")
    return [(s, min(chunk, length - s)) for s in range(resume, length, chunk)]


def cached_end(length: int, grain: int) -> int:
    """The end of the prompt's part later prompts resume from: its last full chunk on the chunk grid (a partial
    last call is padded to another shape, so its rows are never cached), its last full page at the page grain."""
    return length // grain * grain


def resume_limit(length: int, grain: int) -> int:
    """The deepest point a prompt resumes at: a multiple of the grain with at least one of its tokens after it (the
    first token's logits come from its last call)."""
    return (length - 1) // grain * grain


SNAPSHOT_EVERY = 256  # tokens between a hybrid prefix's snapshots (besides each prompt's last boundary)


def snapshot_interval(chunk: int) -> int:
    """Tokens between saved snapshots: the smallest multiple of the chunk that is at least `SNAPSHOT_EVERY`."""
    return -(-SNAPSHOT_EVERY // chunk) * chunk


def budget(gb: float, page_bytes: int, snapshot_bytes: int, pages_per_unit: int, base_pages: int) -> tuple[int, int]:
    """(extra KV pages, snapshot slots) that `gb` GiB buys: one slot per `pages_per_unit` pages (a snapshot
    interval's; a slot is needed only for DeltaNet state), at most four times the lanes' own pool of pages (beyond
    that the tiny models' pages are so small that a gigabyte would allocate hundreds of thousands of them)."""
    if gb < 0:
        raise ValueError(f"prefix_cache_gb={gb} must be >= 0 (0 turns the prefix cache off)")
    unit = pages_per_unit * page_bytes + snapshot_bytes
    units = min(int(gb * 2**30 // unit), 4 * base_pages // pages_per_unit)
    if gb > 0 and snapshot_bytes and units < 1:
        raise ValueError(f"prefix_cache_gb={gb} holds no snapshot of this model's DeltaNet state "
                         f"({unit / 2**20:.1f} MiB with its pages): raise it, or pass 0 to turn the cache off")
    return units * pages_per_unit, units if snapshot_bytes else 0


@dataclasses.dataclass
class Plan:
    """A request's admission: its pages, where its prefill resumes, and the snapshots it restores and saves."""

    pages: list[int]
    resume: int = 0  # prompt tokens taken from the cache (prefill starts here, a multiple of the grain)
    restore: int | None = None  # snapshot slot restored into the lane before the prefill
    saves: dict[int, int] = dataclasses.field(default_factory=dict)  # grid boundary -> slot to save into


@dataclasses.dataclass
class Stats:
    """Counters since the engine started (read by the server's /metrics)."""

    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    """Page allocation with reuse of cached prompt prefixes (`enabled=False`: a plain free list)."""

    def __init__(self, pages: int, page_size: int, chunk: int, snapshots: int = 0, hybrid: bool = False,
                 enabled: bool = True, snapshot_every: int | None = None, grain: int | None = None):
        if enabled and chunk % page_size:
            raise ValueError(f"prefill chunk {chunk} must be a multiple of page_size {page_size} for the prefix "
                             "cache (a resume starts on both grids)")
        self.grain = grain or chunk  # where a resume may start: the chunk grid, or any page (row-invariant prompts)
        if enabled and (self.grain % page_size or chunk % self.grain or (hybrid and self.grain != chunk)):
            raise ValueError(f"grain={self.grain} must be a multiple of page_size {page_size} dividing the chunk "
                             f"{chunk} (the chunk itself for a hybrid: its snapshots sit on the chunk grid)")
        self.snapshot_every = snapshot_every or snapshot_interval(chunk)
        if self.snapshot_every % chunk:
            raise ValueError(f"snapshot_every={self.snapshot_every} must be a multiple of the chunk {chunk}")
        if enabled and hybrid and snapshots < 1:
            raise ValueError("a hybrid model's prefix cache needs at least one snapshot slot")
        self.page_size, self.chunk, self.hybrid, self.enabled = page_size, chunk, hybrid, enabled
        self.free = collections.deque(range(pages))
        self.ref = [0] * pages
        self.key_of: dict[int, bytes] = {}  # cached page -> key
        self.page_of: dict[bytes, int] = {}  # key -> cached page
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, refcount 0, LRU first
        self.snap_of: dict[int, int] = {}  # page ending on a grid boundary -> its snapshot slot
        self.free_slots = list(range(snapshots))
        self.slot_use: collections.OrderedDict[int, int] = collections.OrderedDict()  # slot -> page, LRU first
        self.stats = Stats()

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def match(self, prompt: list[int]) -> tuple[list[int], int, int | None]:
        """The cached pages a prompt can resume after, the resume position and the snapshot slot to restore."""
        if not self.enabled:
            return [], 0, None
        limit = resume_limit(len(prompt), self.grain)
        pages = []
        for key in chain_keys(prompt, self.page_size, limit // self.page_size):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        per_grain = self.grain // self.page_size
        for n in range(len(pages) // per_grain * per_grain, 0, -per_grain):
            slot = self.snap_of.get(pages[n - 1])
            if not self.hybrid or slot is not None:
                return pages[:n], n * self.page_size, slot
        return [], 0, None

    def allocate(self, prompt: list[int], n_pages: int) -> Plan | None:
        """Pages for a request (cached prefix first), or None when the pool can't hold it now."""
        hit, resume, slot = self.match(prompt)
        fresh = n_pages - len(hit)
        if fresh > self.available() - sum(p in self.idle for p in hit):
            return None
        for p in hit:
            self._hold(p)
        pages = hit + [self._take() for _ in range(fresh)]
        if slot is not None:
            self.slot_use.move_to_end(slot)
        self.stats.lookups += self.enabled
        self.stats.hits += resume > 0
        self.stats.cached_tokens += resume
        self.stats.prompt_tokens += len(prompt)
        plan = Plan(pages, resume, slot)
        if self.hybrid and self.enabled:
            keys = chain_keys(prompt, self.page_size, len(prompt) // self.page_size)
            last = cached_end(len(prompt), self.chunk)
            for end in range(resume + self.chunk, last + 1, self.chunk):
                if end % self.snapshot_every and end != last:
                    continue
                cached = self.page_of.get(keys[end // self.page_size - 1])
                slot_for_end = None if cached in self.snap_of else self._slot()
                if slot_for_end is not None:
                    plan.saves[end] = slot_for_end
        return plan

    def commit(self, prompt: list[int], plan: Plan) -> None:
        """After a successful prefill: cache the pages it wrote up to `cached_end` and attach the snapshots it saved."""
        if not self.enabled:
            return
        full = cached_end(len(prompt), self.grain)
        keys = chain_keys(prompt, self.page_size, full // self.page_size)
        for i in range(plan.resume // self.page_size, len(keys)):
            if keys[i] not in self.page_of:
                self.page_of[keys[i]], self.key_of[plan.pages[i]] = plan.pages[i], keys[i]
        for end, slot in plan.saves.items():
            page = self.page_of[keys[end // self.page_size - 1]]
            if page in self.snap_of:  # another request cached this prefix meanwhile
                self.free_slots.append(slot)
            else:
                self.snap_of[page] = slot
                self.slot_use[slot] = page
        plan.saves = {}

    def release(self, plan: Plan) -> None:
        """A lane's request ended: its pages lose a reference (deepest first into the LRU); unsaved slots go back."""
        self.free_slots.extend(plan.saves.values())
        plan.saves = {}
        for p in reversed(plan.pages):
            self.ref[p] -= 1
            if self.ref[p]:
                continue
            if p in self.key_of:
                self.idle[p] = None
            else:
                self.free.append(p)

    def clear(self) -> None:
        """Forget every cached prefix (the device caches were rebuilt); pages held by lanes stay held."""
        for p in list(self.idle):
            self.free.append(p)
        self.idle.clear()
        self.key_of.clear()
        self.page_of.clear()
        self.free_slots.extend(self.slot_use)
        self.slot_use.clear()
        self.snap_of.clear()

    def _hold(self, page: int) -> None:
        self.idle.pop(page, None)
        self.ref[page] += 1

    def _take(self) -> int:
        """A page to write: a free one, else the least recently used idle cached page (evicted)."""
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.idle.popitem(last=False)
            self._forget(page)
            self.stats.evictions += 1
        self.ref[page] = 1
        return page

    def _forget(self, page: int) -> None:
        del self.page_of[self.key_of.pop(page)]
        slot = self.snap_of.pop(page, None)
        if slot is not None:
            del self.slot_use[slot]
            self.free_slots.append(slot)

    def _slot(self) -> int | None:
        """A slot to save into: a free one, else the least recently used one (its page stays cached); None when
        every slot waits for another prefill's save."""
        if not self.free_slots and self.slot_use:
            slot, page = self.slot_use.popitem(last=False)
            del self.snap_of[page]
            self.free_slots.append(slot)
        return self.free_slots.pop() if self.free_slots else None
