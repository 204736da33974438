"""Compiled memory of a prompt chunk and of the prefix cache's snapshot copies at a named geometry (no weights).

  PYTHONPATH=. python3 scripts/probes/prefill_memory.py --geometry dense27 --bits 4 --prefix-cache-gb 8

Everything is lowered from shapes (`jax.eval_shape`), so a 27B geometry compiles on any machine without its weights;
on a GPU the numbers are the GPU compiler's. `prefill_chunk` is compiled twice: as the tree has it, and with
`ops.qmatmul`'s barrier taken out (the dequantizations unordered), to show what the barrier saves. Issue 28: a dense27
prompt chunk asked for a 30.1 GiB temp on an H100 beside the cache-on engine's 4.6 GiB snapshot pool.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.engine import prefix_cache
from tfjax.engine.runner import cache_bytes
from tfjax.lanes import round as lane_round
from tfjax.lanes import snapshots
from tfjax.models.layers import serving_layout

GIB = 2**30


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def report(name: str, jitted, *args) -> None:
    t = time.perf_counter()
    m = jitted.lower(*args).compile().memory_analysis()
    print(f"| {name} | {m.argument_size_in_bytes / GIB:.2f} | {m.output_size_in_bytes / GIB:.2f} | "
          f"{m.alias_size_in_bytes / GIB:.2f} | {m.temp_size_in_bytes / GIB:.3f} | {time.perf_counter() - t:.0f} |",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="dense27")
    ap.add_argument("--bits", type=int, default=4, help="MLX bits of the weights (0: unquantized)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefix-cache-gb", type=float, default=8.0)
    ap.add_argument("--skip-unordered", action="store_true", help="compile the prompt chunk only as the tree has it")
    args = ap.parse_args()
    config = geometry.named(args.geometry)
    if args.bits:
        config = config.replace(quantization=QuantConfig(bits=args.bits, group_size=64))
    kernels = ops.Kernels.default()

    def build():
        model = models.build(config)
        model.kernels = kernels
        if kernels.pallas:
            serving_layout(model)
        return model

    model = nnx.eval_shape(build)
    graphdef, params = models.split(model)
    page_b, snap_b = cache_bytes((model, None), args.page_size)
    base = -(-args.context // args.page_size)
    extra, slots = prefix_cache.budget(args.prefix_cache_gb, page_b, snap_b, args.chunk // args.page_size, base)
    cache = jax.eval_shape(lambda: model.init_cache(1, args.context, args.page_size, base + extra))
    pool = jax.eval_shape(lambda: snapshots.empty_pool(model.init_cache(1, args.context, args.page_size, 1), slots))
    print(f"{args.geometry} on {jax.devices()[0].device_kind}, jax {jax.__version__}, kernels {kernels}: params "
          f"{nbytes(params) / GIB:.2f} GiB, lane cache {nbytes(cache) / GIB:.2f} GiB ({base + extra} pages), "
          f"snapshot pool {nbytes(pool or []) / GIB:.2f} GiB ({slots} slots of {snap_b / 2**20:.0f} MiB)")
    print("| compiled | arguments GiB | outputs GiB | aliased GiB | temp GiB | compile s |")
    print("|---|---|---|---|---|---|")
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    tokens = jax.ShapeDtypeStruct((1, args.chunk), jnp.int32)
    if pool is not None:
        report("snapshots.save", snapshots.save, pool, cache, i32, i32)
        report("snapshots.restore", snapshots.restore, cache, pool, i32, i32)
    report("prefill_chunk", lane_round.prefill_chunk, graphdef, params, cache, i32, tokens, i32, i32)
    if not args.skip_unordered:
        barrier = jax.lax.optimization_barrier
        jax.lax.optimization_barrier = lambda x: x  # ops.qmatmul looks it up at trace time
        try:
            jax.clear_caches()
            report("prefill_chunk, no barrier", lane_round.prefill_chunk, graphdef, params, cache, i32, tokens, i32,
                   i32)
        finally:
            jax.lax.optimization_barrier = barrier


if __name__ == "__main__":
    main()
