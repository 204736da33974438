"""An OpenAI-compatible server over the lanes (starlette on uvicorn).

  PYTHONPATH=. python3 scripts/serve.py --model smollm2 --parallel 4 --context 2048
  curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: /v1/chat/completions, /v1/completions (SSE with "stream": true), /v1/models, /health,
/metrics, /tokenize, /detokenize. Every reply carries token_sha256 and tokens_per_round.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a checkpoint folder or a packaged model name")
    ap.add_argument("--name", default=None, help="the model id clients see (default: the --model value)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--context", type=int, default=2048, help="tokens per lane: prompt + reply + one round")
    ap.add_argument("--parallel", type=int, default=4, help="lanes: requests decoded at once")
    ap.add_argument("--width", type=int, default=8, help="rows per lane per round (1 pending + proposals)")
    ap.add_argument("--drafter", default="none", help="none, dflash2, or a draft checkpoint folder")
    ap.add_argument("--no-drafts", action="store_true", help="every request takes the plain path (no proposals)")
    ap.add_argument("--copy-match", type=int, default=0, help="root-copy match length (0: the model's default)")
    ap.add_argument("--prefix-cache-gb", type=float, default=2.0,
                    help="GiB for cached prompt prefixes beyond the lanes' pages (0: off)")
    ap.add_argument("--max-tokens", type=int, default=256, help="reply length when a request names none")
    ap.add_argument("--queue", type=int, default=64, help="requests that may wait for a lane; more get 429")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from tfjax import api
    from tfjax.server import create_app

    drafter = None if args.drafter == "none" else args.drafter
    if drafter == "dflash2":  # the distilled drafter scripts/train_drafter.py writes for this model
        drafter = Path("runs") / f"{Path(str(args.model)).name}-dflash2" / "drafter"
        if not drafter.is_dir():
            raise SystemExit(f"--drafter dflash2: no drafter at {drafter}; distil one with scripts/train_drafter.py "
                             f"--model {args.model} --out {drafter.parent}, or pass its folder")
    llm = api.load(args.model, drafter=drafter, lanes=args.parallel, width=args.width, context=args.context,
                   copy_match=args.copy_match, dtype=args.dtype, prefix_cache_gb=args.prefix_cache_gb)
    llm.drafter_name = drafter
    app = create_app(llm, name=args.name or str(args.model), queue=args.queue, max_tokens=args.max_tokens,
                     drafts=not args.no_drafts)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
