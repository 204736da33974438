#!/usr/bin/env bash
# Issue 34, call 1 of 2 (<= 560 s): distil a DFlash2 drafter for SmolLM2 that generalizes.
#   prompts  ~4000 from this machine's stdlib + site-packages (code, edit, chat, text), 10% of files held out by
#            a hash of their relative path (tfjax/drafters/corpus.py);
#   data     SmolLM2's own continuations through the serving engine (128 lanes, draft: false), greedy for every
#            prompt, sampled (T=0.8) for a quarter of the training prompts; generation stops at 40% of the budget;
#   training 3-layer DFlash2 (MLP 1024, selector rank 32, block 8, 5 taps), bf16 compute over float32 masters,
#            batch 32 x 16 anchors, cosine learning rate by elapsed time; every 60 s the held-out acceptance
#            (tokens a round of its blocks alone in the lane round, greedy, 8 held-out prompts of each kind)
#            and the best drafter exported to $OUT/run/drafter (27 MB bf16).
# Returns in $OUT: run/{drafter/, prompts.jsonl.gz, data.npz, log.jsonl}, train.log. The orbax checkpoint stays in
# $CKPT (200 MB with the optimizer state): not sent back. Expected: ~490-530 s in all.
set -uo pipefail
MODEL=${MODEL:-/root/sm}
OUT=${OUT:?OUT must be set}
CKPT=${CKPT:-/tmp/draft34-ckpt}
BUDGET=${BUDGET:-480}
PY=${PY:-python3}
export PYTHONPATH=. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
mkdir -p "$OUT/run"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/train.log"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/train.log"
start=$(date +%s)
timeout $((BUDGET + 45)) "$PY" scripts/train_drafter.py --model "$MODEL" --out "$OUT/run" --ckpt "$CKPT" \
  --time-budget "$BUDGET" --gen-share 0.4 --prompts 4000 --held 0.1 --per-file 2 --max-prompt-tokens 256 \
  --max-tokens 128 --sampled 0.25 --lanes 128 --layers 3 --intermediate 1024 --rank 32 --block 8 --taps 5 \
  --batch 32 --anchors 16 --lr 1e-3 --dtype bfloat16 --steps 20000 --eval-every 60 --eval-prompts 8 \
  --eval-tokens 64 --save-every 1000 2>&1 | grep --line-buffered -v "^\s*$" | tee -a "$OUT/train.log"
echo "train_drafter exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/train.log"
ls -la "$OUT/run" "$OUT/run/drafter" 2>&1 | tee -a "$OUT/train.log"
