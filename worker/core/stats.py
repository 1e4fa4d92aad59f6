"""Request statistics: cumulative counters plus latencies over the last interval.

The prefix-cache hit rate, KV-cache usage and running/waiting counts are the engine's own
(EngineStats), never estimated here. No I/O: the service logs and publishes the report.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.port import EngineStats
from ..protocol.messages import Latency, StatsReport, Usage


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class StatsObserver(Protocol):
    """Told of each record as it happens (on the event loop: must not block), e.g. the
    Prometheus metrics (system/metrics.py)."""

    def reply(self, usage: Usage, latency: Latency, finish_reason: str | None) -> None: ...

    def error(self, code: str) -> None: ...

    def invalid_topic(self) -> None: ...

    def tool_call(self, tool: str, outcome: str, seconds: float) -> None: ...


@dataclass
class _Interval:
    started: float
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    queues_ms: list[float] = field(default_factory=list)
    engine_queues_ms: list[float] = field(default_factory=list)  # of the replies whose engine said
    completion_tokens: int = 0
    recomputed_tokens: int = 0


class StatsCollector:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._now = time.monotonic
        self._started = self._now()
        self._interval = _Interval(self._started)
        self.processed = 0
        self.cancelled = 0
        self.invalid_topics = 0
        self.errors_by_code: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._last_prefix = (0, 0)  # engine (queries, hits) at the last report
        self._last_sources = (0, 0, 0)  # engine (computed, GPU hit, host hit) prompt tokens at the last report
        self.observers: list[StatsObserver] = []
        self.tool_calls: Counter[str] = Counter()  # the worker's own calls, by outcome

    def record_reply(
        self, usage: Usage, latency: Latency, *, cancelled: bool = False, finish_reason: str | None = None
    ) -> None:
        cancelled = cancelled or finish_reason == "cancelled"
        self.processed += 1
        self.cancelled += int(cancelled)
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens
        interval = self._interval
        interval.latencies_ms.append(latency.total_ms)
        interval.ttfts_ms.append(latency.ttft_ms)
        interval.queues_ms.append(latency.queue_ms)
        if latency.engine_queue_ms is not None:
            interval.engine_queues_ms.append(latency.engine_queue_ms)
        interval.completion_tokens += usage.completion_tokens
        interval.recomputed_tokens += max(0, usage.prompt_tokens - usage.cached_tokens)
        for observer in self.observers:
            observer.reply(usage, latency, "cancelled" if cancelled else finish_reason)

    def record_error(self, code: str) -> None:
        self.errors_by_code[code] += 1
        for observer in self.observers:
            observer.error(code)

    def record_tool_call(self, tool: str, outcome: str, seconds: float) -> None:
        """One of the worker's own tool calls ended (outcome: ok, error, timeout, ...)."""
        self.tool_calls[outcome] += 1
        for observer in self.observers:
            observer.tool_call(tool, outcome, seconds)

    def record_invalid_topic(self) -> None:
        self.invalid_topics += 1
        for observer in self.observers:
            observer.invalid_topic()

    def report(self, engine: EngineStats, *, sessions: int, pending: int) -> StatsReport:
        """The numbers since the last report; starts a new interval."""
        now = self._now()
        interval, self._interval = self._interval, _Interval(now)
        elapsed = max(now - interval.started, 1e-9)
        queries = engine.prefix_cache_queries - self._last_prefix[0]
        hits = engine.prefix_cache_hits - self._last_prefix[1]
        self._last_prefix = (engine.prefix_cache_queries, engine.prefix_cache_hits)
        sources = (engine.prompt_tokens_computed, engine.prompt_tokens_gpu_hit, engine.prompt_tokens_host_hit)
        computed, gpu_hit, host_hit = (
            max(0, now_ - last) for now_, last in zip(sources, self._last_sources, strict=True)
        )
        self._last_sources = sources
        lat, ttft = interval.latencies_ms, interval.ttfts_ms
        return StatsReport(
            worker_id=self.worker_id,
            timestamp=time.time(),
            uptime_s=round(now - self._started, 3),
            interval_s=round(elapsed, 3),
            processed=self.processed,
            errors=sum(self.errors_by_code.values()),
            errors_by_code=dict(self.errors_by_code),
            cancelled=self.cancelled,
            invalid_topics=self.invalid_topics,
            prompt_tokens_total=self.prompt_tokens,
            completion_tokens_total=self.completion_tokens,
            cached_tokens_total=self.cached_tokens,
            requests=len(lat),
            # No replies in the interval: no latencies (None), not latencies of 0.
            avg_latency_ms=round(sum(lat) / len(lat), 1) if lat else None,
            p50_latency_ms=round(percentile(lat, 50), 1) if lat else None,
            p95_latency_ms=round(percentile(lat, 95), 1) if lat else None,
            avg_ttft_ms=round(sum(ttft) / len(ttft), 1) if ttft else None,
            p95_ttft_ms=round(percentile(ttft, 95), 1) if ttft else None,
            avg_queue_ms=round(sum(interval.queues_ms) / len(interval.queues_ms), 1) if lat else None,
            avg_engine_queue_ms=(
                round(sum(interval.engine_queues_ms) / len(interval.engine_queues_ms), 1)
                if interval.engine_queues_ms
                else None
            ),
            gen_tokens_per_s=round(interval.completion_tokens / elapsed, 1),
            prefix_cache_hit_rate=round(hits / queries, 4) if queries > 0 else None,
            prefix_cache_hit_rate_total=(
                round(engine.prefix_cache_hits / engine.prefix_cache_queries, 4)
                if engine.prefix_cache_queries > 0
                else 0.0
            ),
            kv_cache_usage=round(engine.kv_cache_usage, 4),
            gpu_hit_tokens=gpu_hit,
            host_hit_tokens=host_hit,
            computed_prompt_tokens=computed,
            avg_recomputed_tokens_per_turn=round(interval.recomputed_tokens / len(lat), 1) if lat else None,
            kv_offload_gib=engine.kv_offload_gib,
            running=engine.running,
            waiting=engine.waiting,
            max_running=engine.max_running,
            sessions=sessions,
            pending=pending,
            tool_calls=dict(self.tool_calls) or None,
        )
