#!/usr/bin/env bash
# For the lead: issue 29's structured-output throughput on SmolLM2 (the MLX 4-bit folder at /root/sm) on one GPU,
# from the repo root, under 400 s:  bash scripts/device/gpu_schema.sh
# Installs the carried wheels (outlines-core, starlette, uvicorn, ...) under /tmp/site, then runs
# scripts/bench_schema.py twice, 8 lanes, 128 tokens a reply, greedy, median of 3 runs, compile excluded:
#   engine: llm.generate_many of 8 replies: plain, penalties+bias, json_schema, json_schema+logprobs
#   server: the same as 8 concurrent /v1/chat/completions requests to the in-process server, plus tool_choice named
# Each case prints tok/s (spread), tokens/round and tokens/reply; the json_schema / tool cases end at EOS earlier.
set -u
out=${OUT:-/tmp/api29_gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --oneline 2>/dev/null | tee "$out/tree.txt"
echo "== engine (generate_many)"
timeout 170 python3 scripts/bench_schema.py --model /root/sm --lanes 8 --max-tokens 128 2>&1 | grep -v "it/s\]" \
  | tail -12 | tee "$out/engine.txt"
echo "== server (8 concurrent HTTP requests)"
timeout 200 python3 scripts/bench_schema.py --model /root/sm --lanes 8 --max-tokens 128 --server 2>&1 \
  | grep -v "it/s\]" | tail -12 | tee "$out/server.txt"
