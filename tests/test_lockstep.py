"""Multi-host serving in lock step (`tfjax.engine.lockstep`): process 0's messages carry every submission and
cancellation, in order, through fixed-shape broadcasts; a follower applies them and steps exactly when the leader
does. The two-process run over HTTP is in tests/test_tensor_parallel.py (slow)."""

from __future__ import annotations

import collections
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from tfjax.engine import lockstep

ARGS = dict(prompt=[5, 17, 3], max_tokens=9, temperature=0.8, top_k=20, top_p=0.9, min_p=None, seed=11,
            stop=["\n\n", "ünï"], draft=True, ignore_eos=False, presence_penalty=0.5, frequency_penalty=0.0,
            repetition_penalty=1.1, logit_bias={7: -100.0, 31: 2.5}, logprobs=True, top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, regex=None)


def test_a_message_round_trips_its_submissions_cancellations_and_flags():
    msg = lockstep.Message([("submit", 4, ARGS), ("cancel", 2), ("submit", 5, dict(ARGS, logit_bias=None))],
                           step=True)
    header, payload = lockstep.encode(msg)
    assert header.dtype == np.int32 and header.shape == (3,) and header[0] == len(payload)
    assert lockstep.decode(header, payload + b"\0" * 40) == msg  # padding after the payload is ignored
    for step, stop in ((False, False), (False, True), (True, False)):
        empty = lockstep.Message(step=step, stop=stop, state=2**31 - 1)
        header, payload = lockstep.encode(empty)
        assert payload == b"" and header[0] == 0 and lockstep.decode(header, b"") == empty


def test_payloads_pad_to_few_shapes():
    assert [lockstep.padded(n) for n in (1, 256, 257, 1000, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]


class Wire:
    """A fake broadcast between one leader and one follower in this process: the follower must ask for the shape
    and dtype the leader sent (the real collective needs the same shapes on every process)."""

    def __init__(self):
        self.sent: collections.deque = collections.deque()

    def lead(self, tree):
        self.sent.append(np.array(tree))
        return tree

    def follow(self, tree):
        got = self.sent.popleft()
        assert (got.shape, got.dtype) == (tree.shape, tree.dtype), (got.shape, tree.shape)
        return got


def test_a_long_message_crosses_in_fixed_shapes():
    wire = Wire()
    msg = lockstep.Message([("submit", i, dict(ARGS, prompt=list(range(300)))) for i in range(5)], step=True)
    lockstep.Channel(wire.lead).send(msg)
    assert [a.shape for a in wire.sent] == [(3,), (lockstep.padded(int(wire.sent[0][0])),)]
    assert lockstep.Channel(wire.follow).receive() == msg and not wire.sent


@dataclasses.dataclass
class FakeRequest:
    args: dict | None
    id: int
    on_finish: object = None


class FakeEngine:
    """Records the calls that decide what a round computes; its queue is all its scheduler holds."""

    def __init__(self):
        self.calls, self.results = [], {}
        self.scheduler = SimpleNamespace(running={}, waiting=[])

    def submit(self, r):
        if r.args.get("max_tokens", 1) < 1:
            raise ValueError("refused")
        self.calls.append(("submit", r.id, r.args))
        self.scheduler.waiting.append(r)
        return r.id

    def cancel(self, rid):
        self.calls.append(("cancel", rid))
        self.scheduler.waiting = [r for r in self.scheduler.waiting if r.id != rid]

    def step(self):
        self.calls.append(("step",))


class FakeLLM:
    def __init__(self):
        self.engine = FakeEngine()

    def request(self, prompt, **kw):
        return FakeRequest(dict(prompt=prompt, **kw), id=-1)


def test_a_follower_applies_the_leaders_submissions_and_cancellations_in_order_and_steps_with_it():
    wire, engine, llm = Wire(), FakeEngine(), FakeLLM()
    leader = lockstep.Leader(engine, lockstep.Channel(wire.lead))
    leader.submit(FakeRequest(ARGS, id=40))
    leader.cancel(40)
    leader.submit(FakeRequest(dict(ARGS, prompt=[1]), id=41))
    leader.step()
    leader.heartbeat()  # idle: nothing to apply, no step
    leader.cancel(41)
    leader.heartbeat()  # the cancel goes out without a step
    with pytest.raises(ValueError, match="refused"):
        leader.submit(FakeRequest(dict(ARGS, max_tokens=0), id=42))  # refused here: never sent
    leader.step()
    leader.close()
    assert lockstep.follow(llm, lockstep.Channel(wire.follow)) == 2 and not wire.sent
    assert llm.engine.calls == engine.calls and engine.calls[2][1] == 41, engine.calls


def test_a_follower_finishes_nothing_itself():
    wire, llm = Wire(), FakeLLM()
    seen = []
    llm.engine.submit = lambda r: seen.append(r) or llm.engine.scheduler.waiting.append(r)
    leader = lockstep.Leader(FakeEngine(), lockstep.Channel(wire.lead))
    leader.submit(FakeRequest(ARGS, id=7))
    leader.close()
    lockstep.follow(llm, lockstep.Channel(wire.follow))
    assert seen[0].id == 7 and seen[0].on_finish is lockstep._drop  # process 0 answers; nothing piles up here


def test_the_leader_refuses_a_request_it_cannot_send():
    leader = lockstep.Leader(FakeEngine(), lockstep.Channel(Wire().lead))
    with pytest.raises(ValueError, match="make requests with LLM.request"):
        leader.submit(FakeRequest(None, id=1))
    assert leader.pending == [] and leader.engine.calls == []


def test_a_request_rebuilt_from_its_arguments_is_the_same_request():
    """`LLM.request` records every argument but the callbacks; rebuilt from them (after the JSON trip) a request has
    the same fields, stop check and grammar, so a follower's scheduler decides as the leader's does."""
    import inspect

    from tfjax import api

    grammars = SimpleNamespace(compile=lambda fmt: None if fmt is None else ("grammar", str(fmt)),
                               compile_regex=lambda rx: ("regex", rx))
    llm = SimpleNamespace(encode=list, sampling=lambda **kw: {k: 0.0 if v is None else v for k, v in kw.items()},
                          grammars=grammars, tokenizer=SimpleNamespace(decode=lambda ids, **kw: "".join(map(chr, ids))))
    request = lambda *a, **kw: api.LLM.request(llm, *a, **kw)  # noqa: E731
    made = request([104, 105], on_tokens=print, **{k: v for k, v in ARGS.items() if k != "prompt"})
    assert set(made.args) == set(inspect.signature(api.LLM.request).parameters) - {"self", "on_tokens", "on_logprobs"}
    msg = lockstep.Message([("submit", made.id, made.args)])
    (_, rid, args), = lockstep.decode(*lockstep.encode(msg)).ops
    again = request(args.pop("prompt"), **args)
    skip = {"id", "on_tokens", "stop_check", "args"}
    assert {f: getattr(again, f) for f in vars(made) if f not in skip} == \
        {f: getattr(made, f) for f in vars(made) if f not in skip}
    out = [ord(c) for c in "ab\n\ncd"]
    assert again.stop_check(out) == made.stop_check(out) == 2


def test_a_follower_whose_engine_differs_raises_before_it_steps():
    """A follower that lost a cancellation (or stopped a lane the leader did not) says so at the next message,
    instead of entering a round whose collectives no longer match process 0's."""
    wire, llm = Wire(), FakeLLM()
    llm.engine.cancel = lambda rid: None  # drops the cancellation
    leader = lockstep.Leader(FakeEngine(), lockstep.Channel(wire.lead))
    leader.submit(FakeRequest(ARGS, id=3))
    leader.step()
    leader.cancel(3)
    leader.step()
    with pytest.raises(lockstep.Diverged, match="differs from process 0's before step 2"):
        lockstep.follow(llm, lockstep.Channel(wire.follow))
    assert llm.engine.calls == [("submit", 3, ARGS), ("step",)]
