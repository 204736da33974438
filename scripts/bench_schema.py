"""Throughput of SmolLM2 replies with a JSON schema, with penalties, and plain (median of 3, compile excluded).

`python scripts/bench_schema.py [--plain-only]`: --plain-only runs only the plain case, so the same command
under another checkout (PYTHONPATH=/work/main) says whether the processors' code costs plain rounds anything.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tfjax import api

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "city": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}, "adult": {"type": "boolean"}},
          "required": ["name", "city", "age", "adult"]}
MESSAGES = [{"role": "user", "content": "Describe a person who lives in Paris as JSON with name, city, age, adult."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plain-only", action="store_true", help="time only the unconstrained reply")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per reply (default 64)")
    ap.add_argument("--model", default="smollm2", help="a packaged name, folder or hub id of a SmolLM2 checkpoint")
    ap.add_argument("--lanes", type=int, default=2, help="lanes of the engine (default 2)")
    args = ap.parse_args()
    llm = api.load(args.model, lanes=args.lanes, width=6, context=512, copy_match=3)
    cases = {"plain": {}}
    if not args.plain_only:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        cases["penalties+bias"] = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={28: -5.0})
        cases["json_schema"] = dict(response_format=fmt)
        cases["json_schema+logprobs"] = dict(response_format=fmt, logprobs=True, top_logprobs=5)
    for name, kw in cases.items():
        llm.generate(MESSAGES, max_tokens=8, **kw)  # compile
        rates, tpr = [], []
        for _ in range(3):
            t = time.perf_counter()
            gens = llm.generate_many([MESSAGES] * args.lanes, max_tokens=args.max_tokens, **kw)
            wall = time.perf_counter() - t
            rates.append(sum(len(g.token_ids) for g in gens) / wall)
            tpr.append(statistics.mean(g.tokens_per_round for g in gens))
        print(f"{name:22s} {statistics.median(rates):7.1f} tok/s (spread {max(rates) - min(rates):.1f}), "
              f"{statistics.mean(tpr):.2f} tokens/round, {len(gens[0].token_ids)} tokens/reply")


if __name__ == "__main__":
    main()
