"""Aggregate tok/s of the engine on the tiny random model, where the host's per-round work weighs most.

  python3 scripts/probes/bench_engine_overlap.py [REPO]   # REPO: the checkout to import tfjax from (A/B two trees)
  python3 scripts/probes/bench_engine_overlap.py [REPO] --profile   # cProfile of three runs: where the host's time goes

Four lanes, width 5, four 30-token prompts decoding 96 tokens each; one warm-up run, then the median of
five timed runs of `Engine.run`.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
PROFILE = "--profile" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--profile"]
if ARGS:
    sys.path.insert(0, ARGS[0])

import numpy as np  # noqa: E402

from tfjax import geometry, models  # noqa: E402
from tfjax.engine import Engine, Request  # noqa: E402
from tfjax.lanes.config import LaneConfig  # noqa: E402


def requests(seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, 250, 30).tolist(), max_tokens=96) for _ in range(4)]


def main():
    engine = Engine(models.build(geometry.tiny_dense, seed=11),
                    LaneConfig(capacity=4, width=5, context=192, page_size=16), eos_ids=())
    engine.run(requests(0))
    if PROFILE:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for rep in range(3):
            engine.run(requests(rep + 1))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        return
    rates = []
    for rep in range(5):
        t = time.perf_counter()
        out = engine.run(requests(rep + 1))
        rates.append(sum(len(r.token_ids) for r in out) / (time.perf_counter() - t))
    print(f"tiny_dense 4 lanes x 96 tokens: aggregate tok/s median {np.median(rates):.0f} "
          f"(runs {', '.join(f'{r:.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
