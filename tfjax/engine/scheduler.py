"""The scheduler: plain Python, no jax. It admits requests into free lanes with KV pages from one pool (through
the prefix cache, which hands out cached prompt prefixes first), tracks each lane's output, and decides when a
lane stops (EOS, stop strings, max tokens)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from tfjax.engine.prefix_cache import Plan, PrefixCache


class ContextLengthExceeded(ValueError):
    """A prompt (plus the tokens it asks for) that does not fit a lane's context."""

    code = "context_length_exceeded"


@dataclasses.dataclass
class Request:
    """One generation request, as the engine sees it (token ids in, tokens out)."""

    prompt: list[int]
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: logits of prompt and output tokens divided (>0) or multiplied
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    logprobs: bool = False  # each token's log-probability (the model's log-softmax) in the Result
    top_logprobs: int = 0  # that many most likely alternatives per token (<= sampling.TOP_LOGPROBS)
    grammar: Any = None  # a compiled tfjax.grammar.TokenGrammar the output must follow (response_format)
    draft: bool = True
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_check: Callable[[list[int]], int | None] | None = None  # index to cut at, or None
    on_tokens: Callable[[list[int]], None] | None = None
    # called just before on_tokens (same thread) with those tokens' logprobs and top alternatives, when asked
    on_logprobs: Callable[[list[float], list[list[tuple[int, float]]]], None] | None = None
    on_finish: Callable[[Any], None] | None = None  # gets the Result (then it is not kept in engine.results)
    args: dict | None = None  # the LLM.request arguments it was made from: other processes rebuild it (lockstep)
    submitted_at: float | None = None  # time.perf_counter() when the engine took it (Engine.submit)
    id: int = dataclasses.field(default_factory=itertools.count().__next__)


@dataclasses.dataclass
class LaneSlot:
    """A live request in a lane: its output so far, pages, and round statistics."""

    request: Request
    lane: int
    plan: Plan
    output: list[int] = dataclasses.field(default_factory=list)
    rounds: int = 0
    proposed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)  # per output token, when asked
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None  # time.perf_counter() when its first token (the prompt's sample) was known


class Scheduler:
    """Admission and stopping; the runner does the device work."""

    def __init__(self, lanes: int, context: int, width: int, page_size: int, pages: int,
                 prefix: PrefixCache | None = None):
        self.lanes, self.context, self.width, self.page_size = lanes, context, width, page_size
        self.free_lanes = list(range(lanes))
        self.prefix = prefix or PrefixCache(pages, page_size, page_size, enabled=False)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, LaneSlot] = {}

    def pages_for(self, request: Request) -> int:
        return -(-(len(request.prompt) + request.max_tokens + self.width) // self.page_size)

    def check(self, request: Request) -> None:
        """Raise ContextLengthExceeded for a request no lane can hold."""
        need = len(request.prompt) + request.max_tokens + self.width
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if need > self.context:
            raise ContextLengthExceeded(
                f"prompt of {len(request.prompt)} tokens + max_tokens {request.max_tokens} (+{self.width} for a "
                f"round) exceeds the context of {self.context} tokens")

    def submit(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def admissible(self) -> list[tuple[Request, int, Plan]]:
        """Waiting requests that now get a lane and their pages (FIFO; stops at the first that can't)."""
        out = []
        while self.waiting and self.free_lanes:
            req = self.waiting[0]
            plan = self.prefix.allocate(req.prompt, self.pages_for(req))
            if plan is None:
                break
            self.waiting.popleft()
            lane = self.free_lanes.pop(0)
            self.running[lane] = LaneSlot(req, lane, plan)
            out.append((req, lane, plan))
        return out

    def take(self, lane: int, tokens: list[int], eos_ids: tuple[int, ...], proposed: int = 0) -> list[int]:
        """Append a lane's committed tokens, cutting at a stop; returns the tokens kept this time."""
        slot = self.running[lane]
        slot.rounds += 1
        slot.proposed += proposed
        req = slot.request
        kept = []
        stops = set(req.stop_ids) | (set() if req.ignore_eos else set(eos_ids))
        for t in tokens:
            kept.append(t)
            if t in stops:
                slot.finish_reason = "stop"
                break
            if len(slot.output) + len(kept) >= req.max_tokens:
                slot.finish_reason = "length"
                break
        slot.output.extend(kept)
        if req.stop_check is not None and slot.finish_reason != "stop":
            cut = req.stop_check(slot.output)
            if cut is not None:
                removed = len(slot.output) - cut
                del slot.output[cut:]
                kept = kept[: max(len(kept) - removed, 0)]
                slot.finish_reason = "stop"
        return kept

    def finish(self, lane: int) -> LaneSlot:
        slot = self.running.pop(lane)
        self.free_lanes.append(lane)
        self.free_lanes.sort()
        self.prefix.release(slot.plan)
        return slot

    def drop_waiting(self, request_id: int) -> Request | None:
        """Remove and return a request that has not got a lane yet."""
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return r
        return None

    def cancel(self, request_id: int) -> int | None:
        """The lane of a running request, marked cancelled (the engine frees it), or None."""
        for lane, slot in self.running.items():
            if slot.request.id == request_id:
                slot.finish_reason = "cancelled"
                return lane
        return None
