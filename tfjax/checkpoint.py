"""Checkpoints -> parameters: Hugging Face safetensors (bf16, sharded) and MLX affine-quantized ones.

Loading streams one tensor at a time to the device, so the host never holds two copies of the model.
Keys are canonicalised (`canonical_key`), experts stacked, MLX layouts undone (conv1d [C, K, 1],
RMSNorm weights stored +1), and every mismatch is an error naming the tensor.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from tfjax import models
from tfjax.config import ConfigError, ModelConfig, QuantConfig, canonical_key

OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config or cannot be read."""


def safetensor_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (one file, or shards listed in an index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files")
    return files


def iter_tensors(path: Path) -> Iterator[tuple[str, jax.Array]]:
    """(key, array) for every tensor, one at a time (arrays land on the default device)."""
    for f in safetensor_files(path):
        try:
            handle = safe_open(str(f), framework="flax")
            keys = list(handle.keys())
        except Exception as e:  # truncated header, not a safetensors file
            raise CheckpointError(f"{f}: cannot read safetensors header ({e})") from e
        for key in keys:
            try:
                yield key, handle.get_tensor(key)
            except Exception as e:  # data section shorter than the header says
                raise CheckpointError(f"{f}: tensor {key!r} cannot be read, the file looks truncated ({e})") from e


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the headers only."""
    shapes = {}
    for f in safetensor_files(path):
        try:
            with safe_open(str(f), framework="flax") as h:
                for k in h.keys():
                    shapes[k] = tuple(h.get_slice(k).get_shape())
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors header ({e})") from e
    return shapes


def param_key(path: tuple) -> str:
    """Our parameter path as a canonical checkpoint key."""
    return ".".join(str(p) for p in path).replace("embed_tokens.table.", "embed_tokens.")


def _quant_from_keys(shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> QuantConfig | None:
    """Per-module (bits, group) read off the tensors themselves, checked against config.json."""
    if not any(k.endswith(".scales") for k in shapes):
        return None
    base = config.quantization or QuantConfig()
    found: dict[str, tuple[int, int]] = {}
    for key, shape in shapes.items():
        if not key.endswith(".scales"):
            continue
        module = canonical_key(key[: -len(".scales")])
        wshape = shapes.get(key[: -len(".scales")] + ".weight")
        if wshape is None:
            raise CheckpointError(f"quantized module {module} has scales but no weight")
        expected = config.quantization.for_layer(module) if config.quantization else None
        if expected is None:
            raise CheckpointError(f"{module} is quantized in the checkpoint but config.json says it is not")
        bits = expected[0]
        in_features = wshape[-1] * 32 // bits
        group = in_features // shape[-1]
        if (bits, group) != expected:
            raise ConfigError(f"unsupported quantization at {module}: tensors say group {group}, "
                              f"config says {expected}")
        found[module] = (bits, group)
    overrides = tuple(found.items())
    # Modules whose weight has no scales are not quantized (norms and vectors are never looked up).
    plain = tuple((canonical_key(k[: -len(".weight")]), None) for k, s in shapes.items()
                  if k.endswith(".weight") and len(s) >= 2 and k[: -len(".weight")] + ".scales" not in shapes)
    return QuantConfig(base.bits, base.group_size, overrides + plain)


class _Source:
    """Turns raw checkpoint tensors into canonical parameters (stacking experts, undoing MLX layouts)."""

    def __init__(self, config: ModelConfig, mlx_layout: bool):
        self.config, self.mlx_layout = config, mlx_layout
        self.pending: dict[str, dict[int, jax.Array]] = {}

    def convert(self, key: str, value: jax.Array) -> Iterator[tuple[str, jax.Array]]:
        key = canonical_key(key)
        if key.startswith(("model.visual", "visual.", "vision_tower", "mtp.", "model.mtp")):
            return
        if self.config.tie_word_embeddings and key.startswith("lm_head."):
            return
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$", key)
        if m:
            name = f"{m[1]}.{m[3]}.{m[4]}"
            parts = self.pending.setdefault(name, {})
            parts[int(m[2])] = value
            if len(parts) == self.config.num_experts:
                yield name, jnp.stack([parts[e] for e in range(self.config.num_experts)])
                del self.pending[name]
            return
        if key.endswith(".mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            yield key[: -len("gate_up_proj")] + "gate_proj.weight", value[:, :half]
            yield key[: -len("gate_up_proj")] + "up_proj.weight", value[:, half:]
            return
        if key.endswith(".mlp.experts.down_proj"):
            yield key + ".weight", value
            return
        if key.endswith("conv1d.weight") and value.ndim == 3:
            value = value[:, 0, :] if value.shape[1] == 1 else value[:, :, 0]
        if self.mlx_layout and key.endswith(OFFSET_NORMS) and value.ndim == 1:
            value = (value.astype(jnp.float32) - 1.0).astype(value.dtype)
        yield key, value

    def leftovers(self) -> list[str]:
        return [f"{k} ({len(v)} of {self.config.num_experts} experts)" for k, v in self.pending.items()]


def _is_mlx_layout(shapes: dict[str, tuple[int, ...]]) -> bool:
    """MLX conversions store depthwise conv weights as [C, K, 1]."""
    return any(k.endswith("conv1d.weight") and len(s) == 3 and s[-1] == 1 for k, s in shapes.items())


def load(path: str | Path, *, dtype: str | None = None, progress: bool = True,
         mesh=None) -> tuple[nnx.Module, ModelConfig]:
    """Build the model for a checkpoint folder and fill it tensor by tensor; with a `mesh` (`tfjax.sharding`) each
    tensor goes into its shards as it is read (never the whole model on one device)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    config = ModelConfig.from_json(path)
    if dtype:
        config = config.replace(dtype=dtype)
    shapes = tensor_shapes(path)
    config = config.replace(quantization=_quant_from_keys(shapes, config))
    abstract = nnx.eval_shape(lambda: models.build(config))
    source = _Source(config, _is_mlx_layout(shapes))
    bar = tqdm(total=len(shapes), desc=f"loading {path.name}", unit="tensor", disable=not progress)

    def tensors():
        for raw_key, value in iter_tensors(path):
            bar.update(1)
            yield from source.convert(raw_key, value)
        bar.close()

    place = None
    if mesh is not None:
        from tfjax import sharding

        sharding.plan(abstract, mesh)
        place = sharding.placer(abstract, mesh)
    return fill(abstract, tensors(), f"{path}", leftovers=source.leftovers, place=place), config


def fill(abstract: nnx.Module, tensors: Iterator[tuple[str, jax.Array]], where: str, *, key_of=param_key,
         leftovers=lambda: [], place=None) -> nnx.Module:
    """An abstract module's parameters filled from (key, tensor) pairs: every shape checked, none extra or missing."""
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    wanted = {key_of(k): k for k, v in flat.items() if isinstance(v, nnx.Param)}
    filled: dict[str, jax.Array] = {}
    extra = []
    for key, v in tensors:
        if key not in wanted:
            extra.append(key)
            continue
        target = flat[wanted[key]]
        if tuple(v.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {key}: expected shape {tuple(target.shape)}, found {tuple(v.shape)} "
                                  f"(in {where})")
        filled[key] = v.astype(target.dtype) if v.dtype != target.dtype else v
        if place is not None:  # into its shards now: the full tensor is dropped before the next one is read
            filled[key] = place(wanted[key], filled[key])
    if extra:
        raise CheckpointError(f"unexpected tensors in {where}: {', '.join(sorted(extra)[:8])}"
                              + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))
    missing = sorted(set(wanted) - set(filled)) + list(leftovers())
    if missing:
        raise CheckpointError(f"missing tensors in {where}: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    for key, flat_key in wanted.items():
        flat[flat_key] = flat[flat_key].replace(filled[key])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def write_mlx(src: str | Path, out_dir: str | Path, *, bits: int = 4, group_size: int = 64,
              progress: bool = True) -> Path:
    """Quantize a bf16 Hugging Face folder into an MLX affine checkpoint (MLX layouts, +1 norms)."""
    from safetensors.flax import save_file


    src, out = Path(src), Path(out_dir)
    config = ModelConfig.from_json(src)
    if config.quantization is not None:
        raise CheckpointError(f"{src} is already quantized")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    shapes = tensor_shapes(src)
    source = _Source(config, mlx_layout=False)
    for raw_key, raw_value in tqdm(iter_tensors(src), total=len(shapes), desc="quantizing", disable=not progress):
        for key, value in source.convert(raw_key, raw_value):
            key = key.replace(".mlp.experts.", ".mlp.switch_mlp.")
            if key.endswith("conv1d.weight"):
                tensors[key] = value[:, :, None]  # [C, K] -> MLX [C, K, 1]
            elif config.rms_norm_offset and key.endswith(OFFSET_NORMS) and value.ndim == 1:  # (1 + w) norms only
                tensors[key] = (value.astype(jnp.float32) + 1.0).astype(value.dtype)
            elif key.endswith(".weight") and value.ndim >= 2 and value.shape[-1] % group_size == 0:
                put_quantized(tensors, key[: -len(".weight")], value, bits, group_size)
            else:
                tensors[key] = value
    save_file(tensors, str(out / "model.safetensors"))
    write_quantized_config(src, out, bits, group_size, hf_alias=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def put_quantized(tensors: dict, stem: str, value: jax.Array, bits: int, group_size: int) -> None:
    """tensors[stem + .weight/.scales/.biases] = the MLX affine quantization of value (via bf16)."""
    from tfjax import quant

    w, s, b = quant.quantize(value.astype(jnp.bfloat16), bits=bits, group_size=group_size)
    tensors[stem + ".weight"], tensors[stem + ".scales"], tensors[stem + ".biases"] = w, s, b


def write_quantized_config(src: Path, out: Path, bits: int, group_size: int, *, hf_alias: bool = False) -> None:
    """src's config.json with MLX's quantization entry (and transformers' alias of it) into out."""
    raw = json.loads((src / "config.json").read_text())
    raw["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    if hf_alias:
        raw["quantization_config"] = raw["quantization"]
    (out / "config.json").write_text(json.dumps(raw, indent=2))


def save_orbax(model: nnx.Module, config: ModelConfig, out_dir: str | Path) -> Path:
    """Save converted parameters with orbax (plus config.json) for fast reloads."""
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", state, force=True)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return out


def load_orbax(path: str | Path) -> tuple[nnx.Module, ModelConfig]:
    """Restore parameters saved by `save_orbax`."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    config = ModelConfig.from_json(path)
    abstract = nnx.eval_shape(lambda: models.build(config))
    graphdef, state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path / "params", state)
    return nnx.merge(graphdef, restored), config
