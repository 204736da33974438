"""The device's ceilings, measured right: copy bandwidth as the best of several copies, and the bf16 matmul rate.

  PYTHONPATH=. python3 scripts/bench_roofline.py [--gib 2,4] [--json OUT.json]

Candidates (`tfjax/bench/ceilings.py`): the driver's device-to-device memcpy (through torch, when it sees a GPU),
XLA's elementwise kernel (`a * 1.0001`, what bench_graph used before), XLA's copy and the Pallas copy
(`pallas_kernels/copy.py`) over a few block shapes. Each row: the median of `--reps` synchronised calls, min..max.
"""

from __future__ import annotations

import argparse
import json

from tfjax.bench import ceilings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", default="2,4", help="copy sizes in GiB, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--matmul", type=int, default=8192)
    ap.add_argument("--json", default=None, help="write the best copy and matmul rate here")
    args = ap.parse_args()
    import jax

    print(f"device: {jax.devices()[0].device_kind}")
    best, which, rows = ceilings.best_copy([float(g) for g in args.gib.split(",")], args.reps)
    print("| copy | GiB | median | min..max | GB/s (read + write) |\n|---|---|---|---|---|")
    for name, gib, (med, lo, hi) in rows:
        nbytes = int(gib * 2**30) // 2**17 * 2**17
        print(f"| {name} | {gib:g} | {med * 1e3:.3f} ms | {lo * 1e3:.3f}..{hi * 1e3:.3f} | {2 * nbytes / med / 1e9:.0f} |")
    med, lo, hi = ceilings.matmul_rate(args.matmul, args.reps)
    tflops = 2 * args.matmul**3 / med / 1e12
    print(f"\nbest copy: {best:.0f} GB/s ({which}); bf16 matmul {args.matmul}^3: {tflops:.0f} TFLOP/s "
          f"(median {med * 1e3:.2f} ms, {lo * 1e3:.2f}..{hi * 1e3:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": best, "copy_best": which, "bf16_TFLOPs": tflops}, f)


if __name__ == "__main__":
    main()
