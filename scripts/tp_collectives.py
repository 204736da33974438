"""Collectives per layer of a tensor-parallel forward, from the compiled HLO (abstract: nothing allocated).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH=. \
        python scripts/tp_collectives.py --geometry tiny_dense dense27 --tp 2 4 [--dp 2 --lanes 4 --width 8]

Lowers one decode step (ROWS, 1 lane x 1 row; with --dp, a lane round's verify: --lanes lanes x --width rows split
over `data`) and one prompt chunk (PROMPT, 1 x 256 rows) with jax.eval_shape'd
parameters and caches placed by `tfjax.sharding`, compiles for the simulated devices and counts each collective
and its result bytes, per decoder layer (the geometry cut to one period of its layer pattern).
"""

from __future__ import annotations

import argparse
import collections
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tfjax import geometry, models, sharding
from tfjax.models.layers import PROMPT, ROWS

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str) -> dict:
    """{op: [count, bytes]} over the HLO's collective instructions (start ops of async pairs counted once)."""
    out = collections.defaultdict(lambda: [0, 0])
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(OPS) + r")(-start)?\(", line)
        if not m:
            continue
        nbytes = sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
        out[m.group(2)][0] += 1
        out[m.group(2)][1] += nbytes
    return dict(out)


def measure(config, tp: int, mode, rows: int, dp: int = 1, lanes: int = 1) -> dict:
    mesh = sharding.make_mesh(tp, dp)
    abstract = nnx.eval_shape(lambda: models.build(config))
    sharding.plan(abstract, mesh)
    graphdef, state = nnx.split(abstract)
    specs = sharding.shardings(abstract, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, specs)
    cache = jax.eval_shape(lambda: abstract.init_cache(lanes, 512))
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), cache,
                         sharding.cache_specs(cache, mesh))
    split = P(sharding.DATA) if lanes % dp == 0 else P()  # the lanes over `data`, as the lane state lies
    i32 = (lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, split)))

    def fwd(params, tokens, start, valid, cache):
        return nnx.merge(graphdef, params)(tokens, start, valid, cache, mode)

    hlo = jax.jit(fwd).lower(params, i32(lanes, rows), i32(lanes), i32(lanes), cache).compile().as_text()
    return collectives(hlo)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", nargs="+", default=["tiny_dense", "dense27"])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dp", type=int, default=1, help="lanes over a `data` axis of this many devices")
    ap.add_argument("--lanes", type=int, default=1, help="lanes of the decode pass (with --dp: a multiple of it)")
    ap.add_argument("--width", type=int, default=1, help="rows per lane of the decode pass (a verify round's width)")
    args = ap.parse_args()
    print(f"dp={args.dp}, decode = {args.lanes} lanes x {args.width} rows")
    print("| geometry | tp | pass | collective | per layer | bytes per layer | whole forward (layers + head) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.geometry:
        full = geometry.named(name)
        period = (full.attention_layers[0] + 1) if full.attention_layers else 1
        config = full.replace(num_hidden_layers=period, layer_types=full.layer_types[:period])
        for tp in args.tp:
            for label, mode, lanes, rows in (("decode", ROWS, args.lanes, args.width), ("prompt", PROMPT, 1, 256)):
                for op, (n, b) in sorted(measure(config, tp, mode, rows, args.dp, lanes).items()):
                    print(f"| {name} | {tp} | {label} {lanes}x{rows} | {op} | {n / period:.2f} | {b / period:,.0f} | "
                          f"{n} / {b:,} B over {period} layers |", flush=True)


if __name__ == "__main__":
    main()
