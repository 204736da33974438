"""What a lane round costs the host: the jitted call's dispatch, the round's fetch, and the engine's pipelined step,
beside a trivial jitted call over the same arguments and over N plain leaves (the per-argument cost alone).

  PYTHONPATH=. python3 scripts/probes/host_costs.py --model smollm2
  PYTHONPATH=. python3 scripts/probes/host_costs.py --model /tmp/moe8 --random-weights 4 --context 2048
  PYTHONPATH=. python3 scripts/probes/host_costs.py --leaves-only   # no model: 1, 272, 1847 leaves

A round is host-bound when the pipelined step is longer than the device's busy time a round (profile_round.py):
this says which host part is long. Each figure is the median of `--calls` calls, three times (the spread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

LEAF_COUNTS = (1, 272, 1847)  # one array, SmolLM2's params, dense27 4-bit's params


def host_ms(call, calls: int, block=None) -> list[float]:
    """Three medians of `calls` host times of `call()` in ms, each call's result waited for afterwards (not timed)."""
    block = block or jax.block_until_ready
    block(call())
    out = []
    for _ in range(3):
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            y = call()
            ts.append(time.perf_counter() - t)
            block(y)
        out.append(statistics.median(ts) * 1e3)
    return out


def show(label: str, ms: list[float]) -> None:
    print(f"| {label} | {statistics.median(ms):.3f} ({min(ms):.3f}..{max(ms):.3f}) |", flush=True)


def leaves_rows(calls: int) -> None:
    """A jitted call over N small arrays that it passes to XLA (keep_unused) and one that XLA never sees."""
    for n in LEAF_COUNTS:
        leaves = tuple(jnp.full((256,), i, jnp.float32) for i in range(n))
        show(f"trivial jit over {n} leaves, all passed", host_ms(lambda ls=leaves: _kept(ls), calls))
        show(f"trivial jit over {n} leaves, unused pruned", host_ms(lambda ls=leaves: _pruned(ls), calls))


@jax.jit
def _pruned(leaves):
    return leaves[0] + 1


_kept = jax.jit(lambda leaves: leaves[0] + 1, keep_unused=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-weights", type=int, default=None, metavar="BITS")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=None, help="lane rounds a call runs (default: the backend's)")
    ap.add_argument("--leaves-only", action="store_true")
    args = ap.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {' '.join(sys.argv[1:])}")
    print("| host cost | ms, median of 3 (min..max) |")
    print("|---|---|")
    leaves_rows(args.calls)
    if args.leaves_only:
        return
    from tfjax import api
    from tfjax.engine import Request

    kw = {}
    if args.random_weights is not None:
        sys.path.insert(0, "scripts")
        from bench_generate import random_model

        kw["model"] = random_model(args.model, args.random_weights)
    llm = api.load(args.model, lanes=1, copies=False, context=args.context, rounds=args.rounds, **kw)
    eng, r = llm.engine, llm.engine.runner
    eng.submit(Request([1, 2, 3, 4, 5], max_tokens=args.context - 64, ignore_eos=True))
    for _ in range(3):
        eng.step()
    n_params, n_state = len(jax.tree.leaves(r.target_params)), len(jax.tree.leaves(r.state))
    print(f"(params {n_params} leaves, lane state {n_state})")
    trivial = jax.jit(lambda p, s: s.length + 1, keep_unused=True)
    show("trivial jit over the round's params and state", host_ms(lambda: trivial(r.target_params, r.state),
                                                                  args.calls))
    show("round dispatch (Runner.dispatch)", host_ms(r.dispatch, args.calls, jax.block_until_ready))

    def fetch_ms() -> float:  # a round run to its end first, untimed
        out = r.dispatch()
        jax.block_until_ready(out)
        t = time.perf_counter()
        r.collect(out)
        return (time.perf_counter() - t) * 1e3

    show("fetch of a finished round (Runner.collect)",
         [statistics.median(fetch_ms() for _ in range(args.calls)) for _ in range(3)])
    k = llm.lanes.rounds
    step = host_ms(eng.step, args.calls * 3, lambda _: None)
    show(f"engine step, pipelined (wall a call of {k} round{'s' * (k > 1)})", step)
    show("engine step, pipelined, a round", [ms / k for ms in step])


if __name__ == "__main__":
    main()
