#!/usr/bin/env bash
# The GPU check of a tree, run from its root on the device: the GPU test suite, dense27 4-bit decode (random weights)
# and SmolLM2 bench_generate (exactness and tok/s). Run it on the old tree and the new one in the same session.
#
#   SMOLLM2=/root/smollm2 bash scripts/device/gpu_check.sh [OUT_DIR]
#
# SMOLLM2: a SmolLM2 folder (config.json and tokenizer; with model.safetensors real weights are used, else random
# 4-bit ones, `--random-weights 4 --exact`). Trees before issue 27 need JAX_PLATFORMS=cuda for `pytest -m gpu`.
set -u
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --oneline 2>/dev/null | tee "$out/tree.txt"

echo "== pytest -m gpu"
gpu_model=()
if [ -n "${SMOLLM2:-}" ] && [ -f "$SMOLLM2/model.safetensors" ]; then export TFJAX_GPU_MODEL=$SMOLLM2; else
  gpu_model=(--deselect tests/test_real_model.py::test_gpu_kernels_give_the_reference_paths_tokens_on_a_real_model); fi
timeout 1500 python3 -m pytest -q -m gpu -x -p no:cacheprovider "${gpu_model[@]}" 2>&1 | tail -25 | tee "$out/pytest_gpu.txt"

echo "== dense27 4-bit decode, 1 lane at 2k (kernels)"
timeout 900 python3 scripts/bench_graph.py --sections base,decode --decode-modes kernel --out "$out/decode.json" 2>&1 \
  | tail -30 | tee "$out/decode.txt"

if [ -n "${SMOLLM2:-}" ]; then
  echo "== SmolLM2 bench_generate"
  weights=()
  [ -f "$SMOLLM2/model.safetensors" ] || weights=(--random-weights 4 --exact)
  timeout 900 python3 scripts/bench_generate.py --model "$SMOLLM2" "${weights[@]}" --tokens 64 2>&1 | tail -30 \
    | tee "$out/generate.txt"
fi
