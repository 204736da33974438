"""Tokenizer for a HF-style checkpoint folder: `tokenizer.json` via the `tokenizers` library, the chat
template from `tokenizer_config.json` rendered with sandboxed jinja2 the way transformers renders it,
and the set of stop ids gathered from config.json, tokenizer_config.json and generation_config.json.

`IncrementalDecoder` turns a stream of ids into text pieces for servers. It works on bytes: a
byte-level BPE token can end in the middle of a UTF-8 character, so undecodable trailing bytes are held
back until the next token completes them; the concatenated pieces always equal `decode(all ids)`.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_decoder() -> dict[str, int]:
    """Inverse of `byte_alphabet` (byte-level BPE spelling -> byte)."""
    return {c: b for b, c in byte_alphabet().items()}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


@cache
def _compile_template(source: str):
    """Compile a chat template in an environment matching transformers' (sandbox, helpers, whitespace)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render as-is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode, chat template and stop ids for one checkpoint folder."""

    def __init__(
        self,
        backend,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
        eos_ids: Sequence[int] = (),
    ):
        self.backend = backend  # a `tokenizers.Tokenizer`
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, pad_token, unk_token
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._byte_of = _byte_decoder()
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        tok_config = _read_json(path / "tokenizer_config.json")
        special = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        eos = _ids(_read_json(path / "config.json").get("eos_token_id"))
        if special["eos_token"] is not None and (i := backend.token_to_id(special["eos_token"])) is not None:
            eos.append(i)
        eos += _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        return cls(backend, template, special, eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` as the model's prompt text. Templates that ignore `enable_thinking` do so."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        return _compile_template(self.chat_template).render(
            messages=list(messages),
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **{**self.special_tokens, **kwargs},
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to decoded text."""
        if (b := self._bytes_cache.get(token_id)) is None:
            if token_id in self._added:
                b = self._added[token_id].encode("utf-8")
            else:
                piece = self.backend.id_to_token(token_id)
                if piece is None:
                    raise ValueError(f"{token_id=} is outside the vocabulary of {self.vocab_size}")
                b = bytes(self._byte_of[c] for c in piece)
            self._bytes_cache[token_id] = b
        return b

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Streaming detokenizer: `push(ids)` returns the text those ids complete; `flush()` the remainder."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        tok = self.tokenizer
        skip = tok._special_ids if self.skip_special_tokens else ()
        data = b"".join(tok.token_bytes(i) for i in ids if i not in skip)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Text for any held-back bytes (an incomplete character becomes U+FFFD, as `decode` does)."""
        return self._utf8.decode(b"", final=True)
