#!/bin/bash
# call 1: N=5120 split sweep, StaticDef timing of the decode step, 8-row attention tiles
export PYTHONPATH=. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/call1_smi.txt
timeout 170 python3 scripts/probe_qmatmul.py --only kernels --mgpu-sweep --shapes 5120x17408,5120x6144 2>&1 | grep -v Warning | tee $OUT/call1_probe_n5120.txt
timeout 100 python3 scripts/bench_graph.py --sections base,decode --decode-modes kernel 2>&1 | grep -v Warning | tee $OUT/call1_decode_staticdef.txt
timeout 150 python3 scripts/bench_graph.py --sections base,attention --sweep --asweep tiles 2>&1 | grep -v Warning | tee $OUT/call1_attention_tiles.txt
