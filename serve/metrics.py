"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide).

Request counters by endpoint and HTTP status; TTFT (request received -> first token, queueing
included) and TPOT histograms; prompt, generated and prefix-cached tokens; and gauges read from
the engine at scrape time: queue depth, slots in use, engine steps and rows (rows / steps is the
mean batch occupancy), and with a disk tier (--cache-dir) its PrefixStats: blocks and tokens read back,
blocks written and dropped, damaged files skipped, bytes on disk.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from decodert.runtime.engine.thread import EngineThread
from decodert.runtime.decoding.generate import GenerationResult

CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServerMetrics:
    def __init__(self, engine: EngineThread) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("decodert_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("decodert_request_finished", "Generations by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("decodert_time_to_first_token_seconds", "Request received -> first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("decodert_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("decodert_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("decodert_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("decodert_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.stalled_readers = Counter("decodert_stalled_readers", "Streams dropped: the client took no bytes for "
                                       "--client-timeout seconds", registry=r)
        self.cache_hits = Counter("decodert_prefix_cache_hits", "Generations that reused a cached prefix", registry=r)
        stats = engine.stats
        for name, doc, read in (
            ("decodert_queue_depth", "Requests waiting for a slot", lambda: engine.queued),
            ("decodert_requests_in_flight", "Requests queued or in a slot", lambda: engine.in_flight),
            ("decodert_slots_in_use", "Cache slots decoding a request", lambda: engine.llm.slots_in_use),
            ("decodert_slots", "Cache slots (the artifact's max batch)", lambda: engine.slots),
            ("decodert_engine_steps", "Prefill and decode calls since start", lambda: stats.steps),
            ("decodert_engine_rows", "Rows over all engine steps", lambda: stats.rows),
        ):
            Gauge(name, doc, registry=r).set_function(read)
        prefix = engine.llm.prefix_cache
        if getattr(prefix, "disk", None) is not None:
            for field, doc in (("disk_hits", "Lookups that loaded prefix blocks from the disk tier"),
                               ("disk_hit_tokens", "Prompt tokens loaded from the disk tier"),
                               ("disk_written_blocks", "Prefix blocks written to the disk tier"),
                               ("disk_dropped", "Prefix blocks not written: the disk writer's queue was full or it is off"),
                               ("disk_damaged", "Damaged or foreign disk-tier files skipped and deleted"),
                               ("disk_bytes", "Bytes of the disk tier's files")):
                Gauge(f"decodert_prefix_cache_{field}", doc, registry=r).set_function(
                    lambda f=field: getattr(prefix.stats, f))
        placed = getattr(engine.llm.backend, "placement", None)  # runtime/backends/placement.py
        if placed is not None:
            phase = Gauge("decodert_phase_backend", "1 for the backend that runs each phase (placement)",
                          ["phase", "backend", "source"], registry=r)
            for name, backend in placed.phases.items():
                phase.labels(name, backend, placed.source).set(1)

    def observe(self, result: GenerationResult, ttft_s: float | None) -> None:
        """Record one finished generation (``ttft_s`` measured by the server, None if no token came)."""
        m = result.metrics
        self.finished.labels(result.finish_reason).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if m.generated_tokens > 1:
            self.tpot.observe(m.tpot_ms / 1000)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.generated_tokens)
        cached = int(getattr(m, "cached_tokens", 0) or 0)
        if cached:
            self.cached_tokens.inc(cached)
            self.cache_hits.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
