"""The llama / qwen2 family: every layer full attention (no output gate, no q/k norm), plain RMSNorm.

It is `tfjax.models.decoder` with attention layers only; qwen2 adds q/k/v biases.
"""

from __future__ import annotations

from flax import nnx

from tfjax import ops
from tfjax.config import ModelConfig
from tfjax.models.decoder import CausalLM, DecoderLayer


class LlamaForCausalLM(CausalLM):
    """A llama or qwen2 decoder (the config's flags select biases and tied embeddings)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, kernels: ops.Kernels | None = None):
        if config.model_type not in ("llama", "qwen2"):
            raise ValueError(f"LlamaForCausalLM serves llama and qwen2, not {config.model_type!r}")
        super().__init__(config, DecoderLayer, rngs=rngs, kernels=kernels)
