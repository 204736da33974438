"""Our Qwen3.5 logits equal transformers' on tiny random dense and MoE configs (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import make_hf_checkpoint, prefill_then_steps
from tfjax import checkpoint, geometry


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_logits_equal_transformers_for_prefill_then_cached_steps(tmp_path, name):
    config = geometry.named(name)
    hf = make_hf_checkpoint(config, tmp_path)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 48)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens[None])).logits[0].numpy()
    model, _ = checkpoint.load(tmp_path, progress=False)
    ours = prefill_then_steps(model, tokens, n_prompt=40)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 1e-4, f"{name}: relative error {rel:.2e}"
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))
