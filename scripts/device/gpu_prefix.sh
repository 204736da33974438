# Issue 28 (prefix cache) on one H100 80GB or H200, from the repository root, no internet, <= 400 s.
#   bash scripts/device/gpu_prefix.sh         dense27 bench_prefix (the run that ran out of memory), SmolLM2 8 turns on/off (~300 s)
#   bash scripts/device/gpu_prefix.sh probe   compiled memory of a dense27 prompt chunk with/without the barrier, and where the
#                            cache-on engine's extra ~5 ms a request comes from (~350 s)
#   bash scripts/device/gpu_prefix.sh chunk   the prefill chunk (resume grid) on the GPU: SmolLM2 prefill rate and 8 turns at
#                            64/128/256 (~300 s; docs/prefix_cache.md "The chunk")
# Needs .gpu/models/dense27 (config + tokenizer) and /root/sm (SmolLM2 MLX 4-bit). Writes tables to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TFJAX_COMPILE_CACHE=off
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
fi
export PYTHONPATH=.:/tmp/site
filt() { grep -v "^W0\|^I0\|^E0000\|tensor/s\]\|it/s\]"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null

if [ "${1:-bench}" = bench ]; then
  echo "== dense27 random 4-bit, 6 turns, cache 8 GiB (the OOM of issue 28)"
  timeout 200 python3 scripts/bench_prefix.py --model .gpu/models/dense27 --geometry dense27 --random-weights 4 \
    --prefix-cache-gb 8 --runs 3 --turns 6 2>&1 | filt | tail -20 | tee "$OUT/prefix_dense27.txt"
  echo "== SmolLM2 4-bit, 8 turns, cache on (2 GiB) and off, alternated"
  timeout 110 python3 scripts/bench_prefix.py --model /root/sm --runs 3 2>&1 | filt | tail -16 \
    | tee "$OUT/prefix_smollm2.txt"
  echo "== dense27 compiled memory (no weights), barrier on only"
  timeout 80 python3 scripts/probes/prefill_memory.py --geometry dense27 --bits 4 --prefix-cache-gb 8 \
    --skip-unordered 2>&1 | filt | tail -8 | tee "$OUT/prefill_memory.txt"
elif [ "$1" = chunk ]; then
  echo "== SmolLM2 4-bit: a 1536-token prompt's prefill at chunks 64/128/256, alternated"
  timeout 120 python3 scripts/probes/prefill_chunk.py --model /root/sm --chunks 64,128,256 --tokens 1536 2>&1 | filt \
    | tail -6 | tee "$OUT/prefill_chunk.txt"
  echo "== SmolLM2 4-bit, 8 turns, cache off and on at chunks 64/128/256, alternated"
  timeout 170 python3 scripts/bench_prefix.py --model /root/sm --runs 3 --chunks 64,128,256 2>&1 | filt | tail -16 \
    | tee "$OUT/prefix_chunks.txt"
else
  echo "== dense27 compiled memory (no weights): prompt chunk with and without the barrier, snapshot copies"
  timeout 200 python3 scripts/probes/prefill_memory.py --geometry dense27 --bits 4 --prefix-cache-gb 8 2>&1 | filt \
    | tail -8 | tee "$OUT/prefill_memory.txt"
  echo "== SmolLM2: TTFT of cache on / off / cache-on pool without the bookkeeping, alternated"
  timeout 140 python3 scripts/probes/ttft_pool.py --model /root/sm --reps 15 2>&1 | filt | tail -8 \
    | tee "$OUT/ttft_pool.txt"
fi
