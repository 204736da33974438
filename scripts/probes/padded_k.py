"""Would SmolLM2's 576-input products gain from the Mosaic 4-bit kernel on K padded to whole 256-input tiles?

  JAX_PLATFORMS=cuda PYTHONPATH=. python3 scripts/probes/padded_k.py [--rows 1,8] [--reps 9]

A SmolLM2 round's three 4-bit products a layer with K = 576 (fused q/k/v, o, fused gate/up) take the Triton kernel
on MLX words (`qk.qmatmul`, 559 us of a 1.26 ms round on the H100); the Mosaic kernel needs K in whole 256-input
tiles. Padded with zero groups to K = 768 (zero words, scales and biases; x's extra columns zero, as TMA's
out-of-bounds fill would give them) it computes the same sums with exact zeros added. Per shape and row count: device
time of each (all kernels of a call, the mean of `--reps` calls under the profiler) and the largest difference
between the two results relative to the Triton one (bf16 rounding only). Times, not a decision: the engine change
(a K-padded pair layout) is built only if this wins.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import qmatmul as qk
from pallas_kernels import qmatmul_mgpu, quant
from tfjax.profiling import device_time

SHAPES = {"q+k+v fused": (960, 576), "o": (576, 576), "gate+up fused": (3072, 576)}  # SmolLM2 (N, K)
GROUP, BITS = 64, 4


def weights(n: int, k: int, seed: int):
    """Random MLX 4-bit weights [N, K] (words, scales, biases) and the same padded with zero groups to 256 inputs."""
    kw, ks, kb = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.bits(kw, (n, k * BITS // 32), jnp.uint32)
    s = (jax.random.uniform(ks, (n, k // GROUP)) * 0.01).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, k // GROUP)) * 0.05).astype(jnp.bfloat16)
    pad = -k % qmatmul_mgpu.TILE
    wp = jnp.pad(w, ((0, 0), (0, pad * BITS // 32)))
    sp, bp = (jnp.pad(a, ((0, 0), (0, pad // GROUP))) for a in (s, b))
    pw, ps, pb = quant.to_pair_layout(wp, sp, bp, BITS, GROUP)
    return (w, s, b), (pw, quant.pack_scale_bias(ps, pb)), k + pad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--interpret", action="store_true", help="check the results on the CPU (no times)")
    args = ap.parse_args()
    print(f"{jax.devices()[0].device_kind}; device us a call, mean of {args.reps}")
    print("| product | N x K | rows | Triton, MLX words, K | Mosaic, pairs, K padded | x | max diff / max |")
    print("|---|---|---|---|---|---|---|")
    for seed, (name, (n, k)) in enumerate(SHAPES.items()):
        mlx, pairs, kp = weights(n, k, seed)
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.float32).astype(jnp.bfloat16)
            xp = jnp.pad(x, ((0, 0), (0, kp - k)))
            triton = jax.jit(lambda x, w, s, b: qk.qmatmul(x, w, s, b, bits=BITS, group_size=GROUP,
                                                           interpret=args.interpret))
            mosaic = jax.jit(lambda x, w, p: qmatmul_mgpu.qmatmul_pairs(x, w, p, interpret=args.interpret))
            a = np.asarray(triton(x, *mlx), np.float32)
            b = np.asarray(mosaic(xp, *pairs), np.float32)
            diff = float(np.abs(a - b).max() / np.abs(a).max())
            if args.interpret:
                print(f"| {name} | {n} x {k} | {m} | - | - | - | {diff:.2e} |")
                continue
            t = [device_time(f, a_, None, calls=args.reps) * 1e6 for f, a_ in ((triton, (x, *mlx)), (mosaic, (xp, *pairs)))]
            print(f"| {name} | {n} x {k} -> {kp} | {m} | {t[0]:.1f} | {t[1]:.1f} | {t[0] / t[1]:.2f} | {diff:.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
