"""GPU benchmarks of the kernels and the decode graph beside their rooflines, one module a section; the CLI is
`scripts/bench_graph.py` (`--sections base,qmatmul,attention,delta,delta_prompt,prompt,flash,prefill,decode,hf`).

`common` holds the run's results and table rows and the ceilings (`base`: copy bandwidth, the bf16 matmul rate),
which every other section reads; `hf` runs in a child process before JAX takes the GPU's memory.
"""
