"""response_format: a JSON-schema DFA masks every verify row, so constrained replies validate and still draft."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tfjax import grammar, json_pushdown
from tfjax.engine import Engine, Request
from tfjax.lanes.config import LaneConfig
from tfjax.lanes.drafter import RoundFacts

LANES = LaneConfig(capacity=4, width=5, context=160, page_size=16)
EOS = 255
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 33]},
                                           "tag": {"type": "string", "maxLength": 3}},
          "required": ["ok", "n", "tag"]}
SAMPLED = dict(temperature=1.0, top_k=40)


def _validate(instance, schema) -> None:
    """jsonschema's check, imported here so `pytest -m gpu` collects this module where it is not installed."""
    import jsonschema

    jsonschema.validate(instance, schema)


class ByteTokenizer:
    """A 256-id vocabulary of JSON-ish pieces (single characters and a few longer ones); 255 is EOS."""

    _special_ids: set[int] = set()

    def __init__(self):
        rng = np.random.default_rng(0)
        pieces = [chr(c) for c in range(32, 127)] + ['"ok"', '"n"', '"tag"', "true", "false", "null",
                                                             '": ', '", "', "33", "tr", "ue"]
        while len(pieces) < 255:
            pieces.append("".join(rng.choice(list('abc{}":, 12'), rng.integers(1, 4))))
        self.pieces = pieces
        self.vocab_size = 256

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i].encode() if i < 255 else b"</s>"

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids if i != EOS)


@pytest.fixture(scope="module")
def grammars():
    return grammar.Grammars(ByteTokenizer(), (EOS,), 256)


def _prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    span = rng.integers(0, 250, 10).tolist()
    return rng.integers(0, 250, 14).tolist() + span + span


def _run(target, requests, copy_match=0):
    engine = Engine(target, LANES, eos_ids=(EOS,))
    engine.runner.set_facts(RoundFacts(copy_match=copy_match))
    return engine.run(requests)


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_constrained_replies_validate_and_drafted_equals_plain_beside_free_lanes(target, grammars, params):
    g = grammars.compile({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    obj = grammars.compile({"type": "json_object"})
    reqs = [dict(prompt=_prompt(s), max_tokens=80, grammar=g, **params) for s in range(2)]
    nest = {ord(c) - 32: 3.0 for c in '[{":'}  # json_object: pushed towards nesting, so the round walks a deep stack
    reqs += [dict(prompt=_prompt(5), max_tokens=80, grammar=obj, logit_bias=nest, **params),
             dict(prompt=_prompt(6), max_tokens=20)]
    plain = [_run(target, [Request(**r, draft=False)])[0] for r in reqs]
    drafted = _run(target, [Request(**r) for r in reqs], copy_match=1)
    tok = ByteTokenizer()
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_sha256 == b.token_sha256
    for r in drafted[:2]:
        assert r.finish_reason == "stop", r
        _validate(json.loads(tok.decode(r.token_ids)), SCHEMA)
    text = tok.decode(drafted[2].token_ids).encode()
    if drafted[2].finish_reason == "stop":  # json_object has an unbounded language: it may run to max_tokens
        assert isinstance(json.loads(text), dict) and json_pushdown.accepts(text)
    else:
        assert _open_containers(text) >= 1, text  # a live prefix of the language, inside the object
    free = _run(target, [Request(**reqs[3])])[0]
    assert free.token_ids == drafted[3].token_ids


def _open_containers(prefix: bytes) -> int:
    """How deep a prefix of a json_object reply is nested (0: the byte automaton rejects it or it has closed)."""
    branches = [((json_pushdown.ABSENT,), json_pushdown.START, (), 0, 0)]
    for byte in prefix:
        branches = [n for b in branches for n in json_pushdown.step(b, byte)]
    return len(branches[0][2]) if branches else 0


def test_row_states_walk_the_proposals_and_mask_forbidden_tokens(grammars):
    g = grammars.compile({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    packed = grammar.Table(256)
    assert packed.place(g) == g.initial
    table, pieces = packed.device(grammar.capacity_for(packed.size), 1), ByteTokenizer().pieces
    brace, quote_ok, space = pieces.index("{"), pieces.index('"ok"'), pieces.index(" ")
    rows = jnp.asarray([[0, brace, space], [0, quote_ok, space]], jnp.int32)  # lane 1: '"ok"' first is not JSON
    pos = grammar.row_states(table, grammar.start(jnp.asarray([g.initial, g.initial], jnp.int32)), rows)
    states = np.asarray(pos.state)
    s1 = g.next[g.initial, brace]
    assert states[0].tolist() == [g.initial, s1, g.next[s1, space]]
    assert states[1].tolist() == [g.initial, -1, -1]  # after a forbidden proposal the rows are free
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 256)), jnp.float32)
    masked = np.asarray(grammar.mask_logits(logits, table, pos))
    assert np.array_equal(np.isfinite(masked[0, 0]), g.next[g.initial] >= 0)
    assert np.isfinite(masked[0, 0, brace]) and not np.isfinite(masked[0, 0, quote_ok])
    assert np.array_equal(masked[1, 1:], np.asarray(logits[1, 1:]))
    assert g.next[g.initial, EOS] < 0 and not np.isfinite(masked[0, 0, EOS]), "EOS only in final states"


def test_bad_response_formats_are_clear_errors(grammars):
    for fmt, word in [({"type": "xml"}, "type"), ({"type": "json_schema"}, "json_schema")]:
        with pytest.raises(ValueError, match=word):
            grammars.compile(fmt)
    assert grammars.compile({"type": "text"}) is None and grammars.compile(None) is None


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "city": {"type": "string", "maxLength": 16},
                                           "adult": {"type": "boolean"}},
          "required": ["name", "city", "adult"]}


@pytest.mark.slow  # SmolLM2 and its 49k-token schema automaton: ~3 min a case on 2 cores; the tiny model's case runs in CI
@pytest.mark.parametrize("params", [{}, dict(temperature=0.8, top_p=0.95, seed=3)], ids=["greedy", "sampled"])
def test_a_json_schema_reply_from_smollm2_validates_and_drafted_equals_plain(params):
    from tfjax import api, packaged

    llm = _smollm2(api, packaged)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person who lives in Paris as JSON."}]
    drafted = llm.generate(messages, max_tokens=120, response_format=fmt, **params)
    plain = llm.generate(messages, max_tokens=120, response_format=fmt, draft=False, **params)
    assert drafted.finish_reason == "stop", drafted
    _validate(json.loads(drafted.text), PERSON)
    assert drafted.token_sha256 == plain.token_sha256


@pytest.mark.slow  # SmolLM2 with json_object's pushdown tables over its 49k vocabulary
def test_a_json_object_reply_from_smollm2_parses_and_drafted_equals_plain():
    from tfjax import api, packaged

    llm = _smollm2(api, packaged)
    messages = [{"role": "user", "content": "Give a JSON object with a person's name, age and a list of two pets."}]
    drafted = llm.generate(messages, max_tokens=160, response_format={"type": "json_object"})
    plain = llm.generate(messages, max_tokens=160, response_format={"type": "json_object"}, draft=False)
    assert drafted.token_sha256 == plain.token_sha256
    assert drafted.text.startswith("{")
    if drafted.finish_reason == "stop":  # json_object's language is unbounded: whitespace may run to max_tokens
        assert isinstance(json.loads(drafted.text), dict)


_LLM = {}


def _smollm2(api, packaged):
    """One SmolLM2 engine for the module (a real 49k vocabulary)."""
    if "llm" not in _LLM:
        _LLM["llm"] = api.load(packaged.ensure_converted("smollm2"), lanes=2, width=6, context=512, copy_match=3)
    return _LLM["llm"]
