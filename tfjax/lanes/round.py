"""The lane round: one jitted function that plans, verifies, accepts and rolls back for every lane.

Per round, for each live lane with `length` tokens (its last one, the pending token, not yet fed):
1. plan: a root copy (`copy_match` tokens matched) or else the drafter's proposals (a block drafter's block,
   drafted at the end of the previous round, or a draft model's greedy chain); none for `draft: false`;
2. verify: one target forward over rows [pending, *proposals] at positions length-1 .. length-1+P;
3. accept: the leading proposals equal to the target's own keyed sample, plus the sample at the first
   disagreement (the bonus token);
4. roll back: KV simply keeps the committed length; DeltaNet state is replayed from the round's start
   over the committed rows only;
5. draft next (block drafters): the verify pass also returns the target's tapped hidden states; the drafter
   writes context K/V for the committed rows only and drafts the next block from the new pending token,
   unless every live lane's next round takes a root copy (then the block would go unused).
Shapes are fixed by the static `RoundSpec`, so plain and drafted lanes run the same arithmetic.

Idle lanes cost nothing: given `order` (lane ids, live ones first, padded with idle ones to a bucket of 1, 2, 4 ...
lanes), the round gathers those lanes' rows of the state, runs on them alone and scatters them back; every op is
row-invariant (a lane's numbers never depend on which or how many lanes share the round), so the bucket only
changes the cost; sampling alone runs over every lane's rows (`_choose`). Processors and grammar masks are traced only when `spec.processors` says a live lane uses them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import grammar, models, ops, sampling
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.copies import propose_copies
from tfjax.lanes.drafter import RoundFacts
from tfjax.models.decoder import Cache, DeltaState, lanes_cache, put_lanes_cache, replay
from tfjax.models.decoder import lane_cache as _lane_cache
from tfjax.models.decoder import put_lane as _put_lane
from tfjax.models.decoder import reset_if_first as _reset_if_first
from tfjax.models.layers import PROMPT, ROWS


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """Everything static about a compiled round: lane shape and the merged drafter facts."""

    lanes: LaneConfig
    facts: RoundFacts
    processors: bool = True  # trace penalties, logit_bias, logprobs and grammar masks (False: no live lane uses any)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LaneState:
    """Device state of all lanes: token history, lengths, flags, sampling, target and drafter caches."""

    history: jax.Array  # [L, S] i32, prompt + output
    length: jax.Array  # [L] i32, tokens in history (the last is pending)
    active: jax.Array  # [L] bool
    drafting: jax.Array  # [L] bool, False for `draft: false` requests
    sampling: sampling.SamplingParams
    cache: Cache
    draft_cache: Cache | None
    draft_len: jax.Array  # [L] i32, positions the drafter has absorbed
    block: jax.Array | None = None  # [L, B-1] i32, a block drafter's proposals for the next round
    proc: sampling.Processors | None = None  # penalties, logit_bias, logprobs wanted (per lane, data)
    grammar: grammar.Device | None = None  # the packed grammar tables (grammar.py), None until first used
    gstate: grammar.Position | None = None  # [L] each lane's grammar position after its history (state -1: none)
    end: jax.Array | None = None  # [L] i32, the length where a lane's request has all its tokens: it stops there


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundOut:
    """Each lane's committed tokens, count and proposals offered in one array `packed` [L, W + 2] (one output
    buffer, one copy to the host a round): columns :W the tokens (the first `count`, then -1), W the count, W + 1
    the proposals offered. A call's rounds stack them: [K, L, W + 2]."""

    packed: jax.Array
    logprobs: sampling.Logprobs | None = None  # of every row's chosen token (zeros when no lane wants them)

    @staticmethod
    def of(tokens: jax.Array, count: jax.Array, proposed: jax.Array, logprobs=None) -> RoundOut:
        """A round's tokens [L, W], counts [L] and proposals offered [L], packed as int32 columns."""
        columns = [tokens.astype(jnp.int32), count.astype(jnp.int32)[:, None], proposed.astype(jnp.int32)[:, None]]
        return RoundOut(jnp.concatenate(columns, axis=1), logprobs)

    @staticmethod
    def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [..., L, W], count [..., L], proposed [..., L]) of a fetched `packed`."""
        return packed[..., :-2], packed[..., -2], packed[..., -1]


def _forward(graphdef, params, tokens, start, valid, cache, mode):
    return models.merge(graphdef, params)(tokens, start, valid, cache, mode)


def _replay_layers(start: Cache, new: Cache, traces: list, count: jax.Array) -> Cache:
    """Attention layers keep the new pool; DeltaNet layers are replayed over `count` rows."""
    layers = [replay(s, tr, count) if isinstance(s, DeltaState) else n
              for s, n, tr in zip(start.layers, new.layers, traces, strict=True)]
    return Cache(layers, new.page_table)


def _select_delta(stack: list[Cache], index: jax.Array) -> Cache:
    """Per lane, the DeltaNet state of chain step `index`; attention pools from the last step."""
    last = stack[-1]
    layers = []
    for i, layer in enumerate(last.layers):
        if isinstance(layer, DeltaState):
            conv = jnp.stack([c.layers[i].conv for c in stack])  # [P, L, ...]
            state = jnp.stack([c.layers[i].state for c in stack])
            lanes = jnp.arange(index.shape[0])
            layers.append(DeltaState(conv[index, lanes], state[index, lanes]))
        else:
            layers.append(layer)
    return Cache(layers, last.page_table)


def _draft_chain(graphdef, params, state: LaneState, width: int, context: int):
    """The drafter absorbs committed rows it has not seen, then drafts P tokens greedily."""
    lanes = jnp.arange(state.length.shape[0])
    dl = state.draft_len
    behind = state.length - dl  # 1..W rows to absorb, the pending token last
    idx = jnp.clip(dl[:, None] + jnp.arange(width)[None, :], 0, context - 1)
    rows = jnp.take_along_axis(state.history, idx, axis=1)
    start = jnp.where(state.active, dl, context)
    logits, cache, traces = _forward(graphdef, params, rows, start, behind, state.draft_cache, ROWS)
    cache = _replay_layers(state.draft_cache, cache, traces, jnp.where(state.active, behind, 0))
    token = jnp.argmax(logits[lanes, jnp.maximum(behind - 1, 0)], axis=-1).astype(jnp.int32)
    drafts, stack = [token], [cache]
    for i in range(1, width - 1):
        pos = jnp.where(state.active, state.length - 1 + i, context)
        lg, cache, _ = _forward(graphdef, params, token[:, None], pos, jnp.ones_like(pos), cache, ROWS)
        token = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
        drafts.append(token)
        stack.append(cache)
    return jnp.stack(drafts, axis=1), stack


_SHARED = ("cache", "draft_cache", "grammar")  # not indexed by lane (caches: per-lane parts handled apart)


def take_lanes(state: LaneState, order: jax.Array) -> LaneState:
    """The state of lanes `order` [B] only (B distinct lane ids)."""
    per_lane = {f.name: jax.tree.map(lambda a: a[order], getattr(state, f.name))
                for f in dataclasses.fields(state) if f.name not in _SHARED}
    return dataclasses.replace(state, **per_lane, cache=lanes_cache(state.cache, order),
                               draft_cache=None if state.draft_cache is None else lanes_cache(state.draft_cache, order))


def put_lanes(state: LaneState, sub: LaneState, order: jax.Array) -> LaneState:
    """`state` with lanes `order` replaced by `sub`'s rows (shared pools and the grammar table from `sub`)."""
    per_lane = {f.name: jax.tree.map(lambda a, b: a.at[order].set(b), getattr(state, f.name), getattr(sub, f.name))
                for f in dataclasses.fields(state) if f.name not in _SHARED}
    draft = None if state.draft_cache is None else put_lanes_cache(state.draft_cache, sub.draft_cache, order)
    return dataclasses.replace(sub, **per_lane, cache=put_lanes_cache(state.cache, sub.cache, order), draft_cache=draft)


@functools.partial(jax.jit, static_argnames=("target_def", "drafter_def", "spec"), donate_argnames=("state",))
def lane_round(target_def, target_params, drafter_def, drafter_params, state: LaneState, spec: RoundSpec,
               order: jax.Array | None = None) -> tuple[LaneState, RoundOut]:
    """`spec.lanes.rounds` rounds for all lanes, or for the lanes `order` [B] only (the others' outputs: no tokens),
    their outputs stacked [K, L, ...]; `spec`, the graphdefs and array shapes (B among them) are the only compile
    keys."""
    if order is None:
        return _rounds(target_def, target_params, drafter_def, drafter_params, state, spec)
    new, out = _rounds(target_def, target_params, drafter_def, drafter_params, take_lanes(state, order), spec,
                       (state, order))
    n = state.length.shape[0]
    spread = lambda a, fill=0: jax.vmap(lambda r: _spread(r, order, n, fill))(a)  # noqa: E731 (a round at a time)
    logprobs = None if out.logprobs is None else jax.tree.map(spread, out.logprobs)
    out = RoundOut(spread(out.packed, _no_tokens(out.packed.shape[-1])), logprobs)
    return put_lanes(state, new, order), out


def _rounds(target_def, target_params, drafter_def, drafter_params, state: LaneState, spec: RoundSpec,
            full: tuple[LaneState, jax.Array] | None = None) -> tuple[LaneState, RoundOut]:
    """The call's rounds one after another (a scan: one compiled round body). A lane whose request has all its
    tokens (`length >= end`) sits the rest out as an idle lane does: it writes nowhere and commits nothing."""

    def one(st: LaneState, _) -> tuple[LaneState, RoundOut]:
        new, out = _round(target_def, target_params, drafter_def, drafter_params,
                          dataclasses.replace(st, active=_running(st)), spec, full)
        return dataclasses.replace(new, active=st.active), out

    k = spec.lanes.rounds
    if k == 1:
        new, out = one(state, None)
        return new, jax.tree.map(lambda a: a[None], out)
    empty = jax.eval_shape(one, state, None)[1]

    def idle(st: LaneState, _) -> tuple[LaneState, RoundOut]:  # every lane has its tokens: no round to compute
        row = _no_tokens(empty.packed.shape[-1])
        return st, RoundOut(jnp.broadcast_to(row, empty.packed.shape), jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), empty.logprobs))

    def maybe(st: LaneState, x) -> tuple[LaneState, RoundOut]:
        return jax.lax.cond(jnp.any(_running(st)), one, idle, st, x)

    return jax.lax.scan(maybe, state, None, length=k)


def _running(state: LaneState) -> jax.Array:
    """[L] lanes a round computes: live ones whose request still wants tokens."""
    return state.active & (state.length < state.end)


def _no_tokens(columns: int) -> jax.Array:
    """A lane's packed row in a round it did not run: no tokens (-1), count 0, no proposals."""
    return jnp.concatenate([jnp.full((columns - 2,), -1, jnp.int32), jnp.zeros((2,), jnp.int32)])


def _spread(a: jax.Array, order: jax.Array, n: int, fill=0) -> jax.Array:
    """Rows of lanes `order` placed among `n` lanes, the others `fill` (a scalar or one lane's row)."""
    return jnp.full((n, *a.shape[1:]), fill, a.dtype).at[order].set(a)


def _choose(logits: jax.Array, rows: jax.Array, positions: jax.Array, state: LaneState, spec: RoundSpec,
            full: tuple[LaneState, jax.Array] | None, mesh=None):
    """Each row's token, its grammar state and logprobs. With `full` (the whole state, the bucket's lane ids) the
    rows are spread back over every lane first: sampling and logprobs reduce over the vocabulary, and XLA's
    arithmetic there may follow the array's shape, so they always see [capacity, W, V]; under a `mesh` whole on
    every device too (XLA's partitioner would otherwise give each device its `data` share of the lanes: top-p's
    softmax and cumulative sum over [capacity / dp, W, n]). A greedy token (the first best id) is the same at any
    shape, so a bucket of greedy lanes without processors skips the spread."""
    if full is not None and not spec.processors:
        chosen = jax.lax.cond(jnp.all(state.sampling.temperature == 0), lambda: sampling.greedy(logits),
                              lambda: _spread_choose(logits, rows, positions, state, spec, full, mesh)[0])
        return chosen, None, None
    return _spread_choose(logits, rows, positions, state, spec, full, mesh)


def _spread_choose(logits: jax.Array, rows: jax.Array, positions: jax.Array, state: LaneState, spec: RoundSpec,
                   full: tuple[LaneState, jax.Array] | None, mesh=None):
    if full is not None:
        whole, order = full
        n = whole.length.shape[0]
        logits, rows, positions = (_spread(a, order, n) for a in (logits, rows, positions))
        state = _with_processors_of(whole, state, order)
    scores, row_gstates = choose_scores(logits, rows, state, spec.processors)
    with ops.using_mesh(mesh):  # every device samples every lane, as one device does: never a share of the lanes
        chosen = ops.whole(sampling.sample, scores, positions, state.sampling)  # [L, W]
    logprobs = sampling.logprobs(logits, chosen, state.proc.logprobs) if spec.processors and state.proc is not None \
        else None
    if full is not None:
        take = lambda a: a[order]  # noqa: E731
        chosen = take(chosen)
        row_gstates = None if row_gstates is None else jax.tree.map(take, row_gstates)
        logprobs = None if logprobs is None else jax.tree.map(take, logprobs)
    return chosen, row_gstates, logprobs


def _with_processors_of(whole: LaneState, sub: LaneState, order: jax.Array) -> LaneState:
    """`whole` with lanes `order`'s token counts and grammar positions from `sub`, the bucket as it is now (a call's
    later rounds have moved them on since `whole` was taken)."""
    put = lambda a, b: a.at[order].set(b)  # noqa: E731
    proc = None if whole.proc is None else jax.tree.map(put, whole.proc, sub.proc)
    gstate = None if whole.gstate is None else jax.tree.map(put, whole.gstate, sub.gstate)
    return dataclasses.replace(whole, proc=proc, gstate=gstate)


def _round(target_def, target_params, drafter_def, drafter_params, state: LaneState, spec: RoundSpec,
           full: tuple[LaneState, jax.Array] | None = None) -> tuple[LaneState, RoundOut]:
    cfg = spec.lanes
    n_lanes, width, context = state.length.shape[0], cfg.width, cfg.context
    n_prop = width - 1
    lanes = jnp.arange(n_lanes)
    length = state.length
    pending = state.history[lanes, jnp.maximum(length - 1, 0)]

    # 1. plan
    proposals = jnp.zeros((n_lanes, n_prop), jnp.int32)
    count = jnp.zeros((n_lanes,), jnp.int32)
    drafts = None
    blocks = drafter_def is not None and spec.facts.draft_block > 0
    if blocks and n_prop > 0:
        nb = min(state.block.shape[1], n_prop)
        proposals = proposals.at[:, :nb].set(state.block[:, :nb])
        count = jnp.full((n_lanes,), nb, jnp.int32)
    elif drafter_def is not None and n_prop > 0:
        drafts, draft_stack = _draft_chain(drafter_def, drafter_params, state, width, context)
        proposals, count = drafts, jnp.full((n_lanes,), n_prop, jnp.int32)
    if spec.facts.copy_match > 0 and n_prop > 0:
        copied, copied_n = propose_copies(state.history, length, spec.facts.copy_match, n_prop)
        use_copy = copied_n > 0
        proposals = jnp.where(use_copy[:, None], copied, proposals)
        count = jnp.where(use_copy, copied_n, count)
    room = jnp.maximum(context - length, 0)  # rows must stay inside the lane's context
    count = jnp.where(state.active & state.drafting, jnp.minimum(count, room), 0)

    # 2. verify
    rows = jnp.concatenate([pending[:, None], proposals], axis=1)  # [L, W]
    start = jnp.where(state.active, length - 1, context)  # idle lanes write nowhere
    mode = ROWS
    if blocks:
        drafter = models.merge(drafter_def, drafter_params)
        mode = dataclasses.replace(ROWS, taps=drafter.config.target_layer_ids)
    real = jnp.where(state.active, count + 1, 0)  # rows past a lane's proposals are padding: never read
    logits, cache, traces, *taps = _forward(target_def, target_params, rows, start, real, state.cache, mode)
    positions = length[:, None] + jnp.arange(width)[None, :]
    mesh = getattr(models.merge(target_def, target_params), "mesh", None)
    chosen, row_gstates, logprobs = _choose(logits, rows, positions, state, spec, full, mesh)  # [L, W]
    processed = spec.processors and state.proc is not None

    # 3. accept: leading proposals that equal the target's own token, then the bonus token
    agree = (proposals == chosen[:, :n_prop]) & (jnp.arange(n_prop)[None, :] < count[:, None])
    accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    committed = jnp.where(state.active, accepted + 1, 0)

    # 4. roll back DeltaNet by replay over the committed rows; KV keeps the committed length
    cache = _replay_layers(state.cache, cache, traces, committed)
    keep = jnp.arange(width)[None, :] < committed[:, None]
    where = jnp.where(keep, positions, context)
    history = state.history.at[lanes[:, None], where].set(chosen, mode="drop")
    draft_cache, draft_len = state.draft_cache, state.draft_len
    if drafts is not None:
        right = (drafts == chosen[:, :n_prop]) & (jnp.arange(n_prop)[None, :] < committed[:, None])
        good = jnp.minimum(jnp.sum(jnp.cumprod(right.astype(jnp.int32), axis=1), axis=1), n_prop - 1)
        draft_cache = _select_delta(draft_stack, good)
        draft_len = jnp.where(state.active, length + good, draft_len)
    block = state.block
    if blocks:  # 5. the drafter absorbs the committed rows (never the rejected ones) and drafts the next block
        draft_cache = drafter.absorb(taps[0], start, committed, state.draft_cache)
        new_len = length + committed
        pend = history[lanes, jnp.maximum(new_len - 1, 0)]
        wanted = lanes_wanting_a_block(history, new_len, state.active & state.drafting, spec.facts.copy_match, n_prop)

        def draft(_):
            return drafter.propose(models.merge(target_def, target_params), pend,
                                   jnp.where(state.active, new_len - 1, context), draft_cache)

        block = jax.lax.cond(jnp.any(wanted), draft, lambda _: state.block, None)
    proc, gstate = state.proc, state.gstate
    if processed:  # off, no live lane reads its counts: a lane that needs them turns `processors` on while it lives
        proc = sampling.add_tokens(proc, chosen, keep)
    if spec.processors and state.grammar is not None:
        gstate = grammar.advance(state.grammar, row_gstates, chosen, committed, state.gstate)
    new = dataclasses.replace(state, history=history, length=length + committed, cache=cache,
                              draft_cache=draft_cache, draft_len=draft_len, block=block, proc=proc, gstate=gstate)
    return new, RoundOut.of(jnp.where(keep, chosen, -1), committed, count, logprobs)


def choose_scores(logits: jax.Array, rows: jax.Array, state: LaneState,
                  processors: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """The scores rows [L, R] are sampled from: f32 logits after the lanes' processors and grammar masks,
    each row seeing its lane's committed tokens plus the proposals before it; also the rows' grammar states.
    `processors=False`: the plain logits (no lane uses either, and lanes without them get their logits bit for bit)."""
    scores = logits.astype(jnp.float32)
    if not processors:
        return scores, None
    if state.proc is not None:
        scores = sampling.apply_processors(scores, rows, state.proc)
    states = None
    if state.grammar is not None:
        states = grammar.row_states(state.grammar, state.gstate, rows)
        scores = grammar.mask_logits(scores, state.grammar, states)
    return scores, states


@functools.partial(jax.jit, donate_argnames=("state",))
def admit_processors(state: LaneState, lane: jax.Array, proc: sampling.Processors, first: jax.Array,
                     gstate: jax.Array) -> LaneState:
    """Give `lane` its request's processors (first token counted) and grammar state (after `first`)."""
    vocab = state.proc.counts.shape[-1]
    row = dataclasses.replace(proc, counts=proc.counts.at[0, first].add(1, mode="drop"))
    new = jax.tree.map(lambda a, v: a.at[lane].set(v[0]), state.proc, row)
    g = state.gstate
    if state.grammar is not None:
        after = grammar.step(state.grammar, grammar.start(gstate), jnp.clip(first, 0, vocab - 1))
        g = jax.tree.map(lambda a, v: a.at[lane].set(v), g, after)
    return dataclasses.replace(state, proc=new, gstate=g)


def lanes_wanting_a_block(history: jax.Array, length: jax.Array, live: jax.Array, copy_match: int,
                          n_prop: int) -> jax.Array:
    """Live drafting lanes whose next round takes no root copy: a copy replaces the block, so when no lane
    wants one the round skips the drafter's block forward (the context is absorbed every round regardless)."""
    if copy_match <= 0 or n_prop <= 0:
        return live
    _, copied = propose_copies(history, length, copy_match, n_prop)
    return live & (copied == 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "pages"), donate_argnames=("cache",))
def prefill_chunk(graphdef, params, cache: Cache, lane: jax.Array, tokens: jax.Array, start: jax.Array,
                  valid: jax.Array, pages: int | None = None):
    """Feed one prompt chunk [1, C] of one lane: (logits [1, V] of its last valid row, cache, every layer's output
    [1, C, L * D]). `pages`: the lane's first pages, which hold every key the chunk reads and writes (None: all).

    Every engine runs this one program for a chunk, drafting or not: a block drafter reads its taps out of the
    layer outputs in a program of its own (`blocks.absorb_chunk`). The target's chunk program compiled with a
    drafter's taps (or its absorb) as other outputs gave other bits on the GPU than plain's (issue 34)."""
    sub = _lane_cache(cache, lane)
    if pages is not None:
        sub = dataclasses.replace(sub, page_table=sub.page_table[:, :pages])
    sub = dataclasses.replace(sub, layers=[_reset_if_first(l, start) for l in sub.layers])
    mode = dataclasses.replace(PROMPT, taps=tuple(range(len(sub.layers))))
    logits, sub, _, hidden = _forward(graphdef, params, tokens, start[None], valid[None], sub, mode)
    return logits, _put_lane(cache, sub, lane), hidden


@functools.partial(jax.jit, donate_argnames=("state",))
def admit(state: LaneState, lane: jax.Array, history_row: jax.Array, length: jax.Array, drafting: jax.Array,
          params: sampling.SamplingParams, page_row: jax.Array, end: jax.Array) -> LaneState:
    """Make `lane` live with its prompt + first token, sampling params, pages and the length where it stops."""
    def put(a, v):
        return a.at[lane].set(v)

    samp = jax.tree.map(lambda a, v: a.at[lane].set(v.reshape(())), state.sampling, params)
    cache = dataclasses.replace(state.cache, page_table=put(state.cache.page_table, page_row))
    draft_cache = state.draft_cache
    if draft_cache is not None:
        draft_cache = dataclasses.replace(draft_cache, page_table=put(draft_cache.page_table, page_row))
    return dataclasses.replace(state, history=put(state.history, history_row), length=put(state.length, length),
                               active=put(state.active, True), drafting=put(state.drafting, drafting),
                               sampling=samp, cache=cache, draft_cache=draft_cache,
                               draft_len=put(state.draft_len, length - 1),
                               end=put(state.end, end))


@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: LaneState, lane: jax.Array) -> LaneState:
    """Mark a lane idle (its pages go back to the pool on the host) and greedy, so an idle lane's old
    temperature or top-k never sends the live lanes' rounds down the sampled or sorting path."""
    idle = sampling.SamplingParams.create(1)
    samp = jax.tree.map(lambda a, v: a.at[lane].set(v.reshape(())), state.sampling, idle)
    proc, gstate = state.proc, state.gstate  # processors off, so an idle lane never turns their work on
    if proc is not None:
        proc = dataclasses.replace(proc, used=proc.used.at[lane].set(False),
                                   logprobs=proc.logprobs.at[lane].set(False))
    if gstate is not None:
        gstate = jax.tree.map(lambda a, v: a.at[lane].set(v), gstate, grammar.start(-1))
    return dataclasses.replace(state, active=state.active.at[lane].set(False), sampling=samp, proc=proc,
                               gstate=gstate)
