"""Where one verify-attention call's device time goes: its kernels (the Mosaic kernel, the combine, XLA's prep) at
dense27's attention shape, per context and rows, for each candidate BlockSizes (by default the kernel combine
against XLA's).

  PYTHONPATH=. python3 scripts/probes/profile_attention.py [--contexts 2048,16384,65536] [--rows 1,8] [--sets 4]
      [--span 65536] [--cands "[dict(), dict(chunk_k=128), dict(chunk_programs=264)]"]

`--sets` KV pools a call (4 of 16k and up overflow the H100's 50 MB L2; at 2k they fit in it, so the timing
table of bench_graph.py, which takes more, is the one to quote).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections import defaultdict
from pathlib import Path


def kernels_per_call(fn, sets, q, pos, calls: int = 3) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches, device us) per attention call} from a profiler trace of `calls` jitted calls."""
    import jax

    from tfjax.profiling import latest_events

    f = jax.jit(lambda sets: [fn(q, *s, pos) for s in sets])
    jax.block_until_ready(f(sets))
    folder = Path(tempfile.mkdtemp(prefix="profile_attention_"))
    with jax.profiler.trace(str(folder)):
        for _ in range(calls):
            jax.block_until_ready(f(sets))
    total, count = defaultdict(float), defaultdict(int)
    for e in latest_events(folder):
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    n = calls * len(sets)
    return {k: (count[k] / n, total[k] / n) for k in total}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,16384,65536")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--span", type=int, default=0, help="page tables this many keys wide whatever the context")
    ap.add_argument("--cands", default="[dict(), dict(chunk_k=128)]",
                    help="attention_mgpu.BlockSizes keywords, a Python list of dicts")
    args = ap.parse_args()

    from pallas_kernels import attention_mgpu as am
    from tfjax.bench.attention import kv_sets, verify_rows

    variants = {str(kw): am.BlockSizes(**kw) for kw in eval(args.cands)}  # noqa: S307 (a benchmark's own flag)
    for ctx in map(int, args.contexts.split(",")):
        sets = kv_sets(ctx, args.sets, span=args.span)
        for t in map(int, args.rows.split(",")):
            q, pos = verify_rows(ctx, t, 24, 256, seed=t)
            for name, bs in variants.items():
                per = kernels_per_call(functools.partial(am.paged_attention, block_sizes=bs), sets, q, pos)
                print(f"ctx {ctx} rows {t} {name}: {sum(us for _, us in per.values()):.1f} us a call, "
                      f"{sum(c for c, _ in per.values()):.1f} launches", flush=True)
                for k, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
                    print(f"    {k[:70]}: {c:.1f} x, {us:.2f} us", flush=True)


if __name__ == "__main__":
    main()
