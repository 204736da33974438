#!/usr/bin/env bash
# The open issues' GPU checks in three calls, in priority order, each step under its own timeout, so a call cut short
# still returns the first steps (issues 31, 32; docs/device.md "Next session's calls"):
#   git worktree add --detach .gpu/base 1788943     # the tree before e6359c3 (the MoE gate's loop), for the A/B
#   git worktree add --detach .gpu/n1 865ea9d       # after it, before 73f8dd9 (the MoE's padding rows skip experts)
#   git worktree add --detach .gpu/kpad k-padded-pairs   # the branch k-padded-pairs (e11022a): SmolLM2's K=576 on the Mosaic kernel
#   SMOLLM2=.gpu/models/smollm2 bash scripts/device/gpu_open_issues.sh PART   (carry .gpu/models, .gpu/base, .gpu/n1, .gpu/kpad)
# PART 1 (issue 31, ~520 s): step 1; PART 2 (issues 31, 32, ~450 s): steps 2 and 3; PART 3 (~350 s): steps 4 and 5.
# One device call each.
# .gpu/models/smollm2: SmolLM2's config.json, generation_config.json and tokenizer files, no weights:
#   mkdir -p .gpu/models/smollm2 && cp ~/.cache/tfjax/smollm2-bf16/{config,generation_config,tokenizer,tokenizer_config}.json .gpu/models/smollm2/
# 1. moe35a3's first 8 layers through the engine: before e6359c3, after it, and after 73f8dd9 (a plain lane's 7
#    padding rows read no expert), and the round's graph launches (1 expected);
# 2. the 40-layer moe35a3 against its roofline (bench_moe_gpu); 3. SmolLM2's 576-input products on the Mosaic kernel
# with K padded (scripts/probes/padded_k.py, the branch's GPU test); 4. SmolLM2 plain 4-bit, main against the branch;
# 5. the MoE rows GPU test with a stack dump if it hangs. Full logs under $OUT.
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TFJAX_COMPILE_CACHE=off
filt() { grep -v "^W0\|^I0\|^E0000\|tensor/s\]\|it/s\]\|Warning\|warn("; }
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
M=${SMOLLM2:-.gpu/models/smollm2}
PART=${1:?give the part: 1, 2 or 3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date +%T
if [ "$PART" = 1 ]; then
PYTHONPATH=. python3 scripts/moe_folder.py /tmp/moe8 --layers 8 > /dev/null 2>&1
for tree in .gpu/base .gpu/n1 . .gpu/base .gpu/n1 . ; do  # two runs a process, two processes a tree, in turns
  [ -d $tree ] || continue
  echo "== 1. moe35a3 8 layers, tree $tree, plain decode"; date +%T
  PYTHONPATH=$tree timeout 70 python3 $tree/scripts/bench_generate.py --model /tmp/moe8 --random-weights 4 \
    --cells "code new" --sampling greedy --tokens 64 --runs 2 --context 2048 --copy-match 0 2>&1 | filt | grep "|" | tail -1
done
export PYTHONPATH=.
echo "-- graph launches a round (one expected)"; date +%T
timeout 90 python3 scripts/probes/profile_round.py --model /tmp/moe8 --random-weights 4 --copy-match 0 --tokens 32 \
  --top 8 > $OUT/moe8_profile.txt 2>&1; grep -A9 "rounds,\|host CUDA" $OUT/moe8_profile.txt
elif [ "$PART" = 2 ]; then
export PYTHONPATH=.
echo "== 2. moe35a3 40 layers, 1 and 16 lanes at 2k, against the roofline"; date +%T
timeout 240 python3 scripts/bench_moe_gpu.py --context 2048 --lanes 1,16 --runs 3 --steps 10 --prompt 0 2>&1 | filt | tail -6
echo "== 3. SmolLM2's 576-input products: Triton on MLX words against Mosaic on K padded to 768"; date +%T
timeout 60 python3 scripts/probes/padded_k.py --rows 1,8 2>&1 | filt | grep "|\|on "
if [ -d .gpu/kpad ]; then
  echo "-- the branch's GPU test: TMA's fill past x's 576 columns"
  (cd .gpu/kpad && PYTHONPATH=. timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_qmatmul_mgpu.py \
    -k "padded" 2>&1 | tail -2)
fi
else
export PYTHONPATH=.
for tree in . .gpu/kpad . .gpu/kpad; do
  [ -d $tree ] || continue
  echo "== 4. SmolLM2 random 4-bit, plain, tree $tree"; date +%T
  PYTHONPATH=$tree timeout 60 python3 $tree/scripts/bench_generate.py --model $M --random-weights 4 --cells "code new" \
    --sampling greedy --tokens 128 --runs 3 --context 2048 --copy-match 0 2>&1 | filt | grep "|" | tail -1
done
echo "== 5. MoE rows GPU test [rows], stack dump at 100 s"; date +%T
timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider -o faulthandler_timeout=100 \
  "tests/test_moe_kernel.py::test_gpu_rows_bit_identical_alone_and_among_1_to_16_rows[rows]" > $OUT/moe_rows.txt 2>&1
grep "passed\|failed\|File \"/work\|Timeout" $OUT/moe_rows.txt | head -12
fi
date +%T
