"""json_object's pushdown on SmolLM2's vocabulary: table build time and size, and what masking and walking a round's
rows costs (`choose_scores` on [lanes, width, V] logits, jitted, compile excluded) for plain, json_schema and
json_object lanes (median of 5 batches of 20 calls); with --rounds, also whole lane rounds of SmolLM2 with each
(12 rounds, interleaved, median of 5).

`python scripts/bench_json_object.py [--lanes 2] [--width 6] [--rounds]`
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import grammar, packaged, profiling
from tfjax.lanes.round import LaneState, choose_scores
from tfjax.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TEXT = '{"name": "Ada", "tags": [["x", {"k": [1, 2.5e3]}], true]}'
SCHEMA_TEXT = '{"name": "Ada Lovelace", "age": 36}'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--width", type=int, default=6)
    ap.add_argument("--rounds", action="store_true", help="also time SmolLM2's lane rounds with each grammar")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(packaged.ensure_converted("smollm2"))
    eos = tuple(tok.eos_ids)
    builds = []
    for _ in range(3):
        t = time.perf_counter()
        g = grammar.Grammars(tok, eos, tok.vocab_size).json_object
        builds.append(time.perf_counter() - t)
    print(f"json_object tables: {statistics.median(builds):.2f} s to build (spread {max(builds) - min(builds):.2f}), "
          f"next {g.next.shape} {g.next.nbytes / 1e6:.1f} MB, outcomes {g.outcomes.shape}, "
          f"{int((g.next <= -2).sum())} stack entries of {int((g.next != -1).sum())} allowed")
    schema = grammar.Grammars(tok, eos, tok.vocab_size).compile(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(args.lanes, args.width, tok.vocab_size)), jnp.float32)
    score = jax.jit(choose_scores)
    cases = {"plain": (None, TEXT), "json_schema": (schema, SCHEMA_TEXT), "json_object": (g, TEXT)}
    for name, (which, text) in cases.items():
        ids = tok.encode(text, add_special_tokens=False)
        rows = jnp.asarray([ids[: args.width]] * args.lanes, jnp.int32)  # the pending token, then proposals
        state = LaneState(None, None, None, None, None, None, None, None)
        if which is not None:
            table = grammar.Table(tok.vocab_size)
            initial = table.place(which)
            state.grammar = table.device(grammar.capacity_for(table.size), grammar.outcome_capacity_for(table.outcomes))
            state.gstate = grammar.step(state.grammar, grammar.start(jnp.full((args.lanes,), initial, jnp.int32)),
                                        rows[:, 0])
            assert (np.asarray(grammar.row_states(state.grammar, state.gstate, rows).state) >= 0).all()
        jax.block_until_ready(score(logits, rows, state))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20):
                out = score(logits, rows, state)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t) / 20 * 1e3)
        print(f"{name:12s} {statistics.median(times):7.3f} ms per round's rows (spread {max(times) - min(times):.3f})",
              flush=True)
    if args.rounds:
        lane_rounds(args, {"plain": None, "json_schema": schema, "json_object": g})


def lane_rounds(args, cases: dict) -> None:
    """ms per lane round of SmolLM2 with every lane under each grammar (prefilled afresh per case)."""
    from tfjax import api, sampling

    llm = api.load("smollm2", lanes=args.lanes, width=args.width, context=1024, copy_match=3)
    runner = llm.engine.runner
    prompt = llm.encode([{"role": "user", "content": "Describe a person who lives in Paris as JSON."}])
    per_lane = runner.lanes.pages_per_lane

    def rounds(which) -> float:
        for lane in range(args.lanes):
            runner.prefill(lane, prompt, sampling.SamplingParams.create(1), True,
                           list(range(lane * per_lane, (lane + 1) * per_lane)), token_grammar=which)
        return profiling.round_ms(runner)

    times = {name: [] for name in cases}
    for _ in range(5):
        for name, which in cases.items():
            times[name].append(rounds(which))
    for name, ts in times.items():
        print(f"{name:12s} {statistics.median(ts):7.2f} ms per lane round (spread {max(ts) - min(ts):.2f})")


if __name__ == "__main__":
    main()
