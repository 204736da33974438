"""Timing and launch-structure helpers for the benchmarks and probes: synchronised wall time, device time from
JAX profiler traces, and what a traced or compiled step launches (Pallas kernels, loops, XLA kernels)."""

from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def call_times(call, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `call()` (which waits for its own result), after two warm-up calls."""
    call()
    call()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return ts


def median_time(fn, args, reps: int = 20) -> float:
    """Median seconds of `fn(*args)` over `reps` synchronised calls, after a compile and a warm-up call."""
    import jax  # lazily: bench_graph's torch peer section runs without jax

    return float(np.median(call_times(lambda: jax.block_until_ready(fn(*args)), reps)))


def round_ms(runner, rounds: int = 12) -> float:
    """Milliseconds a lane round of `runner`, pipelined: one call to compile and warm, then about `rounds` rounds in
    calls dispatched back to back and waited for once (a call runs `runner.lanes.rounds` of them)."""
    import jax

    per_call = runner.lanes.rounds
    calls = max(rounds // per_call, 1)
    jax.block_until_ready(runner.dispatch().packed)
    t0 = time.perf_counter()
    for _ in range(calls):
        out = runner.dispatch()
    jax.block_until_ready(out.packed)
    return (time.perf_counter() - t0) / (calls * per_call) * 1e3


def device_time(fn, args, match: str | None, calls: int = 3, per_call: int = 1) -> float:
    """Device seconds from the JAX profiler over `calls` calls of `fn(*args)` (compiled and warm first): the median
    launch of the kernels whose name holds `match`, or with `match=None` all kernels' time per call divided by
    `per_call` (ops a call applies). Unlike `median_time`, launch gaps on the host don't count."""
    import tempfile
    from pathlib import Path

    import jax

    jax.block_until_ready(fn(*args))
    folder = Path(tempfile.mkdtemp(prefix="device_time_"))
    with jax.profiler.trace(str(folder)):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
    return kernel_seconds(latest_events(folder), match, calls * per_call)


def kernel_seconds(events: list[dict], match: str | None, ops: int) -> float:
    """The median launch (microsecond events) of kernels named like `match`, or all kernels' time over `ops`."""
    durs = [float(e["dur"]) for e in events if match is None or match in e["name"]]
    if not durs:
        return float("nan")
    return sum(durs) * 1e-6 / ops if match is None else float(np.median(durs)) * 1e-6


def _gpu_pids(trace: dict) -> set:
    """The trace's GPU tracks (processes named like a GPU)."""
    return {e["pid"] for e in trace.get("traceEvents", []) if e.get("ph") == "M" and e.get("name") == "process_name"
            and "gpu" in e["args"]["name"].lower()}


def device_events(trace: dict) -> list[dict]:
    """Complete events ("X") on GPU tracks; none for a CPU run (its host track nests Python frames)."""
    pids = _gpu_pids(trace)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]


def latest_trace(folder: Path) -> dict:
    """The newest Perfetto trace `jax.profiler.trace` wrote under `folder`."""
    path = max(folder.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    return json.loads(gzip.decompress(path.read_bytes()))


def latest_events(folder: Path) -> list[dict]:
    """Device events of the newest Perfetto trace under `folder`."""
    return device_events(latest_trace(folder))


def host_api_calls(trace: dict, rounds: float, cuda: bool = True, top: int = 12) -> str:
    """The host's events a round by total time: with `cuda` its CUDA API calls (events named cu*: kernel launches,
    graph launches, syncs: tells a round whose host launches every kernel from one that launches a captured graph),
    else every other host event (the runtime's and Python's spans; nested spans each count)."""
    gpu = _gpu_pids(trace)
    total, count = defaultdict(float), defaultdict(int)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") not in gpu and "dur" in e and e["name"].startswith("cu") == cuda:
            total[e["name"]] += float(e["dur"])
            count[e["name"]] += 1
    what = "CUDA call" if cuda else "event"
    if not count:
        return f"no host {what}s in the trace"
    lines = [f"| host {what} | per round | host us per round |", "|---|---|---|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:80]} | {count[name] / rounds:.1f} | {us / rounds:.1f} |")
    return "\n".join(lines)


def summarize(events: list[dict], rounds: float, wall_s: float, top: int = 25) -> str:
    """A table of kernels by total time: launches and microseconds per round."""
    total = defaultdict(float)
    count = defaultdict(int)
    for e in events:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    busy = sum(total.values())
    lines = [f"{rounds:.0f} rounds, {wall_s / rounds * 1e3:.2f} ms wall a round; device busy "
             f"{busy / rounds / 1e3:.2f} ms a round ({busy / 1e6 / wall_s:.0%}); {sum(count.values()) / rounds:.0f} "
             f"kernels a round", "| kernel | per round | us per round | share |", "|---|---|---|---|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:90]} | {count[name] / rounds:.1f} | {us / rounds:.1f} | {us / busy:.1%} |")
    return "\n".join(lines)


KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")  # a Pallas kernel: Triton's, or Mosaic GPU's `plgpu.kernel`


def structure(jaxpr) -> dict:
    """What a traced round launches, before XLA fuses it: Pallas kernels, loops (each iteration relaunches
    its body), and kernels inside loops; a kernel's own body is not walked."""
    out = {"pallas_call": 0, "loops": 0, "pallas_call_in_loops": 0, "ops": 0}

    def walk(j, in_loop):
        for e in j.eqns:
            name = e.primitive.name
            out["ops"] += 1
            if name in KERNEL_PRIMITIVES:
                out["pallas_call_in_loops" if in_loop else "pallas_call"] += 1
                continue
            loop = name in ("while", "scan")
            out["loops"] += loop
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, in_loop or loop)

    walk(getattr(jaxpr, "jaxpr", jaxpr), False)
    return out


FREE_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "opt-barrier"}


def compiled_launches(hlo: str) -> dict:
    """What the entry computation of an optimized HLO module launches: every instruction but the free ones
    (parameters, tuples, bitcasts, constants) is a kernel or a library call on the GPU. Returns the count, the
    count by kind (opcode, with a fusion's kind or a custom call's target) and the names in order: the profiler's
    kernel names, with "." where the profiler writes "_"."""
    import re
    from collections import Counter

    entry = hlo[hlo.index("\nENTRY "):]
    body = entry[entry.index("{") + 1 : entry.index("\n}")]
    kinds, names = Counter(), []
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(", line)
        if not m or m.group(2) in FREE_OPS:
            continue
        op = m.group(2)
        detail = re.search(r"kind=(k\w+)", line) if op == "fusion" else re.search(r'custom_call_target="([^"]+)"', line)
        kinds[f"{op} {detail.group(1)}" if detail else op] += 1
        names.append(m.group(1))
    return {"launches": len(names), "kinds": dict(kinds.most_common()), "names": names}
