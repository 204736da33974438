#!/usr/bin/env bash
# For the lead: issue 33 (tensor parallel) on real GPUs; run on kind nvidia-h100-x4 from the repo root, one part a
# call (each under 10 min):  bash scripts/device/gpu_tp_real.sh tests   |   bash scripts/device/gpu_tp_real.sh bench
# tests: tests/test_tensor_parallel.py on the 4 GPUs (TFJAX_TP_TEST_DEVICES=real: the workers see the real devices;
#        -m "slow or not slow" also keeps conftest off the CPU), logits and token_sha256 at TP=1/2/4 and 2x2.
# bench: dense27 4-bit decode step time and logits sha256 at TP=1/2/4 (must agree), and the GPU compile's collectives.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp/tp33_gpu}
mkdir -p "$out"
nvidia-smi -L | tee "$out/gpus.txt"
case "${1:-tests}" in
  tests)
    TFJAX_TP_TEST_DEVICES=real timeout 570 python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
      -m "slow or not slow" --durations=15 2>&1 | tail -40 | tee "$out/tp_tests.txt" ;;
  bench)
    timeout 240 python3 scripts/bench_tp.py --geometry dense27 --bits 4 --tp 1 2 4 --rows 1 --context 2048 2>&1 \
      | tail -15 | tee "$out/bench_rows1.txt"
    timeout 180 python3 scripts/bench_tp.py --geometry dense27 --bits 4 --tp 1 2 4 --rows 8 --context 2048 2>&1 \
      | tail -15 | tee "$out/bench_rows8.txt"
    timeout 150 python3 scripts/tp_collectives.py --geometry dense27 --tp 2 4 2>&1 | tail -30 | tee "$out/collectives.txt" ;;
esac
