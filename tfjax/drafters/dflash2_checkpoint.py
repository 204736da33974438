"""DFlash(2) drafter checkpoints: the published safetensors layout (bf16, or MLX affine 4-bit) <-> our modules.

Published keys have no `model.` prefix (`layers.0.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`,
`norm.weight`); DFlash2 adds `layers.N.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}` (the codebooks without a
`.weight` suffix in bf16, with one in MLX conversions, quantized there beside `.scales` / `.biases`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.checkpoint import CheckpointError, fill, iter_tensors, put_quantized, tensor_shapes, write_quantized_config
from tfjax.config import ConfigError, ModelConfig, QuantConfig
from tfjax.drafters.dflash2 import DFlashConfig, DFlashDrafter

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def is_dflash(path: str | Path) -> bool:
    """True for a folder whose config.json declares a DFlash or DFlash2 drafter."""
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    raw = json.loads(cfg.read_text())
    return "dflash_config" in raw or any("DFlash" in a for a in raw.get("architectures") or ())


def _ours(key: str) -> str:
    """A checkpoint key as our parameter key (codebooks get `.weight`, a `model.` prefix is dropped)."""
    key = key[len("model."):] if key.startswith("model.") else key
    return key + ".weight" if key in CODEBOOKS else key


def _param_key(path: tuple) -> str:
    return ".".join(str(p) for p in path).replace(".table.", ".")


def _quant_from_shapes(shapes: dict[str, tuple[int, ...]], config: DFlashConfig) -> QuantConfig | None:
    """Per-module (bits, group) read off the tensors: modules with `.scales` are quantized, others not."""
    scaled = {_ours(k)[: -len(".scales")]: s for k, s in shapes.items() if k.endswith(".scales")}
    if not scaled:
        return None
    if config.quantization is None:
        raise ConfigError("drafter tensors carry MLX scales but config.json has no quantization section")
    bits = config.quantization.bits
    found = []
    for module, s in scaled.items():
        w = shapes.get(module + ".weight")
        if w is None:
            raise CheckpointError(f"quantized drafter module {module} has scales but no weight")
        found.append((module, (bits, w[-1] * 32 // bits // s[-1])))
    plain = tuple((_ours(k)[: -len(".weight")], None) for k, s in shapes.items()
                  if len(s) >= 2 and k.endswith(".weight") and _ours(k)[: -len(".weight")] not in scaled)
    plain += tuple((k, None) for k in CODEBOOKS if k in shapes)
    return QuantConfig(bits, config.quantization.group_size, tuple(found) + plain)


def read_config(path: str | Path) -> DFlashConfig:
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"no config.json in drafter folder {path}")
    return DFlashConfig.from_dict(json.loads((path / "config.json").read_text()))


def load(path: str | Path, *, dtype: str | None = None, target: ModelConfig | None = None) -> DFlashDrafter:
    """Build the drafter for a checkpoint folder, fill it, and (given `target`) check and bind it."""
    path = Path(path)
    config = read_config(path)
    if dtype:
        config = dataclasses.replace(config, dtype=dtype)
    shapes = tensor_shapes(path)
    config = dataclasses.replace(config, quantization=_quant_from_shapes(shapes, config))
    if target is not None:
        from tfjax.drafters.dflash2 import check_fits

        check_fits(config, target)
    abstract = nnx.eval_shape(lambda: DFlashDrafter(config, rngs=nnx.Rngs(0)))
    tensors = ((_ours(raw_key), value) for raw_key, value in iter_tensors(path))
    drafter = fill(abstract, tensors, f"drafter {path}", key_of=_param_key)
    return drafter if target is None else drafter.bind(target)


def published_tensors(drafter: DFlashDrafter, dtype=jnp.bfloat16) -> dict[str, jax.Array]:
    """Our parameters under their published bf16 keys (codebooks without `.weight`)."""
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        key = _param_key(path)
        if drafter.config.quantization is not None and not key.endswith(("weight", "base_kernel")):
            raise CheckpointError("export a quantized drafter from its bf16 parameters")
        key = key[: -len(".weight")] if key[: -len(".weight")] in CODEBOOKS else key
        out[key] = jnp.asarray(value[...]).astype(dtype)
    return out


def save(drafter: DFlashDrafter, out_dir: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors in the published layout (readable by `load`)."""
    from safetensors.flax import save_file

    if any(getattr(m, "fused", None) is not None for _, m in nnx.iter_modules(drafter)):
        raise ValueError("this drafter's projections are fused (the GPU serving layout): save it before loading it "
                         "for serving, or load it again from its checkpoint")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(published_tensors(drafter, jnp.dtype(dtype)), str(out / "model.safetensors"))
    cfg = drafter.config.to_dict()
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_mlx(src: str | Path, out_dir: str | Path, *, bits: int = 4, group_size: int = 64) -> Path:
    """Quantize a bf16 drafter folder the way MLX does: every 2-D weight whose input dim fits the group."""
    from safetensors.flax import save_file


    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in iter_tensors(src):
        stem = _ours(key)[: -len(".weight")]
        if value.ndim == 2 and (key.endswith(".weight") or key in CODEBOOKS) and value.shape[-1] % group_size == 0:
            put_quantized(tensors, stem, value, bits, group_size)
        else:
            tensors[key] = value
    save_file(tensors, str(out / "model.safetensors"))
    write_quantized_config(src, out, bits, group_size)
    return out
