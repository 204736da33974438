"""A round costs what its live lanes hold: idle lanes, unused processors, prompt padding and unread keys cost
nothing, and none of these savings changes a lane's numbers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention as pk
from tfjax import ops
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig

LANES = LaneConfig(capacity=4, width=5, context=192, page_size=16)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def test_a_round_computes_the_live_lanes_in_a_power_of_two_bucket(target):
    runner = Engine(target, LANES, eos_ids=()).runner
    for live, lanes in [({2}, (2,)), ({0, 3}, (0, 3)), ({1, 2, 3}, None), ({0, 1, 2, 3}, None)]:
        runner.live = set(live)
        assert runner.round_lanes() == lanes, live
    runner.lanes = LaneConfig(capacity=8, width=5, context=192)
    runner.live = {1, 6, 7}
    assert runner.round_lanes() == (1, 6, 7, 0)


def test_one_request_in_a_four_lane_engine_equals_a_one_lane_engine(target):
    """The one-lane bucket of a wide engine runs what a one-lane engine runs, sampled too; and a second lane with
    processors (the round recompiled with them) leaves the first lane's tokens as they were alone."""
    req = dict(prompt=_prompt(1, 23), max_tokens=12, temperature=1.0, top_k=20, seed=3)
    wide = Engine(target, LANES, eos_ids=()).run([Request(**req)])[0]
    narrow = Engine(target, LaneConfig(capacity=1, width=5, context=192), eos_ids=()).run([Request(**req)])[0]
    assert wide.token_ids == narrow.token_ids
    beside = Engine(target, LANES, eos_ids=()).run([Request(**req), Request(_prompt(2, 30), max_tokens=12,
                                                                            presence_penalty=0.5, logprobs=True)])
    assert beside[0].token_ids == wide.token_ids and beside[1].logprobs is not None


def test_prompt_chunks_are_padded_to_a_bucket_of_their_length_and_pages(target):
    runner = Engine(target, LaneConfig(capacity=1, width=5, context=1024), eos_ids=(), prefill_chunk=256).runner
    shapes = lambda n, resume=0: [(t.shape[1], s, v, p) for t, s, v, p in runner._chunks(np.arange(n), resume)]  # noqa: E731
    # the reference prompt path (the CPU's): its attention reads only the key tiles its rows reach, so the lane's
    # whole table (one program a row size), and a tail padded to a multiple of an eighth of the chunk at most
    assert runner.prompt_reads_its_keys and {p for *_, p in shapes(1000)} == {64}
    assert [t for t, *_ in shapes(300)] == [256, 64] and [t for t, *_ in shapes(256 + 130)] == [256, 160]
    assert shapes(5)[0][0] == 16 and shapes(22)[0][0] == 32
    runner.chunk = runner.grain = 64  # a hybrid resumes on the chunk grid
    assert [t for t, *_ in shapes(64 + 22)] == [64, 24] and shapes(5)[0][0] == 8 and shapes(40)[0][0] == 40
    assert shapes(64 + 22, resume=64) == shapes(64 + 22)[1:]
    runner.chunk = runner.grain = 256
    runner.reference_prompt = False  # the flash kernel's: powers of two of rows, the whole table
    assert shapes(22) == [(32, 0, 22, 64)] and shapes(300) == [(256, 0, 256, 64), (64, 256, 44, 64)]
    runner.prompt_reads_its_keys = False  # a mesh's gathering reference: powers of two of rows and pages
    assert shapes(22) == [(32, 0, 22, 2)]
    assert shapes(5) == [(16, 0, 5, 1)]
    assert shapes(300) == [(256, 0, 256, 16), (64, 256, 44, 32)]
    assert shapes(300, resume=256) == shapes(300)[1:]  # a resume runs the chunks a fresh prefill runs
    assert shapes(1000)[-1] == (256, 768, 232, 64)  # never past the lane's pages


def test_a_prompt_takes_the_whole_table_where_its_attention_walks_only_the_tiles_it_reaches():
    """The flash kernel (its head dims, any mesh) and the reference without a mesh read key tiles up to the chunk's
    last row: a lane's whole table, one prompt program a row count. A mesh's reference gathers the table's pages."""
    mesh = object()
    assert ops.prompt_reads_its_keys(ops.PALLAS, 128, None) and ops.prompt_reads_its_keys(ops.PALLAS, 64, mesh)
    assert ops.prompt_reads_its_keys(ops.REFERENCE, 80, None) and ops.prompt_reads_its_keys(ops.PALLAS, 80, None)
    assert not ops.prompt_reads_its_keys(ops.REFERENCE, 128, mesh) and not ops.prompt_reads_its_keys(ops.PALLAS, 80,
                                                                                                      mesh)


def _pages(rng, n_pages, page=16, g=2, e=32):
    return pk.KVPages(jnp.asarray(rng.standard_normal((n_pages, page, g, e)), jnp.float32),
                      jnp.asarray(rng.standard_normal((n_pages, page, g, e)), jnp.float32))


def test_prompt_attention_reads_only_the_key_tiles_up_to_its_last_row_whatever_the_table_width():
    """A prompt chunk's CPU attention (a chunk of 20 rows at 45..64, 4-page tiles of 64 keys): every page past the
    tile holding the last row's key is NaN and never read; a table cut after that tile and one twice as wide give
    the same bits; the values match the gathered reference."""
    rng = np.random.default_rng(3)
    pages = _pages(rng, 24)
    table = jnp.asarray(rng.permutation(16)[None, :12], jnp.int32)  # 12 pages of the first 16
    pages = pk.KVPages(pages.k.at[16:].set(jnp.nan), pages.v.at[16:].set(jnp.nan))
    far = table.at[:, 8:].set(jnp.arange(16, 20, dtype=jnp.int32))  # pages past tile 1 (keys >= 128) hold NaN
    q = jnp.asarray(rng.standard_normal((1, 20, 6, 32)), jnp.float32)
    pos = jnp.arange(45, 65, dtype=jnp.int32)[None]  # the last row at 64: tile 1, keys 64..127
    out = np.asarray(pk.paged_prompt_reference(q, pages, table, pos))
    assert np.isfinite(out).all()
    assert np.array_equal(np.asarray(pk.paged_prompt_reference(q, pages, far, pos)), out)
    assert np.array_equal(np.asarray(pk.paged_prompt_reference(q, pages, table[:, :8], pos)), out)
    wide = jnp.concatenate([table, jnp.full((1, 12), 17, jnp.int32)], axis=1)
    assert np.array_equal(np.asarray(pk.paged_prompt_reference(q, pages, wide, pos)), out)
    k, v = pk.gather_pages(pages, table[:, :8])
    np.testing.assert_allclose(out, np.asarray(pk.attention_reference(q, k, v, pos)), atol=2e-6)


def test_row_attention_reads_only_its_keys_and_never_depends_on_the_table_width_or_other_lanes():
    rng = np.random.default_rng(0)
    pages = _pages(rng, 40)
    table = jnp.asarray(rng.permutation(40)[:36].reshape(3, 12), jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 4, 6, 32)), jnp.float32)
    pos = jnp.asarray([[3, 4, 5, 6], [60, 61, 62, 63], [150, 151, 152, 153]], jnp.int32)
    out = np.asarray(pk.paged_rows_reference(q, pages, table, pos))
    k, v = pk.gather_pages(pages, table)
    np.testing.assert_allclose(out, np.asarray(pk.attention_reference(q, k, v, pos)), atol=2e-6)
    # lane 1's row 2 alone, through a table cut to its 4 pages, then a table of 12 pages of which 8 hold garbage
    alone = pk.paged_rows_reference(q[1:2, 2:3], pages, table[1:2, :4], pos[1:2, 2:3])
    wide = pk.paged_rows_reference(q[1:2, 2:3], pages, table[1:2].at[:, 4:].set(39), pos[1:2, 2:3])
    assert np.array_equal(np.asarray(alone)[0, 0], out[1, 2]) and np.array_equal(np.asarray(wide)[0, 0], out[1, 2])


def test_row_attention_skips_the_rows_past_a_lanes_valid_ones_and_keeps_the_others_bits():
    rng = np.random.default_rng(1)
    pages = _pages(rng, 24)
    table = jnp.asarray(rng.permutation(24)[:16].reshape(2, 8), jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 5, 6, 32)), jnp.float32)
    pos = jnp.asarray([[20, 21, 22, 23, 24], [70, 71, 72, 73, 74]], jnp.int32)
    full = np.asarray(pk.paged_rows_reference(q, pages, table, pos))
    part = np.asarray(pk.paged_rows_reference(q, pages, table, pos, valid=jnp.asarray([2, 0], jnp.int32)))
    assert np.array_equal(part[0, :2], full[0, :2]) and not part[0, 2:].any() and not part[1].any()


def test_a_resumed_prompt_runs_the_bucketed_chunks_a_fresh_one_runs(target):
    """70 tokens on a grid of 32: chunks of 32, 32 and a last one of 6 padded to 16 rows; a second turn resumes
    at 64 and runs that last chunk as the fresh prefill did, so the tokens after it are the same."""
    prompt = _prompt(70, 70)
    engine = Engine(target, LANES, eos_ids=(), prefix_cache_gb=0.01, prefill_chunk=32)
    engine.run([Request(prompt, max_tokens=2)])
    again = engine.run([Request(prompt, max_tokens=6)])[0]
    fresh = Engine(target, LANES, eos_ids=(), prefill_chunk=32).run([Request(prompt, max_tokens=6)])[0]
    assert again.cached_tokens == 64
    assert again.token_ids == fresh.token_ids





def _compiles(caplog, fn, names) -> list[str]:
    """The programs among `names` that JAX compiles while `fn` runs, one entry a compile."""
    import jax

    caplog.clear()
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        fn()
    return [n for r in caplog.records for n in names if f"Compiling jit({n})" in r.getMessage()]


@pytest.mark.slow  # ~40 s: five rounds compiled
def test_precompiled_rounds_leave_nothing_to_compile_when_lanes_end_apart(target, caplog):
    """`compile_rounds` compiles every lane bucket's round (1, 2, 4 lanes); requests that end apart then run buckets
    4, 2 and 1 and compile no round of their own, where an engine without it compiles them mid-stream (stalling
    every lane). Widths no other test uses, so no earlier compile hides one."""
    def round_compiles(fn) -> int:
        return len(_compiles(caplog, fn, ("lane_round",)))

    requests = [Request(_prompt(5 + i, 9), max_tokens=n) for i, n in enumerate((2, 4, 7, 7))]
    cold = Engine(target, LaneConfig(capacity=4, width=3, context=192, page_size=16), eos_ids=())
    assert round_compiles(lambda: cold.run(requests)) >= 2
    engine = Engine(target, LaneConfig(capacity=4, width=4, context=192, page_size=16), eos_ids=())
    assert engine.runner.round_buckets() == [(0,), (0, 1), None]
    assert round_compiles(engine.runner.compile_rounds) == 3
    assert round_compiles(lambda: engine.run(requests)) == 0


def test_precompiled_prompts_and_admission_leave_nothing_to_compile_for_any_prompt_length(target, caplog):
    """`compile_prompts` compiles one prompt program a row count (the lane's whole table, whatever the prompt's
    depth) and `compile_admission` the programs around a prompt; prompts of every length then compile none of them."""
    import jax

    names = ("prefill_chunk", "_first_token", "admit", "admit_processors", "release")

    def compiles(fn) -> list[str]:
        return _compiles(caplog, fn, names)

    jax.clear_caches()  # programs other tests compiled (same tiny shapes) would hide these compiles
    engine = Engine(target, LaneConfig(capacity=1, width=3, context=176, page_size=16), eos_ids=(), prefill_chunk=16)
    runner = engine.runner
    assert sorted({runner._rows(n) for n in range(1, 17)}) == [8, 16]
    assert compiles(runner.compile_prompts) == ["prefill_chunk"] * 2
    assert sorted(compiles(runner.compile_admission)) == ["_first_token", "admit", "admit_processors", "release"]
    requests = [Request(_prompt(20 + n, n), max_tokens=2) for n in (3, 13, 30, 150)]
    assert compiles(lambda: engine.run(requests)) == []


def test_compile_all_compiles_every_program_on_its_threads_and_raises_a_failed_compile():
    """`precompile` hands each lowered program to a thread as soon as it is lowered: every one compiles, and a compile
    that fails fails the whole call (a server must not listen with a program missing)."""
    import threading

    from tfjax.engine.runner import compile_all

    threads = set()

    class Program:
        def __init__(self, fails: bool = False):
            self.fails, self.compiled = fails, False

        def compile(self):
            threads.add(threading.get_ident())
            if self.fails:
                raise RuntimeError("this program does not compile")
            self.compiled = True

    programs = [Program() for _ in range(6)]
    assert compile_all(iter(programs), workers=2) == 6
    assert all(p.compiled for p in programs) and threading.get_ident() not in threads
    with pytest.raises(RuntimeError, match="does not compile"):
        compile_all([Program(), Program(fails=True), Program()], workers=2)
