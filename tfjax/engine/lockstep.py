"""A multi-host engine in lock step: process 0 takes the requests, every process runs the same engine steps.

JAX's multi-controller model needs every process to launch the same programs in the same order, so every
process's engine must admit the same requests, cancel the same ones and step the same number of times. Process 0
(the leader: the HTTP server or the chat prompt, and its engine) drives its engine through a `Leader`: before each
step it broadcasts what it submitted and cancelled since the last one, in order. The other processes (`follow`: the
engine without HTTP) rebuild each request from the `LLM.request` arguments it was made from (`Request.args`: the
same stop check, grammar and sampling), give it the leader's id, apply the submissions and cancellations in the same
order and step. The scheduler is deterministic and every process reads every lane's tokens (`sharding.fetch`), so
every process makes the same choices and runs the same rounds; only process 0's requests have callbacks.

Each message also carries a fingerprint of process 0's scheduler as it stands (live lanes, their requests and output
lengths, the queue); a follower compares its own before it steps and raises at the first difference, naming the
step, instead of entering a round whose collectives no longer match process 0's (a hang or a crash in the
collectives library).

A message is a [3] int32 header (payload bytes, flags, fingerprint), then, when there is one, the JSON payload padded to a
power of two (few shapes, so few compiles of the broadcast), through `multihost_utils.broadcast_one_to_all`: a
collective every process enters at the same point. An idle leader sends a heartbeat (no step) every
`HEARTBEAT_S`, so a follower never waits long in one collective; a stop message ends the followers' loops.
One process alone (`jax.process_count() == 1`) never needs any of this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the longest an idle leader leaves its followers waiting in one broadcast
STEP, STOP = 1, 2  # header flags
MIN_PAYLOAD = 256  # bytes: the smallest padded payload


@dataclasses.dataclass
class Message:
    """What process 0's engine did since its last step, in order: ("submit", id, args) and ("cancel", id)."""

    ops: list[tuple] = dataclasses.field(default_factory=list)
    step: bool = False  # then run one engine step
    stop: bool = False  # the leader is done: followers return
    state: int = 0  # `fingerprint` of the leader's engine once the ops are applied


class Diverged(RuntimeError):
    """This process's engine no longer matches process 0's: every later round would disagree."""


def fingerprint(engine) -> int:
    """A checksum of what the next step's admissions and round depend on: the live lanes' requests and output lengths,
    and the waiting requests, in order."""
    s = engine.scheduler
    state = (sorted((lane, slot.request.id, len(slot.output)) for lane, slot in s.running.items()),
             [r.id for r in s.waiting])
    return zlib.crc32(repr(state).encode()) & 0x7FFFFFFF


def _jsonable(args: dict) -> dict:
    """`LLM.request` arguments as JSON: logit_bias's int keys become [id, bias] pairs."""
    if args.get("logit_bias"):
        args = {**args, "logit_bias": [[int(k), float(v)] for k, v in args["logit_bias"].items()]}
    return args


def _from_json(args: dict) -> dict:
    if args.get("logit_bias"):
        args = {**args, "logit_bias": {int(k): float(v) for k, v in args["logit_bias"]}}
    return args


def encode(message: Message) -> tuple[np.ndarray, bytes]:
    """The [3] int32 header (payload bytes, flags, state) and the JSON payload (empty when there are no ops)."""
    ops = [[op[0], op[1], _jsonable(op[2])] if op[0] == "submit" else list(op) for op in message.ops]
    payload = json.dumps(ops, ensure_ascii=False, separators=(",", ":")).encode() if ops else b""
    flags = (STEP if message.step else 0) | (STOP if message.stop else 0)
    return np.asarray([len(payload), flags, message.state], np.int32), payload


def decode(header: np.ndarray, payload: bytes) -> Message:
    n, flags, state = (int(x) for x in header)
    ops = json.loads(payload[:n].decode()) if n else []
    ops = [("submit", int(op[1]), _from_json(op[2])) if op[0] == "submit" else ("cancel", int(op[1])) for op in ops]
    return Message(ops, step=bool(flags & STEP), stop=bool(flags & STOP), state=state)


def padded(n: int) -> int:
    """The payload's broadcast length: a power of two, at least MIN_PAYLOAD (few shapes, few compiles)."""
    return max(MIN_PAYLOAD, 1 << max(n - 1, 0).bit_length())


class Channel:
    """Process 0's messages to every process. `broadcast(tree)` returns process 0's values of tree on every process
    (`multihost_utils.broadcast_one_to_all`; a test passes a fake)."""

    def __init__(self, broadcast: Callable | None = None):
        if broadcast is None:
            from jax.experimental import multihost_utils

            broadcast = multihost_utils.broadcast_one_to_all
        self.broadcast = broadcast

    def send(self, message: Message) -> None:
        header, payload = encode(message)
        self.broadcast(header)
        if len(payload):
            buf = np.zeros(padded(len(payload)), np.uint8)
            buf[: len(payload)] = np.frombuffer(payload, np.uint8)
            self.broadcast(buf)

    def receive(self) -> Message:
        header = np.asarray(self.broadcast(np.zeros(3, np.int32)))
        n = int(header[0])
        payload = np.asarray(self.broadcast(np.zeros(padded(n), np.uint8))).tobytes() if n else b""
        return decode(header, payload)


class Leader:
    """Process 0's engine: `submit`, `cancel` and `step` as the engine's, each step first broadcasting what was
    submitted and cancelled since the last; `heartbeat` while idle, `close` when done."""

    def __init__(self, engine, channel: Channel):
        self.engine, self.channel = engine, channel
        self.pending: list[tuple] = []

    def submit(self, request) -> int:
        if request.args is None:
            raise ValueError("a multi-host run rebuilds each request on every process from LLM.request's arguments; "
                             "make requests with LLM.request")
        rid = self.engine.submit(request)  # a refused one raises here and is never sent
        self.pending.append(("submit", request.id, request.args))
        return rid

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)
        self.pending.append(("cancel", request_id))

    def _send(self, step: bool = False, stop: bool = False) -> None:
        ops, self.pending = self.pending, []
        self.channel.send(Message(ops, step=step, stop=stop, state=fingerprint(self.engine)))

    def step(self) -> None:
        self._send(step=True)
        self.engine.step()

    def heartbeat(self) -> None:
        """An idle turn: followers apply what was submitted and cancelled, and wait again (no step)."""
        self._send()

    def close(self) -> None:
        self._send(stop=True)

    def run(self, requests: list) -> list:
        """`Engine.run` through the broadcast."""
        ids = [self.submit(r) for r in requests]
        while any(i not in self.engine.results for i in ids):
            self.step()
        return [self.engine.results.pop(i) for i in ids]


def _drop(result) -> None:
    """A follower's on_finish: process 0 answers; results here are not kept."""


def follow(llm, channel: Channel) -> int:
    """A process other than 0: rebuild and apply process 0's submissions and cancellations, step when it steps,
    until it stops. Returns the steps run. A request the leader accepted but this process cannot rebuild or submit,
    or a scheduler whose fingerprint differs from the leader's, means the processes diverged: it raises."""
    engine, steps = llm.engine, 0
    while True:
        message = channel.receive()
        for op in message.ops:
            if op[0] == "cancel":
                engine.cancel(op[1])
                continue
            args = dict(op[2])
            request = llm.request(args.pop("prompt"), **args)
            request.id, request.on_finish = op[1], _drop
            engine.submit(request)
        if message.stop:
            return steps
        if fingerprint(engine) != message.state:
            raise Diverged(f"this process's engine differs from process 0's before step {steps + 1} (its live lanes, "
                           f"their outputs or its queue); every process must run the same model and engine options")
        if message.step:
            engine.step()
            steps += 1
