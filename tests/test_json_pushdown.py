"""json_object's pushdown: the byte automaton against json.loads, its token tables (SmolLM2's vocabulary, walked in
numpy) against the byte automaton, and the round's masks and walk against the tables."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import grammar
from tfjax import json_pushdown as jp

_STRING_PIECES = ["a", "Zq", " ", '\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\\u00e9", "\\uD83D",
                  "\\uabCD", "é", "☃", "😀", "\x7f", "{", "]", ":", ","]


def _ws(rng) -> str:
    return str(rng.choice(["", "", "", " ", "\n  ", "\t", "\r\n"]))


def _string(rng) -> str:
    return '"' + "".join(rng.choice(_STRING_PIECES, rng.integers(0, 5))) + '"'


def _number(rng) -> str:
    whole = "0" if rng.random() < 0.3 else str(rng.integers(1, 9)) + "".join(map(str, rng.integers(0, 9, rng.integers(0, 4))))
    frac = "." + "".join(map(str, rng.integers(0, 9, rng.integers(1, 4)))) if rng.random() < 0.4 else ""
    exp = str(rng.choice(["e", "E"])) + str(rng.choice(["", "+", "-"])) + str(rng.integers(0, 30)) \
        if rng.random() < 0.3 else ""
    return ("-" if rng.random() < 0.3 else "") + whole + frac + exp


def _value(rng, depth: int, top: bool = False) -> str:
    """Random JSON text: objects and arrays up to `depth` deep, every scalar form, random whitespace."""
    kind = "object" if top else str(rng.choice(["string", "number", "literal"] + ["object", "array"] * (depth > 0)))
    if kind == "string":
        return _string(rng)
    if kind == "number":
        return _number(rng)
    if kind == "literal":
        return str(rng.choice(["true", "false", "null"]))
    n = int(rng.integers(0, 4))
    if kind == "object":
        items = [_ws(rng) + _string(rng) + _ws(rng) + ":" + _ws(rng) + _value(rng, depth - 1) + _ws(rng) for _ in range(n)]
        return "{" + (",".join(items) if n else _ws(rng)) + "}"
    items = [_ws(rng) + _value(rng, depth - 1) + _ws(rng) for _ in range(n)]
    return "[" + (",".join(items) if n else _ws(rng)) + "]"


def _oracle(data: bytes) -> bool:
    """json.loads's verdict on a whole reply: UTF-8, an object, no NaN/Infinity, no whitespace outside it."""
    def refuse(name):
        raise ValueError(name)

    try:
        text = data.decode("utf-8")
        return text == text.strip(" \t\n\r") and isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


def _mutations(rng, data: bytes):
    interesting = b'{}[]":,-+.eE019 \\u\x01\x7f\xc3\xa9\xed\xff\ntfn'
    for _ in range(12):
        i = int(rng.integers(0, len(data) + 1))
        b = bytes([interesting[rng.integers(0, len(interesting))]])
        yield data[:i] + data[i + 1 :]
        yield data[:i] + b + data[i:]
        yield data[:i] + b + data[i + 1 :]


def test_the_byte_automaton_agrees_with_json_loads_on_valid_and_mutated_objects():
    rng = np.random.default_rng(0)
    hand = [b"{}", b'{"a":[]}', b"[]", b'"a"', b"{} ", b" {}", b'{"a":01}', b'{"a":1.}', b'{"a":.5}', b'{"a":-}',
            b'{"a":1e}', b'{"a":NaN}', b'{"a":tru}', b'{"a":1,}', b'{"a":[1,]}', b"{a:1}", b'{"a" 1}', b'{"a":1}}',
            b'{"a":[}', b'{"a":{]}', b'{"a":"\\x"}', b'{"a":"\\u12g4"}', b'{"a":"\x1f"}', b'{"a":"\xed\xa0\x80"}',
            b'{"a":"\xc0\x80"}', b'{"a":"\xf4\x90\x80\x80"}', b'{"a":"\xf0\x9f\x98\x80"}', b'{"\xe2\x98\x83":0}']
    valid = [_value(rng, 6, top=True).encode() for _ in range(150)]
    deep = b'{"a":' + b"[" * 7 + b'{"b":{"c":[{"d":-0.5E+3}]}}' + b"]" * 7 + b"}"
    cases = hand + valid + [deep] + [m for v in valid[:60] for m in _mutations(rng, v)]
    assert sum(map(_oracle, cases)) > 150 and sum(not _oracle(c) for c in cases) > 500  # both sides well covered
    for data in cases:
        assert jp.accepts(data) == _oracle(data), data


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's tokenizer, its spellings (ordinary tokens) and the json_object grammar compiled for it."""
    from tfjax import packaged
    from tfjax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(packaged.ensure_converted("smollm2"))
    grammars = grammar.Grammars(tok, tuple(tok.eos_ids), tok.vocab_size)
    spelled = grammar.spellings(tok, tok.eos_ids[0], skip=tuple(tok.eos_ids))
    return tok, spelled, grammars


def _walk(g: grammar.TokenGrammar, pos, token: int):
    """One token through the tables in plain numpy (grammar._move restated): the next (state, depth, stack) or None."""
    state, depth, stack = pos
    e = int(g.next[state, token])
    if e == -1:
        return None
    if e >= 0:
        return e, depth, stack
    code = -e - 2
    nxt, pops, pushes, bits, peak = (int(x) for x in g.outcomes[(code >> 3) + jp.key_of(depth, stack, code & 7)])
    return None if nxt < 0 or depth + peak > jp.MAX_DEPTH else (nxt, depth - pops + pushes,
                                                                  ((stack >> pops) << pushes) | bits)


def _tokenize(rng, data: bytes, by_bytes: dict[bytes, list[int]], longest: int) -> list[int]:
    """A random segmentation of `data` into vocabulary tokens (not the tokenizer's own: any split is a reply)."""
    out, i = [], 0
    while i < len(data):
        fits = [n for n in range(1, min(longest, len(data) - i) + 1) if data[i : i + n] in by_bytes]
        n = fits[-1] if rng.random() < 0.5 else int(rng.choice(fits))
        out.append(by_bytes[data[i : i + n]][0])
        i += n
    return out


def _alive(branches, data: bytes):
    for byte in data:
        branches = [n for b in branches for n in jp.step(b, byte)]
        if not branches:
            break
    return branches


def test_token_tables_walked_in_numpy_agree_with_the_byte_automaton_on_smollm2(smollm2):
    tok, spelled, grammars = smollm2
    g = grammars.json_object
    eos = list(tok.eos_ids)
    assert g.outcomes is not None and g.next.shape == (len(jp.STATES), tok.vocab_size)
    ordinary = sorted(i for ids in spelled.values() for i in ids)
    others = np.setdiff1d(np.arange(tok.vocab_size), ordinary + eos)
    assert len(others) > 0 and (g.next[:, others] == -1).all(), "special tokens are never allowed"
    text_of = {i: t for t, ids in spelled.items() for i in ids}
    longest = max(map(len, spelled))
    rng = np.random.default_rng(1)
    docs = [_value(rng, 5, top=True).encode() for _ in range(40)]
    docs.append(b'{"a":' + b"[" * (jp.MAX_DEPTH - 1) + b"]" * (jp.MAX_DEPTH - 1) + b"}")  # open to MAX_DEPTH
    docs.append('{"snow": "☃ 😀 \\uD83D\\uDE00", "n": [-0.0e-7, 12.5E+3, {"deep": {"er": [[[{}]]]}}]}'.encode())
    checked = 0
    for n, doc in enumerate(docs):
        assert jp.accepts(doc), doc
        tokens = _tokenize(rng, doc, spelled, longest)
        pos, done = (g.initial, 0, 0), b""
        for t in tokens:
            full = n >= len(docs) - 2 or rng.random() < 0.02  # the whole vocabulary here, against the bytes
            if full:
                branches = _alive([((jp.ABSENT,), jp.START, (), 0, 0)], done)
                table = np.array([_walk(g, pos, i) is not None for i in ordinary])
                byte = np.array([bool(_alive(branches, text_of[i])) for i in ordinary])
                assert np.array_equal(table, byte), (done, [text_of[ordinary[k]] for k in np.flatnonzero(table != byte)])
                checked += 1
            assert all(_walk(g, pos, e) is None for e in eos), "EOS before the object closed"
            pos, done = _walk(g, pos, t), done + text_of[t]
            assert pos is not None, (doc, done)
        assert pos[1] == 0 and all(_walk(g, pos, e) == pos for e in eos), "EOS once it closed"
    assert checked >= 30


def test_the_rounds_mask_and_walk_equal_the_tables_for_several_lanes(smollm2):
    from tfjax.lanes.round import LaneState, choose_scores

    tok, spelled, grammars = smollm2
    schema = grammars.compile({"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}})
    obj = grammars.json_object
    packed = grammar.Table(tok.vocab_size)
    offsets = {"dfa": packed.place(schema) - schema.initial, "obj": packed.place(obj) - obj.initial}
    assert offsets["obj"] > 0 and packed.outcomes > 0  # the pushdown after a DFA: its states and codes are shifted
    table = packed.device(grammar.capacity_for(packed.size), grammar.outcome_capacity_for(packed.outcomes))
    rng = np.random.default_rng(2)
    longest, width = max(map(len, spelled)), 6
    single = {k: v for k, v in spelled.items() if len(k) == 1}
    nested = b'{"a": [[{"b": [1, 2]}, "x"]], "c": {"d": {"e": [true]}}, "f": -1.5e3}'
    deep = b'{"a":' + b"[" * (jp.MAX_DEPTH - 1) + b"]" * (jp.MAX_DEPTH - 1) + b"}"
    special = int(np.flatnonzero((obj.next == -1).all(axis=0))[0])
    lanes = [("obj", _tokenize(rng, nested, spelled, longest), 4),
             ("dfa", _tokenize(rng, b'{"name": "Ada Lovelace"}', spelled, longest), 2),
             ("obj", _tokenize(rng, deep, single, 1), 5 + jp.MAX_DEPTH - 1 - 3),  # rows reach MAX_DEPTH and back
             ("obj", _tokenize(rng, nested, spelled, longest), 3)]
    grammar_of = {"obj": obj, "dfa": schema}
    starts, rows = [], []
    for n, (kind, tokens, cut) in enumerate(lanes):
        g, pos = grammar_of[kind], (grammar_of[kind].initial, 0, 0)
        for t in tokens[:cut]:  # the pending token tokens[cut - 1] included
            pos = _walk(g, pos, t)
        starts.append(pos)
        row = tokens[cut - 1 : cut - 1 + width]
        if n == 3:
            row[3] = special  # a forbidden proposal: the rows after it are free
        rows.append(row + [0] * (width - len(row)))
    rows.append([5] * width)  # lane 4 has no grammar
    start = grammar.Position(*(jnp.asarray([p[k] + (offsets[kind] if k == 0 else 0)
                                            for (kind, _, _), p in zip(lanes, starts, strict=True)]
                                           + [-1 if k == 0 else 0], jnp.int32) for k in range(3)))
    logits = jnp.asarray(rng.normal(size=(5, width, tok.vocab_size)), jnp.float32)
    state = LaneState(None, None, None, None, None, None, None, None, grammar=table, gstate=start)
    scores, walked = choose_scores(logits, jnp.asarray(rows, jnp.int32), state)
    scores, logits = np.asarray(scores), np.asarray(logits)
    got = np.stack([np.asarray(walked.state), np.asarray(walked.depth), np.asarray(walked.stack)], axis=-1)
    for lane, ((kind, _, _), pos) in enumerate(zip(lanes, starts, strict=True)):
        g = grammar_of[kind]
        for j in range(width):
            if pos is None:
                assert got[lane, j, 0] == -1 and np.array_equal(scores[lane, j], logits[lane, j]), (lane, j)
                continue
            assert tuple(got[lane, j]) == (pos[0] + offsets[kind], pos[1], pos[2]), (lane, j)
            want = np.array([_walk(g, pos, i) is not None for i in range(tok.vocab_size)])
            assert np.array_equal(np.isfinite(scores[lane, j]), want), (lane, j)
            pos = _walk(g, pos, rows[lane][j + 1]) if j + 1 < width else None
    assert got[3, 2, 0] >= 0 and (got[3, 3:, 0] == -1).all()  # row 3 has consumed the forbidden proposal
    assert got[2, :, 1].max() == jp.MAX_DEPTH and np.array_equal(scores[4], logits[4]), "a free lane keeps its logits"
