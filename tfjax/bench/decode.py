"""dense27 4-bit end to end: decode steps (synced and pipelined, kernel against reference path) and a prompt
chunk's prefill (DeltaNet through XLA's chunked scan against the Pallas kernel)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np

from tfjax.bench.common import RESULTS, row
from tfjax.profiling import latest_events, median_time, summarize


def decode_section(steps=20, context=2048, layers=0, modes=("reference", "kernel"), rows=1, span=0):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax import geometry, models, ops
    from tfjax.config import QuantConfig
    from tfjax.models.decoder import DeltaState
    from tfjax.models.layers import ROWS as ROWS_MODE
    from tfjax.models.layers import serving_layout

    bw = RESULTS["copy_GBps"] * 1e9
    unit = "tok/s" if rows == 1 else "rounds/s"  # a round of `rows` verify rows keeps one token or more
    config = geometry.named("dense27").replace(quantization=QuantConfig(4, 64))
    if layers:
        config = config.replace(num_hidden_layers=layers, layer_types=config.layer_types[:layers])
    graphdef, params = models.random_params(config)
    c = config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    weight_bytes -= sum(x.nbytes for x in jax.tree.leaves(params["model"]["embed_tokens"]["table"]))
    kv_bytes = len(c.attention_layers) * context * c.num_key_value_heads * c.head_dim * 2 * 2
    state_bytes = len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 8
    step_bytes = weight_bytes + kv_bytes + state_bytes
    tokens, first = {}, {}  # first: each path's logits at the same first step (same weights, cache and token)
    for mode in modes:
        model = nnx.merge(graphdef, params)
        model.kernels = ops.PALLAS if mode == "kernel" else ops.REFERENCE  # static, in the graphdef
        if mode == "kernel":
            fused, packed = serving_layout(model)
            print(f"  fused {fused} projection groups, repacked {packed} linears", flush=True)
        gd, ps = models.split(model)
        cache = model.init_cache(1, span or context + 4 * steps + 64)
        key = jax.random.key(7)
        cache.layers = [DeltaState(l.conv, jax.random.normal(key, l.state.shape) * 0.01) if isinstance(l, DeltaState)
                        else type(l)(jax.random.normal(key, l.k.shape, l.k.dtype) * 0.5,
                                     jax.random.normal(key, l.v.shape, l.v.dtype)) for l in cache.layers]

        @functools.partial(jax.jit, donate_argnames=("cache",))
        def step(ps, token, pos, cache, gd=gd):
            logits, cache, _ = models.forward.__wrapped__(gd, ps, token, pos, jnp.full_like(pos, rows), cache,
                                                          ROWS_MODE)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, logits[:, -1]  # each row's argmax: [1, rows]

        token = jnp.full((1, rows), 11, jnp.int32)  # rows > 1: a verify round's shape, one position accepted a step
        t0 = time.perf_counter()
        token, cache, first[mode] = step(ps, token, jnp.array([context], jnp.int32), cache)
        token.block_until_ready()
        compile_s = time.perf_counter() - t0
        seq, times = [], []
        for i in range(steps):
            t = time.perf_counter()
            token, cache, _ = step(ps, token, jnp.array([context + 1 + i], jnp.int32), cache)
            token.block_until_ready()
            times.append(time.perf_counter() - t)
            seq.append(int(token[0, 0]))
        tokens[mode] = seq
        med = float(np.median(times))
        # the same steps dispatched back to back, the token and position staying on the device, one sync at the
        # end: what a step costs once the host's dispatch overlaps the device (an engine reading each token one
        # step late); the gap to `med` is the host's share of a synced step
        pos, batches = jnp.array([context + 1 + steps], jnp.int32), []
        for _ in range(3):  # the median of three batches: the host's share varies from batch to batch
            t = time.perf_counter()
            for _ in range(steps):
                token, cache, _ = step(ps, token, pos, cache)
                pos = pos + 1
            token.block_until_ready()
            batches.append((time.perf_counter() - t) / steps)
        pipelined = float(np.median(batches))
        print(f"  {mode}: synced step {med * 1e3:.2f} ms, pipelined step {pipelined * 1e3:.2f} ms "
              f"({1 / pipelined:.1f} {unit}; batches {', '.join(f'{b * 1e3:.2f}' for b in batches)} ms)", flush=True)
        if os.environ.get("BENCH_PROFILE"):  # where a step goes: device kernels from a profiler trace
            token, cache = profile_steps(step, ps, token, cache, context + 1 + 4 * steps, f"{mode} decode step")
        RESULTS[f"decode_{mode}"] = dict(tok_s=1 / med, ms=med * 1e3, pipelined_ms=pipelined * 1e3,
                                         compile_s=compile_s, tokens=seq, step_GB=step_bytes / 1e9)
        shape = f"1 lane x {rows} rows" if rows > 1 else "1 lane"
        row("decode", f"dense27 4-bit {shape} ctx {context}, {mode} ({1 / med:.1f} {unit}; compile {compile_s:.0f} s;"
            f" {step_bytes / 1e9:.2f} GB/step)", med, step_bytes / med / 1e9, bw / 1e9, "GB/s")
        del ps, cache, model
    if len(tokens) < 2:
        return
    RESULTS["decode_same_tokens"] = tokens["kernel"] == tokens["reference"]
    same = next((i for i, (a, b) in enumerate(zip(tokens["kernel"], tokens["reference"], strict=True)) if a != b),
                len(tokens["kernel"]))
    ref, got = (np.asarray(first[m], np.float32)[0] for m in ("reference", "kernel"))
    top2 = np.sort(ref)[-2:]
    RESULTS["decode_first_logits"] = dict(rel_err=float(np.abs(got - ref).max() / np.abs(ref).max()),
                                          same_argmax=bool(got.argmax() == ref.argmax()),
                                          ref_top2_margin=float(top2[1] - top2[0]),
                                          max_abs_err=float(np.abs(got - ref).max()), agreeing_steps=same)
    print(f"  kernel tokens == reference tokens: {RESULTS['decode_same_tokens']} (first {same} of {len(tokens['kernel'])} "
          f"agree); first step's logits, same inputs: {RESULTS['decode_first_logits']}", flush=True)


def prefill_section(rows=2048, layers=0, delta_chunked=("0", "1")):
    """One lane's prompt chunk of `rows` tokens through dense27 4-bit (random weights, kernels on), with prompt
    DeltaNet through XLA's chunked scan (`Kernels.delta_chunked` off: "0") and through the Pallas kernel ("1"): wall time a
    chunk, tokens/s, the rate over the bf16 matmul rate, and the two paths' last-row logits against each other."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tfjax import geometry, models, ops
    from tfjax.config import QuantConfig
    from tfjax.models.layers import PROMPT, serving_layout

    config = geometry.named("dense27").replace(quantization=QuantConfig(4, 64))
    if layers:
        config = config.replace(num_hidden_layers=layers, layer_types=config.layer_types[:layers])
    graphdef, params = models.random_params(config)
    words = [x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]  # the 4-bit linears' packed weights
             if x.dtype == jnp.uint32 and "embed_tokens" not in jax.tree_util.keystr(path)]
    flops = 2 * rows * sum(x.size for x in words) * (32 // config.quantization.bits)  # matmuls only
    model = nnx.merge(graphdef, params)
    serving_layout(model)
    tokens = jax.random.randint(jax.random.key(3), (1, rows), 0, config.vocab_size, jnp.int32)
    last = {}
    for setting in delta_chunked:
        model.kernels = ops.Kernels(pallas=True, delta_chunked=setting == "1")  # static: one jit per setting
        gd, ps = models.split(model)
        cache = model.init_cache(1, rows + 64)

        @jax.jit
        def prefill(ps, tokens, cache, gd=gd):
            logits, _, _ = models.forward.__wrapped__(gd, ps, tokens, jnp.array([0]), jnp.array([rows]), cache, PROMPT)
            return logits[:, -1]

        t0 = time.perf_counter()
        last[setting] = prefill(ps, tokens, cache).block_until_ready()
        compile_s = time.perf_counter() - t0
        t = median_time(prefill, (ps, tokens, cache), reps=5)
        RESULTS.setdefault("prefill", []).append(dict(rows=rows, delta_chunked=setting, ms=t * 1e3,
                                                      tok_s=rows / t, compile_s=compile_s))
        what = "Pallas chunked kernel" if setting == "1" else "XLA chunked scan"
        row("prefill", f"dense27 4-bit, {rows}-token chunk, DeltaNet on the {what} ({rows / t:.0f} tok/s; compile "
            f"{compile_s:.0f} s)", t, flops / t / 1e12, RESULTS["bf16_TFLOPs"], "TFLOP/s")
        del cache
    if len(last) == 2:
        a, b = (np.asarray(v, np.float32)[0] for v in last.values())
        RESULTS["prefill_logits"] = dict(rel_err=float(np.abs(a - b).max() / np.abs(b).max()),
                                         same_argmax=bool(a.argmax() == b.argmax()))
        print(f"  prefill: last-row logits, kernel against scan: {RESULTS['prefill_logits']}", flush=True)


def profile_steps(step, ps, token, cache, pos, what, count=5):
    """Run `count` more steps under the profiler and print their kernels per step (tfjax.profiling)."""
    import jax
    import jax.numpy as jnp

    out = Path(os.environ["BENCH_PROFILE"]) / what.replace(" ", "_")
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        t = time.perf_counter()
        for i in range(count):
            token, cache, _ = step(ps, token, jnp.array([pos + i], jnp.int32), cache)
        token.block_until_ready()
        wall = time.perf_counter() - t
    print(f"  profile of {what}:\n" + summarize(latest_events(out), count, wall), flush=True)
    return token, cache
