"""Per-stream decode speed with and without drafting on a packaged model, with hash equality per cell.

  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --tokens 96
"""

from __future__ import annotations

import argparse
import time

from tfjax import api

CODE = ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n")
CHAT = [{"role": "user", "content": "Write three short tips for learning to cook."}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--copy-match", type=int, default=5)
    ap.add_argument("--width", type=int, default=8)
    args = ap.parse_args()
    llm = api.load(args.model, lanes=1, width=args.width, context=1024, copy_match=args.copy_match)
    print("| cell | plain tok/s | drafted tok/s | plain tok/round | drafted tok/round | hashes equal |")
    print("|---|---|---|---|---|---|")
    for name, prompt in (("code", CODE), ("chat", CHAT)):
        for mode, params in (("greedy", {}), ("sampled", dict(temperature=1.0, top_k=20, top_p=0.95, seed=3))):
            row = {}
            for draft in (False, True):
                llm.generate(prompt, max_tokens=8, draft=draft, ignore_eos=True, **params)  # warm the compile cache
                t = time.perf_counter()
                out = llm.generate(prompt, max_tokens=args.tokens, draft=draft, ignore_eos=True, **params)
                row[draft] = (len(out.token_ids) / (time.perf_counter() - t), out)
            (p_s, p), (d_s, d) = row[False], row[True]
            print(f"| {name}, {mode} | {p_s:.1f} | {d_s:.1f} | {p.tokens_per_round:.2f} | {d.tokens_per_round:.2f} | "
                  f"{'1/1' if p.token_sha256 == d.token_sha256 else '0/1'} |")


if __name__ == "__main__":
    main()
