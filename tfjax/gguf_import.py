"""Convert a llama.cpp GGUF file into a Hugging Face-style checkpoint folder.

The folder holds `config.json`, `model.safetensors` (HF key names, bf16 or f32), `tokenizer.json`,
`tokenizer_config.json` (with the chat template) and `generation_config.json`, so both tfjax and
transformers load it like a Hub checkpoint.

Invariants:
- Quantized GGUF tensors are dequantized one at a time and written straight into the safetensors file,
  whose header is computed up front from the tensor shapes; peak memory is about one f32 tensor.
- llama.cpp's `convert_hf_to_gguf.py` permutes the rows of q_proj/k_proj for arch `llama` (to turn HF's
  half-split rotary layout into GGML's interleaved one); `_unpermute_rows` undoes it. qwen2 is stored
  unpermuted.
- The tokenizer is rebuilt from `tokenizer.ggml.*`: byte-level BPE with the pre-tokenizer the original
  HF tokenizer uses for `tokenizer.ggml.pre` (which is also what llama.cpp implements for that name).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from tfjax.tokenizer import byte_alphabet

GGUF_MAGIC = b"GGUF"
# Bump when the converted output changes, so cached folders (`packaged.ensure_converted`) are redone.
CONVERTER_VERSION = 2


class GGUFImportError(ValueError):
    """A GGUF file that cannot be converted: corrupt, truncated, or of an unsupported kind."""


@dataclass(frozen=True)
class _Arch:
    model_type: str
    hf_class: str
    qkv_bias: bool  # q/k/v projections carry a bias
    permuted_qk: bool  # llama.cpp permuted q/k rows when writing the GGUF


ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaForCausalLM", qkv_bias=False, permuted_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", qkv_bias=True, permuted_qk=False),
}

# GGUF tensors that carry nothing a HF checkpoint stores (precomputed rope frequencies).
_IGNORED_TENSORS = {"rope_freqs.weight"}

_DTYPES = {"bfloat16": (ml_dtypes.bfloat16, "BF16"), "float32": (np.float32, "F32")}


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Write a HF-style folder for `gguf_path` into `out_dir` and return `out_dir`.

    `progress(done, total, hf_name)` is called after each tensor is written (e.g. to advance a tqdm bar).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"{dtype=} must be one of {sorted(_DTYPES)}")
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    meta = _Metadata(reader, gguf_path)

    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_path}: architecture {arch_name!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(meta, arch, tensors, dtype)
    plan = list(_tensor_plan(config, arch))
    for gguf_name, hf_name in plan:
        if gguf_name not in tensors:
            raise GGUFImportError(f"{gguf_path}: missing tensor {gguf_name!r} (for {hf_name})")
    unexpected = set(tensors) - {g for g, _ in plan} - _IGNORED_TENSORS
    if unexpected:
        raise GGUFImportError(f"{gguf_path}: tensors with no HF counterpart: {sorted(unexpected)[:8]}")

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out_dir / "model.safetensors", plan, tensors, config, arch, dtype, progress)
    tokenizer_json, tokenizer_config, generation_config = _tokenizer_files(meta, config)
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)
    _write_json(out_dir / "tfjax_convert.json", {"converter_version": CONVERTER_VERSION, "source": gguf_path.name})
    _write_json(out_dir / "config.json", config)  # last: its presence marks a finished folder
    return out_dir


def open_gguf(path: Path):
    """A `gguf.GGUFReader` for `path`, or a `GGUFImportError` saying what is wrong with the file."""
    import gguf

    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises bare ValueError/IndexError on short or garbled headers
        raise GGUFImportError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFImportError(
                f"{path}: truncated GGUF: tensor {t.name!r} needs bytes up to "
                f"{t.data_offset + t.n_bytes:,} but the file has {size:,}"
            )
    return reader


class _Metadata:
    """Typed access to a reader's key/value fields."""

    _MISSING = object()

    def __init__(self, reader, path: Path):
        self.fields = reader.fields
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.fields:
            if default is self._MISSING:
                raise GGUFImportError(f"{self.path}: missing metadata key {key!r}")
            return default
        return self.fields[key].contents()


def _f32_clean(x: float) -> float:
    """GGUF stores floats as f32; `9.999999747378752e-06` reads back as the intended `1e-05`."""
    return float(str(np.float32(x)))


def _hf_config(meta: _Metadata, arch: _Arch, tensors: dict, dtype: str) -> dict:
    a = arch.model_type
    hidden = int(meta.get(f"{a}.embedding_length"))
    n_head = int(meta.get(f"{a}.attention.head_count"))
    n_kv = int(meta.get(f"{a}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{a}.attention.key_length", meta.get(f"{a}.rope.dimension_count", hidden // n_head)))
    if "token_embd.weight" not in tensors:
        raise GGUFImportError(f"{meta.path}: missing tensor 'token_embd.weight' (for model.embed_tokens.weight)")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are [cols, rows]
    config = {
        "architectures": [arch.hf_class],
        "model_type": a,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(meta.get(f"{a}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_clean(meta.get(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
        "torch_dtype": dtype,
    }
    if arch.model_type == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": _f32_clean(meta.get(f"{a}.rope.scaling.factor")),
        }
        if f"{a}.rope.scaling.original_context_length" in meta:
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                meta.get(f"{a}.rope.scaling.original_context_length")
            )
    return config


def _tensor_plan(config: dict, arch: _Arch) -> Iterator[tuple[str, str]]:
    """(GGUF name, HF name) for every tensor the HF checkpoint holds, in file order."""
    yield "token_embd.weight", "model.embed_tokens.weight"
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    mlp = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
    for i in range(config["num_hidden_layers"]):
        g, h = f"blk.{i}", f"model.layers.{i}"
        yield f"{g}.attn_norm.weight", f"{h}.input_layernorm.weight"
        for gn, hn in attn.items():
            yield f"{g}.{gn}.weight", f"{h}.self_attn.{hn}.weight"
            if arch.qkv_bias and gn != "attn_output":
                yield f"{g}.{gn}.bias", f"{h}.self_attn.{hn}.bias"
        yield f"{g}.ffn_norm.weight", f"{h}.post_attention_layernorm.weight"
        for gn, hn in mlp.items():
            yield f"{g}.{gn}.weight", f"{h}.mlp.{hn}.weight"
    yield "output_norm.weight", "model.norm.weight"
    if not config["tie_word_embeddings"]:
        yield "output.weight", "lm_head.weight"


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows [h, 2, d/2] were written as [h, d/2, 2].

    w: [n_head * head_dim, ...] (a weight's rows or a bias).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_tensor(t, hf_name: str, config: dict, arch: _Arch) -> np.ndarray:
    """Dequantize one GGUF tensor to f32 in HF layout ([out, in] for weights)."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError as e:
        raise GGUFImportError(f"tensor {t.name!r}: {e}") from e
    if arch.permuted_qk:
        if ".self_attn.q_proj." in hf_name:
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif ".self_attn.k_proj." in hf_name:
            w = _unpermute_rows(w, config["num_key_value_heads"])
    return w


def _write_safetensors(path, plan, tensors, config, arch, dtype, progress) -> None:
    """Stream tensors into a safetensors file: header first (offsets from shapes), then raw bytes."""
    np_dtype, st_dtype = _DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for gguf_name, hf_name in plan:
        shape = [int(d) for d in reversed(tensors[gguf_name].shape.tolist())]
        nbytes = int(np.prod(shape)) * itemsize
        header[hf_name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for done, (gguf_name, hf_name) in enumerate(plan, 1):
            w = _load_tensor(tensors[gguf_name], hf_name, config, arch).astype(np_dtype)
            f.write(np.ascontiguousarray(w).tobytes())
            if progress is not None:
                progress(done, len(plan), hf_name)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------
# Tokenizer

# Split regexes of the original HF tokenizers, keyed by `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pipeline(pre: str | None):
    """(normalizer, pre_tokenizer) the original tokenizer used for this `tokenizer.ggml.pre`."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    def split(regex):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return normalizers.NFC(), split(_QWEN2_SPLIT)
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        return None, split(_LLAMA3_SPLIT)
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2 splitting
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in (None, "default", "gpt-2", "gpt2"):
        return None, gpt2
    raise GGUFImportError(
        f"tokenizer pre-tokenizer {pre!r} is not supported; supported: qwen2, deepseek-r1-qwen, llama3, "
        "llama-bpe, smollm, gpt-2"
    )


def build_tokenizer(meta_get: Callable[..., Any]):
    """A `tokenizers.Tokenizer` for the byte-level BPE vocabulary in a GGUF's `tokenizer.ggml.*` keys."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta_get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFImportError(f"tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    tokens = list(meta_get("tokenizer.ggml.tokens"))
    types = list(meta_get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ")) for m in meta_get("tokenizer.ggml.merges")]
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())

    # Ordinary tokens are stored byte-level spelled; respell any that slipped through raw. Control and
    # user-defined tokens stay raw: they are matched whole in the text as added tokens.
    def spell(token: str, kind: int) -> str:
        if kind in (_CONTROL, _USER_DEFINED) or set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spell(t, k): i for i, (t, k) in enumerate(zip(tokens, types, strict=True))}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    normalizer, pre_tokenizer = _pipeline(meta_get("tokenizer.ggml.pre", None))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    if (n := tok.get_vocab_size(with_added_tokens=True)) != len(tokens):
        raise GGUFImportError(f"rebuilt tokenizer has {n} tokens, the GGUF lists {len(tokens)}")
    return tok


def _tokenizer_files(meta: _Metadata, config: dict) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config, generation_config) for the GGUF's vocabulary."""
    tok = build_tokenizer(meta.get)
    tokens = meta.get("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta.get("tokenizer.chat_template")
    # Stop on end-of-turn / end-of-message as well as EOS, where the GGUF names them, and on the
    # end-of-document token (Qwen's own generation_config lists <|im_end|> and <|endoftext|>).
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos += [i for i, t in enumerate(tokens) if t == "<|endoftext|>"]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}
    if "tokenizer.ggml.padding_token_id" in meta:
        generation_config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    return tok.to_str(), tokenizer_config, generation_config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
