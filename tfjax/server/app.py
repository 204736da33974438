"""The OpenAI-compatible ASGI app over one engine (starlette); `scripts/serve.py` runs it on uvicorn.

Threads: one engine thread (`Worker`) owns the engine and is the only caller of `submit`, `cancel`
and `step`, so async handlers never wait on the engine's lock during a round. Handlers hand requests
and cancellations to the worker's inbox; the engine's `on_tokens` / `on_finish` callbacks come back
to the event loop through `call_soon_threadsafe`. A client that disconnects is cancelled before the
next round, so its lane is free for the next request at once. In a multi-host run process 0's worker drives the
engine through a `lockstep.Leader`, which broadcasts each step's submissions and cancellations to the other processes
(`tfjax/engine/lockstep.py`); an idle one sends a heartbeat every `lockstep.HEARTBEAT_S`.

The event loop never does work that grows with the request: bodies are bounded (`max_body_mb`, 413), large
bodies are parsed, and every prompt rendered, length-checked and tokenized, in starlette's threadpool, so
`/health` answers while a large request is refused or admitted. One error path: a refusal is an `ApiError`
(a 4xx OpenAI-style JSON body), anything else is a logged 500 JSON body naming a request id, sent with
`Connection: close`; a stream that fails after its headers ends with an error event and `[DONE]`.

Early length check: with no normalizer and no added token that strips whitespace, the tokens of a text
partition its UTF-8 bytes, and no token covers more bytes than the longest token's text, so
`ceil(bytes / max_token_bytes)` is a lower bound on the token count; a prompt whose bound already exceeds
the context is refused before tokenizing. Tokenizers with a normalizer (which may shrink the text) skip it.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tfjax.engine import ContextLengthExceeded, Request, Result, lockstep
from tfjax.server import protocol
from tfjax.server import tools as tooling
from tfjax.server.errors import ApiError, error_body
from tfjax.server.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)
MAX_BODY_MB = 16.0
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")  # the requests /metrics counts by outcome
PARSE_INLINE_BYTES = 1 << 16  # bodies up to this many bytes are parsed on the event loop (a thread hop costs more)


class Worker:
    """The engine thread: takes submissions and cancellations from an inbox, steps while there is work."""

    def __init__(self, engine, lockstep=None):
        self.engine = engine
        self.lockstep = lockstep  # a multi-host run's `lockstep.Leader`: every submit, cancel and step goes through it
        self.driver = lockstep or engine
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
                    if self.lockstep is None:
                        self.cv.wait()
                    elif not self.cv.wait(lockstep.HEARTBEAT_S):
                        break  # idle a while: the other processes hear from us (below)
                if self.stopping:
                    if self.lockstep is not None:
                        self.lockstep.close()
                    return
                idle = self.lockstep is not None and self._idle()
                if not idle:
                    inbox, cancels = list(self.inbox), list(self.cancels)
                    self.inbox.clear()
                    self.cancels.clear()
            if idle:
                self.lockstep.heartbeat()
                continue
            for req in inbox:
                try:
                    self.driver.submit(req)
                except Exception as e:  # checked before, so only a bug lands here; end the request, not the loop
                    log.exception("submit failed")
                    if req.on_finish is not None:
                        req.on_finish(Result(req.id, len(req.prompt), [], "error", 0, 0, repr(e)))
            for request_id, asked in cancels:
                self.driver.cancel(request_id)
                self.cancel_log.append((request_id, asked, self.engine.rounds))
            try:
                self.driver.step()
            except Exception:  # the engine ends failing requests itself; this is the last guard of the thread
                log.exception("engine step failed")
                time.sleep(0.1)


class Stream:
    """One request's way back to the event loop, and its text: deltas whose concatenation is the reply.

    With stop strings, text that could still become a stop string is held back, and only whole tokens'
    text goes out, so what was sent is always a prefix of the final (stop-cut) reply.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stops: tuple[str, ...],
                 events: asyncio.Queue | None = None, index: int = 0):
        self.loop, self.tokenizer, self.stops = loop, tokenizer, stops
        self.events: asyncio.Queue = events if events is not None else asyncio.Queue()  # (index, kind, value)
        self.index = index  # the choice this request answers (n > 1 requests share one queue)
        self.last_at: float | None = None
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=True)
        self.text = ""
        self.bounds = [0]  # text length after each token
        self.sent = 0
        self.first_token_at: float | None = None
        self.logprobs: list[tuple[int, float, list]] = []  # (token, logprob, top) of every token, when asked
        self.lp_sent = 0  # tokens whose logprobs went out
        self.lp_offset = 0  # completions: the text_offset of the next token's logprobs
        self._pending_lp: tuple[list, list] | None = None  # engine thread: the logprobs of the coming tokens

    # Engine thread: on_logprobs comes right before the on_tokens of the same tokens.
    def on_logprobs(self, logprobs: list[float], tops: list[list[tuple[int, float]]]) -> None:
        self._pending_lp = (list(logprobs), [list(t) for t in tops])

    def on_tokens(self, tokens: list[int]) -> None:
        lp, self._pending_lp = self._pending_lp, None
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, "tokens", (list(tokens), lp)))

    def on_finish(self, result: Result) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, "done", result))

    # Event loop.
    def delta(self, tokens: list[int], lp: tuple[list, list] | None = None) -> str:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if lp is not None:
            self.logprobs.extend(zip(tokens, *lp, strict=True))
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

    def logprobs_delta(self, chat: bool) -> dict | None:
        """The logprobs of the tokens whose text went out and whose logprobs did not yet (None: no such tokens)."""
        released = min(bisect.bisect_right(self.bounds, self.sent) - 1, len(self.logprobs))
        if released <= self.lp_sent:
            return None
        ids, lps, tops = zip(*self.logprobs[self.lp_sent : released], strict=True)
        body = protocol.logprobs_of(chat, self.tokenizer, ids, lps, tops, self.lp_offset)
        self.lp_offset += sum(len(protocol.token_text(self.tokenizer, t)) for t in ids)
        self.lp_sent = released
        return body

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


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes one token covers, or None where that bounds nothing (see the module docstring)."""
    backend = tokenizer.backend
    if backend.normalizer is not None:
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    most = max((len(t.content.encode()) for t in added), default=1)
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        # Byte-level pieces have one symbol per byte; a Metaspace piece covers its decoded text plus at most the
        # one leading space its decoder strips; a byte-fallback piece (<0x41>) covers one byte.
        piece = backend.id_to_token(i) or ""
        most = max(most, len(piece), len(backend.decode([i], skip_special_tokens=False).encode()) + 1)
    return most


class Server:
    """The app's state: the loaded model, the engine thread, the metrics, and the request handlers."""

    def __init__(self, llm, *, name: str, queue: int = 64, max_tokens: int = 256, drafts: bool = True,
                 retry_after: int = 1, max_body_mb: float = MAX_BODY_MB, served_model_names: Sequence[str] = (),
                 lockstep: lockstep.Leader | None = None):
        self.llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self.names = tuple(served_model_names) or (name,)
        self.name = self.names[0]
        self.queue_limit, self.max_tokens, self.drafts, self.retry_after = queue, max_tokens, drafts, retry_after
        self.max_body = int(max_body_mb * 2**20)
        self.worker = Worker(self.engine, lockstep)
        self.metrics = Metrics(self)
        self.created = protocol.now()
        self.template_knows_tools = "tools" in (getattr(self.tokenizer, "chat_template", None) or "")
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        # OpenAI's temperature 1 where a request is silent, unless the checkpoint's generation_config.json names one
        self.default_temperature = getattr(llm, "generation_defaults", {}).get("temperature", 1.0)

    # --- reading a request (4xx ApiErrors) -----------------------------------------------------------
    async def _json(self, http: HttpRequest) -> dict:
        """The body as a JSON object: 413 past max_body_mb (before reading it, when Content-Length says so)."""
        too_big = ApiError(413, f"the request body exceeds the server's limit of {self.max_body} bytes "
                           "(--max-body-mb); send a shorter prompt", "request_too_large",
                           headers={"Connection": "close"})
        length = http.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise too_big
        chunks, size = [], 0
        async for part in http.stream():
            size += len(part)
            if size > self.max_body:
                raise too_big
            chunks.append(part)
        raw = b"".join(chunks)
        if len(raw) <= PARSE_INLINE_BYTES:
            return protocol.load_json(raw)
        return await run_in_threadpool(protocol.load_json, raw)

    def _model(self, model: str | None) -> str:
        """The model name the reply echoes: the request's when served, else 404 model_not_found."""
        if model is None:
            return self.name
        if model not in self.names:
            shown = model if len(model) <= 100 else model[:97] + "..."
            raise ApiError(404, f"The model '{shown}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.names)}", "model_not_found", "model")
        return model

    # --- building requests (threadpool) ---------------------------------------------------------------
    def _render(self, params: protocol.Params) -> str | list[int]:
        """The prompt text (chat messages through the chat template, with tools), or token ids as given."""
        if not params.chat:
            return params.prompt
        try:
            messages, tools = tooling.render_args(params.prompt, params.tools, params.tool_choice,
                                                  self.template_knows_tools)
            return self.tokenizer.apply_chat_template(messages, tools=tools, **params.template_kwargs)
        except Exception as e:  # a template that refuses these messages or kwargs; values nested too deep
            raise ApiError(400, f"cannot render the prompt with the chat template: {e}", "invalid_value",
                           "messages") from None

    def _ids(self, prompt: str | list[int], reserve: int, field: str) -> list[int]:
        """Token ids of the rendered prompt; 400 early when even its lower bound cannot fit with `reserve`."""
        if isinstance(prompt, list):
            return list(prompt)
        if self.max_token_bytes is not None:
            size = len(prompt.encode())
            least = -(-size // self.max_token_bytes)
            if least + reserve > self.engine.lanes.context:
                raise ApiError(400, f"the prompt has at least {least} tokens ({size} UTF-8 bytes, at most "
                               f"{self.max_token_bytes} a token), more than the context of "
                               f"{self.engine.lanes.context} tokens allows; shorten it", "context_length_exceeded",
                               field)
        # a raw prompt gets the BOS the tokenizer adds; a chat template writes its own
        return self.tokenizer.encode(prompt) if field == "messages" else self.tokenizer.encode_prompt(prompt)

    def _build(self, params: protocol.Params, streams: list[Stream]) -> list[Request]:
        """One engine request per choice; choice i samples with seed + i, so greedy choices are equal."""
        field = "messages" if params.chat else "prompt"
        lanes = self.engine.lanes
        ids = self._ids(self._render(params), (params.max_tokens or 1) + lanes.width, field)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "invalid_value", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(min(self.max_tokens, lanes.context - len(ids) - lanes.width), 1)
        if any(not 0 <= t < self.engine.runner.vocab for t in params.sampling.get("logit_bias", {})):
            raise ApiError(400, f"logit_bias token ids must be in [0, {self.engine.runner.vocab})", "invalid_value",
                           "logit_bias")
        regex = tooling.choice_regex(params.tools, params.tool_choice)  # tool_choice required / named
        if regex is not None and params.sampling.get("response_format", {"type": "text"}) != {"type": "text"}:
            raise ApiError(400, "'response_format' cannot be combined with 'tool_choice' = \"required\" or a named "
                           "function: the reply is then tool calls", "invalid_value", "response_format")
        reqs = []
        for stream in streams:
            seed = None if params.seed is None else (params.seed + stream.index) % 2**32
            try:  # the output format compiles here: one the grammar library refuses is a 400
                req = self.llm.request(ids, max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                                       top_p=params.top_p, min_p=params.min_p, seed=seed, stop=list(params.stop),
                                       draft=params.draft and self.drafts, ignore_eos=params.ignore_eos,
                                       on_tokens=stream.on_tokens, on_logprobs=stream.on_logprobs, regex=regex,
                                       **params.sampling)
            except ValueError as e:
                raise ApiError(400, str(e), "invalid_value", "tool_choice" if regex else "response_format") from None
            req.on_finish = stream.on_finish
            reqs.append(req)
        try:
            self.engine.scheduler.check(reqs[0])
        except ContextLengthExceeded as e:
            raise ApiError(400, str(e), e.code, field) from None
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_value", field) from None
        return reqs

    def _admit(self, n: int) -> None:
        """503 without an engine thread; 429 (Retry-After) when n more would overfill the queue."""
        if not self.worker.alive:
            raise ApiError(503, "the engine thread is not running", "engine_unavailable", type="server_error")
        if n > self.engine.lanes.capacity + self.queue_limit:
            raise ApiError(400, f"'n' = {n} exceeds what this server holds at once "
                           f"({self.engine.lanes.capacity} lanes + a queue of {self.queue_limit})", "invalid_value", "n")
        if max(0, self.worker.queued() + n - self.worker.free_lanes()) > self.queue_limit:
            raise ApiError(429, f"the queue is full ({self.queue_limit} requests wait for a lane); retry later",
                           "queue_full", type="rate_limit_error", headers={"Retry-After": str(self.retry_after)})

    # --- handlers --------------------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=False)

    async def chat_completions(self, http: HttpRequest) -> Response:
        return await self._complete(http, chat=True)

    async def _complete(self, http: HttpRequest, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        try:
            params = protocol.parse_completion(await self._json(http), chat, self.default_temperature)
            model = self._model(params.model)
            events: asyncio.Queue = asyncio.Queue()
            streams = [Stream(loop, self.tokenizer, params.stop, events, i) for i in range(params.n)]
            reqs = await run_in_threadpool(self._build, params, streams)
            self._admit(len(reqs))  # on the loop, right before submitting: no other handler runs in between
        except ApiError as e:
            self.metrics.rejected(e.code)
            return _error(e)
        started = time.perf_counter()
        for req in reqs:
            self.worker.submit(req)
        watcher = asyncio.create_task(self._watch_disconnect(http, [r.id for r in reqs]))
        rid, created = protocol.completion_id(chat, reqs[0].id), protocol.now()
        if params.stream:
            return StreamingResponse(self._sse(http, params, reqs, streams, watcher, rid, created, model, started),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results: list[Result | None] = [None] * len(reqs)
        try:
            while any(r is None for r in results):
                i, kind, value = await events.get()
                if kind == "done":
                    results[i] = value
                    self.metrics.finished(value)
                else:
                    self._delta(streams[i], value, started)
        finally:
            watcher.cancel()
            for req, result in zip(reqs, results, strict=True):
                if result is None:  # the handler itself was cancelled
                    self.worker.cancel(req.id)
                    self.metrics.requests.labels("cancelled").inc()
        if failed := [r for r in results if r.finish_reason == "error"]:
            log.error("request %s: generation failed: %s", _request_id(http), failed[0].error)
            return JSONResponse(error_body(f"generation failed (request id {_request_id(http)}): {failed[0].error}",
                                           "server_error", "generation_failed"), status_code=500)
        texts = await run_in_threadpool(lambda: [s.final(r)[0] for s, r in zip(streams, results, strict=True)])
        draft = reqs[0].draft
        choices = [protocol.choice(params, i, text, r, draft) for i, (text, r) in enumerate(zip(texts, results,
                                                                                              strict=True))]
        for c, r in zip(choices, results, strict=True):
            c["logprobs"] = protocol.logprobs_body(params.chat, self.tokenizer, r)
        return JSONResponse(protocol.reply(params, rid, model, created, choices, results, draft))

    def _delta(self, stream: Stream, value: tuple[list[int], tuple | None], started: float) -> str:
        """The text these tokens (and their logprobs) add to the choice, timing them for the TTFT and inter-token
        histograms."""
        tokens, lp = value
        now = time.perf_counter()
        if stream.last_at is None:
            self.metrics.first_token(now - started)
        else:
            self.metrics.tokens(len(tokens), now - stream.last_at)
        stream.last_at = now
        return stream.delta(tokens, lp)

    async def _watch_disconnect(self, http: HttpRequest, request_ids: list[int]) -> None:
        """Cancel the requests as soon as the client goes away (checked every 50 ms)."""
        with contextlib.suppress(asyncio.CancelledError):
            while not await http.is_disconnected():
                await asyncio.sleep(0.05)
            for request_id in request_ids:
                self.worker.cancel(request_id)

    async def _sse(self, http: HttpRequest, params: protocol.Params, reqs: list[Request], streams: list[Stream],
                   watcher: asyncio.Task, rid: str, created: int, model: str, started: float):
        def chunk(i: int, **kw) -> str:
            return _event(protocol.chunk(params, rid, model, created, index=i, **kw))

        def pieces(i: int, items: list) -> list[str]:
            """Chunks of text and tool calls; the first carries the logprobs of the tokens whose text went out."""
            out = []
            for item in items:
                if not item:
                    continue
                lp = None if out else streams[i].logprobs_delta(params.chat)
                if isinstance(item, tooling.ToolCall):
                    out.append(chunk(i, tool_calls=[item.openai(index=calls[i])], logprobs=lp))
                    calls[i] += 1
                else:
                    out.append(chunk(i, text=item, logprobs=lp))
            return out

        events, draft = streams[0].events, reqs[0].draft
        results: list[Result | None] = [None] * len(reqs)
        parsers = [tooling.StreamParser() if params.chat and params.parse_tools else None for _ in reqs]
        calls = [0] * len(reqs)
        outcome = "cancelled"  # what an unfinished request counts as when the stream ends early
        try:
            for i in range(len(reqs)):
                yield chunk(i, role=True)
            while any(r is None for r in results):
                i, kind, value = await events.get()
                if kind == "tokens":
                    piece = self._delta(streams[i], value, started)
                    for ev in pieces(i, parsers[i].feed(piece) if parsers[i] else [piece]):
                        yield ev
                    continue
                results[i] = result = value
                self.metrics.finished(result)
                if result.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {result.error}")
                _, tail = await run_in_threadpool(streams[i].final, result)
                items = (parsers[i].feed(tail) + parsers[i].finish()) if parsers[i] else [tail]
                for ev in pieces(i, items):
                    yield ev
                reason = "tool_calls" if calls[i] and result.finish_reason == "stop" else result.finish_reason
                yield chunk(i, finish_reason=reason, extra=protocol.extras(result, draft),  # with the logprobs not sent
                            logprobs=protocol.logprobs_body(params.chat, self.tokenizer, result, streams[i].lp_sent,
                                                            streams[i].lp_offset))
            if params.include_usage:
                yield _event(protocol.usage_chunk(params, rid, model, created, results, draft))
            yield "data: [DONE]\n\n"
        except Exception as e:  # after the headers: the client learns it from an error event, then [DONE]
            outcome = "error"
            log.exception("request %s: the stream failed", _request_id(http))
            yield _event(error_body(f"the stream failed (request id {_request_id(http)}): {e}", "server_error",
                                    "stream_failed"))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for req, result in zip(reqs, results, strict=True):
                if result is None:  # the client went away (or the stream failed): free the lane now
                    self.worker.cancel(req.id)
                    self.metrics.requests.labels(outcome).inc()

    async def models(self, http: HttpRequest) -> Response:
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "tfjax",
                  "max_model_len": self.engine.lanes.context} for name in self.names]
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, http: HttpRequest) -> Response:
        lanes = self.engine.lanes
        body = {"status": "ok" if self.worker.alive else "engine_stopped", "model": self.name,
                "lanes": lanes.capacity, "width": lanes.width, "context": lanes.context, "rounds": lanes.rounds,
                "drafts": self.drafts, "drafter": getattr(self.llm, "drafter_name", None),
                "queue_depth": self.worker.queued(), "lanes_busy": len(self.engine.scheduler.running)}
        return JSONResponse(body, status_code=200 if self.worker.alive else 503)

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, http: HttpRequest) -> Response:
        try:
            body = await self._json(http)
            unknown = set(body) - {"model", "prompt", "messages", "tools", "chat_template_kwargs"}
            if unknown:
                name = sorted(unknown)[0]
                raise ApiError(400, f"unrecognized request argument: '{name}'", "unknown_parameter", name)
            chat = "messages" in body
            if not chat and not isinstance(body.get("prompt"), str):
                raise ApiError(400, "'prompt' (a string) or 'messages' is required", "invalid_type", "prompt")
            params = protocol.parse_completion(body, chat=chat)
            self._model(params.model)
            ids = await run_in_threadpool(lambda: self._ids(self._render(params), 0, "messages" if chat else "prompt"))
        except ApiError as e:
            return _error(e)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.lanes.context})

    async def detokenize(self, http: HttpRequest) -> Response:
        try:
            body = await self._json(http)
            unknown = set(body) - {"model", "tokens"}
            if unknown:
                name = sorted(unknown)[0]
                raise ApiError(400, f"unrecognized request argument: '{name}'", "unknown_parameter", name)
            self._model(body.get("model") if isinstance(body.get("model"), str) else None)
            ids = body.get("tokens")
            vocab = self.tokenizer.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(400, "'tokens' must be a list of token ids", "invalid_type", "tokens")
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids must be in [0, {vocab})", "invalid_value", "tokens")
        except ApiError as e:
            return _error(e)
        return JSONResponse({"prompt": await run_in_threadpool(self.tokenizer.decode, ids)})


def _request_id(http: HttpRequest) -> str:
    return http.scope.get("state", {}).get("request_id", "-")


class Guard:
    """The last line of the one error path: a request id for every request, and any exception that escapes a
    handler becomes a logged 500 JSON body with `Connection: close` (the body read may have been cut short)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = secrets.token_hex(6)
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            return
        except Exception:
            log.exception("request %s: %s %s failed", rid, scope.get("method"), scope.get("path"))
            if started:  # nothing more can be said; uvicorn ends the response and the connection
                return
            body = json.dumps(error_body(f"internal server error (request id {rid}); the server logged it",
                                         "server_error", "internal_error")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close"), (b"x-request-id", rid.encode())]})
            await send({"type": "http.response.body", "body": body})


class ApiKey:
    """401 with OpenAI's body unless `Authorization: Bearer <key>` is sent; /health stays open."""

    def __init__(self, app, key: str, metrics: Metrics | None = None):
        self.app, self.want, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.want):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if got else
                   "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
        if self.metrics is not None and scope["path"] in COMPLETIONS:
            self.metrics.rejected("invalid_api_key")
        response = JSONResponse(error_body(message, "invalid_request_error", "invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


async def _http_error(http: HttpRequest, e: HTTPException) -> JSONResponse:
    """404/405 and other routing errors as OpenAI-style JSON."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    message = {404: f"no route {http.url.path}; see /v1/models, /v1/chat/completions, /v1/completions",
               405: f"{http.method} is not allowed on {http.url.path}"}.get(e.status_code, str(e.detail))
    return JSONResponse(error_body(message, "invalid_request_error", code), status_code=e.status_code,
                        headers=e.headers)


def create_app(llm, *, name: str = "tfjax", queue: int = 64, max_tokens: int = 256, drafts: bool = True,
               api_key: str | None = None, allowed_origins: Sequence[str] = (), max_body_mb: float = MAX_BODY_MB,
               served_model_names: Sequence[str] = (), lockstep: lockstep.Leader | None = None) -> Starlette:
    """The ASGI app for a loaded `tfjax.LLM`; its engine thread runs for the app's lifespan.

    `api_key` None reads TFJAX_API_KEY (unset or empty: no key); `served_model_names` are the names requests may
    use (default: `name`); `allowed_origins` turns on CORS for those origins ("*" for any); `lockstep` (process 0 of
    a multi-host run) broadcasts each engine step's submissions and cancellations to the other processes."""
    server = Server(llm, name=name, queue=queue, max_tokens=max_tokens, drafts=drafts, max_body_mb=max_body_mb,
                    served_model_names=served_model_names, lockstep=lockstep)
    if api_key is None:
        api_key = os.environ.get("TFJAX_API_KEY")

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
    middleware = []  # outermost first: CORS (so preflights and errors carry its headers), the guard, the key
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                     allow_headers=["*"]))
    middleware.append(Middleware(Guard))
    if api_key:
        middleware.append(Middleware(ApiKey, key=api_key, metrics=server.metrics))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error})
    app.state.server = server
    return app
