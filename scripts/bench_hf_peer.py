"""The peer on the same GPU: Hugging Face transformers decoding one stream with a static cache and torch.compile.

  python3 scripts/bench_hf_peer.py --model FOLDER [--tokens 128] [--runs 3] [--dtype bfloat16]

The folder's config.json with random weights (speed does not depend on the values), greedy, `--tokens` new
tokens after a short prompt, `min_new_tokens` so EOS never ends a run early. Prints each run's tok/s and the
median with its spread: the row tfjax's `bench_generate --random-weights 0` is compared against in one call.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", default="reduce-overhead", help="torch.compile mode, or 'none'")
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(dev).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 24), device=dev)
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
              cache_implementation="static", pad_token_id=0)
    # generate compiles the decode step itself and marks each CUDA-graph step (a forward compiled by hand with
    # reduce-overhead fails on the second token: the static cache's graph outputs are overwritten, H100 2026-12-07)
    if args.compile == "none":
        kw["disable_compile"] = True
    else:
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig(fullgraph=True, mode=args.compile)
    with torch.inference_mode():
        for _ in range(2):  # compile and warm up
            model.generate(prompt, **kw)
        rates = []
        for _ in range(args.runs):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(prompt, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            rates.append((out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"transformers {args.dtype}, compile {args.compile}, static cache on {name}: "
          f"{' '.join(f'{r:.1f}' for r in rates)} tok/s; median {statistics.median(rates):.1f} "
          f"({min(rates):.1f}..{max(rates):.1f})")


if __name__ == "__main__":
    main()
