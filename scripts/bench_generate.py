"""Per-stream decode speed of plain, copies-only and drafted decoding on a packaged model, with hash equality.

  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --tokens 96
  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --drafter runs/smollm2-dflash2/drafter

Every row's `token_sha256` is compared with the plain row of its cell (`draft: false`).
"""

from __future__ import annotations

import argparse
import time

from tfjax import api

CODE = ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n")
CODE_NEW = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
CHAT = [{"role": "user", "content": "Write three short tips for learning to cook."}]
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95, seed=3)


def timed(llm, prompt, tokens: int, draft: bool, params: dict):
    llm.generate(prompt, max_tokens=8, draft=draft, ignore_eos=True, **params)  # warm the compile cache
    t = time.perf_counter()
    out = llm.generate(prompt, max_tokens=tokens, draft=draft, ignore_eos=True, **params)
    return len(out.token_ids) / (time.perf_counter() - t), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default=None, help="a DFlash2 drafter folder: adds drafted rows")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--copy-match", type=int, default=5)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    kw = dict(lanes=1, width=args.width, context=args.context)
    engines = {"copies": api.load(args.model, copy_match=args.copy_match, **kw)}
    if args.drafter:
        engines["dflash2"] = api.load(args.model, drafter=args.drafter, copies=False, **kw)
        engines["dflash2+copies"] = api.load(args.model, drafter=args.drafter, copy_match=args.copy_match, **kw)
    print("| cell | mode | tok/s | tok/round | x plain | hash == plain |")
    print("|---|---|---|---|---|---|")
    for name, prompt in (("code edit", CODE), ("code new", CODE_NEW), ("chat", CHAT)):
        for sampling, params in (("greedy", {}), ("sampled", SAMPLED)):
            base_s, base = timed(engines["copies"], prompt, args.tokens, False, params)
            print(f"| {name}, {sampling} | plain | {base_s:.1f} | {base.tokens_per_round:.2f} | 1.00 | - |")
            for mode, llm in engines.items():
                s, out = timed(llm, prompt, args.tokens, True, params)
                same = "1/1" if out.token_sha256 == base.token_sha256 else "0/1"
                print(f"| {name}, {sampling} | {mode} | {s:.1f} | {out.tokens_per_round:.2f} | {s / base_s:.2f} | {same} |",
                      flush=True)


if __name__ == "__main__":
    main()
