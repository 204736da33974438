"""bench_generate with every compile logged and its timed regions marked: which programs compile on the clock.

  JAX_LOG_COMPILES=1 PYTHONPATH=. python3 scripts/probes/timed_compiles.py --model smollm2 --streams 4 ... 2>&1 \\
      | grep "=== \\|Finished XLA compilation"
"""

import sys
import time

sys.path.insert(0, "scripts")
import bench_generate  # noqa: E402

_timed = bench_generate.timed_groups


def marked(llm, groups, tokens, draft, params):
    """`timed_groups` between two stderr marks, with its wall time."""
    print(f"=== timed start: draft={draft}, {len(groups)} groups", file=sys.stderr, flush=True)
    t = time.perf_counter()
    out = _timed(llm, groups, tokens, draft, params)
    print(f"=== timed end: {out[0]:.1f} tok/s, {time.perf_counter() - t:.2f} s", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    bench_generate.timed_groups = marked
    bench_generate.main()
