"""Checkpoints: MLX 4-bit round trip, orbax reloads, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.flax import load_file, save_file

from tests.helpers import make_hf_checkpoint, prefill_then_steps
from tfjax import checkpoint, geometry, quant
from tfjax.checkpoint import CheckpointError
from tfjax.config import ConfigError


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_dense")
    make_hf_checkpoint(geometry.tiny_dense, path)
    return path


def _tokens(n=20):
    return np.random.default_rng(3).integers(0, 256, n)


def _dequantized_folder(mlx_dir, out):
    """An unquantized HF folder holding exactly the MLX checkpoint's dequantized weights."""
    raw = load_file(str(mlx_dir / "model.safetensors"))
    cfg = json.loads((mlx_dir / "config.json").read_text())
    group, bits = cfg["quantization"]["group_size"], cfg["quantization"]["bits"]
    out.mkdir()
    tensors = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        stem = key[: -len(".weight")]
        if stem + ".scales" in raw:
            value = quant.dequantize(value, raw[stem + ".scales"], raw[stem + ".biases"], bits=bits,
                                     group_size=group, dtype=jnp.float32)
        tensors[key] = value
    save_file(tensors, str(out / "model.safetensors"))
    cfg.pop("quantization")
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_mlx_checkpoint_we_write_gives_logits_of_its_dequantized_weights(tmp_path, name):
    hf = tmp_path / "hf"
    make_hf_checkpoint(geometry.named(name), hf)
    mlx = checkpoint.write_mlx(hf, tmp_path / "mlx", bits=4, group_size=64, progress=False)
    assert any(k.endswith(".scales") for k in load_file(str(mlx / "model.safetensors")))
    _dequantized_folder(mlx, tmp_path / "deq")
    q_model, q_config = checkpoint.load(mlx, progress=False)
    d_model, _ = checkpoint.load(tmp_path / "deq", progress=False)
    assert q_config.quantization is not None
    tokens = _tokens()
    np.testing.assert_array_equal(prefill_then_steps(q_model, tokens, 12), prefill_then_steps(d_model, tokens, 12))


@pytest.mark.parametrize("offset", [False, True], ids=["llama", "qwen3_5"])
def test_mlx_checkpoint_we_write_keeps_every_norm_of_its_source(tmp_path, hf_dense, offset):
    """Norm weights survive write_mlx + load (llama norms have no +1 to undo; a stray one broke SmolLM2)."""
    src = hf_dense if offset else _tiny_llama(tmp_path / "hf")
    mlx = checkpoint.write_mlx(src, tmp_path / "mlx", bits=4, group_size=64, progress=False)
    norms = lambda m: {k: np.asarray(v, np.float32) for k, v in nnx.to_flat_state(nnx.state(m))  # noqa: E731
                       if "norm" in ".".join(map(str, k))}
    want, got = norms(checkpoint.load(src, progress=False)[0]), norms(checkpoint.load(mlx, progress=False)[0])
    assert want.keys() == got.keys() and want
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, err_msg=str(k))


def _tiny_llama(out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def test_orbax_reload_gives_the_same_logits(tmp_path, hf_dense):
    model, config = checkpoint.load(hf_dense, progress=False)
    checkpoint.save_orbax(model, config, tmp_path / "orbax")
    again, _ = checkpoint.load_orbax(tmp_path / "orbax")
    tokens = _tokens()
    np.testing.assert_array_equal(prefill_then_steps(model, tokens, 12), prefill_then_steps(again, tokens, 12))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path, hf_dense):
    bad = _copy(hf_dense, tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
        checkpoint.load(bad, progress=False)


def test_extra_tensor_is_named(tmp_path, hf_dense):
    bad = _copy(hf_dense, tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.__setitem__("model.layers.0.surprise.weight", jnp.ones((2, 2))))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.0\.surprise\.weight"):
        checkpoint.load(bad, progress=False)


def test_wrong_shape_names_tensor_expected_and_found(tmp_path, hf_dense):
    bad = _copy(hf_dense, tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.__setitem__("model.norm.weight", jnp.ones((63,))))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: expected shape \(64,\), found \(63,\)"):
        checkpoint.load(bad, progress=False)


def test_truncated_file_is_reported(tmp_path, hf_dense):
    bad = _copy(hf_dense, tmp_path / "bad")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated|cannot read"):
        checkpoint.load(bad, progress=False)


def test_unknown_model_type_is_named(tmp_path, hf_dense):
    bad = _copy(hf_dense, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown model_type 'mamba'"):
        checkpoint.load(bad, progress=False)


@pytest.mark.parametrize("quantization, message", [
    ({"bits": 3, "group_size": 64}, "bits=3"),
    ({"bits": 4, "group_size": 48}, "group_size=48"),
    ({"bits": 4, "group_size": 64, "mode": "mxfp4"}, "mode 'mxfp4'"),
])
def test_unsupported_quantization_is_named(tmp_path, hf_dense, quantization, message):
    bad = _copy(hf_dense, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization"] = quantization
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        checkpoint.load(bad, progress=False)


def test_missing_folder_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "nowhere", progress=False)
