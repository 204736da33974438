#!/usr/bin/env bash
# Tensor parallel on a multi-GPU host (issue 35): the sharded tests on real devices, then dense27 4-bit decode at
# TP=1/2/4 (step time and logits sha256, which must agree across degrees). Run from the repo root:
#   bash scripts/device/gpu_tp.sh 2>&1 | tee tp_gpu.log
set -euo pipefail
export PYTHONPATH=.
nvidia-smi -L
python -c "import jax; print(jax.devices())"
# the test cases on the GPUs (TFJAX_TP_TEST_DEVICES=real: no simulated CPU devices, the kernels' path)
TFJAX_TP_TEST_DEVICES=real python -m pytest -q tests/test_tensor_parallel.py -m "slow or not slow" -x
# dense27 4-bit decode, 1 row and a width-8 verify round's 8 rows, at 2k context
python scripts/bench_tp.py --geometry dense27 --bits 4 --tp 1 2 4 --rows 1 --context 2048
python scripts/bench_tp.py --geometry dense27 --bits 4 --tp 1 2 4 --rows 8 --context 2048
# the collectives of the GPU compile
python scripts/tp_collectives.py --geometry dense27 --tp 2 4
