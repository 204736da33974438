"""Model families: `qwen3_5` (dense and MoE) and `llama` (llama, qwen2)."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from tfjax.config import ModelConfig


def build(config: ModelConfig, *, seed: int = 0) -> nnx.Module:
    """A randomly initialised causal LM for `config` (load a checkpoint into it to serve)."""
    rngs = nnx.Rngs(seed)
    if config.model_type in ("qwen3_5", "qwen3_5_moe"):
        from tfjax.models.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(config, rngs=rngs)
    from tfjax.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(config, rngs=rngs)


def split(model: nnx.Module):
    """(graphdef, params) once, so jitted calls never walk Python objects."""
    return nnx.split(model)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"))
def forward(graphdef, params, tokens: jax.Array, start: jax.Array, valid: jax.Array, cache, mode):
    """Jitted forward over rows `tokens` [B, T] at `start` [B]: (logits, cache, DeltaNet traces)."""
    return nnx.merge(graphdef, params)(tokens, start, valid, cache, mode)
