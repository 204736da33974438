"""Named geometries (configs/*.json): `geometry.dense27`, `geometry.moe35a3`, tiny test shapes."""

from __future__ import annotations

from pathlib import Path

from tfjax.config import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def named(name: str) -> ModelConfig:
    """The geometry stored as configs/<name>.json."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise KeyError(f"unknown geometry {name!r}; known: {', '.join(known)}")
    return ModelConfig.from_json(path)


def same_shape(a: ModelConfig, b: ModelConfig) -> bool:
    """True when two configs describe the same network shape (dtype and quantization aside)."""
    keep = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_experts")
    return all(getattr(a, k) == getattr(b, k) for k in keep)


dense27 = named("dense27")
moe35a3 = named("moe35a3")
tiny_dense = named("tiny_dense")
tiny_moe = named("tiny_moe")
