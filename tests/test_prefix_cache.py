"""The prefix cache: resumed == fresh (token_sha256) on hybrid and attention-only models, with and without
copies and drafters; shared and evicted pages never reach a lane that reads them; the bookkeeping alone."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from tests.test_lanes import SAMPLED
from tfjax import geometry, models
from tfjax.config import ModelConfig
from tfjax.engine import Engine, Request
from tfjax.engine.prefix_cache import PrefixCache, budget, cached_end, chain_keys, prefill_calls, resume_limit
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts

LANES = LaneConfig(capacity=2, width=4, context=128, page_size=8)
CHUNK = 16  # two pages a chunk: turn 1's prompt of 37 tokens ends mid-chunk and mid-page
LLAMA = ModelConfig.from_dict(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="float32"))
SHAPES = {"dense": geometry.tiny_dense, "moe": geometry.tiny_moe, "llama": LLAMA}


@pytest.fixture(scope="module")
def built():
    return {}


def _model(built, name):
    if name not in built:
        built[name] = models.build(SHAPES[name], seed=21)
    return built[name]


GB = 0.001  # hybrids: 4 snapshot slots (the cap: four times the lanes' pages, in 256-token snapshot intervals)


def _engine(target, drafter=None, copies=True, gb=GB, lanes=LANES, chunk=CHUNK):
    engine = Engine(target, lanes, drafter=drafter, eos_ids=(), prefix_cache_gb=gb, prefill_chunk=chunk)
    engine.runner.set_facts(RoundFacts(copy_match=1 if copies else 0, draft_block=engine.runner.spec.facts.draft_block))
    return engine


def _words(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def _conversations(seed: int, head: int = 17) -> list[dict]:
    """Turn 1 of a greedy and of a sampled conversation: `head` words, then a repeated span so copies fire."""
    out = []
    for i, params in enumerate(({}, SAMPLED)):
        span = _words(seed + 7 * i, 10)
        out.append(dict(prompt=_words(seed + 7 * i + 1, head) + span + span, params=params))
    return out


def _turn2(engine, convs, message: int = 9) -> list[list[int]]:
    """Turn 1 on `engine`, then turn 2 prompts: turn 1's prompt + reply (10 tokens) + a new message."""
    first = engine.run([Request(c["prompt"], max_tokens=10, **c["params"]) for c in convs])
    return [c["prompt"] + r.token_ids + _words(99 + i, message)
            for i, (c, r) in enumerate(zip(convs, first, strict=True))]


def _resumed_equals_fresh(target, drafter=None, copies=True, seed=0, gb=GB, lanes=LANES, chunk=CHUNK, head=17,
                          message=9):
    """Turn 2 resumed after turn 1's full chunks (turn 1: `head` + 20 tokens) equals it on a cold engine."""
    convs = _conversations(seed, head)
    warm = _engine(target, drafter, copies, gb, lanes, chunk)
    prompts = _turn2(warm, convs, message)
    resumed = warm.run([Request(p, max_tokens=12, **c["params"]) for p, c in zip(prompts, convs, strict=True)])
    fresh = _engine(target, drafter, copies, gb, lanes, chunk).run([Request(p, max_tokens=12, **c["params"])
                                                                    for p, c in zip(prompts, convs, strict=True)])
    full = (head + 20) // warm.prefix.grain * warm.prefix.grain  # turn 1's full chunks (pages: attention-only, CPU)
    for r, f in zip(resumed, fresh, strict=True):
        assert r.token_sha256 == f.token_sha256, (r.token_ids, f.token_ids)
        assert r.cached_tokens == full > 0 and f.cached_tokens == 0  # a cold engine has none
    assert warm.prefix_stats.hits == 2 and warm.prefix_stats.cached_tokens == 2 * full
    return resumed


SLOW = pytest.mark.slow  # the same contract on more shapes; CI runs one copies setting per shape


@pytest.mark.parametrize("name,copies", [("dense", True), ("moe", False), ("llama", False),
                                         pytest.param("dense", False, marks=SLOW), pytest.param("moe", True, marks=SLOW),
                                         pytest.param("llama", True, marks=SLOW)])
def test_turn_two_resumed_from_the_cache_equals_a_cold_engine(built, name, copies):
    resumed = _resumed_equals_fresh(_model(built, name), copies=copies)
    if copies:
        assert sum(r.proposed for r in resumed) > 0, "copies never proposed: the test would not exercise them"


@pytest.mark.slow  # ~20-30 s a model; the chunk-64 grid's resumed == fresh stays in CI (dense, MoE, llama)
@pytest.mark.parametrize("name", ["dense", "llama"])
def test_turn_two_resumed_on_the_platforms_default_grid_equals_a_cold_engine(built, name):
    """The engine's own prefill chunk (64 on the CPU) and page size (16): turn 1 ends mid-chunk and mid-page (two
    chunks and 37 tokens), turn 2 resumes at its last full chunk (a hybrid's snapshot taken at the prompt's last
    boundary, not a multiple of the snapshot interval) with more than a chunk after it (a full chunk, then a last
    one ending mid-page), greedy and sampled."""
    chunk = Engine(_model(built, name), LANES, eos_ids=()).runner.chunk
    lanes = LaneConfig(capacity=2, width=4, context=4 * chunk, page_size=16)
    message = chunk - 37 - 10 + 23  # turn 2: 37 + 10 (reply) + message = a chunk and 23 tokens after the resume
    _resumed_equals_fresh(_model(built, name), copies=False, lanes=lanes, chunk=None, head=2 * chunk + 17,
                          message=message)


def test_attention_only_models_resume_at_a_page_and_hybrids_on_the_chunk_grid(built):
    """On the reference prompt path (the CPU's) a llama prompt's rows are row-invariant (below), so a resume starts
    at any page; a hybrid's DeltaNet state between calls keeps it on the chunk grid."""
    assert _engine(_model(built, "llama")).prefix.grain == LANES.page_size
    assert _engine(_model(built, "dense")).prefix.grain == CHUNK
    pc = PrefixCache(pages=12, page_size=2, chunk=4, grain=2)
    p = _prompt(11)
    pc.commit(p, pc.allocate(p, 6))  # every full page: 10 tokens
    assert len(pc.page_of) == 5 and pc.allocate(p + [3, 3], 7).resume == 10 and pc.allocate(p[:9], 5).resume == 8
    with pytest.raises(ValueError, match="the chunk itself for a hybrid"):
        PrefixCache(pages=12, page_size=2, chunk=4, snapshots=1, hybrid=True, grain=2)


def _assert_prompt_rows_invariant(target, tokens: int, sizes: tuple[int, ...], more: bool = True):
    """One prompt prefilled along other calls than the chunk grid's (each row size `sizes` names at the platform's
    chunk and page, starts on and off the grid, tails padded mid-page, a turn resumed 13 rows back from its
    predecessor's end): every layer's K and V at every position, and the last row's logits, equal bit for bit."""
    runner = Engine(target, LaneConfig(capacity=1, width=4, context=tokens + 64, page_size=16), eos_ids=()).runner
    c = runner.chunk
    prompt = np.random.default_rng(5).integers(0, target.config.vocab_size, tokens).astype(np.int32)

    def repeat(ns):
        calls, s = [], 0
        while s < tokens:
            calls.append((s, min(ns[len(calls) % len(ns)], tokens - s)))
            s += calls[-1][1]
        return calls

    logits, kv = runner.prefill_along(prompt, repeat([c]))
    resumed = [(0, 61)] + [(s, min(c, tokens - s)) for s in range(48, tokens, c)]
    partitions = [repeat([n]) for n in sizes] + [resumed] + ([repeat([13, 51, 37, c]), repeat([16, c])] if more else [])
    for calls in partitions:
        other_logits, other_kv = runner.prefill_along(prompt, calls)
        rows = [int((a != b).reshape(tokens, -1).any(1).sum()) for a, b in zip(kv, other_kv, strict=True)]
        assert not any(rows) and np.array_equal(logits, other_logits), (calls, rows)


@SLOW  # ~6-8 s; in CI the llama resumed == fresh tests above resume at a page off the grid
def test_a_prompt_rows_bits_never_depend_on_the_call_that_holds_them(built):
    """What a page-grained resume rests on (`Runner.grain`), on the tiny llama in float32: 8-row calls (where XLA's
    small sums took another order before the norms' row tiles and the attention's row blocks) and a resumed turn."""
    llama = _model(built, "llama")
    assert Engine(llama, LANES, eos_ids=()).runner.chunk == 64, "the platform's chunk (the CPU's) is what runs here"
    _assert_prompt_rows_invariant(llama, 100, (8,), more=False)


@SLOW
def test_a_prompt_rows_bits_never_depend_on_the_call_at_every_row_size():
    """The same for every row size a 64-token chunk compiles, tails padded mid-page and off-grid starts, float32 and
    bfloat16."""
    for dtype in ("float32", "bfloat16"):
        _assert_prompt_rows_invariant(models.build(LLAMA.replace(dtype=dtype), seed=21), 150, tuple(range(8, 65, 8)))


@SLOW
def test_a_prompt_rows_bits_never_depend_on_the_call_at_smollm2s_shapes():
    """The same at SmolLM2-135M's widths (bf16, random weights, two layers), every row size a 64-token chunk
    compiles: XLA:CPU's dots at its shapes (scripts/probes/prompt_rows.py runs the packaged model itself)."""
    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                        num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                                        rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="bfloat16"))
    _assert_prompt_rows_invariant(models.build(config, seed=4), 200, tuple(range(8, 65, 8)))


@SLOW
def test_resumed_equals_fresh_with_a_draft_model(built):
    drafter = models.build(geometry.tiny_dense.replace(num_hidden_layers=2, layer_types=("linear_attention",
                                                                                         "full_attention")), seed=12)
    resumed = _resumed_equals_fresh(_model(built, "dense"), drafter=drafter, seed=3)
    assert all(r.proposed > 0 for r in resumed)


@pytest.mark.slow  # ~30-45 s: a DFlash2 engine compiled cold and warm
def test_resumed_equals_fresh_with_a_block_drafter(built):
    from tests.test_dflash2 import drafter_config
    from tfjax.drafters import dflash2

    raw = drafter_config(vocab_size=geometry.tiny_dense.vocab_size)
    raw["dflash_config"].update(block_size=4, target_layer_ids=[0, 2, 3])
    drafter = dflash2.build(dflash2.DFlashConfig.from_dict(raw), seed=12).bind(geometry.tiny_dense)
    resumed = _resumed_equals_fresh(_model(built, "dense"), drafter=drafter, seed=5)
    assert all(r.proposed > 0 for r in resumed)


def _check_pages(engine) -> None:
    """Every page a live lane maps is held once per lane, never free or idle; idle pages are cached ones."""
    pc = engine.prefix
    held = collections.Counter(p for slot in engine.scheduler.running.values() for p in slot.plan.pages)
    for page, n in held.items():
        assert pc.ref[page] == n, (page, pc.ref[page], n)
        assert page not in pc.idle and page not in pc.free
        assert n == 1 or page in pc.key_of, f"page {page} shared by {n} lanes but not a cached prefix page"
    assert all(pc.ref[p] == 0 and p in pc.key_of for p in pc.idle)
    assert all(pc.ref[p] == 0 and p not in pc.key_of for p in pc.free)
    assert len(held) + len(pc.idle) + len(pc.free) == engine.runner.pages


def test_shared_and_evicted_pages_never_reach_a_lane_that_reads_them(built):
    """Two lanes share a cached system prompt while other requests evict idle pages; every reply equals its
    run alone on a cold engine."""
    target = _model(built, "dense")
    system = _words(40, 48)
    reqs = [dict(prompt=system + _words(41, 5), max_tokens=30), dict(prompt=system + _words(42, 9), max_tokens=8),
            *[dict(prompt=_words(50 + i, 100), max_tokens=6, **SAMPLED) for i in range(6)]]
    alone = [_engine(target).run([Request(**r)])[0] for r in reqs]
    engine = _engine(target, gb=0.0002)  # 32 lane pages + 32 extra and one slot: 78 pages to cache, so it evicts
    engine.run([Request(system + _words(43, 3), max_tokens=4)])  # caches the system prompt's 48 tokens
    ids = [engine.submit(Request(**r)) for r in reqs]
    shared = 0
    while engine.busy:
        engine.step()
        _check_pages(engine)
        pages = [set(s.plan.pages) for s in engine.scheduler.running.values()]
        shared += len(pages) == 2 and bool(pages[0] & pages[1])
    got = [engine.results.pop(i) for i in ids]
    for a, g in zip(alone, got, strict=True):
        assert g.token_sha256 == a.token_sha256
    assert got[0].cached_tokens == 48 and got[1].cached_tokens == 48
    assert shared > 0, "the two system-prompt requests never ran at once"
    assert engine.prefix_stats.evictions > 0, "the pool never ran out: the test would not exercise eviction"


def test_the_same_prompt_again_resumes_before_its_last_token_and_a_zero_budget_caches_nothing(built):
    target = _model(built, "llama")
    prompt = _words(60, 40)
    engine = _engine(target)
    first, again = (engine.run([Request(prompt, max_tokens=4)])[0] for _ in range(2))
    assert first.cached_tokens == 0 and first.token_sha256 == again.token_sha256
    assert again.cached_tokens == 32  # the grid point before the last prompt token
    assert engine.prefix_stats.lookups == 2 and engine.prefix_stats.hits == 1
    off = Engine(target, LANES, eos_ids=(), prefix_cache_gb=0.0, prefill_chunk=CHUNK)
    assert off.runner.pages == LANES.capacity * LANES.pages_per_lane and not off.prefix.enabled
    plan = off.prefix.allocate(prompt, 6)
    off.prefix.commit(prompt, plan)
    assert off.prefix.allocate(prompt, 6).resume == 0 and off.prefix_stats.lookups == 0


# The bookkeeping alone, in plain Python.

def test_chain_keys_name_the_whole_prefix_not_just_the_page():
    a, b = chain_keys([1, 2, 3, 4, 5, 6], 2, 3), chain_keys([9, 2, 3, 4, 5, 6], 2, 3)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b, strict=True)), "a different first page must change every later key"
    assert chain_keys([1, 2, 3, 4, 7], 2, 2) == a[:2]


def _prompt(n, seed=0):
    return _words(seed, n)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_a_resumed_prompt_runs_the_fresh_prompts_calls_from_its_resume_point(chunk):
    """The rule both the runner (its calls) and the cache (what it keeps, where it resumes) follow: from any grid
    point a later prompt may resume at, the calls are the cold prompt's own from there; what is cached lies in full
    chunks only; a prompt's own resume point leaves its last call to run."""
    for length in range(1, 5 * chunk + 2):
        fresh = prefill_calls(length, chunk)
        assert sum(n for _, n in fresh) == length and all(0 < n <= chunk for _, n in fresh)
        end = cached_end(length, chunk)
        assert all(n == chunk for s, n in fresh if s < end), "a cached position came from a partial call"
        limit = resume_limit(length, chunk)
        assert limit < length and limit >= length - chunk and limit % chunk == 0
        for resume in range(0, limit + 1, chunk):
            assert prefill_calls(length, chunk, resume) == [c for c in fresh if c[0] >= resume]
    with pytest.raises(ValueError, match="multiple of the grain 4"):
        prefill_calls(10, 4, 2)


def test_at_the_page_grain_a_resumed_prompt_runs_chunks_from_its_resume_point():
    """Row-invariant prompts (`Runner.grain`): a resume at any page runs chunks from there, so a turn whose new part
    fits a chunk runs one call; every full page is cached; the prompt's own resume point leaves a token to run."""
    for length in range(1, 5 * 16 + 2):
        assert cached_end(length, 4) == length // 4 * 4 and length - 4 <= resume_limit(length, 4) < length
        for resume in range(0, resume_limit(length, 4) + 1, 4):
            calls = prefill_calls(length, 16, resume, grain=4)
            assert calls[0][0] == resume and sum(n for _, n in calls) == length - resume
            assert all(n == 16 for _, n in calls[:-1]) and len(calls) == -(-(length - resume) // 16)
    with pytest.raises(ValueError, match="multiple of the grain 4"):
        prefill_calls(10, 16, 2, grain=4)


def test_a_prefix_resumes_on_the_chunk_grid_and_only_from_committed_pages():
    pc = PrefixCache(pages=12, page_size=2, chunk=4)
    p = _prompt(11)
    plan = pc.allocate(p, 6)
    assert plan.resume == 0 and plan.saves == {}
    dup = pc.allocate(p, 6)
    assert dup.resume == 0, "pages are cached only once the prefill succeeded (commit)"
    pc.release(dup)
    pc.commit(p, plan)  # full chunks end at 8: pages 0..3 cached
    assert len(pc.page_of) == 4
    again = pc.allocate(p + [1, 2], 6)
    assert again.resume == 8 and again.pages[:4] == plan.pages[:4]
    assert pc.allocate(p[:8], 6).resume == 4, "at least one prompt token is prefilled: resume before the end"
    assert pc.stats.hits == 2 and pc.stats.cached_tokens == 12


def test_hybrid_resume_needs_a_snapshot_and_saves_each_new_boundary():
    pc = PrefixCache(pages=12, page_size=2, chunk=4, snapshots=3, hybrid=True, snapshot_every=4)
    p = _prompt(13)
    plan = pc.allocate(p, 7)
    assert sorted(plan.saves) == [4, 8, 12]
    slot8 = plan.saves[8]
    pc.commit(p, plan)
    assert pc.allocate(p + [5], 7).restore == pc.snap_of[plan.pages[5]]
    # a fourth boundary needs a slot: the least recently used snapshot goes, its pages stay cached
    q = p[:12] + [7, 7, 7, 7, 7]
    plan2 = pc.allocate(q, 9)
    assert plan2.resume == 12 and sorted(plan2.saves) == [16]
    pc.commit(q, plan2)
    assert plan.pages[1] not in pc.snap_of and plan.pages[1] in pc.key_of
    held = pc.allocate(p[:9] + [3, 3, 3], 5)
    assert held.resume == 8 and held.restore == slot8


def test_a_hybrid_prefill_snapshots_each_interval_and_its_prompts_last_boundary_only():
    pc = PrefixCache(pages=40, page_size=2, chunk=4, snapshots=8, hybrid=True, snapshot_every=8)
    p = _prompt(23)  # boundaries 4, 8, 12, 16, 20
    plan = pc.allocate(p, 12)
    assert sorted(plan.saves) == [8, 16, 20]
    pc.commit(p, plan)
    assert pc.allocate(p + [5, 5], 12).resume == 20, "the next turn resumes at the last boundary"
    branch = pc.allocate(p[:14] + [9] * 6, 10)
    assert branch.resume == 8 and branch.restore == pc.snap_of[plan.pages[3]], "no snapshot at 12: back to 8"
    assert sorted(branch.saves) == [16, 20] and pc.allocate(p[:7] + [9] * 3, 5).resume == 0
    with pytest.raises(ValueError, match="multiple of the chunk"):
        PrefixCache(pages=4, page_size=2, chunk=4, snapshots=1, hybrid=True, snapshot_every=6)


def test_eviction_takes_the_least_recently_used_idle_page_never_a_held_one():
    pc = PrefixCache(pages=6, page_size=2, chunk=2)
    a, b = _prompt(5, 1), _prompt(5, 2)
    pa = pc.allocate(a, 3)
    pc.commit(a, pa)  # pages of a[:4] cached
    pc.release(pa)  # deepest page first into the LRU
    pb = pc.allocate(b, 3)
    assert pc.allocate(_prompt(5, 3), 4) is None, "3 free + idle pages can't hold 4"
    pc.commit(b, pb)
    hit = pc.allocate(a, 2)  # both cached pages of a, now held again
    assert hit.resume == 4 and pc.ref[pa.pages[0]] == 1
    before = set(pc.page_of.values())
    pc.release(hit)
    pc.release(pb)
    pc.allocate(_prompt(5, 4), 6)  # 2 free + 4 idle: evicts every idle cached page
    assert pc.stats.evictions == len(before) and not pc.page_of


def test_budget_maps_gigabytes_to_pages_and_slots():
    assert budget(0.0, 1000, 0, 2, 100) == (0, 0)
    assert budget(1 / 1024, 2**18, 0, 2, 100) == (4, 0)  # 1 MiB of 256 KiB pages, two a chunk
    assert budget(1.0, 10, 10, 2, 100) == (400, 200)  # capped at four times the lanes' own pool
    with pytest.raises(ValueError, match="holds no snapshot"):
        budget(1e-6, 1000, 10**9, 2, 100)
    with pytest.raises(ValueError, match=">= 0"):
        budget(-1.0, 1000, 0, 2, 100)


def test_the_reply_usage_reports_cached_prompt_tokens():
    from tfjax.engine import Result
    from tfjax.server.protocol import usage

    u = usage([Result(0, 40, [5, 6, 7], "stop", 2, 0, cached_tokens=32)])  # one result a choice
    assert u["prompt_tokens"] == 40 and u["prompt_tokens_details"] == {"cached_tokens": 32}


def test_snapshot_copies_update_the_pool_and_the_lanes_in_place():
    """The snapshot pool is most of the budget (a dense27 snapshot is 147 MiB): save and restore write into the
    donated pool or cache, with no temp as large as one snapshot (compiled from shapes, nothing allocated)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax.lanes import snapshots

    model = nnx.eval_shape(lambda: models.build(geometry.tiny_dense))
    cache = jax.eval_shape(lambda: model.init_cache(LANES.capacity, LANES.context, LANES.page_size))
    pool = jax.eval_shape(lambda: snapshots.empty_pool(model.init_cache(1, LANES.context, LANES.page_size), 64))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    one = size(pool) // 64
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    saved = snapshots.save.lower(pool, cache, i32, i32).compile().memory_analysis()
    assert saved.alias_size_in_bytes == size(pool) and saved.temp_size_in_bytes < one
    restored = snapshots.restore.lower(cache, pool, i32, i32).compile().memory_analysis()
    assert restored.alias_size_in_bytes == size(cache) and restored.temp_size_in_bytes < one


def test_with_one_snapshot_slot_a_resume_falls_back_to_a_shallower_boundary_and_stays_exact(built):
    """Snapshot slots scarcer than grid boundaries: turn 1 keeps its first boundary's snapshot only, so turn 2
    resumes there (a shallower point than its cached pages allow); once another prompt takes the slot, the same turn
    resumes nowhere. Every reply equals a cold engine's."""
    target = _model(built, "dense")
    conv = _conversations(8)[1]  # sampled
    engine = _engine(target)  # the shapes and facts of the dense case above (no new compile)
    del engine.prefix.free_slots[1:]  # the bookkeeping hands out one of the pool's slots
    engine.prefix.snapshot_every = CHUNK  # a snapshot at every boundary
    (turn2,) = _turn2(engine, [conv])
    cold = _engine(target).run([Request(turn2, max_tokens=8, **conv["params"])])[0]
    resumed = engine.run([Request(turn2, max_tokens=8, **conv["params"])])[0]
    assert resumed.cached_tokens == CHUNK and resumed.token_sha256 == cold.token_sha256
    engine.run([Request(_words(77, 2 * CHUNK + 3), max_tokens=2)])  # its boundary takes the only slot
    again = engine.run([Request(turn2, max_tokens=8, **conv["params"])])[0]
    assert again.cached_tokens == 0 and again.token_sha256 == cold.token_sha256


@SLOW  # ~16 s; the four-round contract stays in CI through tests/test_call_rounds.py
def test_turn_two_resumed_at_four_rounds_a_call_equals_a_cold_engine_and_one_round_calls(built):
    """A call of four rounds resumes a cached prefix as one-round calls do: the same tokens, warm or cold."""
    llama = _model(built, "llama")
    four = _resumed_equals_fresh(llama, lanes=dataclasses.replace(LANES, rounds=4))
    one = _resumed_equals_fresh(llama)
    assert [r.token_ids for r in four] == [r.token_ids for r in one]
