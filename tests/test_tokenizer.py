"""tfjax.tokenizer against transformers, on tokenizers rebuilt from real GGUF vocabularies."""

from __future__ import annotations

import json
import random

import jinja2
import pytest

from tfjax.gguf_import import build_tokenizer
from tfjax.packaged import ensure_converted, fetch_gguf
from tfjax.tokenizer import Tokenizer, byte_alphabet

MIXED_TEXT = (
    "Hello, world! It's 2024-06-01 and I've   got 12345 apples (3.14159 each).\n\n"
    "def f(x):\n    return x ** 2  # square\n\tindented\r\nclass A: pass\n"
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский, العربية, हिन्दी 👍🏽👨‍👩‍👧 🤖!\n"
    '<|im_start|>user\nhi<|im_end|>  trailing   spaces   \n\n\n  {"json": [1, 2.5, null]} $x^2$ — “quotes”'
)

MESSAGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in binary? 🤖"},
]


@pytest.fixture(scope="module")
def smollm2():
    """(our Tokenizer, transformers' tokenizer read from the GGUF)."""
    from transformers import AutoTokenizer

    gguf_path = fetch_gguf("smollm2")
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return Tokenizer.from_dir(ensure_converted("smollm2")), ref


def test_smollm2_ids_match_transformers_gguf_tokenizer(smollm2):
    ours, ref = smollm2
    for text in [MIXED_TEXT, MIXED_TEXT.upper(), "x" * 7 + " " * 9 + "y\n" * 3]:
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.encode("<|im_start|>") == [1]  # control tokens match whole


def test_smollm2_decode_round_trips(smollm2):
    ours, _ = smollm2
    assert ours.decode(ours.encode(MIXED_TEXT)) == MIXED_TEXT


def test_smollm2_splits_digits_one_by_one(smollm2):
    """SmolLM's pre-tokenizer (and llama.cpp's `smollm`) isolates each digit."""
    ours, _ = smollm2
    assert [ours.decode([i]) for i in ours.encode("x=2024")] == ["x", "=", "2", "0", "2", "4"]


def test_incremental_decoder_equals_decode_and_holds_back_partial_utf8(smollm2):
    ours, _ = smollm2
    ids = ours.encode(MIXED_TEXT)
    dec = ours.incremental_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # split characters were held back, never mangled
    assert any(p == "" for p in pieces)  # ... and some tokens did end inside a character
    # Pushing in random-sized chunks gives the same text.
    rng = random.Random(0)
    dec, out, i = ours.incremental_decoder(), [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(dec.push(ids[i : i + n]))
        i += n
    assert "".join(out) + dec.flush() == MIXED_TEXT
    dec = ours.incremental_decoder(skip_special_tokens=True)
    assert dec.push(ids) + dec.flush() == ours.decode(ids, skip_special_tokens=True) != MIXED_TEXT


def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, ref = smollm2
    for messages in [MESSAGES, [{"role": "system", "content": "Be terse."}, *MESSAGES]]:
        for add in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_smollm2_eos_ids(smollm2):
    ours, _ = smollm2
    assert ours.eos_ids == (2, 0)  # <|im_end|>, then <|endoftext|> from generation_config.json
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_eos_ids_gather_config_tokenizer_config_and_generation_config(tmp_path):
    tok = byte_level_tokenizer("smollm")
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert Tokenizer.from_dir(tmp_path).eos_ids == (2, 0, 1)


def byte_level_tokenizer(pre: str):
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_alphabet().values(), "Ġt", "Ã©"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "Ã ©"],
    }
    return build_tokenizer(lambda key, default=None: meta.get(key, default))


def test_qwen2_pretokenizer_normalizes_to_nfc():
    """Qwen2's tokenizer.json applies NFC; transformers' GGUF path leaves it out, we keep it."""
    tok = byte_level_tokenizer("qwen2")
    assert tok.encode("e\u0301").ids == tok.encode("\u00e9").ids


def test_unknown_pretokenizer_is_named():
    from tfjax.gguf_import import GGUFImportError

    with pytest.raises(GGUFImportError, match="pre-tokenizer 'mystery' is not supported"):
        byte_level_tokenizer("mystery")


def chat_tokenizer(template: str) -> Tokenizer:
    return Tokenizer(byte_level_tokenizer("smollm"), template, {"eos_token": "<|im_end|>"})


def test_template_helpers_match_transformers_environment():
    tok = chat_tokenizer(
        "{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ enable_thinking }}|{{ eos_token }}"
        "{% if tools %}|{{ tools[0].name }}{% endif %}"
    )
    msg = [{"role": "user", "content": "<b>&é</b>"}]
    assert tok.apply_chat_template(msg) == '{"role": "user", "content": "<b>&é</b>"}|True|<|im_end|>'
    assert tok.apply_chat_template(msg, enable_thinking=False, tools=[{"name": "calc"}]).endswith(
        "False|<|im_end|>|calc"
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="too many"):
        tok.apply_chat_template(msg * 3)


def test_template_sandbox_blocks_attribute_escapes():
    tok = chat_tokenizer("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])


@pytest.mark.slow
def test_qwen25_coder_ids_and_template_match_transformers():
    from transformers import AutoTokenizer

    gguf_path = fetch_gguf("qwen2.5-coder-0.5b")
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = Tokenizer.from_dir(ensure_converted("qwen2.5-coder-0.5b"))
    assert ours.encode(MIXED_TEXT) == ref(MIXED_TEXT, add_special_tokens=False)["input_ids"]
    assert ours.encode("<tool_call>") == [151657]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for kw in ({}, {"tools": tools}):
        expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(MESSAGES, **kw) == expected
    assert ours.eos_ids == (151645, 151643)  # as Qwen's own generation_config


# --------------------------------------------------------------------------------------------------
# SentencePiece-style vocabularies (Llama-2, Mistral, TinyLlama): Metaspace spaces and byte fallback

SP_TRAIN = ["the quick brown fox jumps over the lazy dog", "a café in the town", "hello world, hello there",
            "streaming text one token at a time"] * 4
SP_TEXT = "hello  wörld, the café ☕ says 日本語 🤖!\n  indented\tend "


def sentencepiece_tokenizer(style: str):
    """A tiny BPE with byte fallback, trained here; `llama2`: normalizer + Replace/Strip decoder as Llama-2's
    tokenizer.json, `metaspace`: a Metaspace pre-tokenizer and decoder. Characters outside the training text
    (ö, ☕, 日本語, 🤖, tab) only exist as <0xNN> byte pieces."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    probe = Backend(models.BPE(unk_token="<unk>"))
    probe.pre_tokenizer = pre_tokenizers.Metaspace()
    probe.train_from_iterator(SP_TRAIN, trainer)
    trained = json.loads(probe.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Backend(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return tok


@pytest.mark.parametrize("style", ["llama2", "metaspace"])
def test_sentencepiece_stream_equals_decode(style):
    tok = Tokenizer(sentencepiece_tokenizer(style), None, {"bos_token": "<s>"})
    ids = tok.encode(SP_TEXT)
    pieces = [tok.backend.id_to_token(i) for i in ids]
    assert any(p.startswith("<0x") for p in pieces) and any("▁" in p for p in pieces)  # both kinds are exercised
    assert tok.decode(ids) == SP_TEXT
    dec = tok.incremental_decoder()
    streamed = [dec.push(i) for i in ids]
    assert "".join(streamed) + dec.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in streamed)  # byte pieces of one character wait for the last of them
    assert "" in streamed  # ... so some tokens returned nothing yet
    # With a BOS first and skip_special_tokens, as the server streams a reply.
    dec = tok.incremental_decoder(skip_special_tokens=True)
    both = [tok.backend.token_to_id("<s>"), *ids]
    assert "".join(dec.push(i) for i in both) + dec.flush() == tok.decode(both, skip_special_tokens=True)


def test_stream_flush_gives_the_replacement_character_decode_gives():
    tok = Tokenizer(sentencepiece_tokenizer("metaspace"), None, {})
    ids = tok.encode("ok 🤖")[:-1]  # the emoji's last byte piece cut off
    dec = tok.incremental_decoder()
    assert dec.push(ids) + dec.flush() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_stream_refuses_ids_outside_the_vocabulary():
    tok = Tokenizer(sentencepiece_tokenizer("metaspace"), None, {})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.incremental_decoder().push([tok.vocab_size])


def save_tokenizer(tmp_path, backend, tok_config: dict):
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return Tokenizer.from_dir(tmp_path)


def test_raw_prompts_get_the_bos_the_post_processor_adds_once(tmp_path):
    tok = save_tokenizer(tmp_path, sentencepiece_tokenizer("llama2"), {"bos_token": "<s>"})
    bos = tok.token_to_id("<s>")
    assert tok.bos_ids == (bos,)
    assert tok.encode_prompt("hello world") == [bos, *tok.encode("hello world")]
    assert tok.encode_prompt("<s>hello world") == [bos, *tok.encode("hello world")]  # not twice


def test_add_bos_token_in_tokenizer_config_decides(tmp_path):
    backend = sentencepiece_tokenizer("llama2")
    assert save_tokenizer(tmp_path, backend, {"bos_token": "<s>", "add_bos_token": False}).bos_ids == ()
    backend.post_processor = None
    tok = save_tokenizer(tmp_path, backend, {"bos_token": "<s>", "add_bos_token": True})
    assert tok.bos_ids == (tok.token_to_id("<s>"),)
    assert save_tokenizer(tmp_path, backend, {"bos_token": "<s>"}).bos_ids == ()  # nothing says so: no BOS


def test_chat_prompts_get_only_the_templates_bos(tmp_path):
    from types import SimpleNamespace

    from tfjax.api import LLM

    tok = save_tokenizer(tmp_path, sentencepiece_tokenizer("llama2"), {
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"})
    bos = tok.token_to_id("<s>")
    ids = LLM.encode(SimpleNamespace(tokenizer=tok), [{"role": "user", "content": "hello"}])
    assert ids.count(bos) == 1 and ids[0] == bos
    assert LLM.encode(SimpleNamespace(tokenizer=tok), "hello")[0] == bos


def test_token_bytes_join_to_the_text_on_a_byte_level_vocabulary():
    """logprobs' `bytes`: each token's bytes, which joined are the text, multibyte characters split across tokens."""
    import os
    from pathlib import Path

    folder = Path(os.path.expanduser("~/.cache/tfjax/smollm2-bf16"))
    if not (folder / "tokenizer.json").is_file():
        from tfjax import packaged

        folder = packaged.ensure_converted("smollm2")
    tok = Tokenizer.from_dir(folder)
    text = "Hello wörld ✓ 日本"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text


@pytest.mark.parametrize("style", ["llama2", "metaspace"])
def test_token_bytes_join_to_the_text_on_a_sentencepiece_vocabulary(style):
    """Byte-fallback pieces are their byte, `▁` a space: joined, the text with the space SentencePiece prepends."""
    tok = Tokenizer(sentencepiece_tokenizer(style), None, {})
    ids = tok.encode(SP_TEXT)
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == " " + SP_TEXT
