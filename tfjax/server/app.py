"""The OpenAI-compatible ASGI app over one engine (starlette); `scripts/serve.py` runs it on uvicorn.

Threads: one engine thread (`Worker`) owns the engine and is the only caller of `submit`, `cancel`
and `step`, so async handlers never wait on the engine's lock during a round. Handlers hand requests
and cancellations to the worker's inbox; the engine's `on_tokens` / `on_finish` callbacks come back
to the event loop through `call_soon_threadsafe`. A client that disconnects is cancelled before the
next round, so its lane is free for the next request at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tfjax.engine import ContextLengthExceeded, Request, Result
from tfjax.server import protocol
from tfjax.server.protocol import ApiError

log = logging.getLogger(__name__)


class Worker:
    """The engine thread: takes submissions and cancellations from an inbox, steps while there is work."""

    def __init__(self, engine):
        self.engine = engine
        self.cv = threading.Condition()
        self.inbox: collections.deque[Request] = collections.deque()
        self.cancels: collections.deque[tuple[int, int]] = collections.deque()  # (request id, round asked)
        self.cancel_log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=64)  # + round freed
        self.paused = False
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="tfjax-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def queued(self) -> int:
        """Requests without a lane yet (in the inbox or the scheduler's queue)."""
        return len(self.inbox) + len(self.engine.scheduler.waiting)

    def free_lanes(self) -> int:
        """Lanes running no request."""
        return self.engine.lanes.capacity - len(self.engine.scheduler.running)

    def backlog(self) -> int:
        """Requests that the next round cannot give a lane: those without one beyond the free lanes."""
        return max(0, self.queued() - self.free_lanes())

    def submit(self, request: Request) -> None:
        with self.cv:
            self.inbox.append(request)
            self.cv.notify()

    def cancel(self, request_id: int) -> None:
        with self.cv:
            self.cancels.append((request_id, self.engine.rounds))
            self.cv.notify()

    def pause(self) -> None:
        """Stop stepping after the current round (requests queue up); for tests and maintenance."""
        with self.cv:
            self.paused = True

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify()

    def _idle(self) -> bool:
        return self.paused or not (self.inbox or self.cancels or self.engine.busy)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and self._idle():
                    self.cv.wait()
                if self.stopping:
                    return
                inbox, cancels = list(self.inbox), list(self.cancels)
                self.inbox.clear()
                self.cancels.clear()
            for req in inbox:
                try:
                    self.engine.submit(req)
                except Exception as e:  # checked before, so only a bug lands here; end the request, not the loop
                    log.exception("submit failed")
                    if req.on_finish is not None:
                        req.on_finish(Result(req.id, len(req.prompt), [], "error", 0, 0, repr(e)))
            for request_id, asked in cancels:
                self.engine.cancel(request_id)
                self.cancel_log.append((request_id, asked, self.engine.rounds))
            try:
                self.engine.step()
            except Exception:  # the engine ends failing requests itself; this is the last guard of the thread
                log.exception("engine step failed")
                time.sleep(0.1)


class Stream:
    """One request's way back to the event loop, and its text: deltas whose concatenation is the reply.

    With stop strings, text that could still become a stop string is held back, and only whole tokens'
    text goes out, so what was sent is always a prefix of the final (stop-cut) reply.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stops: tuple[str, ...]):
        self.loop, self.tokenizer, self.stops = loop, tokenizer, stops
        self.events: asyncio.Queue = asyncio.Queue()
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
        self.text = ""
        self.bounds = [0]  # text length after each token
        self.sent = 0
        self.first_token_at: float | None = None

    # Engine thread.
    def on_tokens(self, tokens: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("tokens", list(tokens)))

    def on_finish(self, result: Result) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("done", result))

    # Event loop.
    def delta(self, tokens: list[int]) -> str:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for t in tokens:
            self.text += self.decoder.push(t)
            self.bounds.append(len(self.text))
        safe = len(self.text)
        if self.stops:
            safe = min([self.text.find(s) for s in self.stops if s in self.text] or [safe])
            safe = min(safe, len(self.text) - self._stop_prefix())
            safe = max(b for b in self.bounds if b <= safe)  # whole tokens only
        piece, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return piece

    def _stop_prefix(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def final(self, result: Result) -> tuple[str, str]:
        """(whole reply text, the part not sent yet)."""
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if not text.startswith(self.text[: self.sent]):
            log.warning("request %d: streamed text is not a prefix of the reply", result.request_id)
        return text, text[self.sent :]


class Metrics:
    """Counters and gauges for /metrics (Prometheus text format)."""

    def __init__(self):
        self.requests = collections.Counter()  # by outcome
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.lane_rounds = 0
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def record(self, result: Result | None, outcome: str) -> None:
        self.requests[outcome] += 1
        if result is not None:
            self.prompt_tokens += result.prompt_tokens
            self.generation_tokens += len(result.token_ids)
            self.lane_rounds += result.rounds

    def render(self, server: Server) -> str:
        engine = server.engine
        lines = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            lines.append(f"# HELP tfjax_{name} {help}")
            lines.append(f"# TYPE tfjax_{name} {kind}")
            for labels, value in samples:
                lines.append(f"tfjax_{name}{labels} {value}")

        metric("requests_total", "counter", "Completion requests by outcome.",
               [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())] or [('{outcome="ok"}', 0)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Generated tokens of finished requests.",
               [("", self.generation_tokens)])
        metric("lane_rounds_total", "counter", "Rounds summed over finished requests' lanes.", [("", self.lane_rounds)])
        metric("rounds_total", "counter", "Engine rounds run.", [("", engine.rounds)])
        metric("tokens_per_round", "gauge", "Generated tokens per lane round over finished requests.",
               [("", round(self.generation_tokens / max(self.lane_rounds, 1), 4))])
        metric("time_to_first_token_seconds_sum", "counter", "Sum of times to first token.", [("", self.ttft_sum)])
        metric("time_to_first_token_seconds_count", "counter", "Requests timed to first token.",
               [("", self.ttft_count)])
        metric("queue_depth", "gauge", "Requests waiting for a lane.", [("", server.worker.queued())])
        metric("lanes_busy", "gauge", "Lanes running a request.", [("", len(engine.scheduler.running))])
        metric("lanes_total", "gauge", "Lanes in the engine.", [("", engine.lanes.capacity)])
        return "\n".join(lines) + "\n"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """The app's state: the loaded model, the engine thread, the metrics, and the request handlers."""

    def __init__(self, llm, *, name: str, queue: int = 64, max_tokens: int = 256, drafts: bool = True,
                 retry_after: int = 1):
        self.llm, self.engine, self.name = llm, llm.engine, name
        self.queue_limit, self.max_tokens, self.drafts, self.retry_after = queue, max_tokens, drafts, retry_after
        self.worker = Worker(self.engine)
        self.metrics = Metrics()
        self.created = protocol.now()

    # --- building a request -------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        try:
            return self.llm.encode(prompt)
        except Exception as e:  # a chat template that refuses these messages
            raise ApiError(400, f"cannot render the prompt: {e}", "invalid_value", "messages") from None

    def _request(self, params: protocol.Params, stream: Stream) -> Request:
        ids = self._encode(params.prompt)
        if any(not 0 <= t < self.llm.tokenizer.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {self.llm.tokenizer.vocab_size})", "invalid_value",
                           "prompt")
        lanes = self.engine.lanes
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(min(self.max_tokens, lanes.context - len(ids) - lanes.width), 1)
        if any(not 0 <= t < self.engine.runner.vocab for t in params.sampling.get("logit_bias", {})):
            raise ApiError(400, f"logit_bias token ids must be in [0, {self.engine.runner.vocab})", "invalid_value",
                           "logit_bias")
        try:  # response_format compiles here: a schema the grammar library refuses is a 400
            req = self.llm.request(ids, max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                                   top_p=params.top_p, min_p=params.min_p, seed=params.seed, stop=list(params.stop),
                                   draft=params.draft and self.drafts, ignore_eos=params.ignore_eos,
                                   on_tokens=stream.on_tokens, **params.sampling)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_value", "response_format") from None
        req.on_finish = stream.on_finish
        try:
            self.engine.scheduler.check(req)
        except ContextLengthExceeded as e:
            raise ApiError(400, str(e), e.code, "messages" if params.chat else "prompt") from None
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_value", "messages" if params.chat else "prompt") from None
        return req

    # --- handlers --------------------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=False)

    async def chat_completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=True)

    async def _complete(self, http: HttpRequest, chat: bool) -> Response:
        stream = Stream(asyncio.get_running_loop(), self.llm.tokenizer, ())
        try:
            params = protocol.parse_completion(protocol.load_json(await http.body()), chat)
            stream.stops = params.stop
            req = self._request(params, stream)
            if not self.worker.alive:
                raise ApiError(503, "the engine thread is not running", "engine_unavailable", type="server_error")
            if self.worker.backlog() >= self.queue_limit:
                raise ApiError(429, f"the queue is full ({self.queue_limit} requests wait for a lane); retry later",
                               "queue_full", type="rate_limit_error", headers={"Retry-After": str(self.retry_after)})
        except ApiError as e:
            self.metrics.requests[f"rejected_{e.code}"] += 1
            return _error(e)
        started = time.perf_counter()
        self.worker.submit(req)
        watcher = asyncio.create_task(self._watch_disconnect(http, req.id))
        rid, created, draft = protocol.completion_id(chat, req.id), protocol.now(), req.draft
        model = params.model or self.name
        if params.stream:
            return StreamingResponse(self._sse(params, req, stream, watcher, rid, created, model, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while True:
                kind, value = await stream.events.get()
                if kind == "done":
                    break
                stream.delta(value)
        finally:
            watcher.cancel()
        result: Result = value
        self._record(result, stream, started)
        if result.finish_reason == "error":
            return JSONResponse(protocol.error_body(f"generation failed: {result.error}", "server_error",
                                                    "generation_failed"), status_code=500)
        text, _ = stream.final(result)
        body = protocol.reply(params, rid, model, created, text, result, draft)
        body["choices"][0]["logprobs"] = protocol.logprobs_body(chat, self.llm.tokenizer, result)
        return JSONResponse(body)

    def _record(self, result: Result, stream: Stream, started: float) -> None:
        outcome = {"stop": "ok", "length": "ok"}.get(result.finish_reason, result.finish_reason)
        self.metrics.record(result, outcome)
        if stream.first_token_at is not None:
            self.metrics.ttft_sum += stream.first_token_at - started
            self.metrics.ttft_count += 1

    async def _watch_disconnect(self, http: HttpRequest, request_id: int) -> None:
        """Cancel the request as soon as its client goes away (the body was read, so only disconnects arrive)."""
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                self.worker.cancel(request_id)
                return

    async def _sse(self, params, req: Request, stream: Stream, watcher: asyncio.Task, rid: str, created: int,
                   model: str, started: float):
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        done = False
        try:
            yield event(protocol.chunk(params, rid, model, created, role=True))
            while True:
                kind, value = await stream.events.get()
                if kind == "done":
                    break
                if piece := stream.delta(value):
                    yield event(protocol.chunk(params, rid, model, created, text=piece))
            result: Result = value
            done = True
            self._record(result, stream, started)
            if result.finish_reason == "error":
                yield event(protocol.error_body(f"generation failed: {result.error}", "server_error",
                                                "generation_failed"))
            else:
                _, tail = stream.final(result)
                if tail:
                    yield event(protocol.chunk(params, rid, model, created, text=tail))
                end = protocol.chunk(params, rid, model, created, finish_reason=result.finish_reason)
                end["choices"][0]["logprobs"] = protocol.logprobs_body(params.chat, self.llm.tokenizer, result)
                yield event(end)
                yield event(protocol.usage_chunk(params, rid, model, created, result, req.draft))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not done:  # the client went away (or the send failed): free the lane now
                self.worker.cancel(req.id)

    async def models(self, http: HttpRequest) -> Response:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "tfjax",
                "max_model_len": self.engine.lanes.context}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, http: HttpRequest) -> Response:
        lanes = self.engine.lanes
        body = {"status": "ok" if self.worker.alive else "engine_stopped", "model": self.name,
                "lanes": lanes.capacity, "width": lanes.width, "context": lanes.context,
                "drafts": self.drafts, "drafter": getattr(self.llm, "drafter_name", None),
                "queue_depth": self.worker.queued(), "lanes_busy": len(self.engine.scheduler.running)}
        return JSONResponse(body, status_code=200 if self.worker.alive else 503)

    async def metrics_text(self, http: HttpRequest) -> Response:
        return PlainTextResponse(self.metrics.render(self), media_type="text/plain; version=0.0.4")

    async def tokenize(self, http: HttpRequest) -> Response:
        try:
            body = protocol.load_json(await http.body())
            unknown = set(body) - {"model", "prompt", "messages"}
            if unknown:
                name = sorted(unknown)[0]
                raise ApiError(400, f"unrecognized request argument: '{name}'", "unknown_parameter", name)
            if "messages" in body:
                prompt = protocol.parse_completion({"messages": body["messages"]}, chat=True).prompt
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' (a string) or 'messages' is required", "invalid_type", "prompt")
            ids = self._encode(prompt)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.lanes.context})

    async def detokenize(self, http: HttpRequest) -> Response:
        try:
            body = protocol.load_json(await http.body())
            ids = body.get("tokens")
            vocab = self.llm.tokenizer.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(400, "'tokens' must be a list of token ids", "invalid_type", "tokens")
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", "invalid_value", "tokens")
        except ApiError as e:
            return _error(e)
        return JSONResponse({"prompt": self.llm.tokenizer.decode(ids)})


def create_app(llm, *, name: str = "tfjax", queue: int = 64, max_tokens: int = 256, drafts: bool = True) -> Starlette:
    """The ASGI app for a loaded `tfjax.LLM`; its engine thread runs for the app's lifespan."""
    server = Server(llm, name=name, queue=queue, max_tokens=max_tokens, drafts=drafts)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    routes = [
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app
