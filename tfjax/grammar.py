"""Structured output: a JSON schema becomes a token-level DFA whose table lives on the device.

outlines-core compiles the schema's regex against the vocabulary into an index (state -> token -> state).
We store it dense, `next[state, token]` (-1: not allowed), so the jitted round can walk a lane's state along
its own proposals (row j's state has consumed proposals 0..j-1) and mask every verify row: a constrained
lane drafts and stays exact. EOS is allowed only in final states. Several grammars share one table, each
at its own state offset. xgrammar was measured too (faster to compile) but is a pushdown automaton with a
host-side stack, which the round cannot walk over proposals it makes on the device
(docs/sampling_processors.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

JSON_OBJECT_DEPTH = 1  # json_object: containers nested inside the top object (see _json_object_regex)


def _json_object_regex(depth: int = JSON_OBJECT_DEPTH) -> str:
    """A JSON object whose values may be objects and arrays nested `depth` deep below it (string keys): response_format
    json_object. A DFA cannot count brackets, so the depth is bounded: each level copies the value pattern four
    times (first and later members of objects and arrays), and on SmolLM2's 49k vocabulary depth 1 measured
    401 states and 0.8 s to compile, depth 2 1,633 states and 22 s (docs/sampling_processors.md)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING
    from outlines_core.json_schema import WHITESPACE as WS

    scalar = rf"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"

    def obj(value: str) -> str:
        member = rf"{STRING}{WS}:{WS}{value}"
        return rf"\{{{WS}({member}({WS},{WS}{member})*)?{WS}\}}"

    value = scalar
    for _ in range(depth):
        array = rf"\[{WS}({value}({WS},{WS}{value})*)?{WS}\]"
        value = rf"({scalar}|{obj(value)}|{array})"
    return obj(value)


def schema_regex(schema: dict, what: str = "response_format schema") -> str:
    """The regex of a JSON schema (outlines-core; key order is the output order); ValueError when unsupported."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(json.dumps(schema))
    except Exception as e:  # the library's own message says which part it cannot express
        raise ValueError(f"{what} is not supported: {e}") from e


@dataclasses.dataclass(frozen=True)
class TokenGrammar:
    """One compiled grammar: `next` [S, V] i32 (-1: the token is not allowed), its initial state."""

    key: str
    next: np.ndarray
    initial: int

    @property
    def states(self) -> int:
        return self.next.shape[0]


def regex_of(response_format: dict | None) -> str | None:
    """The regex an OpenAI `response_format` asks for, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_object_regex()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return schema_regex(spec["schema"])
    raise ValueError(f"response_format type {kind!r} must be 'text', 'json_object' or 'json_schema'")


def outlines_vocabulary(tokenizer, eos_id: int, skip: tuple[int, ...] = ()):
    """outlines-core's Vocabulary from a tfjax Tokenizer: every ordinary token's exact bytes."""
    import outlines_core

    special = set(getattr(tokenizer, "_special_ids", set())) | set(skip) | {eos_id}
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:  # decode(skip_special_tokens=True) drops a special token's text: it cannot spell any
        special |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    spelled: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i in special:
            continue
        try:
            spelled.setdefault(tokenizer.token_bytes(i), []).append(i)
        except ValueError:  # a hole in the id range
            continue
    spelled.pop(b"", None)
    return outlines_core.Vocabulary(eos_id, spelled)


def dense_table(index, vocab_size: int) -> tuple[np.ndarray, int]:
    """An outlines-core Index as `next` [S, V] i32 with states renumbered 0..S-1, and the initial state."""
    transitions = index.get_transitions()
    initial = index.get_initial_state()
    named = set(transitions) | {initial} | {d for moves in transitions.values() for d in moves.values()}
    order = {s: n for n, s in enumerate(sorted(named))}
    table = np.full((len(order), vocab_size), -1, np.int32)
    for s, moves in transitions.items():
        if moves:
            toks = np.fromiter(moves.keys(), np.int64, len(moves))
            dest = np.fromiter((order[d] for d in moves.values()), np.int32, len(moves))
            table[order[s], toks] = dest
    return table, order[initial]


class Grammars:
    """Compiles response formats for one tokenizer, with a cache (schemas repeat across requests).

    Every EOS id ends a reply in a final state (outlines-core knows one: the others copy its column)."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...], vocab_size: int):
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, tuple(eos_ids), vocab_size

    @functools.cached_property
    def _vocabulary(self):
        if not self.eos_ids:
            raise ValueError("response_format needs an EOS token to end the reply, and this model names none")
        return outlines_vocabulary(self.tokenizer, self.eos_ids[0], skip=self.eos_ids)

    def compile(self, response_format: dict | None) -> TokenGrammar | None:
        regex = regex_of(response_format)
        return None if regex is None else self.compile_regex(regex)

    @functools.lru_cache(maxsize=32)  # noqa: B019 (one Grammars per loaded model)
    def compile_regex(self, regex: str) -> TokenGrammar:
        """The token DFA of a regex in outlines-core's syntax (a JSON schema's, or tool calls' with their tags)."""
        import outlines_core

        try:
            index = outlines_core.Index(regex, self._vocabulary)
        except Exception as e:
            why = str(e).rsplit("'. ", 1)[-1]  # the library's message without its (long) regex
            raise ValueError(f"the output format cannot be spelled with this vocabulary: {why}") from e
        table, initial = dense_table(index, self.vocab_size)
        for other in self.eos_ids[1:]:
            table[:, other] = table[:, self.eos_ids[0]]
        return TokenGrammar(regex, table, initial)


class Table:
    """Grammars packed into one host table for the device (`next` values shifted by each one's offset)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.offsets: dict[str, int] = {}
        self.rows: list[np.ndarray] = []
        self.size = 0

    def place(self, g: TokenGrammar) -> int:
        """The global initial state of `g`, placing it if it is new."""
        if g.key not in self.offsets:
            self.offsets[g.key] = self.size
            self.rows.append(np.where(g.next >= 0, g.next + self.size, -1).astype(np.int32))
            self.size += g.states
        return self.offsets[g.key] + g.initial

    def clear(self) -> None:
        self.offsets.clear()
        self.rows.clear()
        self.size = 0

    def array(self, capacity: int) -> np.ndarray:
        """The table padded to `capacity` states (a power of two, so growth rarely recompiles)."""
        out = np.full((capacity, self.vocab_size), -1, np.int32)
        if self.rows:
            out[: self.size] = np.concatenate(self.rows)
        return out


def capacity_for(states: int) -> int:
    return max(64, 1 << (states - 1).bit_length())


def row_states(table: jax.Array, state: jax.Array, rows: jax.Array) -> jax.Array:
    """Each verify row's grammar state [L, R]: the lane's state walked along proposals 0..j-1 (-1: none).

    A proposal the grammar forbids can never be accepted (the row before it chooses an allowed token),
    so the rows after it are unconstrained: nobody reads their tokens.
    """
    states, s = [state], state
    for j in range(1, rows.shape[1]):
        nxt = table[jnp.maximum(s, 0), rows[:, j]]
        s = jnp.where(s >= 0, nxt, -1)
        states.append(s)
    return jnp.stack(states, axis=1)


def mask_logits(logits: jax.Array, table: jax.Array, states: jax.Array) -> jax.Array:
    """-inf for tokens a row's grammar state forbids; rows without a state keep their logits."""
    def masked(x: jax.Array) -> jax.Array:
        allowed = (table[jnp.maximum(states, 0)] >= 0) | (states < 0)[..., None]  # [L, R, V]
        return jnp.where(allowed, x, -jnp.inf)

    return jax.lax.cond(jnp.any(states >= 0), masked, lambda x: x, logits)


def advance(table: jax.Array, states: jax.Array, chosen: jax.Array, committed: jax.Array,
            old: jax.Array) -> jax.Array:
    """The lane's state after its committed tokens: row c-1's state fed the last committed token."""
    lanes = jnp.arange(states.shape[0])
    last = jnp.maximum(committed - 1, 0)
    s = states[lanes, last]
    nxt = table[jnp.maximum(s, 0), chosen[lanes, last]]
    return jnp.where((committed > 0) & (s >= 0), nxt, old)

