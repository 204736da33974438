"""moe35a3 4-bit (random weights) decode at 1 and 16 lanes and a 2k prompt, against the measured-copy roofline.

  PYTHONPATH=. python3 scripts/bench_moe_gpu.py --context 2048 --lanes 1,16
  PYTHONPATH=. python3 scripts/bench_moe_gpu.py --layers 8   # fewer layers (compile time), said in the table

Bytes per decode step: every weight a step reads (attention, DeltaNet, router, shared experts, lm_head, norms;
one embedding row) + the routed experts the lanes chose (8 at one lane; at L lanes the expected union of L
uniform draws of k of E, `E * (1 - (1 - k/E)^L)`, per layer) + KV at the context + DeltaNet state read and
written. Bandwidth: the best of several device-to-device copies (`x.copy()`, 1-4 GiB, read + write) and of a
scale (`x * c`); both are printed and the roofline uses the copy. Prompt rate: one 2k prompt, against a bf16
dense matmul's measured FLOP rate (2 * active parameters FLOPs a token).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfjax import geometry, models
from tfjax.config import QuantConfig
from tfjax.models.layers import PROMPT, ROWS, serving_layout
from tfjax.models.qwen3_5 import DeltaState


def _best(f, x, reps: int = 5) -> float:
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return min(times)


def bandwidths(sizes=(1, 2, 4)) -> tuple[float, float]:
    """(copy, scale) bytes/s, read + write, best over `sizes` GiB."""
    copy = jax.jit(lambda a: a.copy())
    scale = jax.jit(lambda a: a * 1.0001)
    best_copy = best_scale = 0.0
    for gib in sizes:
        x = jax.random.normal(jax.random.key(0), (int(gib * 2**30) // 4,), jnp.float32)
        best_copy = max(best_copy, 2 * x.nbytes / _best(copy, x))
        best_scale = max(best_scale, 2 * x.nbytes / _best(scale, x))
        del x
    return best_copy, best_scale


def matmul_flops(n: int = 8192) -> float:
    """bf16 dense matmul FLOP/s (n^3, best of 5)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _best(f, a)


def expert_bytes(params) -> tuple[int, int]:
    """(bytes of all routed experts of all layers, bytes of one expert of one layer)."""
    total = one = 0
    for layer in params["model"]["layers"].values():
        ex = layer["mlp"]["experts"]
        leaves = jax.tree.leaves(ex)
        total += sum(x.nbytes for x in leaves)
        one = sum(x.nbytes // x.shape[0] for x in leaves)
    return total, one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=0, help="truncate the layer count (0 = all 40)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens to time (0: skip)")
    ap.add_argument("--matmul", type=int, default=8192, help="the dense matmul's size for the FLOP rate")
    ap.add_argument("--copy-gib", default="1,2,4", help="copy sizes for the bandwidth, GiB")
    ap.add_argument("--runs", type=int, default=3, help="timing runs of --steps steps each (median of medians)")
    args = ap.parse_args()
    c = geometry.moe35a3.replace(quantization=QuantConfig(4, 64))
    if args.layers:
        c = c.replace(num_hidden_layers=args.layers, layer_types=c.layer_types[: args.layers])
    t0 = time.perf_counter()
    graphdef, params = models.random_params(c)
    model = nnx.merge(graphdef, params)
    serving_layout(model)
    graphdef, params = nnx.split(model)
    jax.block_until_ready(params)
    all_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{c.num_hidden_layers} layers, random 4-bit weights: {all_bytes / 1e9:.1f} GB on "
          f"{jax.devices()[0].device_kind} in {time.perf_counter() - t0:.0f} s", flush=True)
    routed_all, per_expert = expert_bytes(params)
    table = sum(x.nbytes for x in jax.tree.leaves(params["model"]["embed_tokens"]))
    fixed = all_bytes - routed_all - table  # read every step whatever the routing
    bw, bw_scale = bandwidths(tuple(float(v) for v in args.copy_gib.split(",")))
    print(f"copy {bw / 1e12:.2f} TB/s (x.copy(), best of {args.copy_gib} GiB), scale {bw_scale / 1e12:.2f} TB/s; "
          f"roofline uses the copy", flush=True)
    e, k = c.num_experts, c.num_experts_per_tok
    print(f"tok/s and ms/step: median of {args.runs} runs (min..max), each the median of {args.steps} synced steps")
    print("| lanes | ctx | tok/s (all lanes) | ms/step | GB/step (fixed + routed + KV/state) | roofline tok/s | share | "
          "compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for lanes in (int(v) for v in args.lanes.split(",")):
        cache = model.init_cache(lanes, args.context + args.steps + 8)
        key = jax.random.key(7)
        cache.layers = [DeltaState(l.conv, jax.random.normal(key, l.state.shape) * 0.01) if isinstance(l, DeltaState)
                        else type(l)(jax.random.normal(key, l.k.shape, l.k.dtype) * 0.1,
                                     jax.random.normal(key, l.v.shape, l.v.dtype)) for l in cache.layers]
        chosen = e * (1 - (1 - k / e) ** lanes)  # expected distinct experts a layer
        routed = chosen * per_expert * c.num_hidden_layers
        kv = lanes * len(c.attention_layers) * args.context * c.num_key_value_heads * c.head_dim * 2 * 2
        state = lanes * len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim \
            * c.linear_value_head_dim * 4 * 2
        step_bytes = fixed + routed + kv + state

        @functools.partial(jax.jit, donate_argnames=("cache",))
        def step(params, last, at, cache):
            logits, cache, _ = models.forward.__wrapped__(graphdef, params, last, at, jnp.ones_like(at), cache, ROWS)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

        token = jnp.arange(lanes, dtype=jnp.int32)[:, None] + 11
        pos = jnp.full((lanes,), args.context, jnp.int32)
        t0 = time.perf_counter()
        token, cache = step(params, token, pos, cache)
        token.block_until_ready()
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(args.runs):
            times = []
            for i in range(args.steps):
                t = time.perf_counter()
                token, cache = step(params, token, pos + 1 + i, cache)
                token.block_until_ready()
                times.append(time.perf_counter() - t)
            runs.append(float(np.median(times)))
        roof = step_bytes / bw
        med, lo, hi = float(np.median(runs)), min(runs), max(runs)
        print(f"| {lanes} | {args.context} | {lanes / med:.1f} ({lanes / hi:.1f}..{lanes / lo:.1f}) | {med * 1e3:.2f} | "
              f"{step_bytes / 1e9:.2f} ({fixed / 1e9:.2f} + {routed / 1e9:.2f} + {(kv + state) / 1e9:.2f}) | "
              f"{lanes / roof:.0f} | {roof / med:.1%} | {compile_s:.0f} |", flush=True)
        del cache
    if args.prompt:
        cache = model.init_cache(1, args.prompt + 16)
        tokens = jax.random.randint(jax.random.key(3), (1, args.prompt), 0, c.vocab_size, jnp.int32)
        prefill = jax.jit(lambda p, t, cache: models.forward.__wrapped__(
            graphdef, p, t, jnp.zeros((1,), jnp.int32), jnp.full((1,), t.shape[1], jnp.int32), cache, PROMPT)[0])
        prefill(params, tokens, cache).block_until_ready()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            prefill(params, tokens, cache).block_until_ready()
            times.append(time.perf_counter() - t)
        sec = min(times)
        active = fixed / 0.5625 + c.num_hidden_layers * k * per_expert / 0.5625  # 4-bit + bf16 scale/bias a 64-group
        flops = matmul_flops(args.matmul)
        print(f"prompt {args.prompt} tokens: {args.prompt / sec:.0f} tok/s ({sec * 1e3:.0f} ms); at ~{active / 1e9:.1f}B "
              f"active params that is {2 * active * args.prompt / sec / 1e12:.1f} TFLOP/s against a bf16 {args.matmul}^3 matmul's "
              f"{flops / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
