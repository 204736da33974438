"""Decode step time of a random-weight geometry at several TP degrees (weights made straight into their shards).

    PYTHONPATH=. python scripts/bench_tp.py --geometry dense27 --bits 4 --tp 1 2 4

One ROWS step (1 lane x `--rows` rows, `--context` keys) per call, compile excluded, median of `--iters`; each
degree prints its logits' sha256 too (the same at every degree: exact across TP).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax import geometry, models, sharding
from tfjax.config import QuantConfig
from tfjax.models.layers import ROWS


def sharded_random(config, mesh, seed: int = 0):
    """(graphdef, params) of a planned model, each leaf random and made in its shards."""
    abstract = nnx.eval_shape(lambda: models.build(config))
    sharding.plan(abstract, mesh)
    graphdef, state = nnx.split(abstract)
    specs = sharding.shardings(abstract, mesh)
    leaves, treedef = jax.tree.flatten(state)
    out = []
    for i, (leaf, s) in enumerate(zip(leaves, jax.tree.leaves(specs), strict=True)):
        key = jax.random.fold_in(jax.random.key(seed), i)
        if jnp.dtype(leaf.dtype) == jnp.uint32:
            make = (lambda k, shape=leaf.shape: jax.random.bits(k, shape, jnp.uint32))
        else:
            make = (lambda k, shape=leaf.shape, dt=leaf.dtype: (jax.random.normal(k, shape) * 0.02).astype(dt))
        out.append(jax.jit(make, out_shardings=s)(key))
    return models.StaticDef(graphdef), jax.tree.unflatten(treedef, out), abstract


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="dense27")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=0, help="truncate the layer count (0: all)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    config = geometry.named(args.geometry)
    if args.bits:
        config = config.replace(quantization=QuantConfig(args.bits, args.group_size))
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers, layer_types=config.layer_types[: args.layers])
    print(f"| geometry | bits | tp | rows | context | step ms (median of {args.iters}) | logits sha256 |")
    print("|---|---|---|---|---|---|---|")
    for tp in args.tp:
        mesh = sharding.make_mesh(tp)
        graphdef, params, abstract = sharded_random(config, mesh)
        cache = jax.jit(lambda m=abstract: m.init_cache(1, args.context + args.rows))()
        cache = sharding.shard_cache(cache, mesh)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, args.rows)), jnp.int32)
        start, valid = jnp.array([args.context], jnp.int32), jnp.array([args.rows], jnp.int32)
        logits, _, _ = models.forward(graphdef, params, tokens, start, valid, cache, ROWS)
        jax.block_until_ready(logits)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            jax.block_until_ready(models.forward(graphdef, params, tokens, start, valid, cache, ROWS)[0])
            times.append(time.perf_counter() - t)
        sha = hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()[:16]
        print(f"| {args.geometry} | {args.bits} | {tp} | {args.rows} | {args.context} | "
              f"{statistics.median(times) * 1e3:.2f} | {sha} |", flush=True)


if __name__ == "__main__":
    main()
