#!/usr/bin/env bash
# The open issues' GPU checks in one call, in priority order, each step under its own timeout (~580 s in all), so a call
# cut short still returns the first steps (issues 28, 31; docs/device.md "Next session's calls"):
#   SMOLLM2=FOLDER bash scripts/device/gpu_open_issues.sh
# FOLDER: SmolLM2's config.json, generation_config.json and tokenizer files, no weights (random 4-bit ones are made):
#   mkdir -p .gpu/models/smollm2 && cp ~/.cache/tfjax/smollm2-bf16/{config,generation_config,tokenizer,tokenizer_config}.json .gpu/models/smollm2/
# and carry `.gpu/models`. 1. the flash kernel's GPU tests (it reads pages through the table); 2. the MoE rows GPU
# tests; 3. 8 turns cache off/on with each prompt program's compile time. (The ninth session's first run also timed
# XLA command buffers for every kind: no win, dropped.)
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TFJAX_COMPILE_CACHE=off PYTHONPATH=.
filt() { grep -v "^W0\|^I0\|^E0000\|tensor/s\]\|it/s\]\|Warning\|warn("; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date +%T
M=${SMOLLM2:-.gpu/models/smollm2}
echo "== 1. pytest -m gpu tests/test_flash_attention.py (the paged flash kernel)"
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flash_attention.py 2>&1 | tail -3
echo "== 2. MoE rows GPU tests"; date +%T
timeout 280 python3 -m pytest -v -m gpu -p no:cacheprovider \
  "tests/test_moe_kernel.py::test_gpu_rows_bit_identical_alone_and_among_1_to_16_rows" \
  tests/test_moe_kernel.py::test_gpu_rows_bit_identical_when_every_row_shares_one_expert 2>&1 | grep "PASS\|FAIL\|Error\|passed\|failed"
echo "== 3. SmolLM2 random 4-bit, 8 turns, cache off / on, 4 runs"; date +%T
JAX_LOG_COMPILES=1 timeout 230 python3 scripts/bench_prefix.py --model $M --random-weights 4 --runs 4 --reply 16 2>&1 \
  | filt | grep -v "Finished tracing\|jaxpr to MLIR\|Compiling \|compilation of jit(\(stage\|squeeze\|_squeeze\|convert\|broad\|scatter\|concat\|dynamic\|select\|gather\|iota\|add\|reshape\|clamp\|mul\|bitwise\|remainder\)" \
  | sed 's/^.*Finished XLA compilation of/compiled/' | tail -40
date +%T
