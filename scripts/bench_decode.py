"""Plain decode of a named geometry with random weights (one lane), timed on the default device.

  PYTHONPATH=. python3 scripts/bench_decode.py --geometry dense27 --bits 4 --context 2048 --kernels reference
Prints tok/s and the bytes-per-step roofline (weights + KV + DeltaNet state over measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax import geometry, models, ops
from tfjax.config import QuantConfig
from tfjax.models.layers import ROWS
from tfjax.models.qwen3_5 import DeltaState


def copy_bandwidth(gb=4.0):
    """Device copy bandwidth in bytes/s (read + write)."""
    x = jax.random.normal(jax.random.key(1), (int(gb * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="dense27")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernels", default="reference", choices=["reference", "kernel", "auto"])
    ap.add_argument("--layers", type=int, default=0, help="truncate the layer count (0 = all)")
    args = ap.parse_args()
    ops.set_kernels(args.kernels)
    config = geometry.named(args.geometry)
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers, layer_types=config.layer_types[: args.layers])
    if args.bits:
        config = config.replace(quantization=QuantConfig(args.bits, 64))
    t0 = time.perf_counter()
    graphdef, params = models.random_params(config)
    jax.block_until_ready(params)
    print(f"random weights in {time.perf_counter() - t0:.0f} s", flush=True)
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(1, args.context + 64)
    key = jax.random.key(7)
    cache.layers = [DeltaState(l.conv, jax.random.normal(key, l.state.shape) * 0.01) if isinstance(l, DeltaState)
                    else type(l)(jax.random.normal(key, l.k.shape, l.k.dtype), jax.random.normal(key, l.v.shape, l.v.dtype))
                    for l in cache.layers]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    table = params["model"]["embed_tokens"]["table"]
    weight_bytes -= sum(x.nbytes for x in jax.tree.leaves(table))  # one embedding row is read, not the table
    c = config
    kv_bytes = len(c.attention_layers) * args.context * c.num_key_value_heads * c.head_dim * 2 * 2
    state_bytes = len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4 * 2
    step_bytes = weight_bytes + kv_bytes + state_bytes

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def step(params, token, pos, cache):
        logits, cache, _ = models.forward.__wrapped__(graphdef, params, token, pos, jnp.ones_like(pos), cache, ROWS)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    token = jnp.array([[11]], jnp.int32)
    t0 = time.perf_counter()
    token, cache = step(params, token, jnp.array([args.context], jnp.int32), cache)
    token.block_until_ready()
    compile_s = time.perf_counter() - t0
    print(f"first step (compile) in {compile_s:.0f} s", flush=True)
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        token, cache = step(params, token, jnp.array([args.context + 1 + i], jnp.int32), cache)
        token.block_until_ready()
        times.append(time.perf_counter() - t)
    bw = copy_bandwidth()
    med = float(np.median(times))
    roof = step_bytes / bw
    print(f"| {args.geometry} | {args.bits or 16}-bit | {args.kernels} | ctx {args.context} | {1 / med:.1f} tok/s | "
          f"{med * 1e3:.2f} ms/step | {step_bytes / 1e9:.2f} GB/step | copy {bw / 1e12:.2f} TB/s | "
          f"roofline {1 / roof:.0f} tok/s | {roof / med:.1%} of roofline | compile {compile_s:.0f} s | "
          f"{jax.devices()[0].device_kind} |")


if __name__ == "__main__":
    main()
