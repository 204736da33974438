"""Decode speed of one stream under several sampling settings (and drafted vs plain with --drafter), in turns.

  PYTHONPATH=. python3 scripts/probes/decode_modes.py --model smollm2
  PYTHONPATH=. python3 scripts/probes/decode_modes.py --model smollm2 --drafter DIR --context 512 --no-copies \\
      --prompt code --modes greedy --tokens 64

Each cell: decode tok/s after the first token (`Generation.decode_tok_s`), median (min..max) of --runs replies,
the modes in turns, and the last reply's token_sha256 (the same before and after a change that keeps the tokens).
Run it against two trees (PYTHONPATH) in turns to compare them.
"""

from __future__ import annotations

import argparse
import statistics

from tfjax import api

PROMPTS = {"prose": "The history of the printing press begins",
           "code": "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"}
MODES = {"greedy": {}, "top_p": dict(temperature=0.7, top_p=0.9),
         "top_p_min_p": dict(temperature=1.0, top_p=0.95, min_p=0.05), "top_k": dict(temperature=0.7, top_k=40)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default=None, help="also time draft: false on the same engine")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--no-copies", action="store_true")
    ap.add_argument("--prompt", choices=sorted(PROMPTS), default="prose")
    ap.add_argument("--modes", default="greedy,top_p,top_p_min_p")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = api.load(args.model, lanes=1, drafter=args.drafter, context=args.context, prefix_cache_gb=0,
                   copies=not args.no_copies)
    llm.precompile()
    cells = [(m, MODES[m], True) for m in args.modes.split(",")]
    if args.drafter:
        cells += [(f"{m}, draft false", MODES[m], False) for m in args.modes.split(",")]
    prompt = PROMPTS[args.prompt]
    for _, kw, draft in cells:  # every program compiled before the clock
        llm.generate(prompt, max_tokens=8, ignore_eos=True, seed=1, draft=draft, **kw)
    speed, last = {}, {}
    for _ in range(args.runs):
        for name, kw, draft in cells:
            g = llm.generate(prompt, max_tokens=args.tokens, ignore_eos=True, seed=1, draft=draft, **kw)
            speed.setdefault(name, []).append(g.decode_tok_s)
            last[name] = g
    for name, v in speed.items():
        g = last[name]
        print(f"| {name} | {statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f}) | {g.tokens_per_round:.2f} | "
              f"{g.token_sha256[:10]} |")


if __name__ == "__main__":
    main()
