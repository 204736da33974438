"""/metrics through prometheus_client, one CollectorRegistry per app (tests build several apps).

Requests are counted by outcome (ok, cancelled, error, rejected_<code>); TTFT, inter-token latency and tokens per
round are histograms; the queue, the busy lanes and the engine's rounds are read at scrape time, with any
the engine's prefix-cache counters (`Engine.prefix_stats`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("ok", "cancelled", "error")


class EngineCollector(Collector):
    """Engine state read when scraped: queue depth, lanes busy and total, rounds run, prefix-cache counters."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        engine, worker = self.server.engine, self.server.worker
        yield GaugeMetricFamily("tfjax_queue_depth", "Requests waiting for a lane.", value=worker.queued())
        yield GaugeMetricFamily("tfjax_lanes_busy", "Lanes running a request.", value=len(engine.scheduler.running))
        yield GaugeMetricFamily("tfjax_lanes_total", "Lanes in the engine.", value=engine.lanes.capacity)
        yield CounterMetricFamily("tfjax_rounds", "Engine rounds run.", value=engine.rounds)
        pc = engine.prefix_stats
        for name, help in (("lookups", "Requests that looked up the prefix cache."),
                           ("hits", "Requests resumed after a cached prefix."),
                           ("cached_tokens", "Prompt tokens taken from the prefix cache."),
                           ("prompt_tokens", "Prompt tokens of requests that looked up the prefix cache."),
                           ("evictions", "Cached KV pages evicted for new requests.")):
            yield CounterMetricFamily(f"tfjax_prefix_cache_{name}", help, value=getattr(pc, name))
        yield GaugeMetricFamily("tfjax_prefix_cache_hit_rate", "Prefix cache hits over lookups.",
                                value=pc.hits / max(pc.lookups, 1))


class Metrics:
    """The app's metrics; handlers call `finished`, `rejected`, `first_token` and `tokens`."""

    def __init__(self, server):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tfjax_requests", "Completion requests by outcome.", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("tfjax_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tfjax_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.ttft = Histogram("tfjax_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.itl = Histogram("tfjax_inter_token_latency_seconds", "Time between tokens of one request.",
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.tokens_per_round = Histogram("tfjax_tokens_per_round", "Generated tokens per lane round, per request.",
                                          buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=r)
        r.register(EngineCollector(server))

    def rejected(self, code: str) -> None:
        self.requests.labels(f"rejected_{code}").inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int, gap: float) -> None:
        """`n` tokens arrived `gap` seconds after the previous ones: n observations of gap / n."""
        for _ in range(n):
            self.itl.observe(gap / n)

    def finished(self, result, outcome: str | None = None) -> None:
        """One engine request ended (the outcome from its finish reason unless given)."""
        if outcome is None:
            outcome = {"stop": "ok", "length": "ok"}.get(result.finish_reason, result.finish_reason)
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        if result.rounds:
            self.tokens_per_round.observe(result.tokens_per_round)

    def render(self) -> bytes:
        return generate_latest(self.registry)
