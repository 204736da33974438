"""Convert a GGUF file or a bf16 checkpoint folder (to MLX 4-bit with --bits 4): `tfjax convert` as a script.

  PYTHONPATH=. python3 scripts/convert.py SRC OUT [--bits 4] [--group-size 64]
"""

from __future__ import annotations

import sys

from tfjax.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["convert", *sys.argv[1:]]))
