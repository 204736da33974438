"""The llama / qwen2 family: every layer full attention (no output gate, no q/k norm), plain RMSNorm.

It shares tfjax's attention, MLP, norms, caches and `CausalLM` with qwen3_5; qwen2 adds q/k/v biases.
"""

from __future__ import annotations

from flax import nnx

from tfjax.config import ModelConfig
from tfjax.models.qwen3_5 import CausalLM, DecoderLayer


class LlamaForCausalLM(CausalLM):
    """A llama or qwen2 decoder (the config's flags select biases and tied embeddings)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.model_type not in ("llama", "qwen2"):
            raise ValueError(f"LlamaForCausalLM serves llama and qwen2, not {config.model_type!r}")
        super().__init__(config, DecoderLayer, rngs=rngs)
