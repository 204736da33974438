#!/usr/bin/env bash
# Issue 31 on the GPU, from the checkout root:  bash scripts/device/gpu_moe.sh   (at most ~7 min: each step has a timeout,
# rows print as they finish)
# 1. the routed-experts kernel's GPU tests; 2. moe35a3 4-bit (random weights, 19.5 GB) decode at 1 and 16 lanes at
# 2k against the measured-copy roofline, and a 2k prompt; 3. drafted == plain token_sha256 (bench_generate --exact).
# MOE_LAYERS=N truncates moe35a3 to its first N layers (compile time); unset = all 40.
set -u
export PYTHONPATH=. JAX_PLATFORMS=cuda
LAYERS=${MOE_LAYERS:-0}
FOLDER=${MOE_FOLDER:-/tmp/moe35a3}
echo "== 1. pytest -m gpu tests/test_moe_kernel.py"
timeout 120 python3 -m pytest -q -m gpu tests/test_moe_kernel.py 2>&1 | tail -15
echo "== 2. decode 1 and 16 lanes at 2k, 2k prompt (scripts/bench_moe_gpu.py --layers $LAYERS)"
timeout 180 python3 scripts/bench_moe_gpu.py --context 2048 --lanes 1,16 --layers "$LAYERS" 2>&1 | grep -v "^W0\|^I0"
echo "== 3. bench_generate --exact on moe35a3 random 4-bit weights ($FOLDER: config.json + byte-level tokenizer)"
python3 scripts/moe_folder.py "$FOLDER" --layers "$LAYERS"
timeout 120 python3 scripts/bench_generate.py --model "$FOLDER" --random-weights 4 --exact --cells "code edit" \
  --tokens 48 --context 2048 2>&1 | grep -v "^W0\|^I0" | tail -8
