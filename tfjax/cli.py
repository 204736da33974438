"""`tfjax generate MODEL PROMPT` and `tfjax convert SRC OUT`."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tfjax")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text with a model folder or packaged model name")
    g.add_argument("model")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--no-draft", action="store_true", help="the plain reference path (no proposals)")
    g.add_argument("--drafter", default=None)
    g.add_argument("--copy-match", type=int, default=0)
    g.add_argument("--context", type=int, default=2048)
    g.add_argument("--prefix-cache-gb", type=float, default=2.0,
                   help="GiB for cached prompt prefixes beyond the lanes' pages (0: off)")
    c = sub.add_parser("convert", help="convert a GGUF file or bf16 folder (to MLX 4-bit with --bits)")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--bits", type=int, default=0)
    c.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "convert":
        from pathlib import Path

        from tfjax import checkpoint

        src = Path(args.src)
        if src.suffix == ".gguf":
            from tfjax.gguf_import import convert_gguf

            target = Path(args.out) if not args.bits else Path(args.out + "-bf16")
            convert_gguf(src, target)
            src = target
        if args.bits:
            checkpoint.write_mlx(src, args.out, bits=args.bits, group_size=args.group_size)
        print(args.out)
        return 0
    from tfjax import api

    llm = api.load(args.model, drafter=args.drafter, lanes=1, copy_match=args.copy_match, context=args.context,
                   prefix_cache_gb=args.prefix_cache_gb)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    t = time.perf_counter()
    out = llm.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, draft=not args.no_draft)
    dt = time.perf_counter() - t
    sys.stdout.write(args.prompt if not args.chat else "")
    print(out.text)
    print(f"[{len(out.token_ids)} tokens in {dt:.1f} s incl. compile, {out.tokens_per_round:.2f} tokens/round, "
          f"finish={out.finish_reason}, token_sha256={out.token_sha256}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
