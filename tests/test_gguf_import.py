"""GGUF -> HF folder conversion and packaged-model fetching.

The real-model tests download SmolLM2-135M (a 93 MB wheel) once into $TFJAX_CACHE (default
~/.cache/tfjax) and compare against transformers reading the same GGUF directly.
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tfjax.gguf_import import GGUFImportError, _unpermute_rows, convert_gguf
from tfjax.packaged import PackagedModel, PackagedModelError, ensure_converted, fetch_gguf

PROMPT = "The capital of France is Paris. The capital of Germany is"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to q_proj/k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# A tiny random llama written as GGUF the way llama.cpp would (q/k permuted, f32).

TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    from tfjax.tokenizer import byte_alphabet

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = specials + byte_tokens + ["Ġt", "he", "Ġthe", "in", "<think>"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials) - 1) + [4]
    return tokens, types, merges


def tiny_hf_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, hd = TINY["hidden"], TINY["hidden"] // TINY["heads"]
    vocab = len(tiny_vocab()[0])
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)), "model.norm.weight": rng.random(h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = rng.random(h)
        w[f"{p}.post_attention_layernorm.weight"] = rng.random(h)
        w[f"{p}.self_attn.q_proj.weight"] = rng.standard_normal((TINY["heads"] * hd, h))
        w[f"{p}.self_attn.k_proj.weight"] = rng.standard_normal((TINY["kv_heads"] * hd, h))
        w[f"{p}.self_attn.v_proj.weight"] = rng.standard_normal((TINY["kv_heads"] * hd, h))
        w[f"{p}.self_attn.o_proj.weight"] = rng.standard_normal((h, TINY["heads"] * hd))
        w[f"{p}.mlp.gate_proj.weight"] = rng.standard_normal((TINY["ffn"], h))
        w[f"{p}.mlp.up_proj.weight"] = rng.standard_normal((TINY["ffn"], h))
        w[f"{p}.mlp.down_proj.weight"] = rng.standard_normal((h, TINY["ffn"]))
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama", skip: str | None = None):
    import gguf

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    for hf_name, value in weights.items():
        g = hf_name
        for a, b in names.items():
            g = g.replace(a, b)
        g = g.replace("model.layers.", "blk.")
        if ".attn_q." in g:
            value = llama_cpp_permute(value, TINY["heads"])
        elif ".attn_k." in g:
            value = llama_cpp_permute(value, TINY["kv_heads"])
        if g != skip:
            w.add_tensor(g, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim in [(9, 64), (3, 64), (4, 8)]:
        w = rng.standard_normal((n_head * head_dim, 5)).astype(np.float32)
        np.testing.assert_array_equal(_unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
        b = rng.standard_normal(n_head * head_dim).astype(np.float32)
        np.testing.assert_array_equal(_unpermute_rows(llama_cpp_permute(b, n_head), n_head), b)


def test_tiny_llama_gguf_converts_to_exact_hf_weights(tmp_path):
    weights = tiny_hf_weights(np.random.default_rng(1))
    write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
    got = read_safetensors(out / "model.safetensors")
    assert set(got) == set(weights)  # tied: no lm_head.weight
    for name, value in weights.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 8)
    assert config["vocab_size"] == len(tiny_vocab()[0]) and config["eos_token_id"] == 2
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_config["chat_template"]


def test_bf16_output_rounds_f32_weights(tmp_path):
    import ml_dtypes

    weights = tiny_hf_weights(np.random.default_rng(2))
    write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    got = read_safetensors(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf") / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    assert got[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[name], weights[name].astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------------------------------
# Bad input


def test_truncated_gguf_names_the_problem(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(np.random.default_rng(3)))
    data = (tmp_path / "tiny.gguf").read_bytes()
    for cut in (len(data) - 1000, 200):  # inside the tensor data, inside the header
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFImportError, match="truncated") as e:
            convert_gguf(bad, tmp_path / "out")
        assert str(bad) in str(e.value)


def test_bad_magic_is_rejected(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")


def test_unknown_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.random.default_rng(4).standard_normal((8, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match=r"'mamba' is not supported; supported: llama, qwen2"):
        convert_gguf(path, tmp_path / "out")


def test_missing_tensor_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights(np.random.default_rng(5)), skip="blk.1.ffn_up.weight")
    with pytest.raises(GGUFImportError, match=r"missing tensor 'blk.1.ffn_up.weight'"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "out")


def make_wheel(index: Path, dist: str, version: str, member: str, payload: bytes) -> None:
    """A minimal wheel holding `payload` at `member`, as the model-part wheels do."""
    pkg = dist.replace("-", "_")
    info = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(index / f"{pkg}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{pkg}/{member}", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def fake_parts(tmp_path: Path, n: int, present: set[int], size: int) -> PackagedModel:
    index = tmp_path / "index"
    index.mkdir()
    for i in present:
        make_wheel(index, f"tfjax-fake-part{i}", "0.1", f"data/part{i:02d}.bin", bytes([i]) * 100)
    return PackagedModel(
        "fake",
        tuple(f"tfjax-fake-part{i}==0.1" for i in range(1, n + 1)),
        "*/data/part*.bin",
        size,
        pip_args=("--no-index", "--find-links", str(index)),
    )


def test_multipart_fetch_joins_parts_in_order(tmp_path):
    model = fake_parts(tmp_path, 3, {1, 2, 3}, 300)
    path = fetch_gguf(model, tmp_path / "cache")
    assert path.read_bytes() == bytes([1]) * 100 + bytes([2]) * 100 + bytes([3]) * 100
    assert fetch_gguf(model, tmp_path / "cache") == path  # cached: no pip call needed


def test_two_fetches_at_once_download_once_and_both_get_the_file(tmp_path, monkeypatch):
    """Two processes (here threads: flock locks each open file apart) starting at once: the second waits for the
    first's file instead of racing it on the same partial file."""
    import threading

    from tfjax import packaged

    model = fake_parts(tmp_path, 3, {1, 2, 3}, 300)
    calls, download = [], packaged._download
    monkeypatch.setattr(packaged, "_download", lambda *a: calls.append(a[0]) or download(*a))
    got, errors = [], []

    def fetch():
        try:
            got.append(fetch_gguf(model, tmp_path / "cache").read_bytes())
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [bytes([1]) * 100 + bytes([2]) * 100 + bytes([3]) * 100] * 2
    assert len(calls) == 3, calls


def test_missing_part_names_the_part(tmp_path):
    model = fake_parts(tmp_path, 3, {1, 3}, 300)
    with pytest.raises(PackagedModelError, match=r"part 2 of 3 \(tfjax-fake-part2==0.1\)") as e:
        fetch_gguf(model, tmp_path / "cache")
    assert "tfjax-fake-part2" in str(e.value).split("\n", 1)[1]  # pip's own stderr tail follows
    assert not list((tmp_path / "cache").glob("fake.gguf*"))  # neither the file nor a partial one


def test_wrong_total_size_is_rejected(tmp_path):
    model = fake_parts(tmp_path, 2, {1, 2}, 999)
    with pytest.raises(PackagedModelError, match="200 bytes, expected 999"):
        fetch_gguf(model, tmp_path / "cache")


# --------------------------------------------------------------------------------------------------
# Real models


def transformers_logits(folder: Path, gguf_file: str | None, text: str):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits[0].numpy()


def assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
    """bf16 weights vs f32 dequantized weights: tiny relative error, same predictions."""
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    cos = (ours * ref).sum() / np.linalg.norm(ours) / np.linalg.norm(ref)
    agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
    assert err < 0.03 and cos > 0.9995 and agree >= 0.9, f"{err=:.4f} {cos=:.6f} {agree=:.2f}"


def test_smollm2_converted_logits_match_transformers_gguf():
    gguf_path = fetch_gguf("smollm2")
    folder = ensure_converted("smollm2")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    ref = transformers_logits(gguf_path.parent, gguf_path.name, PROMPT)
    ours = transformers_logits(folder, None, PROMPT)
    assert_logits_close(ours, ref)


@pytest.mark.slow
def test_qwen25_coder_05b_converted_logits_match_transformers_gguf(capsys):
    """About 90-100 s on CPU with warm caches (491 MB of wheels, 1.26 GB bf16 folder); conversion ~25 s."""
    start = time.perf_counter()
    gguf_path = fetch_gguf("qwen2.5-coder-0.5b")
    folder = ensure_converted("qwen2.5-coder-0.5b")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False  # GGUF has output.weight
    prompt = "def fibonacci(n):\n    "
    assert_logits_close(
        transformers_logits(folder, None, prompt), transformers_logits(gguf_path.parent, gguf_path.name, prompt)
    )
    with capsys.disabled():
        print(f"\nqwen2.5-coder-0.5b fetch+convert+logits: {time.perf_counter() - start:.0f}s")


def test_unknown_packaged_name_lists_known_ones():
    with pytest.raises(KeyError, match="unknown packaged model 'nope'; known: smollm2"):
        fetch_gguf("nope")
