"""`tfjax serve` from a checkout: `PYTHONPATH=. python3 scripts/serve.py --model smollm2 --parallel 4`.

The same options as `tfjax serve MODEL ...` (see `tfjax serve --help`); `--model` names the model here
(default smollm2).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = "smollm2"
    argv = [a for arg in argv for a in (arg.split("=", 1) if arg.startswith("--model=") else [arg])]
    if "--model" in argv:
        i = argv.index("--model")
        model = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    from tfjax.cli import main as cli

    return cli(["serve", model, *argv])


if __name__ == "__main__":
    raise SystemExit(main())
