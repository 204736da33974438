"""Shared test helpers: tiny random transformers models saved as checkpoints, and our forward loop."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfjax.bench.hf import hf_config
from tfjax.config import ModelConfig
from tfjax.models.layers import PROMPT, ROWS


def make_hf_checkpoint(config: ModelConfig, out: Path, seed: int = 0):
    """A random transformers model for `config`, perturbed so no parameter sits at its init, saved."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    cls = Qwen3_5MoeForCausalLM if config.is_moe else Qwen3_5ForCausalLM
    model = cls(hf_config(config)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return model


def prefill_then_steps(model, tokens: np.ndarray, n_prompt: int, context: int = 128) -> np.ndarray:
    """Logits [T, V] from a prompt prefill (all rows) then single cached steps."""
    import dataclasses

    from tfjax import models

    graphdef, params = models.split(model)
    cache = model.init_cache(1, context)
    prompt = jnp.asarray(tokens[None, :n_prompt])
    mode = dataclasses.replace(PROMPT, last_only=False)
    logits, cache, _ = models.forward(graphdef, params, prompt, jnp.array([0]), jnp.array([n_prompt]), cache, mode)
    rows = [np.asarray(logits[0])]
    for i in range(n_prompt, len(tokens)):
        lg, cache, _ = models.forward(graphdef, params, jnp.asarray(tokens[None, i : i + 1]), jnp.array([i]), jnp.array([1]), cache,
                                       ROWS)
        rows.append(np.asarray(lg[0]))
    return np.concatenate(rows, axis=0)


def make_tiny_llama_with_tokenizer(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random llama checkpoint (float32) that speaks a real tokenizer (its vocabulary size and files)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tfjax.checkpoint import TOKENIZER_FILES

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=4096, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked, varied logits, so greedy and sampled replies differ
            p.normal_(0, 1.0 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def rel_err(y, r) -> float:
    """Relative L2 error of y against the reference r, in float64."""
    y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
    return float(np.linalg.norm(y - r) / np.linalg.norm(r))


def check_kernel(kernel, reference, args, bs, interpret: bool, dtype) -> None:
    """A kernel's output has the query's shape and dtype, is finite, and is within dtype tolerance of the reference."""
    y = kernel(*args, block_sizes=bs, interpret=interpret)
    assert y.shape == args[0].shape and y.dtype == dtype
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert rel_err(y, reference(*args)) < (1e-5 if dtype == jnp.float32 else 1e-2)


def finished(out):
    """`out` once computed (tracers pass through): one interpreted kernel at a time. The Mosaic GPU interpreter's host
    callbacks dispatch jax ops themselves; with eager dispatch running ahead, two such kernels held a 2-core CPU
    client's threads waiting on each other's ops (a hang seen once in test_model_kernels)."""
    leaves = jax.tree.leaves(out)
    if leaves and not any(isinstance(x, jax.core.Tracer) for x in leaves):
        jax.block_until_ready(out)
    return out


def spy_interpreted(monkeypatch, module, name: str, record) -> list:
    """Swap module.name for a spy that appends record(args, kwargs) and runs the kernel in interpret mode, to the end."""
    calls = []
    kernel = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(record(args, kwargs))
        return finished(kernel(*args, **{**kwargs, "interpret": True}))

    monkeypatch.setattr(module, name, spy)
    return calls
