"""Tokenizer for a HF-style checkpoint folder: `tokenizer.json` via the `tokenizers` library, the chat
template from `tokenizer_config.json` rendered with sandboxed jinja2 the way transformers renders it,
and the set of stop ids gathered from config.json, tokenizer_config.json and generation_config.json.

`IncrementalDecoder` turns a stream of ids into text pieces for servers through the tokenizer's own
decoder pipeline (`tokenizers.decoders.DecodeStream`), so byte-level BPE and SentencePiece vocabularies
(Metaspace, byte fallback) both stream; a token that ends inside a character yields nothing until the
next one completes it, and the concatenated pieces equal `decode(all ids)`.
`bos_ids` are the ids the tokenizer puts before a raw prompt (`add_bos_token`, else its post-processor).
"""

from __future__ import annotations

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
        bos_ids: Sequence[int] = (),
    ):
        self.backend = backend  # a `tokenizers.Tokenizer`
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, pad_token, unk_token
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.bos_ids: tuple[int, ...] = tuple(bos_ids)  # put before raw prompts (never before chat templates)
        self._added = set(backend.get_added_tokens_decoder())
        self._byte_level = "ByteLevel" in str(backend.decoder)  # pieces spelled in GPT-2's byte alphabet
        self._byte_of = {c: b for b, c in byte_alphabet().items()}
        self._bytes: dict[int, bytes] = {}

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
        return cls(backend, template, special, eos, _bos_ids(backend, tok_config.get("add_bos_token"), special))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it runs (encode does not), so a server's event loop keeps answering
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids with the BOS the tokenizer adds, unless the text already starts with it."""
        ids = self.encode(text)
        bos = list(self.bos_ids)
        return ids if not bos or ids[: len(bos)] == bos else bos + ids

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
        """The bytes one token contributes to text (logprobs' `bytes`): byte-level BPE pieces through GPT-2's
        alphabet, SentencePiece byte-fallback pieces `<0xNN>` as that byte, `▁` as a space, added tokens as written."""
        if (b := self._bytes.get(token_id)) is not None:
            return b
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"{token_id=} is outside the vocabulary of {self.vocab_size}")
        if token_id in self._added:
            b = piece.encode("utf-8")
        elif self._byte_level:
            b = bytes(self._byte_of.get(c, 0) for c in piece) if all(c in self._byte_of for c in piece) else \
                piece.encode("utf-8")
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            b = bytes([int(piece[3:5], 16)])
        else:
            b = piece.replace("\u2581", " ").encode("utf-8")
        self._bytes[token_id] = b
        return b

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


def _bos_ids(backend, add_bos_token: bool | None, special: dict[str, str | None]) -> tuple[int, ...]:
    """What goes before a raw prompt: tokenizer_config's `add_bos_token` if set, else the post-processor's lead."""
    bos = special.get("bos_token")
    if add_bos_token is not None:
        bos_id = backend.token_to_id(bos) if add_bos_token and bos else None
        return (bos_id,) if bos_id is not None else ()
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    lead = len(full) - len(plain)
    return tuple(full[:lead]) if lead > 0 and full[lead:lead + len(plain)] == plain else ()


class IncrementalDecoder:
    """Streaming detokenizer: `push(ids)` returns the text those ids complete; `flush()` the remainder."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._sent = 0  # characters returned so far

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        vocab = self.tokenizer.vocab_size
        pieces = []
        for i in ids:
            if not 0 <= i < vocab:
                raise ValueError(f"token id {i} is outside the vocabulary of {vocab}")
            self._ids.append(i)
            pieces.append(self._stream.step(self.tokenizer.backend, i) or "")
        text = "".join(pieces)
        self._sent += len(text)
        return text

    def flush(self) -> str:
        """Text the stream still holds back (an incomplete character becomes U+FFFD, as `decode` does)."""
        rest = self.tokenizer.decode(self._ids, self.skip_special_tokens)[self._sent :]
        self._sent += len(rest)
        return rest
