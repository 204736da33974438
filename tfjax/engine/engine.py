"""The engine: `step()` admits waiting requests, runs one lane round, and hands tokens to requests.

Every generated token after the first comes out of `lane_round`; the first is the prompt's own sample.
One round stays in flight: a step dispatches the next round before it reads the previous one's tokens, so
the host's work (reading tokens, stop checks, callbacks, the next dispatch) overlaps the device's. A lane
whose request ended in the round being read runs one more round whose tokens nobody reads; its pages may go
to a new request at once, but every later use of them consumes the cache that round returns, so its writes
come first in device order and never touch another request's tokens.
A request that fails (its prefill, its callbacks, its stop check) ends alone with finish_reason "error";
lanes are independent rows of the round, so the others' tokens are untouched. A failing round fails
every live request and rebuilds the lane state, since its donated buffers may be gone.
With `prefix_cache_gb` > 0 a request resumes after its longest cached prompt prefix on the chunk grid
(`prefix_cache.py`); the pages a prefill wrote are cached only once it succeeded, and a rebuilt lane state
forgets them all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax

from tfjax import sampling
from tfjax.engine import prefix_cache
from tfjax.engine.runner import Runner, cache_bytes, default_prefill_chunk
from tfjax.engine.scheduler import LaneSlot, Request, Scheduler
from tfjax.lanes.config import LaneConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Result:
    """A finished request: its tokens, why it stopped, and round statistics."""

    request_id: int
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str
    rounds: int
    proposed: int
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)
    logprobs: list[float] | None = None  # per token, when the request asked (Request.logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), most likely first
    ttft_s: float | None = None  # seconds from submit to the first token (queueing and prefill)
    decode_s: float | None = None  # seconds from the first token to the last one's arrival on the host

    @property
    def token_sha256(self) -> str:
        return sampling.token_sha256(self.token_ids)

    @property
    def tokens_per_round(self) -> float:
        return len(self.token_ids) / max(self.rounds, 1)


class Engine:
    """Continuous batching over lanes; thread-safe `submit`/`cancel`, `step()` from one loop."""

    def __init__(self, target, lanes: LaneConfig, drafter=None, eos_ids: tuple[int, ...] = (),
                 prefix_cache_gb: float = 0.0, **runner_kw):
        self.lanes = lanes
        chunk = runner_kw["prefill_chunk"] = runner_kw.get("prefill_chunk") or default_prefill_chunk()
        page_b, snap_b = cache_bytes((target, drafter), lanes.page_size)
        every = prefix_cache.snapshot_interval(chunk)
        extra, slots = prefix_cache.budget(prefix_cache_gb, page_b, snap_b, max(every // lanes.page_size, 1),
                                           lanes.capacity * lanes.pages_per_lane)
        self.runner = Runner(target, lanes, drafter=drafter, extra_pages=extra, snapshot_slots=slots, **runner_kw)
        self.prefix = prefix_cache.PrefixCache(self.runner.pages, lanes.page_size, chunk, slots, hybrid=snap_b > 0,
                                               enabled=prefix_cache_gb > 0, snapshot_every=every,
                                               grain=self.runner.grain)
        self.scheduler = Scheduler(lanes.capacity, lanes.context, lanes.width, lanes.page_size, self.runner.pages,
                                   self.prefix)
        self.eos_ids = tuple(eos_ids)
        self.results: dict[int, Result] = {}
        self.lock = threading.Lock()
        self.rounds = 0
        self._inflight = None  # (RoundOut, {lane: request id}) of the round dispatched but not yet read

    def submit(self, request: Request) -> int:
        self._processors(request)  # bad penalties or logit_bias: a ValueError for the caller, not a failed lane
        request.submitted_at = time.perf_counter()
        with self.lock:
            self.scheduler.submit(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        """End a waiting or running request with finish_reason "cancelled" (a running one frees its lane now)."""
        with self.lock:
            req = self.scheduler.drop_waiting(request_id)
            if req is not None:
                self._complete(req, Result(req.id, len(req.prompt), [], "cancelled", 0, 0))
                return
            lane = self.scheduler.cancel(request_id)
            if lane is not None:
                self._finish(lane)

    @property
    def prefix_stats(self) -> prefix_cache.Stats:
        """Prefix cache counters: lookups, hits, cached and prompt tokens, evicted pages."""
        return self.prefix.stats

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight is not None)

    def _sampling(self, req: Request) -> sampling.SamplingParams:
        seed = sampling.default_seed(req.prompt) if req.seed is None else req.seed
        return sampling.SamplingParams.create(1, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                              min_p=req.min_p, seed=seed)

    def _processors(self, req: Request) -> sampling.Processors:
        if not 0 <= req.top_logprobs <= sampling.TOP_LOGPROBS:
            raise ValueError(f"top_logprobs {req.top_logprobs} must be in [0, {sampling.TOP_LOGPROBS}]")
        return sampling.Processors.for_request(
            self.runner.vocab, req.prompt, req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
            req.logit_bias, logprobs=req.logprobs or req.top_logprobs > 0)

    @staticmethod
    def _wants_logprobs(req: Request) -> bool:
        return req.logprobs or req.top_logprobs > 0

    def _add_logprobs(self, slot: LaneSlot, logprob, top_ids, top_lp, n: int) -> None:
        """Append a lane's first `n` row logprobs, then keep one per output token (stops cut tokens)."""
        k = slot.request.top_logprobs
        slot.logprobs.extend(float(x) for x in logprob[:n])
        slot.top_logprobs.extend([(int(i), float(v)) for i, v in zip(ids[:k], vals[:k], strict=True)]
                                 for ids, vals in zip(top_ids[:n], top_lp[:n], strict=True))
        del slot.logprobs[len(slot.output):], slot.top_logprobs[len(slot.output):]

    def _deliver(self, slot: LaneSlot, tokens: list[int]) -> None:
        """Hand a request its newly kept tokens (the tail of its output), their logprobs first when asked."""
        req = slot.request
        if tokens and req.on_logprobs is not None and self._wants_logprobs(req):
            req.on_logprobs(slot.logprobs[-len(tokens):], slot.top_logprobs[-len(tokens):])
        if tokens and req.on_tokens is not None:
            req.on_tokens(tokens)

    def _complete(self, req: Request, result: Result) -> None:
        """Hand a Result to its request's `on_finish`, or keep it in `results` for `run`."""
        if req.on_finish is None:
            self.results[req.id] = result
            return
        try:
            req.on_finish(result)
        except Exception:
            log.exception("on_finish of request %d failed", req.id)

    def _finish(self, lane: int, release: bool = True) -> None:
        slot = self.scheduler.finish(lane)
        if release:
            self.runner.release(lane)
        wants = self._wants_logprobs(slot.request)
        first, submitted = slot.first_token_at, slot.request.submitted_at
        self._complete(slot.request, Result(slot.request.id, len(slot.request.prompt), slot.output,
                                            slot.finish_reason or "stop", slot.rounds, slot.proposed, slot.error,
                                            cached_tokens=slot.plan.resume, logprobs=slot.logprobs if wants else None,
                                            top_logprobs=slot.top_logprobs if wants else None,
                                            ttft_s=None if first is None or submitted is None else first - submitted,
                                            decode_s=None if first is None else time.perf_counter() - first))

    def _fail(self, lane: int, error: Exception) -> None:
        """End one lane's request with finish_reason "error"; the other lanes go on."""
        log.error("request in lane %d failed: %r", lane, error, exc_info=error)  # the operator's traceback
        slot = self.scheduler.running[lane]
        slot.finish_reason, slot.error = "error", f"{type(error).__name__}: {error}"
        try:
            self.runner.release(lane)
        except Exception:  # the device state itself is gone (donated into a failed call)
            self._reset(error)
            return
        self._finish(lane, release=False)

    def _reset(self, error: Exception) -> None:
        """Rebuild the lane state after a failed device call; every live request ends with an error."""
        log.error("lane state rebuilt after %r", error)
        self._inflight = None  # computed from the lost state
        self.runner.reset()
        for lane in list(self.scheduler.running):
            slot = self.scheduler.running[lane]
            slot.finish_reason, slot.error = "error", f"{type(error).__name__}: {error}"
            self._finish(lane, release=False)
        self.prefix.clear()  # the rebuilt caches hold none of the cached pages

    def _admit(self, req: Request, lane: int, plan: prefix_cache.Plan) -> None:
        first = self.runner.prefill(lane, req.prompt, self._sampling(req), req.draft, plan.pages, plan.resume,
                                    plan.restore, plan.saves, proc=self._processors(req), token_grammar=req.grammar,
                                    max_tokens=req.max_tokens)
        self.prefix.commit(req.prompt, plan)
        slot = self.scheduler.running[lane]
        slot.first_token_at = time.perf_counter()
        kept = self.scheduler.take(lane, [first], self.eos_ids)
        if self._wants_logprobs(req):
            lp = jax.device_get(self.runner.first_logprobs)
            self._add_logprobs(slot, lp.logprob[0], lp.top_ids[0], lp.top_logprobs[0], 1)
        slot.rounds -= 1  # the prompt's token is not a round
        self._deliver(slot, kept)

    def step(self) -> None:
        """Admit what fits, then one call of rounds for all live lanes (and read the call before it)."""
        with self.lock:
            for req, lane, plan in self.scheduler.admissible():
                slot = self.scheduler.running.get(lane)
                if slot is None or slot.request is not req:  # ended by a reset after an earlier failure
                    continue
                try:
                    self._admit(req, lane, plan)
                except Exception as e:
                    self._fail(lane, e)
                    continue
                if self.scheduler.running[lane].finish_reason:
                    self._finish(lane)
            live = {lane: slot.request.id for lane, slot in self.scheduler.running.items()}
            dispatched = None
            if any(self._wants_another_call(lane, slot) for lane, slot in self.scheduler.running.items()):
                try:
                    dispatched = (self.runner.dispatch(), live)
                except Exception as e:
                    self._reset(e)
                    return
            previous, self._inflight = self._inflight, dispatched
            if previous is not None:
                self._read(*previous)

    def _wants_another_call(self, lane: int, slot) -> bool:
        """Whether a live lane may want tokens beyond those the call in flight gives it at the least: each of a call's
        rounds commits a token or more to every lane that still wants some, so a lane whose budget the call in flight
        fills needs no other (and a reply's end no longer costs a call of rounds that nobody reads)."""
        inflight = self._inflight is not None and self._inflight[1].get(lane) == slot.request.id
        return len(slot.output) + (self.lanes.rounds if inflight else 0) < slot.request.max_tokens

    def _read(self, out, live: dict[int, int]) -> None:
        """Hand a dispatched call's tokens, round by round, to the requests that were live in it and still are."""
        try:
            tokens, count, proposed = self.runner.collect(out)
        except Exception as e:  # the call failed on the device
            self._reset(e)
            return
        lps = None  # None also from a call dispatched before any live lane wanted them
        if any(self._wants_logprobs(s.request) for s in self.scheduler.running.values()):
            lps = self.runner.collect_logprobs(out)
        for k in range(tokens.shape[0]):
            self.rounds += bool(count[k].any())  # a call's rounds after every lane had its tokens did not run
            for lane, request_id in live.items():
                slot = self.scheduler.running.get(lane)
                if slot is None or slot.request.id != request_id:  # ended (or replaced) since the dispatch
                    continue
                n = int(count[k, lane])
                try:
                    kept = self.scheduler.take(lane, [int(t) for t in tokens[k, lane, :n]], self.eos_ids,
                                               int(proposed[k, lane]))
                    if lps is not None and self._wants_logprobs(slot.request):
                        self._add_logprobs(slot, lps[0][k, lane], lps[1][k, lane], lps[2][k, lane], n)
                    self._deliver(slot, kept)
                except Exception as e:
                    self._fail(lane, e)
                    continue
                if slot.finish_reason:
                    self._finish(lane)

    def run(self, requests: list[Request]) -> list[Result]:
        """Submit requests and step until all of them are done (the synchronous API)."""
        ids = [self.submit(r) for r in requests]
        while any(i not in self.results for i in ids):
            self.step()
        return [self.results.pop(i) for i in ids]
