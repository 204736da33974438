"""What every section shares: the run's results and markdown rows, timing helpers, and the ceilings (`base`)."""

from __future__ import annotations

import os
import time

import numpy as np

from tfjax.profiling import median_time

START, BUDGET = time.perf_counter(), float(os.environ.get("BENCH_BUDGET_S", "1e9"))  # sweeps stop past BUDGET
ROWS = []  # markdown rows: (section, what, time, achieved, ceiling, fraction)
RESULTS: dict = {}


def per_call(op, sets, reps=20, extra=()):
    """Seconds per application of `op(*set, *extra)`, one jitted program cycling through `sets`."""
    import jax

    f = jax.jit(lambda sets, extra: [op(*s, *extra) for s in sets])
    return median_time(f, (sets, tuple(extra)), reps) / len(sets)


def row(section, what, seconds, achieved, ceiling, unit):
    frac = achieved / ceiling
    ROWS.append((section, what, f"{seconds * 1e6:.1f} us", f"{achieved:.0f} {unit}", f"{ceiling:.0f} {unit}",
                 f"{frac:.1%}"))
    print(f"  {section} | {what} | {seconds * 1e6:.1f} us | {achieved:.0f} {unit} | {frac:.1%}", flush=True)


def checked_time(label, f, sets, ref):
    """(relative error of f on the first set against `ref`, seconds per call over `sets`), or None when the config
    fails (a config Triton refuses is skipped, not fatal)."""
    try:
        return rel_err(f(*sets[0]), ref), per_call(f, sets)
    except Exception as e:
        print(f"  {label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def rel_err(y, r):
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(y - r) / np.linalg.norm(r))


# --- ceilings ---
def base():
    """The ceilings every row is stated against: the best copy measured (driver, XLA, Pallas) and XLA's bf16 rate."""
    from tfjax.bench import ceilings

    bw, which, _ = ceilings.best_copy([4.0], 10)
    n = 8192
    tm = ceilings.matmul_rate(n, 10)[0]
    RESULTS["copy_GBps"], RESULTS["bf16_TFLOPs"] = bw, 2 * n**3 / tm / 1e12
    RESULTS["copy_best"] = which
    print(f"copy {bw:.0f} GB/s ({which}), bf16 matmul {2 * n**3 / tm / 1e12:.0f} TFLOP/s", flush=True)
