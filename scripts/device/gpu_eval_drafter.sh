#!/usr/bin/env bash
# Issue 34, call 2 of 2 (<= 400 s): the trained drafter on HELD-OUT prompts, greedy, 128 tokens, ignore_eos:
# plain (draft: false) vs copies alone vs DFlash2 alone vs DFlash2 + copies, tokens a round, tok/s, and every
# drafted reply's token_sha256 against plain; 4 held-out prompts a cell (code edit, code new, chat), one stream,
# then the same 4 prompts as 4 streams at once (4 lanes). Needs the training call's run/drafter and
# run/prompts.jsonl.gz carried to $RUN (default runs/draft34, relative to the repo root).
# Expected: ~250-330 s (six engines compiled cold, ~100 short generations).
set -uo pipefail
MODEL=${MODEL:-/root/sm}
OUT=${OUT:?OUT must be set}
RUN=${RUN:-runs/draft34}
PY=${PY:-python3}
export PYTHONPATH=. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/eval.md"
if [ ! -f "$RUN/prompts.jsonl.gz" ]; then  # the same set, rebuilt: deterministic on the same Python install
  mkdir -p "$RUN"
  "$PY" -c "from tfjax.drafters import corpus; corpus.save(corpus.build(prompts=4000, held=0.1, per_file=2), '$RUN/prompts.jsonl.gz')"
fi
ls -la "$RUN/drafter" | tee -a "$OUT/eval.md"
COMMON=(--model "$MODEL" --drafter "$RUN/drafter" --prompts "$RUN/prompts.jsonl.gz" --per-cell 4 --tokens 128
        --sampling greedy --cells "code edit,code new,chat")
start=$(date +%s)
echo "## 1 stream" | tee -a "$OUT/eval.md"
timeout 210 "$PY" scripts/bench_generate.py "${COMMON[@]}" --streams 1 2>&1 | grep --line-buffered -v "Warning\|^\s*$" | tee -a "$OUT/eval.md"
left=$(( ${LIMIT:-385} - ($(date +%s) - start) ))  # what is left of the call, less start-up
echo "## 4 streams (${left} s left)" | tee -a "$OUT/eval.md"
timeout "$left" "$PY" scripts/bench_generate.py "${COMMON[@]}" --streams 4 2>&1 | grep --line-buffered -v "Warning\|^\s*$" | tee -a "$OUT/eval.md"
