"""The HF transformers peer: dense27 bf16 decode steps in torch (run in a child process, before JAX takes the GPU)."""

from __future__ import annotations

import json
import time

import numpy as np


def hf_config(config):
    """The transformers text config equal to a tfjax geometry (`tfjax.config.ModelConfig`)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    d = config.to_dict()
    d.pop("model_type")
    d.pop("dtype")
    cls = Qwen3_5MoeTextConfig if config.is_moe else Qwen3_5TextConfig
    keep = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ or k in ("rope_parameters",)}
    return cls(**keep)


def hf_section(steps=20, context=2048):
    import torch
    from transformers import Qwen3_5ForCausalLM

    from tfjax import geometry

    cfg = hf_config(geometry.named("dense27"))
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"  HF init {time.perf_counter() - t0:.0f} s", flush=True)
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t)
    med = float(np.median(times))
    print(json.dumps(dict(hf_tok_s=1 / med, hf_ms=med * 1e3, torch=torch.__version__)), flush=True)
