#!/usr/bin/env bash
# Issue 34 (<= 300 s on an H100): where does the dflash2 engine's TARGET compute differ bit for bit from the plain
# engine's? (scripts/probes/exact34.py; on the CPU every line says `same`.) Hand-crafted proposals, no trained
# drafter: ORACLE blocks are the plain run's own next tokens (every round accepts all 8), HALF blocks turn wrong
# from a point that varies (partial acceptance). Per held-out prompt it prints:
#   prefill, plain, whole page table   plain's prefill program over all pages instead of a bucket of them
#   prefill, dflash2 production        plain's round.prefill_chunk itself, then blocks.absorb_chunk apart
#   dflash2, <mode>                    the dflash2 engine end to end (draft off / oracle / half)
#   dflash2, plain's prefill, <mode>   the same with the target's prompt K/V from plain's prefill program: rounds only
# each with the logits or tokens, and the first layer and position whose K/V differ from plain's (or `same`).
# Reading: a prefill line that differs while `plain's prefill, draft off` is same => the prefill program (XLA's
# fusion/autotuning of the prompt path around the taps); `plain's prefill, draft off` differs => the round program
# (taps as outputs, the drafter beside the target); only `oracle`/`half` differ => the drafted rows themselves
# (row invariance of the GPU kernels with real proposals and 8 accepted rows).
#   MODEL   a SmolLM2 folder (default /root/sm; without model.safetensors: random 4-bit weights of its geometry)
#   RUN     a folder with prompts.jsonl.gz and drafter/config.json (weights optional: a random drafter otherwise)
# Before the call, here: mkdir -p .gpu/sm .gpu/run34/drafter; cp /tmp/sm/*.json .gpu/sm/;
#   cp /tmp/run34/prompts.jsonl.gz .gpu/run34/; cp /tmp/run34/drafter/config.json .gpu/run34/drafter/
#   and run it with carry [".gpu"] (2 MB: the weights, 73 MB, exceed what travels; random weights show K/V bits too).
set -uo pipefail
MODEL=${MODEL:-/root/sm}
RUN=${RUN:-.gpu/run34}
OUT=${OUT:-/tmp/exact34}
PY=${PY:-python3}
[ -f "$MODEL/config.json" ] || MODEL=.gpu/sm
export PYTHONPATH=. HF_HUB_OFFLINE=1 TFJAX_COMPILE_CACHE=/tmp/exact34-jax XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
mkdir -p "$OUT"
LOG="$OUT/exact34.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$LOG"
echo "model $MODEL: $(ls "$MODEL" | tr '\n' ' ')" | tee -a "$LOG"
probe() { timeout "$1" "$PY" scripts/probes/exact34.py --model "$MODEL" --drafter "$RUN/drafter" \
  --prompts "$RUN/prompts.jsonl.gz" "${@:2}" 2>&1 | grep --line-buffered -v "loading\|Warning" | tee -a "$LOG"; }
probe 170 --cells "code edit,chat" --per-cell 2 --streams 1 --tokens 64
probe 110 --cells "chat" --per-cell 4 --streams 4 --tokens 64 --no-prefill-check
