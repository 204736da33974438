#!/usr/bin/env bash
# The open issues' GPU checks in one call, in priority order, each step under its own timeout (~580 s in all), so a call
# cut short still returns the first steps (issues 28, 31, 32; docs/device.md "Next session's calls"):
#   SMOLLM2=FOLDER bash scripts/device/gpu_open_issues.sh
# FOLDER: SmolLM2's config.json, generation_config.json and tokenizer files, no weights (random 4-bit ones are made):
#   mkdir -p .gpu/models/smollm2 && cp ~/.cache/tfjax/smollm2-bf16/{config,generation_config,tokenizer,tokenizer_config}.json .gpu/models/smollm2/
# and carry `.gpu/models`. 1. the Mosaic 4-bit kernel at a prompt chunk's 256 rows against its reference (dense27's MLP);
# 2. dense27's 8 turns with prompt rows to 256 on that kernel (ops.MOSAIC_MAX_ROWS); 3. SmolLM2's prompt calls with the
# kernel to 256 rows against 64 (its 576-wide products); 4. the MoE rows GPU tests.
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TFJAX_COMPILE_CACHE=off PYTHONPATH=.
filt() { grep -v "^W0\|^I0\|^E0000\|tensor/s\]\|it/s\]\|Warning\|warn("; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date +%T
M=${SMOLLM2:-.gpu/models/smollm2}
echo "== 1. pytest -m gpu the Mosaic kernel on dense27's MLP tiles (1-256 rows)"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmatmul_mgpu.py -k dense27 2>&1 | tail -3
echo "== 2. dense27 random 4-bit, 8 turns, cache off / on (8 GiB), 3 runs"; date +%T
timeout 300 python3 scripts/bench_prefix.py --model $M --geometry dense27 --random-weights 4 --prefix-cache-gb 8 \
  --runs 3 --reply 16 2>&1 | filt | tail -16
echo "== 3. SmolLM2 prompt calls, the Mosaic kernel to 256 rows (now) against 64 (before)"; date +%T
for k in 256 64; do
  timeout 60 python3 scripts/probes/prompt_compile.py --model $M --random-weights 4 --reps 5 --rows 128,256 \
    --kernel-max-rows $k 2>&1 | grep "prefill_chunk\|rror\|on NVIDIA"
done
echo "== 4. MoE rows GPU tests"; date +%T
timeout 90 python3 -m pytest -v -m gpu -p no:cacheprovider \
  "tests/test_moe_kernel.py::test_gpu_rows_bit_identical_alone_and_among_1_to_16_rows" \
  tests/test_moe_kernel.py::test_gpu_rows_bit_identical_when_every_row_shares_one_expert 2>&1 | grep "PASS\|FAIL\|Error\|passed\|failed"
date +%T
