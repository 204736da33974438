"""Per-stream decode speed of plain, copies-only and drafted decoding on a packaged model, with hash equality.

  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --tokens 96
  PYTHONPATH=. python3 scripts/bench_generate.py --model smollm2 --drafter runs/smollm2-dflash2/drafter
  PYTHONPATH=. python3 scripts/bench_generate.py --model FOLDER --random-weights 4   # plain speed only

`--random-weights BITS` times the folder's geometry (config.json, tokenizer) with random MLX weights
(0 = the config's dtype), for a model too large to ship: plain rows only, since what copies and drafts
accept depends on real weights (`--exact` adds them anyway: their hashes still check exactness on the GPU).

Every row's `token_sha256` is compared with the plain row of its cell (`draft: false`).
"""

from __future__ import annotations

import argparse
import time

from flax import nnx

from tfjax import api, models
from tfjax.config import ModelConfig, QuantConfig

CODE = ("Original:\ndef add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\nThe same function with `total` renamed to `acc`:\ndef add_all(values):\n    acc = 0\n")
CODE_NEW = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
CHAT = [{"role": "user", "content": "Write three short tips for learning to cook."}]
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.95, seed=3)


def timed(llm, prompt, tokens: int, draft: bool, params: dict):
    llm.generate(prompt, max_tokens=8, draft=draft, ignore_eos=True, **params)  # warm the compile cache
    t = time.perf_counter()
    out = llm.generate(prompt, max_tokens=tokens, draft=draft, ignore_eos=True, **params)
    if out.finish_reason == "error":  # a failed reply's hash proves nothing: stop the table here
        raise SystemExit(f"reply failed (draft={draft}): {out.error}")
    return len(out.token_ids) / (time.perf_counter() - t), out


def random_model(path: str, bits: int):
    """(module, config) of the folder's geometry with random weights, MLX `bits`-bit (group 64) unless 0."""
    config = ModelConfig.from_json(api.resolve(path, weights=False))
    if bits:
        config = config.replace(quantization=QuantConfig(bits=bits, group_size=64))
    graphdef, params = models.random_params(config)
    return nnx.merge(graphdef, params), config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default=None, help="a DFlash2 drafter folder: adds drafted rows")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--copy-match", type=int, default=5)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--plain-twice", action="store_true", help="a second plain row: is plain decoding deterministic?")
    ap.add_argument("--exact", action="store_true",
                    help="with --random-weights, the drafted rows too (their hashes check exactness; speeds mean little)")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS",
                    help="random MLX BITS-bit weights of the folder's geometry (0: unquantized); plain rows only")
    ap.add_argument("--cells", default="code edit,code new,chat", help="prompts to run, comma separated")
    ap.add_argument("--sampling", default="greedy,sampled", help="greedy, sampled or both")
    args = ap.parse_args()
    kw = dict(lanes=1, width=args.width, context=args.context)
    if args.random_weights is not None:
        kw["model"] = random_model(args.model, args.random_weights)
    engines = {"copies": api.load(args.model, copy_match=args.copy_match, **kw)}
    if args.drafter:
        engines["dflash2"] = api.load(args.model, drafter=args.drafter, copies=False, **kw)
        engines["dflash2+copies"] = api.load(args.model, drafter=args.drafter, copy_match=args.copy_match, **kw)
    import jax

    print(f"{args.model} on {jax.devices()[0].device_kind}, jax {jax.__version__}"
          + (f", random {args.random_weights}-bit weights" if args.random_weights is not None else ""))
    notes: list[str] = []
    print("| cell | mode | tok/s | tok/round | x plain | hash == plain |")
    print("|---|---|---|---|---|---|")
    cells = [c for c in (("code edit", CODE), ("code new", CODE_NEW), ("chat", CHAT)) if c[0] in args.cells.split(",")]
    modes = [m for m in (("greedy", {}), ("sampled", SAMPLED)) if m[0] in args.sampling.split(",")]
    for name, prompt in cells:
        for sampling, params in modes:
            base_s, base = timed(engines["copies"], prompt, args.tokens, False, params)
            print(f"| {name}, {sampling} | plain | {base_s:.1f} | {base.tokens_per_round:.2f} | 1.00 | - |")
            drafted = args.random_weights is None or args.exact
            runs = [(m, llm, True) for m, llm in engines.items()] if drafted else []
            if args.plain_twice:
                runs.insert(0, ("plain again", engines["copies"], False))
            for mode, llm, draft in runs:
                s, out = timed(llm, prompt, args.tokens, draft, params)
                same = "1/1" if out.token_sha256 == base.token_sha256 else "0/1"
                print(f"| {name}, {sampling} | {mode} | {s:.1f} | {out.tokens_per_round:.2f} | {s / base_s:.2f} | {same} |",
                      flush=True)
                if out.token_sha256 != base.token_sha256:
                    notes.append(f"{name}, {sampling}, {mode}: {first_difference(base.token_ids, out.token_ids)}")
    for note in notes:
        print(note)


def first_difference(a: list[int], b: list[int]) -> str:
    """Where two replies part: the index and the two tokens there."""
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i} of {len(a)}: {a[i] if i < len(a) else None} vs {b[i] if i < len(b) else None}"


if __name__ == "__main__":
    main()
