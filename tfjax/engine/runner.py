"""The runner owns device state (parameters, caches, lane state) and is the only caller of jitted code.

A round computes only a bucket of lanes (1, 2, 4 ... up to the capacity) holding the live ones, and traces the
sampling processors only while a live lane uses them; prompt chunks are padded to a bucket of their length and
attend over a bucket of pages. Each is a compile key, and none changes a lane's numbers (tests/test_lanes.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import grammar, models, ops, sampling, sharding
from tfjax.engine import prefix_cache
from tfjax.lanes import blocks, snapshots
from tfjax.lanes import round as lane_round_mod
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import ModelFacts, RoundFacts, round_facts
from tfjax.models.decoder import DeltaState


def compile_all(programs, workers: int | None = None) -> int:
    """Compile lowered programs on `workers` threads (default `compile_workers()`), each as soon as it is lowered
    (XLA's compile releases the GIL, so the next program traces meanwhile); how many. A failed compile raises here."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers or compile_workers()) as pool:
        futures = [pool.submit(lowered.compile) for lowered in programs]
        for f in futures:
            f.result()
    return len(futures)


def compile_workers() -> int:
    """Threads `compile_all` compiles on: the host's cores on the CPU; one on a GPU, where XLA's autotuner times
    kernels on the device while it compiles (concurrent compiles would time them against each other; unmeasured)."""
    return (os.cpu_count() or 1) if jax.default_backend() == "cpu" else 1


class Runner:
    """Target (and optional drafter) parameters, the lanes' device state, and the jitted entry points."""

    def __init__(self, target, lanes: LaneConfig, drafter=None, prefill_chunk: int | None = None,
                 target_facts: ModelFacts | None = None, drafter_facts=None, extra_pages: int = 0,
                 snapshot_slots: int = 0):
        self.lanes = lanes
        own = getattr(drafter, "facts", None)  # a block drafter declares its Facts; a draft model is a plain CausalLM
        self.block_drafter = own is not None and own.kind == "block"
        if drafter_facts is None and self.block_drafter:
            drafter_facts = own
        self.target_def, self.target_params = models.split(target)
        self.drafter_def, self.drafter_params = (None, None) if drafter is None else models.split(drafter)
        self.chunk = prefill_chunk or default_prefill_chunk()
        # the reference prompt path (the CPU's) pads a chunk's tail to fewer rows (`_call`); where a chunk's attention
        # walks key tiles up to its end (the flash kernel, the reference without a mesh) it takes the lane's whole
        # table, else (a mesh's reference gathers the table's pages) the table is cut to a power of two of pages
        self.reference_prompt = not target.kernels.pallas
        self.prompt_reads_its_keys = all(ops.prompt_reads_its_keys(m.kernels, m.config.head_dim, getattr(m, "mesh", None))
                                         for m in (target, None if self.block_drafter else drafter) if m is not None)
        # where a prefix resume may start: the chunk grid (a resumed prompt runs the fresh prompt's own calls), or any
        # page where a prompt row's bits never depend on the call holding it (its start, rows, offset): the reference
        # path without a mesh over attention-only models (no DeltaNet state between calls; docs/prefix_cache.md
        # "Resuming at a page", pinned by tests/test_prefix_cache.py), so a chat's next turn runs one call, not two
        by_page = not self.block_drafter and all(
            not m.kernels.pallas and getattr(m, "mesh", None) is None and not m.config.linear_layers
            for m in (target, drafter) if m is not None)
        self.grain = lanes.page_size if by_page else self.chunk
        self.pages = lanes.capacity * lanes.pages_per_lane + extra_pages  # extra pages hold cached prefixes
        self.snapshot_slots = snapshot_slots
        self._models = (target, drafter)
        self.vocab = target.config.vocab_size
        self.grammars = grammar.Table(self.vocab)  # grammars of the live constrained lanes, packed
        self.constrained: set[int] = set()  # lanes whose request has a grammar
        self.live: set[int] = set()  # lanes between prefill and release
        self.processed: set[int] = set()  # live lanes with penalties, logit_bias, logprobs or a grammar
        self._order: tuple[tuple[int, ...], jax.Array | None] = ((), None)  # the last round's lanes, on the device
        self.first_logprobs: sampling.Logprobs | None = None  # of the last prefill's first token
        self.reset()
        target_facts = target_facts or ModelFacts(root_copies=True, enter_match=lanes.enter_match)
        self.spec = lane_round_mod.RoundSpec(lanes, round_facts(target_facts, drafter_facts))

    def reset(self) -> None:
        """Fresh lane state: every lane idle, caches empty (also the way back from a failed device call)."""
        lanes, (target, drafter) = self.lanes, self._models
        cache = target.init_cache(lanes.capacity, lanes.context, lanes.page_size, self.pages,
                                  kv_dtype=kv_dtype(target))
        draft_cache = None if drafter is None else drafter.init_cache(lanes.capacity, lanes.context,
                                                                       lanes.page_size, self.pages,
                                                                       kv_dtype=kv_dtype(drafter))
        n = lanes.capacity
        self.state = lane_round_mod.LaneState(
            history=jnp.zeros((n, lanes.context), jnp.int32), length=jnp.ones((n,), jnp.int32),
            active=jnp.zeros((n,), bool), drafting=jnp.zeros((n,), bool),
            sampling=sampling.SamplingParams.create(n), cache=cache, draft_cache=draft_cache,
            draft_len=jnp.zeros((n,), jnp.int32),
            block=blocks.empty_blocks(n, drafter.config.block_size) if self.block_drafter else None,
            proc=sampling.Processors.create(n, self.vocab), gstate=grammar.start(jnp.full((n,), -1, jnp.int32)),
            end=jnp.full((n,), lanes.context, jnp.int32))
        self.pools = [snapshots.empty_pool(cache, self.snapshot_slots), snapshots.empty_pool(draft_cache,
                                                                                              self.snapshot_slots)]
        if getattr(target, "mesh", None) is not None:  # tensor parallel: caches by head, lanes over `data`
            sharded_drafter = getattr(drafter, "mesh", None) is not None
            self.state = sharding.shard_lane_state(self.state, target.mesh, draft_heads=sharded_drafter)
            self.pools = [sharding.shard_pool(p, target.mesh) for p in self.pools]
        self.grammars.clear()
        self.constrained.clear()
        self.live, self.processed = set(), set()

    def set_facts(self, facts: RoundFacts) -> None:
        """Swap the static facts (a new compile key for the round)."""
        self.spec = lane_round_mod.RoundSpec(self.lanes, facts)

    def _chunks(self, prompt: np.ndarray, resume: int):
        """The prompt's calls from `resume` (`prefix_cache.prefill_calls` at the runner's grain), each `_call`."""
        for s, n in prefix_cache.prefill_calls(len(prompt), self.chunk, resume, self.grain):
            yield self._call(prompt, s, n)

    def prefill_along(self, prompt: np.ndarray, calls: list[tuple[int, int]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Lane 0 of a reset runner prefilled along `calls` ((start, tokens) each, not only the chunk grid's), for
        row-invariance checks: (the last call's logits, every layer's K and V at the prompt's positions)."""
        self.reset()
        cache, logits = self.state.cache, None
        for s, n in calls:
            tokens, start, valid, pages = self._call(prompt, s, n)
            logits, cache, _ = lane_round_mod.prefill_chunk(self.target_def, self.target_params, cache, jnp.int32(0),
                                                            tokens, jnp.int32(start), jnp.int32(valid), pages=pages)
        kv = [np.asarray(x).reshape(-1, *x.shape[2:])[: len(prompt)] for lc in cache.layers for x in (lc.k, lc.v)]
        return np.asarray(logits), kv

    def _call(self, prompt: np.ndarray, s: int, n: int):
        """One call of `n` tokens at `s`: (tokens [1, C], start, valid, pages). C is `_rows(n)`; `pages` the lane's
        whole table where the prompt attention reads only the key tiles up to the chunk's last row (the flash
        kernel, the reference without a mesh: one program a row count, `compile_prompts`), else a power of two of
        pages holding the keys up to its end. All follow from the call's start and length only, so on the chunk grid
        a resumed prompt runs exactly the calls a fresh one runs."""
        piece = prompt[s : s + n]
        size = self._rows(n)
        tokens = np.zeros((1, size), np.int32)
        tokens[0, : len(piece)] = piece
        need = -(-(s + size) // self.lanes.page_size)
        pages = min(self.lanes.pages_per_lane, 1 << (need - 1).bit_length())
        return jnp.asarray(tokens), s, n, self.lanes.pages_per_lane if self.prompt_reads_its_keys else pages

    def _rows(self, n: int) -> int:
        """Rows of a call of `n` tokens: a power of two from 16 up to the chunk; on the reference path also at most
        the next multiple of an eighth of the chunk (from 8): XLA's CPU dots take any row count."""
        size = min(self.chunk, max(16, 1 << (n - 1).bit_length()))
        if self.reference_prompt:  # eight row sizes a chunk at most
            step = max(8, self.chunk // 8)
            size = min(size, -(-n // step) * step)
        return size

    def compile_prompts(self) -> int:
        """Compile, ahead of time and running nothing, every prompt call's program (each row count `_rows` gives;
        with a block drafter, its absorb too) where a call takes the lane's whole table (`prompt_reads_its_keys`),
        so the first prompt of a new length stalls no lane; returns how many. Elsewhere (a mesh's gathering
        reference) the pages vary too and programs compile as met."""
        return compile_all(self.lower_prompts())

    def lower_prompts(self):
        """Every prompt call's program, lowered, one at a time (`compile_prompts`)."""
        if not self.prompt_reads_its_keys:
            return
        zero, st = jnp.int32(0), self.state
        models = [(self.target_def, self.target_params, st.cache)]
        if st.draft_cache is not None and not self.block_drafter:
            models.append((self.drafter_def, self.drafter_params, st.draft_cache))
        for rows in sorted({self._rows(n) for n in range(1, self.chunk + 1)}):
            tokens = jnp.zeros((1, rows), jnp.int32)
            for graphdef, params, cache in models:
                lowered = lane_round_mod.prefill_chunk.lower(graphdef, params, cache, zero, tokens, zero, zero,
                                                             pages=self.lanes.pages_per_lane)
                yield lowered
            if self.block_drafter:
                hidden = lowered.out_info[2]
                yield blocks.absorb_chunk.lower(self.drafter_def, self.drafter_params, st.draft_cache, zero,
                                                jnp.zeros(hidden.shape, hidden.dtype), zero, zero)

    def compile_admission(self) -> int:
        """Compile, ahead of time and running nothing, the small programs every request runs around its prompt (its
        first token, the lane's admission with its processors, the release; a block drafter's first block), so the
        first request after start-up compiles none of them; returns how many. A grammar's table compiles its own."""
        return compile_all(self.lower_admission())

    def lower_admission(self):
        """The programs around a prompt, lowered, one at a time (`compile_admission`)."""
        st, zero = self.state, jnp.int32(0)
        params, proc = sampling.SamplingParams.create(1), sampling.Processors.for_request(self.vocab, [0])
        first = jnp.zeros((1,), jnp.int32)
        yield lane_round_mod.admit.lower(st, zero, jnp.zeros((self.lanes.context,), jnp.int32), zero,
                                         jnp.bool_(False), params, jnp.zeros((self.lanes.pages_per_lane,), jnp.int32),
                                         zero)
        yield lane_round_mod.admit_processors.lower(st, zero, proc, first[0], first[0])
        yield lane_round_mod.release.lower(st, zero)
        if getattr(self._models[0], "mesh", None) is None:  # a mesh's logits come sharded: that program as met
            logits = jnp.zeros((1, self.vocab), jnp.float32)  # the models' logits are float32
            yield _first_token.lower(logits, zero, params, proc, st.grammar, grammar.start(jnp.int32([-1])))
        if self.block_drafter:
            yield blocks.first_block.lower(self.target_def, self.target_params, self.drafter_def, self.drafter_params,
                                           st, zero)

    def _snapshot(self, which: int, cache, lane: int, end: int, saves: dict[int, int]) -> None:
        if end in saves and self.pools[which] is not None:
            self.pools[which] = snapshots.save(self.pools[which], cache, jnp.int32(lane), jnp.int32(saves[end]))

    def _restore(self, which: int, cache, lane: int, slot: int | None):
        if slot is None or self.pools[which] is None:
            return cache
        return snapshots.restore(cache, self.pools[which], jnp.int32(lane), jnp.int32(slot))

    def _prefill_model(self, which: int, graphdef, params, cache, lane: int, prompt: np.ndarray, resume: int,
                       restore: int | None, saves: dict[int, int]):
        logits, cache = None, self._restore(which, cache, lane, restore)
        for tokens, s, n, pages in self._chunks(prompt, resume):
            logits, cache, _ = lane_round_mod.prefill_chunk(graphdef, params, cache, jnp.int32(lane), tokens,
                                                         jnp.int32(s), jnp.int32(n), pages=pages)
            self._snapshot(which, cache, lane, s + n, saves)
        return logits, cache

    def _place_grammar(self, lane: int, g: grammar.TokenGrammar | None) -> int:
        """The lane's initial grammar state in the device table (-1: none), uploading a new grammar."""
        self.constrained.discard(lane)
        if g is None:
            return -1
        if not self.constrained:  # no live lane reads the table: start it afresh
            self.grammars.clear()
        size = self.grammars.size
        initial = self.grammars.place(g)
        self.constrained.add(lane)
        have, have_out = (0, 0) if self.state.grammar is None else (self.state.grammar.next.shape[0],
                                                                      self.state.grammar.outcomes.shape[0])
        if self.grammars.size != size or have < self.grammars.size:
            cap = max(have, grammar.capacity_for(self.grammars.size))  # a new capacity is a new compile
            out_cap = max(have_out, grammar.outcome_capacity_for(self.grammars.outcomes))
            self.state.grammar = self.grammars.device(cap, out_cap)
        return initial

    def prefill(self, lane: int, prompt: list[int], params: sampling.SamplingParams, drafting: bool,
                pages: list[int], resume: int = 0, restore: int | None = None,
                saves: dict[int, int] | None = None, proc: sampling.Processors | None = None,
                token_grammar: grammar.TokenGrammar | None = None, max_tokens: int | None = None) -> int:
        """Feed a prompt into `lane` (and the drafter), pick its first token, and make the lane live; its rounds stop
        once it has `max_tokens` tokens after the prompt (None: at the context).

        With a cached prefix, the first `resume` tokens (a multiple of `grain`) are already in `pages`; snapshot slot
        `restore` holds the DeltaNet state there. `saves` maps grid boundaries to slots to snapshot into."""
        saves = saves or {}
        proc = proc if proc is not None else sampling.Processors.for_request(self.vocab, prompt)
        initial = self._place_grammar(lane, token_grammar)
        prompt_arr = np.asarray(prompt, np.int32)
        row = np.zeros((self.lanes.pages_per_lane,), np.int32)
        row[: len(pages)] = pages
        row[len(pages):] = self.pages  # out of the pool: writes there are dropped
        st = self.state
        st.cache.page_table = st.cache.page_table.at[lane].set(jnp.asarray(row))
        if self.block_drafter:
            st.draft_cache.page_table = st.draft_cache.page_table.at[lane].set(jnp.asarray(row))
            logits = self._prefill_with_taps(lane, prompt_arr, resume, restore, saves)
        else:
            logits, st.cache = self._prefill_model(0, self.target_def, self.target_params, st.cache, lane, prompt_arr,
                                                   resume, restore, saves)
        if st.draft_cache is not None and not self.block_drafter:
            st.draft_cache.page_table = st.draft_cache.page_table.at[lane].set(jnp.asarray(row))
            _, st.draft_cache = self._prefill_model(1, self.drafter_def, self.drafter_params, st.draft_cache, lane,
                                                    prompt_arr, resume, restore, saves)
        first_arr, self.first_logprobs = _first_token(logits, jnp.int32(len(prompt)), params, proc,
                                                      self.state.grammar, grammar.start(jnp.int32([initial])))
        first = int(first_arr[0])
        history = np.zeros((self.lanes.context,), np.int32)
        history[: len(prompt)] = prompt_arr
        history[len(prompt)] = first
        end = self.lanes.context if max_tokens is None else min(len(prompt) + max_tokens, self.lanes.context)
        self.state = lane_round_mod.admit(st, jnp.int32(lane), jnp.asarray(history), jnp.int32(len(prompt) + 1),
                                          jnp.bool_(drafting), params, jnp.asarray(row), jnp.int32(end))
        self.state = lane_round_mod.admit_processors(self.state, jnp.int32(lane), proc, jnp.int32(first),
                                                     jnp.int32(initial))
        if self.block_drafter:
            self.state = blocks.first_block(self.target_def, self.target_params, self.drafter_def,
                                            self.drafter_params, self.state, jnp.int32(lane))
        self.live.add(lane)
        used, logprobs = jax.device_get((proc.used[0], proc.logprobs[0]))
        if used or logprobs or token_grammar is not None:
            self.processed.add(lane)
        else:
            self.processed.discard(lane)
        return first

    def _prefill_with_taps(self, lane: int, prompt: np.ndarray, resume: int, restore: int | None,
                           saves: dict[int, int]):
        """Prompt chunks through the target, their tapped states into the block drafter's (paged) context."""
        st, logits = self.state, None
        st.cache = self._restore(0, st.cache, lane, restore)
        for tokens, s, n, pages in self._chunks(prompt, resume):
            logits, st.cache, hidden = lane_round_mod.prefill_chunk(
                self.target_def, self.target_params, st.cache, jnp.int32(lane), tokens, jnp.int32(s), jnp.int32(n),
                pages=pages)
            st.draft_cache = blocks.absorb_chunk(self.drafter_def, self.drafter_params, st.draft_cache,
                                                 jnp.int32(lane), hidden, jnp.int32(s), jnp.int32(n))
            self._snapshot(0, st.cache, lane, s + n, saves)
        return logits

    def round_lanes(self) -> tuple[int, ...] | None:
        """The lanes the next round computes: the live ones (ascending), then idle ones up to a power of two;
        None for all of them (the bucket is the capacity)."""
        n = self.lanes.capacity
        bucket = 1 << max(len(self.live) - 1, 0).bit_length()
        if bucket >= n:
            return None
        idle = [i for i in range(n) if i not in self.live]
        return tuple(sorted(self.live)) + tuple(idle[: bucket - len(self.live)])

    def round_buckets(self) -> list[tuple[int, ...] | None]:
        """Every lane set `round_lanes` can give, as a compile key: 1, 2, 4 ... lanes below the capacity, then None."""
        n, sizes = self.lanes.capacity, []
        while (b := 1 << len(sizes)) < n:
            sizes.append(tuple(range(b)))
        return [*sizes, None]

    def compile_rounds(self) -> int:
        """Compile, ahead of time and running nothing, the round of every lane bucket (without processors), so a
        bucket first met while serving (lanes ending apart) costs no trace and compile that stalls every lane; returns
        how many. JAX's jit call path reuses these compiles."""
        return compile_all(self.lower_rounds())

    def lower_rounds(self):
        """The round of every lane bucket (without processors), lowered, one at a time (`compile_rounds`)."""
        spec = dataclasses.replace(self.spec, processors=False)
        for lanes in self.round_buckets():
            order = None if lanes is None else jnp.asarray(lanes, jnp.int32)
            yield lane_round_mod.lane_round.lower(self.target_def, self.target_params, self.drafter_def,
                                                  self.drafter_params, self.state, spec, order)

    def dispatch(self) -> lane_round_mod.RoundOut:
        """Enqueue one call of lane rounds (`LaneConfig.rounds`; asynchronous): the lane state moves on, the output
        stays on the device."""
        lanes = self.round_lanes()
        if lanes is None:
            order = None
        elif lanes == self._order[0]:
            order = self._order[1]
        else:
            order = jnp.asarray(lanes, jnp.int32)
            self._order = (lanes, order)
        spec = dataclasses.replace(self.spec, processors=bool(self.processed))
        self.state, out = lane_round_mod.lane_round(self.target_def, self.target_params, self.drafter_def,
                                                    self.drafter_params, self.state, spec, order)
        return out

    @staticmethod
    def collect(out: lane_round_mod.RoundOut) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A dispatched call's committed tokens [K, L, W], counts [K, L], proposals offered [K, L], a row a round
        (waits for it)."""
        return lane_round_mod.RoundOut.unpack(sharding.fetch(out.packed))

    @staticmethod
    def collect_logprobs(out: lane_round_mod.RoundOut) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A call's chosen-token logprobs [R, L, W], top ids and top logprobs [R, L, W, K] (waits for it)."""
        lp = out.logprobs
        if lp is None:  # a round without processors: no live lane wanted them when it was dispatched
            return None
        return sharding.fetch((lp.logprob, lp.top_ids, lp.top_logprobs))

    def release(self, lane: int) -> None:
        self.constrained.discard(lane)
        self.live.discard(lane)
        self.processed.discard(lane)
        self.state = lane_round_mod.release(self.state, jnp.int32(lane))


@jax.jit
def _first_token(logits: jax.Array, position: jax.Array, params: sampling.SamplingParams,
                 proc: sampling.Processors, table: grammar.Device | None,
                 gstate: grammar.Position) -> tuple[jax.Array, sampling.Logprobs]:
    """The token after the prompt, chosen by the lane's keyed sampler after its processors and grammar
    (lane params sliced to one row), and its logprobs."""
    state = lane_round_mod.LaneState(None, None, None, None, params, None, None, None, proc=proc, grammar=table,
                                     gstate=gstate)
    scores, _ = lane_round_mod.choose_scores(logits[:, None, :], jnp.zeros((1, 1), jnp.int32), state)
    token = sampling.sample(scores, position[None, None], params)
    return token[:, 0], sampling.logprobs(logits[:, None, :], token, proc.logprobs)


def default_prefill_chunk() -> int:
    """Prompt tokens a prefill call takes, which is also the prefix cache's resume grid (docs/prefix_cache.md)."""
    # the CPU's prefill rate does not depend on the chunk, so the finest grid the DeltaNet chunk allows costs nothing
    return 64 if jax.default_backend() == "cpu" else 256


def kv_dtype(model) -> jnp.dtype | None:
    """The KV pages' dtype: the model's, except float32 on the CPU, where XLA widens a 16-bit pool around every
    write (one pass over the whole pool a layer, measured by scripts/probes/cpu_pool_write.py) but updates a
    float32 pool in place."""
    if jax.default_backend() == "cpu" and jnp.dtype(model.config.dtype).itemsize < 4:
        return jnp.dtype(jnp.float32)
    return None


def cache_bytes(models_: tuple, page_size: int) -> tuple[int, int]:
    """Bytes of one KV page (every attention layer of each model) and of one snapshot (a lane's DeltaNet state in
    each); a snapshot of 0 bytes means a prefix resume needs pages only."""
    page = state = 0
    for model in models_:
        if model is None:
            continue
        shapes = jax.eval_shape(lambda m=model: m.init_cache(1, page_size, page_size, 1, kv_dtype=kv_dtype(m)))
        for layer in shapes.layers:
            size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer))
            if isinstance(layer, DeltaState):
                state += size
            else:
                page += size
    return page, state
