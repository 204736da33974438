"""How far two ways of inverting the chunked DeltaNet's triangle (I - A) drift, in float32, from float64's solve.

  python3 scripts/probes/probe_wy_inverse.py

A = -(beta k k^T) * decay strictly below the diagonal for one 64-row chunk of unit keys; near-equal keys (a
repeated token) with beta near 1 and little decay are the hard case. The series multiplies out
(I + A)(I + A^2)...(I + A^32); the doubling form (`pallas_kernels/gated_delta_chunked.py`) builds each 2b-row
diagonal block's inverse from its two b-row ones (T2 A21 T1 below the diagonal). Prints the largest entry of
A^32 and each form's largest error (the inverse's entries are at most 1 in these cases).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

C = 64
ROW, COL = np.arange(C)[:, None], np.arange(C)[None, :]


def triangle(beta: float, decay: float, spread: float, rng) -> np.ndarray:
    """A for 64 unit keys of dimension 128 spread around one key by `spread` (0: identical)."""
    k = rng.standard_normal(128) + spread * rng.standard_normal((C, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    cum = np.cumsum(np.full(C, -decay))
    d = np.where(ROW >= COL, np.exp(np.minimum(cum[:, None] - cum[None, :], 0.0)), 0.0)
    return np.where(ROW > COL, -beta * (k @ k.T) * d, 0.0).astype(np.float32)


def series(a: np.ndarray) -> tuple[np.ndarray, float]:
    t, power = np.eye(C, dtype=np.float32) + a, a
    for _ in range(5):
        power = power @ power
        t = t + t @ power
    return t, float(np.abs(power).max())


def doubling(a: np.ndarray) -> np.ndarray:
    t, b = np.eye(C, dtype=np.float32), 1
    while b < C:
        below = (ROW // (2 * b) == COL // (2 * b)) & ((ROW // b) % 2 == 1) & ((COL // b) % 2 == 0)
        t = t + t @ np.where(below, a, 0.0).astype(np.float32) @ t
        b *= 2
    return t


def main():
    rng = np.random.default_rng(0)
    print("| keys | beta | decay a row | max A^32 | series error | doubling error | float32 solve error |")
    print("|---|---|---|---|---|---|---|")
    for label, beta, decay, spread in (("identical", 1.0, 0.0, 0.0), ("near-equal", 0.9, 0.02, 0.01),
                                       ("similar", 0.5, 0.1, 0.1), ("identical", 0.99, 0.001, 0.0),
                                       ("random", 0.5, 0.3, 1e3)):
        a = triangle(beta, decay, spread, rng)
        exact = scipy.linalg.solve_triangular(np.eye(C) - a.astype(np.float64), np.eye(C), lower=True)
        s, big = series(a)
        f32 = scipy.linalg.solve_triangular(np.eye(C, dtype=np.float32) - a, np.eye(C, dtype=np.float32), lower=True)
        err = lambda t, exact=exact: float(np.abs(t - exact).max())
        print(f"| {label} | {beta} | {decay} | {big:.1e} | {err(s):.1e} | {err(doubling(a)):.1e} | {err(f32):.1e} |")


if __name__ == "__main__":
    main()
