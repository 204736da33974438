"""Where a lane round's time goes: device kernels per round, from a JAX profiler trace of real decoding.

  PYTHONPATH=. python3 scripts/probes/profile_round.py --model /root/smollm2 --tokens 64
  PYTHONPATH=. python3 scripts/probes/profile_round.py --model /root/smollm2 --drafter DIR --tokens 64
  TFJAX_KERNELS=kernel PYTHONPATH=. python3 scripts/probes/profile_round.py --model smollm2 --structure  # no GPU needed
  PYTHONPATH=. python3 scripts/probes/profile_round.py --structure --geometry dense27 --layers 8
  PYTHONPATH=. python3 scripts/probes/profile_round.py --launches --geometry dense27 --layers 8 [--hlo-out F]  # compiled

Decodes one request (one lane, `ignore_eos`) under `jax.profiler.trace`, then reads the Perfetto trace and
prints the device kernels by time per round: how many launches a round makes, how long the device is busy
against the round's wall time (a launch-bound round is mostly idle device), and which kernels dominate.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tfjax.profiling import compiled_launches, device_events, host_api_calls, latest_trace, structure, summarize

PROMPT = ("Original:\ndef scale(values, k):\n    out = []\n    for v in values:\n        out.append(v * k)\n"
          "    return out\n\nThe same function with `out` renamed to `scaled`:\ndef scale(values, k):\n")


def geometry_step(name: str, layers: int):
    """One row-mode decode step of a named geometry (random 4-bit weights, its first `layers`): (step, args)."""
    import jax.numpy as jnp

    from tfjax import geometry, models, ops
    from tfjax.config import QuantConfig
    from tfjax.models.layers import ROWS, serving_layout

    c = geometry.named(name).replace(quantization=QuantConfig(4, 64))
    c = c.replace(num_hidden_layers=layers, layer_types=c.layer_types[:layers])
    model = models.build(c, seed=0, kernels=ops.PALLAS)  # the GPU dispatch (tracing needs no GPU)
    serving_layout(model)
    gd, ps = models.split(model)
    cache = model.init_cache(1, 2048 + 64)

    def step(ps, token, pos, cache):
        return models.forward.__wrapped__(gd, ps, token, pos, jnp.ones_like(pos), cache, ROWS)[0]

    return step, (ps, jnp.zeros((1, 1), jnp.int32), jnp.array([2048]), cache)


def geometry_step_structure(name: str, layers: int) -> dict:
    """The structure of one row-mode decode step of a named geometry (random 4-bit weights, first `layers`)."""
    import jax

    step, args = geometry_step(name, layers)
    return structure(jax.make_jaxpr(step)(*args))


def print_launches(args) -> None:
    """The decode step compiled for this host's backend (GPU kernels on a GPU): its launches by kind."""
    import jax

    step, inputs = geometry_step(args.geometry or "dense27", args.layers)
    hlo = jax.jit(step).lower(*inputs).compile().as_text()
    if args.hlo_out:
        Path(args.hlo_out).write_text(hlo)
    got = compiled_launches(hlo)
    print(f"{args.geometry or 'dense27'}, {args.layers} layers, one decode step compiled on "
          f"{jax.devices()[0].device_kind}: {got['launches']} launches")
    for kind, n in got["kinds"].items():
        print(f"  {n:5d}  {kind}")
    print("  in order: " + " ".join(got["names"]))


def print_structure(args) -> None:
    """The round's launch structure with the GPU dispatch forced (no GPU needed: tracing only)."""
    from tfjax import api, ops
    from tfjax.lanes import round as lane_round

    if args.geometry:
        print(f"{args.geometry}, {args.layers} layers, one decode step: {geometry_step_structure(args.geometry, args.layers)}")
        return
    if not ops.Kernels.default().pallas:
        raise SystemExit("--structure --model traces the GPU dispatch: run with TFJAX_KERNELS=kernel (or on a GPU)")
    llm = api.load(args.model, lanes=1, drafter=args.drafter,
                   **({"copy_match": args.copy_match} if args.copy_match else {"copies": False}))
    r = llm.engine.runner
    traced = lane_round.lane_round.trace(r.target_def, r.target_params, r.drafter_def, r.drafter_params, r.state,
                                         r.spec)
    print(f"{args.model}; drafter {args.drafter}; copy_match {args.copy_match}: {structure(traced.jaxpr)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--copy-match", type=int, default=5, help="0: no root copies")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="/tmp/tfjax-profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--structure", action="store_true", help="count the traced round's kernels and loops (any host)")
    ap.add_argument("--geometry", default=None, help="with --structure: a decode step of this geometry instead")
    ap.add_argument("--layers", type=int, default=8, help="with --geometry: the first N layers")
    ap.add_argument("--launches", action="store_true", help="compile a --geometry decode step on this host and list "
                    "what its optimized HLO launches (a GPU gives the GPU's fusions)")
    ap.add_argument("--hlo-out", default=None, help="with --launches: write the optimized HLO here")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS",
                    help="random MLX BITS-bit weights of the --model folder's geometry (config and tokenizer)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--cprofile", action="store_true", help="the host's Python by own time (cProfile), no trace")
    ap.add_argument("--streams", type=int, default=1, help="concurrent copies of the prompt (lanes = streams)")
    args = ap.parse_args()
    if args.structure:
        print_structure(args)
        return
    if args.launches:
        print_launches(args)
        return
    import jax

    from tfjax import api

    kw = dict(lanes=args.streams, drafter=args.drafter, context=args.context)
    if args.random_weights is not None:
        from tfjax import models
        from tfjax.config import ModelConfig, QuantConfig

        config = ModelConfig.from_json(api.resolve(args.model, weights=False))
        if args.random_weights:
            config = config.replace(quantization=QuantConfig(bits=args.random_weights, group_size=64))
        graphdef, params = models.random_params(config)
        from flax import nnx

        kw["model"] = (nnx.merge(graphdef, params), config)
    llm = api.load(args.model, **(kw | ({"copy_match": args.copy_match} if args.copy_match else {"copies": False})))
    llm.precompile()  # every lane bucket's round, outside the trace
    prompts = [PROMPT] * args.streams
    llm.generate_many(prompts, max_tokens=8, ignore_eos=True)  # the prompt programs too
    if args.cprofile:  # the host's Python a round, without the profiler's tracing
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        gen = llm.generate_many(prompts, max_tokens=args.tokens, ignore_eos=True)[0]
        prof.disable()
        wall = time.perf_counter() - t
        rounds = len(gen.token_ids) / gen.tokens_per_round
        print(f"{args.model} on {jax.devices()[0].device_kind}: {wall / rounds * 1e3:.2f} ms wall a round under "
              f"cProfile, {rounds:.0f} rounds; per round, by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        return
    t = time.perf_counter()  # the same request outside the profiler, whose tracing inflates the host's share
    free = llm.generate_many(prompts, max_tokens=args.tokens, ignore_eos=True)[0]
    free_ms = (time.perf_counter() - t) / (len(free.token_ids) / free.tokens_per_round) * 1e3
    out = Path(args.out)
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        t = time.perf_counter()
        gens = llm.generate_many(prompts, max_tokens=args.tokens, ignore_eos=True)
        wall = time.perf_counter() - t
    gen = gens[0]
    rounds = len(gen.token_ids) / gen.tokens_per_round  # the streams decode the same prompt: the same rounds
    print(f"{args.model} on {jax.devices()[0].device_kind}; drafter {args.drafter}; copy_match {args.copy_match}; "
          f"{args.streams} streams; {len(gen.token_ids)} tokens a stream, {gen.tokens_per_round:.2f} a round; "
          f"trace under {out}; {free_ms:.2f} ms wall a round outside the profiler")
    trace = latest_trace(out)
    events = device_events(trace)
    if not events:
        raise SystemExit(f"no GPU kernels in the trace ({jax.default_backend()} run): the table needs a GPU")
    print(summarize(events, rounds, wall, args.top))
    print(host_api_calls(trace, rounds))
    print(host_api_calls(trace, rounds, cuda=False, top=args.top))


if __name__ == "__main__":
    main()
