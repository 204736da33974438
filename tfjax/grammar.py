"""Structured output: every grammar becomes token tables on the device that the jitted round walks and masks with.

A lane's grammar position (`Position`) is a state, plus a depth and a stack of container kinds for a pushdown.
The round walks it along the lane's own proposals (row j's position has consumed proposals 0..j-1) and masks
every verify row, so a constrained lane drafts and stays exact. EOS is allowed only in final states.

- json_schema (and tool calls): outlines-core compiles the schema's regex against the vocabulary into a token
  DFA, stored dense, `next[state, token]` (-1: not allowed).
- json_object: any JSON object up to `json_pushdown.MAX_DEPTH` containers deep, a pushdown whose stack is an
  int32 of bits. Its `next` entries are either plain moves (no stack effect, like a DFA's) or codes <= -2 into
  a small table of outcomes selected at run time by the top few stack entries (json_pushdown.py).

Several grammars share one `next` table, each at its own state offset, and one `outcomes` table (one dummy row
while no pushdown is placed, and the round then skips that work). xgrammar was measured too (faster to
compile) but keeps its stack on the host, which the round cannot walk over proposals it makes on the device
(docs/sampling_processors.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from tfjax import json_pushdown


def schema_regex(schema: dict, what: str = "response_format schema") -> str:
    """The regex of a JSON schema (outlines-core; key order is the output order); ValueError when unsupported."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(json.dumps(schema))
    except Exception as e:  # the library's own message says which part it cannot express
        raise ValueError(f"{what} is not supported: {e}") from e


@dataclasses.dataclass(frozen=True)
class TokenGrammar:
    """One compiled grammar: `next` [S, V] i32 (>= 0: the next state, -1: not allowed, <= -2: a pushdown code
    into `outcomes` [O, 5], json_pushdown.py), its initial state."""

    key: str
    next: np.ndarray
    initial: int
    outcomes: np.ndarray | None = None

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
        raise ValueError("json_object is a pushdown grammar, not a regex: use Grammars.compile")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return schema_regex(spec["schema"])
    raise ValueError(f"response_format type {kind!r} must be 'text', 'json_object' or 'json_schema'")


def spellings(tokenizer, eos_id: int, skip: tuple[int, ...] = ()) -> dict[bytes, list[int]]:
    """Every ordinary token's exact bytes -> its ids (special tokens, EOS and `skip` left out: no grammar spells
    with them)."""
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
    return spelled


def outlines_vocabulary(tokenizer, eos_id: int, skip: tuple[int, ...] = ()):
    """outlines-core's Vocabulary from a tfjax Tokenizer: every ordinary token's exact bytes."""
    import outlines_core

    return outlines_core.Vocabulary(eos_id, spellings(tokenizer, eos_id, skip))


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
        if response_format is not None and response_format.get("type") == "json_object":
            return self.json_object
        regex = regex_of(response_format)
        return None if regex is None else self.compile_regex(regex)

    @functools.cached_property
    def json_object(self) -> TokenGrammar:
        """response_format json_object: any JSON object up to `json_pushdown.MAX_DEPTH` deep (a pushdown)."""
        if not self.eos_ids:
            raise ValueError("response_format needs an EOS token to end the reply, and this model names none")
        spelled = spellings(self.tokenizer, self.eos_ids[0], skip=self.eos_ids)
        table, outcomes = json_pushdown.token_tables(spelled, self.vocab_size, self.eos_ids)
        return TokenGrammar("json_object", table, json_pushdown.START, outcomes)

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
    """Grammars packed into one host table for the device: `next` values shifted by each one's state offset,
    pushdown codes by its offset in the shared `outcomes`."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.offsets: dict[str, int] = {}
        self.rows: list[np.ndarray] = []
        self.outcome_rows: list[np.ndarray] = []
        self.size = 0
        self.outcomes = 0

    def place(self, g: TokenGrammar) -> int:
        """The global initial state of `g`, placing it if it is new."""
        if g.key not in self.offsets:
            self.offsets[g.key] = self.size
            moved = np.where(g.next >= 0, g.next + self.size, np.where(g.next <= -2, g.next - (self.outcomes << 3), -1))
            self.rows.append(moved.astype(np.int32))
            if g.outcomes is not None:
                out = g.outcomes.astype(np.int32)
                out[:, 0] = np.where(out[:, 0] >= 0, out[:, 0] + self.size, -1)
                self.outcome_rows.append(out)
                self.outcomes += len(out)
            self.size += g.states
        return self.offsets[g.key] + g.initial

    def clear(self) -> None:
        self.offsets.clear()
        self.rows.clear()
        self.outcome_rows.clear()
        self.size = self.outcomes = 0

    def device(self, capacity: int, outcome_capacity: int) -> Device:
        """The table padded to `capacity` states and `outcome_capacity` outcomes (powers of two, so growth
        rarely recompiles; one outcome means no pushdown, which the round then skips)."""
        nxt = np.full((capacity, self.vocab_size), -1, np.int32)
        if self.rows:
            nxt[: self.size] = np.concatenate(self.rows)
        outcomes = np.zeros((outcome_capacity, 5), np.int32)
        outcomes[:, 0] = -1
        if self.outcome_rows:
            outcomes[: self.outcomes] = np.concatenate(self.outcome_rows)
        return Device(jnp.asarray(nxt), jnp.asarray(outcomes))


def capacity_for(states: int) -> int:
    return max(64, 1 << (states - 1).bit_length())


def outcome_capacity_for(outcomes: int) -> int:
    return 1 if outcomes == 0 else max(64, 1 << (outcomes - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Device:
    """The packed grammars on the device: `next` [S, V] i32 (TokenGrammar's codes), `outcomes` [O, 5] i32
    (next state or -1, pops, pushes, pushed bits, peak: json_pushdown.py)."""

    next: jax.Array
    outcomes: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Position:
    """Grammar positions, one per lane or row: the state (-1: unconstrained) and a pushdown's open containers."""

    state: jax.Array  # i32
    depth: jax.Array  # i32, containers open (0 for a DFA)
    stack: jax.Array  # i32, bit i: the i-th open container from the top is an object (1) or an array (0)


def start(state: jax.Array) -> Position:
    """Positions at `state` with nothing open."""
    state = jnp.asarray(state, jnp.int32)
    return Position(state, jnp.zeros_like(state), jnp.zeros_like(state))


def _move(table: Device, pos: Position, entry: jax.Array) -> Position:
    """The position after a token whose `next` entry is `entry` (broadcast against `pos`); state -1: forbidden."""
    shape = jnp.broadcast_shapes(entry.shape, pos.state.shape)
    if table.outcomes.shape[0] <= 1:  # no pushdown placed: a DFA move, nothing else to compute
        state = jnp.where(pos.state >= 0, entry, -1)
        return Position(state, jnp.broadcast_to(pos.depth, shape), jnp.broadcast_to(pos.stack, shape))
    code = jnp.maximum(-entry - 2, 0)
    reads = code & 7
    low = (1 << jnp.minimum(pos.depth, reads)) - 1  # the key: present entries read, then one absent (key_of)
    row = table.outcomes[jnp.minimum((code >> 3) + low + (pos.stack & low), table.outcomes.shape[0] - 1)]
    nxt, pops, pushes, bits, peak = (row[..., i] for i in range(5))
    depth = pos.depth - pops + pushes
    pushdown = (entry <= -2) & (nxt >= 0) & (pos.depth + peak <= json_pushdown.MAX_DEPTH)
    state = jnp.where(entry >= -1, entry, jnp.where(pushdown, nxt, -1))
    plain = entry >= -1
    return Position(jnp.where(pos.state >= 0, state, -1), jnp.where(plain, pos.depth, depth),
                    jnp.where(plain, pos.stack, ((pos.stack >> pops) << pushes) | bits))


def step(table: Device, pos: Position, token: jax.Array) -> Position:
    """Positions after one token each (`token` shaped like `pos`)."""
    return _move(table, pos, table.next[jnp.maximum(pos.state, 0), token])


def row_states(table: Device, pos: Position, rows: jax.Array) -> Position:
    """Each verify row's grammar position [L, R]: the lane's walked along proposals 0..j-1 (state -1: none).

    A proposal the grammar forbids can never be accepted (the row before it chooses an allowed token),
    so the rows after it are unconstrained: nobody reads their tokens.
    """
    out, p = [pos], pos
    for j in range(1, rows.shape[1]):
        p = step(table, p, rows[:, j])
        out.append(p)
    return jax.tree.map(lambda *a: jnp.stack(a, axis=1), *out)


def allowed(table: Device, pos: Position) -> jax.Array:
    """[..., V] bool: the tokens each position allows (every token where it is unconstrained); `_move`'s validity
    alone, with one gather of each outcome's deepest allowed start."""
    entry = table.next[jnp.maximum(pos.state, 0)]  # [..., V]
    ok = entry >= 0
    if table.outcomes.shape[0] > 1:
        depth, stack = pos.depth[..., None], pos.stack[..., None]
        deepest = jnp.where(table.outcomes[:, 0] >= 0, json_pushdown.MAX_DEPTH - table.outcomes[:, 4], -1)  # [O]
        code = jnp.maximum(-entry - 2, 0)
        low = (1 << jnp.minimum(depth, code & 7)) - 1
        limit = deepest[jnp.minimum((code >> 3) + low + (stack & low), deepest.shape[0] - 1)]
        ok = ok | ((entry <= -2) & (depth <= limit))
    return ok | (pos.state < 0)[..., None]


def mask_logits(logits: jax.Array, table: Device, pos: Position) -> jax.Array:
    """-inf for tokens a row's grammar position forbids; rows without a state keep their logits."""
    def masked(x: jax.Array) -> jax.Array:
        return jnp.where(allowed(table, pos), x, -jnp.inf)

    return jax.lax.cond(jnp.any(pos.state >= 0), masked, lambda x: x, logits)


def advance(table: Device, states: Position, chosen: jax.Array, committed: jax.Array, old: Position) -> Position:
    """The lane's position after its committed tokens: row c-1's position fed the last committed token."""
    lanes = jnp.arange(chosen.shape[0])
    last = jnp.maximum(committed - 1, 0)
    p = jax.tree.map(lambda a: a[lanes, last], states)
    moved = step(table, p, chosen[lanes, last])
    keep = (committed > 0) & (p.state >= 0)
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), moved, old)
