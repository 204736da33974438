#!/usr/bin/env bash
# Issue 31, the routed experts' decode kernels on one H100, from the checkout root (no internet):
#   bash scripts/device/gpu_moe31.sh        (~2.5 min, at most 200 s: each step has a timeout)
# Prints: 1. `pytest -m gpu tests/test_moe_kernel.py` (kernel == reference at moe35a3's shape for the grouped GEMM and
# the lane-round K-split kernels; rows bit-identical alone and among 1..16 rows, both paths); its last 15 lines.
# 2. scripts/bench_moe_rows.py: one moe35a3 layer's routed experts at 1, 4, 16 decode rows, old (grouped GEMM in its
# decode placement) against new (`moe(rows=True)`) and two variants of the new, device time per kernel and per layer,
# median (min..max) of 7 calls x 8 routings, compile excluded, beside the bytes roofline at 3032 GB/s.
set -u
export PYTHONPATH=. JAX_PLATFORMS=cuda
echo "== 1. pytest -m gpu tests/test_moe_kernel.py"
timeout 110 python3 -m pytest -q -m gpu tests/test_moe_kernel.py 2>&1 | tail -15
echo "== 2. scripts/bench_moe_rows.py (device time, us)"
timeout 85 python3 scripts/bench_moe_rows.py --rows 1,4,16 --reps 7 --sets 8 2>&1 | grep -v "^W0\|^I0\|Warning"
