"""Time to first token of each turn of an 8-turn conversation with the prefix cache on and off.

  PYTHONPATH=. python3 scripts/bench_prefix.py --model smollm2 [--chunks 64,128,256]
  PYTHONPATH=. python3 scripts/bench_prefix.py --geometry dense27 --random-weights 4 --prefix-cache-gb 8

Each turn's prompt is the chat so far (earlier messages and replies) plus a new user message. A turn's time to
first token is a one-token generation of that prompt (the prefill and the first sample); the reply itself is
generated after it, `--reply` tokens with EOS ignored, and becomes the next turn's history; the clock starts once
the engine is idle (the reply's last round, dispatched before its end was known, read). Per run the cache
starts empty. Each engine is precompiled (`LLM.precompile`, timed: what `tfjax serve` pays before it listens) and
its first run only compiles what precompile leaves; then runs alternate between cache off (the first engine with
its cache switched off: the same programs, so a comparison of work, not of compiles) and cache on at each
`--chunks` prefill chunk (the prefix cache's resume grid). Every reply's
token_sha256 with the cache on is compared with the cache off (resumed == fresh). `--random-weights BITS` follows bench_generate.py (random MLX
weights of `--model`'s geometry, or of `--geometry NAME`'s with `--model`'s tokenizer); with random weights the
turns are built in token space (prompt + reply ids + the next message's ids), since random replies are no text.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_generate import random_model

from tfjax import api, geometry, models
from tfjax.config import QuantConfig

MESSAGES = [
    "I am planning a small vegetable garden on a sunny balcony. Which vegetables grow well in containers, and how "
    "deep should the pots be for each of them?",
    "Tomatoes sound good. How often should I water them in summer, and what are the signs of too much water?",
    "What about fertiliser? I would prefer something organic that does not smell too bad on a balcony.",
    "My neighbour says basil planted next to tomatoes keeps pests away. Is that true, or just garden folklore?",
    "Some leaves have small yellow spots now. What could cause that, and what should I check first?",
    "If it turns out to be a fungus, how do I treat it without harming the bees that visit the flowers?",
    "At the end of the season, what should I do with the soil in the pots before next spring?",
    "Finally, could you summarise everything we discussed as a short checklist I can stick on the fridge?",
]


def ttft(llm, prompt_ids: list[int]):
    """Seconds to the first token of a prompt on an idle engine, and its result (cached tokens)."""
    while llm.engine.busy:  # the last reply's round still in flight (~120 ms on the CPU): a chat's next message
        llm.engine.step()  # comes after it ended
    t = time.perf_counter()
    out = llm.generate(prompt_ids, max_tokens=1, ignore_eos=True)
    return time.perf_counter() - t, out


def empty_cache(llm, enabled: bool) -> None:
    """Start from an empty prefix cache, switched on or off (off: every prompt prefilled whole, with the same
    compiled programs)."""
    llm.engine.prefix.clear()
    llm.engine.prefix.enabled = enabled


def conversation(llm, turns: int, reply: int, token_space: bool, cache: bool = True):
    """One run: per turn (prompt tokens, cached tokens, ttft seconds, reply sha256); `cache=False` runs the
    engine with its prefix cache switched off."""
    empty_cache(llm, cache)  # every run starts from an empty cache
    messages, ids, rows = [], [], []
    for text in MESSAGES[:turns]:
        messages.append({"role": "user", "content": text})
        ids = ids + llm.encode(messages[-1:]) if token_space else llm.encode(messages)
        seconds, first = ttft(llm, ids)
        out = llm.generate(ids, max_tokens=reply, ignore_eos=True)
        if out.finish_reason == "error":
            raise SystemExit(f"reply failed: {out.error}")
        messages.append({"role": "assistant", "content": out.text})
        ids = ids + out.token_ids
        rows.append((len(ids) - len(out.token_ids), first.cached_tokens, seconds, out.token_sha256))
    print(f"  run: TTFT {', '.join(f'{r[2] * 1e3:.0f}' for r in rows)} ms", file=sys.stderr, flush=True)
    return rows


def geometry_model(name: str, bits: int | None):
    """(module, config) of a named geometry with random weights, MLX `bits`-bit (group 64) unless 0 or None."""
    config = geometry.named(name)
    if bits:
        config = config.replace(quantization=QuantConfig(bits=bits, group_size=64))
    graphdef, params = models.random_params(config)
    from flax import nnx

    return nnx.merge(graphdef, params), config


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS",
                    help="random MLX BITS-bit weights of the folder's geometry (0: unquantized)")
    ap.add_argument("--geometry", default=None, help="a named geometry (dense27...) with random weights")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply", type=int, default=48, help="tokens each reply decodes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dtype", default=None, help="the checkpoint's weights cast to this dtype (float32 on a CPU)")
    ap.add_argument("--prefix-cache-gb", type=float, default=2.0, help="the cache-on engines' budget")
    ap.add_argument("--chunks", default=None, help="prefill chunks of the cache-on engines, e.g. 64,128,256 (default: "
                    "the platform's); the cache-off engine takes the first")
    args = ap.parse_args()
    kw = dict(lanes=1, context=args.context, dtype=args.dtype)
    if args.geometry is not None:
        kw["model"] = geometry_model(args.geometry, args.random_weights)
    elif args.random_weights is not None:
        kw["model"] = random_model(args.model, args.random_weights)
    token_space = args.geometry is not None or args.random_weights is not None
    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [None]
    engines = {}
    for c in chunks:
        llm = api.load(args.model, prefix_cache_gb=args.prefix_cache_gb, prefill_chunk=c, **kw)
        kw["model"] = (llm.model, llm.config)  # one set of weights for every engine
        engines[f"on {llm.engine.runner.chunk}"] = llm
    ons = list(engines)
    off = engines[ons[0]]  # the first engine with its cache switched off: the same programs, every prompt whole
    import jax

    print(f"{args.geometry or args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}"
          + (f", random {args.random_weights}-bit weights" if args.random_weights is not None else "")
          + f"; {args.turns} turns, {args.reply}-token replies, cache off = the {ons[0]} engine with its cache "
          f"switched off, median (min-max) of {args.runs} runs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for name, llm in engines.items():
        t = time.perf_counter()
        n = llm.precompile()
        print(f"{name}: precompile {n} programs in {time.perf_counter() - t:.1f} s", flush=True)
    runs = {name: [] for name in ["off", *ons]}
    conversation(off, args.turns, args.reply, token_space, cache=False)  # compiles what precompile does not
    for llm in engines.values():
        conversation(llm, args.turns, args.reply, token_space)
    one_message = off.encode([{"role": "user", "content": MESSAGES[0]}])
    single = []
    for _ in range(args.runs):  # the engines alternate, so a change in the machine's load hits all alike
        runs["off"].append(conversation(off, args.turns, args.reply, token_space, cache=False))
        for name, llm in engines.items():
            runs[name].append(conversation(llm, args.turns, args.reply, token_space))
        empty_cache(off, False)
        single.append(ttft(off, one_message)[0])
    one = statistics.median(single)
    print("| turn | prompt tokens | TTFT off, ms | " + " | ".join(
        f"{n}: cached, TTFT ms, / one message" for n in ons) + " | reply hash on == off |")
    print("|---|---|---|" + "---|" * len(ons) + "---|")
    for t in range(args.turns):
        n = runs["off"][0][t][0]
        cells = []
        for name in ons:
            on = [r[t][2] for r in runs[name]]
            cells.append(f"{runs[name][0][t][1]}, {spread(on)}, {statistics.median(on) / one:.2f}")
        same = sum(a[t][3] == b[t][3] for name in ons for a, b in zip(runs[name], runs["off"], strict=True))
        print(f"| {t + 1} | {n} | {spread([r[t][2] for r in runs['off']])} | {' | '.join(cells)} | "
              f"{same}/{args.runs * len(ons)} |")
    print(f"one-message request ({len(one_message)} tokens): TTFT {spread(single)} ms; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name in ons:
        stats = engines[name].engine.prefix_stats
        print(f"cache {name}, all runs: {stats.hits}/{stats.lookups} lookups hit, {stats.cached_tokens} of "
              f"{stats.prompt_tokens} prompt tokens skipped, {stats.evictions} pages evicted")

if __name__ == "__main__":
    main()
