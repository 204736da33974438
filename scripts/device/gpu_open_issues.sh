#!/usr/bin/env bash
# The open issues' GPU checks in five calls, in priority order, each step under its own timeout and a call deadline,
# so a call cut short still returns its first steps (issues 31, 32; docs/device.md "Next session's calls"):
#   git worktree add --detach .gpu/n1 865ea9d       # before 73f8dd9 (a lane's padding rows skip their experts)
#   git worktree add --detach .gpu/pre f8bf68b      # before 11d7d80 (params as a flat tuple)
#   git worktree add --detach .gpu/kpad k-padded-pairs   # the branch k-padded-pairs (e11022a): SmolLM2's K=576 on the Mosaic kernel
#   SMOLLM2=.gpu/models/smollm2 bash scripts/device/gpu_open_issues.sh PART   (carry .gpu/models, .gpu/n1, .gpu/pre, .gpu/kpad, .gpu/tools)
# .gpu/models/smollm2: SmolLM2's config.json, generation_config.json and tokenizer files, no weights:
#   mkdir -p .gpu/models/smollm2 && cp ~/.cache/tfjax/smollm2-bf16/{config,generation_config,tokenizer,tokenizer_config}.json .gpu/models/smollm2/
# A moe8 bench_generate process takes ~80 s on the H100 (load, compile, 3 runs): never give it less than 150 s.
# PART 1 (issues 31, 32, ~560 s): rounds a call, 4 (the GPU's default since the fifteenth session) against 8, SmolLM2
#   and moe8 in turns; SmolLM2 drafted (copies) == plain at the default rounds (`--exact`); dense27's second K=4 process.
# PART 2 (issue 32, ~570 s): SmolLM2 at 1 live lane of 4 (a bucketed round's lax.cond) with XLA's default
#   command buffers and with conditionals in them; where a host-bound round's host time goes
#   (scripts/probes/host_costs.py): the per-leaf cost of a jitted call, moe8 and SmolLM2 at HEAD, moe8 with XLA's command buffers off, SmolLM2 before the flat
#   params; then py-spy (Python frames only: --native pauses the process and starved a run in the thirteenth session).
# PART 3 (issue 31, ~520 s): moe8 plain through the engine, before and after 73f8dd9, in turns, two processes each;
#   the 40-layer moe35a3 at 1 lane against its roofline.
# PART 4 (issue 32, ~450 s): SmolLM2 plain 4-bit, main against the branch k-padded-pairs, in turns; the MoE rows GPU
#   test with a stack dump if it hangs.
# PART 5 (issue 32, ~570 s): where dense27's device-bound round goes (9.2 ms a token on the H100 at K=1 and 4):
#   profile_round.py through the engine, kernels a round and the device's busy time; then dense27 at 1, 4 and 16
#   streams (bench_generate --streams: variants of the built-in prompt). Full logs under $OUT.
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TFJAX_COMPILE_CACHE=off
filt() { grep -v "^W0\|^I0\|^E0000\|tensor/s\]\|it/s\]\|Warning\|warn("; }
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
M=${SMOLLM2:-.gpu/models/smollm2}
PART=${1:?give the part: 1, 2, 3, 4 or 5}
T0=$(date +%s); DEADLINE=${DEADLINE:-570}; left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
cap() { local L; L=$(left); echo $(( L < $1 ? L : $1 )); }  # a step's timeout: its own, or what the call has left
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date +%T
PYTHONPATH=. python3 scripts/moe_folder.py /tmp/moe8 --layers 8 > /dev/null 2>&1
gen() {  # TREE LABEL MODEL TOKENS [ARGS...]: one bench_generate process, plain, one lane at 2k
  local L; L=$(cap 160); [ $L -gt 90 ] || { echo "skip $2: $L s left"; return; }
  echo "== $2 ($L s)"; date +%T
  PYTHONPATH=$1 timeout $L python3 $1/scripts/bench_generate.py --model $3 --random-weights 4 --cells "code new" \
    --sampling greedy --tokens $4 --runs 3 --context 2048 --copy-match 0 "${@:5}" > $OUT/gen_$2.txt 2>&1
  grep "|" $OUT/gen_$2.txt | tail -1; grep "plain token_sha256" $OUT/gen_$2.txt | tail -1
}
costs() {  # TREE LABEL ARGS...: host_costs.py (HEAD's probe) on a tree's code
  local tree=$1 label=$2 L; shift 2; L=$(cap 120); [ $L -gt 60 ] || { echo "skip $label: $L s left"; return; }
  echo "== host costs, $label ($L s)"; date +%T
  PYTHONPATH=$tree timeout $L python3 scripts/probes/host_costs.py "$@" > $OUT/costs_$label.txt 2>&1
  grep "|\|leaves)" $OUT/costs_$label.txt | grep -v "^|---\|host cost"; grep -m2 "Error\|flag" $OUT/costs_$label.txt
}
if [ "$PART" = 1 ]; then
  gen . smollm2_rounds4 $M 128 --rounds 4; gen . smollm2_rounds8 $M 128 --rounds 8
  gen . moe8_rounds4 /tmp/moe8 64 --rounds 4; gen . moe8_rounds8 /tmp/moe8 64 --rounds 8
  L=$(cap 120); echo "== SmolLM2 drafted == plain at the default rounds ($L s)"
  PYTHONPATH=. timeout $L python3 scripts/bench_generate.py --model $M --random-weights 4 --exact --tokens 48 \
    > $OUT/exact_smollm2.txt 2>&1; grep "|" $OUT/exact_smollm2.txt | tail -7
  PYTHONPATH=. python3 scripts/moe_folder.py /tmp/d27 --geometry dense27 > /dev/null 2>&1
  gen . d27_rounds4_b /tmp/d27 64 --rounds 4
elif [ "$PART" = 2 ]; then
  # a bucketed round (1 live lane of 4) has a lax.cond (_choose's greedy check), which XLA's default command buffer
  # types (no CONDITIONAL) run as a host sync: default against CONDITIONAL and WHILE in the command buffer
  gen . smollm2_lanes4 $M 128 --lanes 4
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL \
    gen . smollm2_lanes4_conditional_in_graph $M 128 --lanes 4
  costs . leaves --leaves-only
  costs . moe8 --model /tmp/moe8 --random-weights 4
  XLA_FLAGS=--xla_gpu_enable_command_buffer= costs . moe8_no_command_buffers --model /tmp/moe8 --random-weights 4
  XLA_FLAGS=--xla_gpu_command_buffer_update_mode=FULL_UPDATE_FREE costs . moe8_update_free --model /tmp/moe8 --random-weights 4
  costs . smollm2 --model $M --random-weights 4
  XLA_FLAGS=--xla_gpu_enable_command_buffer= costs . smollm2_no_command_buffers --model $M --random-weights 4
  XLA_FLAGS=--xla_gpu_command_buffer_update_mode=FULL_UPDATE_FREE costs . smollm2_update_free --model $M --random-weights 4
  [ -d .gpu/pre ] && costs .gpu/pre smollm2_pre --model $M --random-weights 4
  L=$(cap 150); if [ $L -gt 90 ] && [ -x .gpu/tools/py-spy ]; then
    echo "== py-spy (Python frames) over moe8's engine ($L s)"
    PYTHONPATH=. timeout $L .gpu/tools/py-spy record --nonblocking --idle --rate 100 --format raw -o $OUT/moe8_pyspy.raw -- \
      python3 scripts/probes/host_costs.py --model /tmp/moe8 --random-weights 4 > $OUT/pyspy_run.txt 2>&1
    ls -la $OUT/moe8_pyspy.raw
  fi
elif [ "$PART" = 3 ]; then
  for i in a b; do gen .gpu/n1 moe8_n1_$i /tmp/moe8 64; gen . moe8_head_$i /tmp/moe8 64 --rounds 1; done  # n1 has one round a call
  L=$(cap 200); if [ $L -gt 100 ]; then
    echo "== moe35a3 40 layers, 1 lane at 2k, against the roofline ($L s)"; date +%T
    PYTHONPATH=. timeout $L python3 scripts/bench_moe_gpu.py --context 2048 --lanes 1 --runs 3 --steps 10 --prompt 0 \
      > $OUT/moe40.txt 2>&1; filt < $OUT/moe40.txt | tail -4
  fi
elif [ "$PART" = 5 ]; then
  PYTHONPATH=. python3 scripts/moe_folder.py /tmp/d27 --geometry dense27 > /dev/null 2>&1
  L=$(cap 220); echo "== dense27 profile through the engine, plain, 1 lane at 2k ($L s)"; date +%T
  PYTHONPATH=. timeout $L python3 scripts/probes/profile_round.py --model /tmp/d27 --random-weights 4 --copy-match 0 \
    --tokens 32 --top 40 > $OUT/profile_d27.txt 2>&1; filt < $OUT/profile_d27.txt | tail -60
  # issue 32's stream goals: per-stream decode at 4 streams against 1 (then 16, if the call has time)
  gen . d27_streams1 /tmp/d27 64; gen . d27_streams4 /tmp/d27 64 --streams 4; gen . d27_streams16 /tmp/d27 64 --streams 16
else
  for i in a b; do gen . smollm2_main_$i $M 128 --rounds 1;  # the branch has one round a call
     [ -d .gpu/kpad ] && gen .gpu/kpad smollm2_kpad_$i $M 128; done
  L=$(cap 130); echo "== MoE rows GPU test [rows], stack dump at $((L - 20)) s"; date +%T
  timeout $L python3 -m pytest -q -s -m gpu -p no:cacheprovider -o faulthandler_timeout=$((L - 20)) \
    "tests/test_moe_kernel.py::test_gpu_rows_bit_identical_alone_and_among_1_to_16_rows[rows]" > $OUT/moe_rows.txt 2>&1
  grep "passed\|failed\|File \"/work\|Timeout" $OUT/moe_rows.txt | head -12
fi
date +%T
