#!/bin/bash
# call 2: attention blocks sharing a program (GPU tests, A/B), the down projection's K split in decode (A/B/A/B)
export PYTHONPATH=. JAX_PLATFORMS=cuda
timeout 150 python3 -m pytest -q -m gpu tests/test_attention_kernel.py 2>&1 | tail -5 | tee $OUT/call2_tests.txt
for v in "dict(q_blocks=4)" "dict(q_blocks=1)" "dict(q_blocks=4, num_warps=8)"; do
  echo "== attn $v" | tee -a $OUT/call2_attention.txt
  timeout 90 python3 scripts/bench_graph.py --sections base,attention --attn-blocks "$v" 2>&1 | grep -v Warning | grep "attention\|copy" | tee -a $OUT/call2_attention.txt
done
for i in 1 2; do
  for p in "dict()" "dict(max_split=17)"; do
    echo "== decode $p run $i" | tee -a $OUT/call2_decode.txt
    timeout 100 python3 scripts/bench_graph.py --sections base,decode --decode-modes kernel --mgpu-policy "$p" 2>&1 | grep -v Warning | grep "kernel:\|copy\|policy" | tee -a $OUT/call2_decode.txt
  done
done
