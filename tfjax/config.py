"""Frozen model configs built from a checkpoint's config.json; unknown keys are dropped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "llama", "qwen2")
SUPPORTED_QUANT_BITS = (4, 8)
SUPPORTED_QUANT_GROUPS = (32, 64, 128)


class ConfigError(ValueError):
    """A config.json that tfjax cannot serve."""


_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head", "lm_head"), ("language_model.", ""))


def canonical_key(key: str) -> str:
    """A checkpoint key or module path without VLM prefixes, MLX's `switch_mlp` renamed `experts`."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    return key.replace(".switch_mlp.", ".experts.").replace(".switch_mlp", ".experts")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """MLX affine quantization: a default and per-layer overrides (path -> (bits, group) or None)."""

    bits: int = 4
    group_size: int = 64
    overrides: tuple[tuple[str, tuple[int, int] | None], ...] = ()

    def for_layer(self, path: str) -> tuple[int, int] | None:
        """(bits, group) for a module path, or None when that module is not quantized."""
        path = canonical_key(path)
        for key, value in self.overrides:
            if canonical_key(key) == path:
                return value
        return (self.bits, self.group_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        bits, group = int(d.get("bits", 4)), int(d.get("group_size", 64))
        _check_quant(bits, group, "quantization")
        overrides = []
        for key, value in d.items():
            if key in ("bits", "group_size", "mode"):
                continue
            if value is False:
                overrides.append((key, None))
            elif isinstance(value, dict):
                b, g = int(value.get("bits", bits)), int(value.get("group_size", group))
                _check_quant(b, g, key)
                overrides.append((key, (b, g)))
        if d.get("mode", "affine") != "affine":
            raise ConfigError(f"unsupported quantization mode {d['mode']!r}: only MLX 'affine' is supported")
        return cls(bits, group, tuple(overrides))


def _check_quant(bits: int, group: int, where: str) -> None:
    if bits not in SUPPORTED_QUANT_BITS:
        raise ConfigError(f"unsupported quantization at {where}: bits={bits}, expected one of {SUPPORTED_QUANT_BITS}")
    if group not in SUPPORTED_QUANT_GROUPS:
        raise ConfigError(
            f"unsupported quantization at {where}: group_size={group}, expected one of {SUPPORTED_QUANT_GROUPS}"
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One text decoder's geometry; hashable so it can be a static argument under jit."""

    model_type: str = "qwen3_5"
    vocab_size: int = 248320
    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_hidden_layers: int = 64
    num_attention_heads: int = 24
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    attn_output_gate: bool = True
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    # Gated DeltaNet (linear attention) layers.
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    # Mixture of experts (qwen3_5_moe); num_experts == 0 means a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Llama-family details.
    qkv_bias: bool = False
    rms_norm_offset: bool = True
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    quantization: QuantConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (VLM `text_config` nesting and unknown keys handled)."""
        d = dict(raw)
        model_type = d.get("model_type")
        if "text_config" in d and isinstance(d["text_config"], dict):
            text = dict(d["text_config"])
            for key in ("quantization", "quantization_config", "tie_word_embeddings"):
                if key in d and key not in text:
                    text[key] = d[key]
            d = text
        model_type = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(
            d.get("model_type", model_type), d.get("model_type", model_type)
        )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"unknown model_type {model_type!r}: tfjax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        d["model_type"] = model_type
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" not in d and "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if "head_dim" not in d or d["head_dim"] is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if model_type in ("llama", "qwen2"):
            d.setdefault("partial_rotary_factor", 1.0)
            d.setdefault("rope_theta", 10000.0)
            d["attn_output_gate"] = False
            d["rms_norm_offset"] = False
            d["qkv_bias"] = model_type == "qwen2" or bool(d.get("attention_bias", False))
            d["layer_types"] = ["full_attention"] * d["num_hidden_layers"]
        elif not d.get("layer_types"):
            interval = d.get("full_attention_interval", 4)
            d["layer_types"] = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(d["num_hidden_layers"])
            ]
        d["layer_types"] = tuple(d["layer_types"])
        if len(d["layer_types"]) != d["num_hidden_layers"]:
            raise ConfigError(f"layer_types has {len(d['layer_types'])} entries for {d['num_hidden_layers']} layers")
        eos = d.get("eos_token_id")
        d["eos_token_id"] = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        if "torch_dtype" in d and "dtype" not in d:
            d["dtype"] = d["torch_dtype"]
        d["dtype"] = str(d.get("dtype") or "bfloat16")
        quant = d.get("quantization") or d.get("quantization_config")
        d["quantization"] = QuantConfig.from_dict(quant) if quant else None
        if model_type == "qwen3_5":
            d["num_experts"] = 0
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """A transformers-style config.json dict (text model) for this geometry."""
        d = dataclasses.asdict(self)
        d.pop("quantization")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        if self.quantization is not None:
            q: dict[str, Any] = {"bits": self.quantization.bits, "group_size": self.quantization.group_size}
            for key, value in self.quantization.overrides:
                q[key] = False if value is None else {"bits": value[0], "group_size": value[1]}
            d["quantization"] = q
        return d
