"""Decode tok/s of random 4-bit MoE models that differ only in the expert count (same active size).

  PYTHONPATH=. python3 scripts/bench_moe.py --experts 8,128
  PYTHONPATH=/work/main python3 scripts/bench_moe.py --experts 8,128   # another checkout's model code

The geometry is moe35a3's layer pattern shrunk (`--hidden`, `--moe-intermediate`, `--layers`, vocab 1024); one
lane decodes `--steps` single-token lane-round forwards (`Mode(rows=True)`) after a warm-up, compile excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax import geometry, models
from tfjax.config import QuantConfig
from tfjax.models.layers import Mode


def decode_rate(config, steps: int) -> tuple[float, float]:
    """Single-lane decode (tokens per second, process CPU ms per token) of `config` with random weights; the CPU
    time is the steadier number on a shared machine."""
    graphdef, params = models.random_params(config)
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(1, steps + 16)
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tok, pos, cache):
        logits, cache, _ = nnx.merge(graphdef, params)(tok, pos, jnp.ones((1,), jnp.int32), cache, Mode(rows=True))
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    tok, pos = jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)
    tok, cache = step(params, tok, pos, cache)  # compile
    jax.block_until_ready(tok)
    t, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        tok, cache = step(params, tok, pos + 1 + i, cache)
    jax.block_until_ready(tok)
    return steps / (time.perf_counter() - t), (time.process_time() - cpu) * 1e3 / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,128", help="expert counts to time, comma separated")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    base = geometry.moe35a3.replace(
        hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.moe_intermediate, num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers, layer_types=geometry.moe35a3.layer_types[: args.layers], vocab_size=1024,
        num_attention_heads=4, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, dtype=args.dtype, quantization=QuantConfig(bits=4, group_size=64))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; D={args.hidden}, I={args.moe_intermediate}, "
          f"k={args.top_k}, {args.layers} layers, 4-bit, {args.dtype}")
    print("| experts | decode tok/s | CPU ms/token |")
    print("|---|---|---|")
    for e in (int(v) for v in args.experts.split(",")):
        rate, cpu_ms = decode_rate(base.replace(num_experts=e), args.steps)
        print(f"| {e} | {rate:.1f} | {cpu_ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
