"""Prometheus metrics on an optional ``/metrics`` endpoint (``stats.metrics_port``; off by default).

What happens to requests is counted as it happens: ``WorkerMetrics`` is a StatsObserver, fed
by the StatsCollector's record points on the event loop (a counter or histogram update is a
lock and an addition). What is a current value (queue depth, running requests, sessions, the
engine's KV-cache usage and prefix-cache counters) is read when Prometheus scrapes, by a
custom collector on the HTTP server's thread: nothing runs on the event loop for a scrape, and
the engine's numbers are read without resetting anything (the stats report's interval maximum
is untouched). Those reads are single attribute or ``len`` reads, atomic under the GIL.

Labels are bounded: ``outcome`` takes the values in OUTCOMES, never a user, session, request
id or message text (privacy, and one series per value forever). A private CollectorRegistry
holds everything, so nothing else in the process (vLLM registers its own metrics in the global
one) ends up on this endpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import get_args
from wsgiref.simple_server import WSGIServer

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from ..config.models import StatsConfig
from ..core.stats import StatsCollector
from ..engine.port import EngineStats
from ..protocol.messages import ErrorCode, Latency, Usage
from ..tools.port import CallStatus

PREFIX = "mqtt_vllm_worker"

# finish_reason of a generated reply -> outcome, named as the reply's finishReason (docs/protocol.md)
# except "stop", which is "replied"; anything else from the engine is "replied" too.
FINISH_OUTCOMES = {
    "stop": "replied",
    "length": "length",
    "reasoning_budget": "reasoning_budget",
    "cancelled": "cancelled",
}
TOOL_OUTCOMES: tuple[str, ...] = get_args(CallStatus)  # every label exported from the start
OUTCOMES: tuple[str, ...] = (
    "replied",
    "length",
    "reasoning_budget",
    "cancelled",
    *(code.value for code in ErrorCode),
)

# Seconds. Replies of an LLM take from a few tens of milliseconds (a short reply of a small
# model) to minutes (a long reply under load); the time to the first token is mostly shorter.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Tokens. A returning turn whose prefix stayed cached computes its new message only (tens to
# hundreds of tokens); one whose prefix was evicted computes its whole history (thousands).
RECOMPUTED_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class LiveSources:
    """Where the current values come from; each is called on every scrape, on the HTTP
    server's thread, so each must be a cheap read that is safe from another thread."""

    engine_stats: Callable[[], EngineStats]
    sessions: Callable[[], int]
    pending: Callable[[], int]
    info: dict[str, str] = field(default_factory=dict)


class LiveCollector(Collector):
    """The gauges and the engine's own counters, read when scraped. Before ``sources`` is
    set (the model is still loading) it yields nothing."""

    def __init__(self) -> None:
        self.sources: LiveSources | None = None

    def collect(self) -> Iterable[Metric]:
        sources = self.sources
        if sources is None:
            return []
        engine = sources.engine_stats()
        metrics: list[Metric] = []
        if sources.info:
            info = InfoMetricFamily(f"{PREFIX}_build", "The worker's version, its engine and the model it serves.")
            info.add_metric([], sources.info)
            metrics.append(info)
        gauges = [
            ("pending_requests", "Requests accepted and not yet answered (waiting for their turn or generating).",
             sources.pending()),
            ("sessions", "Sessions held in memory.", sources.sessions()),
            ("engine_running_requests", "Requests in the engine's running batch (vLLM's scheduler).", engine.running),
            ("engine_waiting_requests", "Requests waiting in the engine's queue (vLLM's scheduler).", engine.waiting),
            ("kv_cache_usage_ratio", "Share of the engine's KV-cache blocks in use, 0 to 1.", engine.kv_cache_usage),
        ]  # fmt: skip
        for name, help_text, value in gauges:
            metrics.append(GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value))
        metrics.append(
            CounterMetricFamily(
                f"{PREFIX}_prefix_cache_queries",
                "Prompt tokens the engine looked up in its prefix cache (vLLM's counter).",
                value=engine.prefix_cache_queries,
            )
        )
        metrics.append(
            CounterMetricFamily(
                f"{PREFIX}_prefix_cache_hits",
                "Of those, tokens found in the prefix cache (vLLM's counter). Hit rate: "
                "rate(..._hits_total) / rate(..._queries_total).",
                value=engine.prefix_cache_hits,
            )
        )
        by_kind = (
            ("gpu_hit", "found in the GPU's prefix cache", engine.prompt_tokens_gpu_hit),
            ("host_hit", "loaded back from the host-memory KV tier (kv_offload_gib)", engine.prompt_tokens_host_hit),
            ("computed", "computed (prefilled)", engine.prompt_tokens_computed),
        )
        by_source = CounterMetricFamily(
            f"{PREFIX}_engine_prompt_tokens",
            "Prompt tokens of the engine's prefills by where their KV came from (vLLM's counters): "
            + "; ".join(f"{name}: {text}" for name, text, _ in by_kind)
            + ".",
            labels=["source"],
        )
        for name, _, value in by_kind:
            by_source.add_metric([name], value)
        metrics.append(by_source)
        metrics.append(
            GaugeMetricFamily(
                f"{PREFIX}_kv_offload_bytes",
                "Size of the host-memory KV tier in bytes; 0: off.",
                value=engine.kv_offload_gib * 2**30,
            )
        )
        queries = engine.prefix_cache_queries
        metrics.append(
            GaugeMetricFamily(
                f"{PREFIX}_prefix_cache_hit_ratio",
                "Prefix-cache hits over queries since the engine started, 0 to 1.",
                value=engine.prefix_cache_hits / queries if queries > 0 else 0.0,
            )
        )
        return metrics


class WorkerMetrics:
    """Every metric of the worker, in a registry of its own; a StatsObserver."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests answered, by outcome: replied (the model ended its turn), length (stopped at "
            "maxTokens), reasoning_budget (stopped at the thinking budget), cancelled, or the error "
            "code of an error reply.",
            ["outcome"],
            registry=reg,
        )
        for outcome in OUTCOMES:  # every series exists from the start: rate() sees the first one
            self.requests.labels(outcome)
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Generated replies (cancelled ones too): from the request's arrival to the reply's publication.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Generated replies: from the request's arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.queue = Histogram(
            f"{PREFIX}_request_queue_seconds",
            "Generated replies: from the request's arrival until it was handed to the engine "
            "(behind its session's earlier turns).",
            buckets=QUEUE_BUCKETS,
            registry=reg,
        )
        self.engine_queue = Histogram(
            f"{PREFIX}_engine_queue_seconds",
            "Generated replies: in vLLM's own scheduler queue, from queued until first scheduled "
            "(vLLM's request stats; replies whose engine keeps none are not counted).",
            buckets=QUEUE_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of generated replies.", registry=reg)
        self.cached_tokens = Counter(
            f"{PREFIX}_prompt_cached_tokens",
            "Of the prompt tokens, those the engine found in its prefix cache.",
            registry=reg,
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens", "Tokens generated (completion tokens of replies).", registry=reg
        )
        self.recomputed = Histogram(
            f"{PREFIX}_recomputed_prompt_tokens",
            "Generated replies: prompt tokens the engine had to compute (not found in the GPU's prefix "
            "cache nor loaded from the host-memory tier) per turn.",
            buckets=RECOMPUTED_BUCKETS,
            registry=reg,
        )
        self.invalid_topics = Counter(
            f"{PREFIX}_invalid_topics", "Messages on topics the worker cannot parse (not answered).", registry=reg
        )
        # By outcome only: a tool label would grow with every MCP server discovered on the
        # broker (the worker's log names the tool of each call).
        self.tool_calls = Counter(
            f"{PREFIX}_tool_calls",
            "The worker's own tool calls (device tools, MCP servers), by outcome: ok, error, timeout, "
            "unavailable, declined, unknown (the worker restarted while waiting), skipped (a limit).",
            ["outcome"],
            registry=reg,
        )
        for outcome in TOOL_OUTCOMES:
            self.tool_calls.labels(outcome)
        self.tool_duration = Histogram(
            f"{PREFIX}_tool_call_duration_seconds",
            "The worker's own tool calls: from sending the call to its result.",
            buckets=QUEUE_BUCKETS,
            registry=reg,
        )
        self.live = LiveCollector()
        reg.register(self.live)
        ProcessCollector(registry=reg)  # process_* (memory, CPU, open files) of this process

    def attach(self, stats: StatsCollector, sources: LiveSources) -> None:
        """Count what ``stats`` records from now on, and read the current values from ``sources``."""
        stats.observers.append(self)
        self.live.sources = sources

    # -- StatsObserver --------------------------------------------------------------------

    def reply(self, usage: Usage, latency: Latency, finish_reason: str | None) -> None:
        self.requests.labels(FINISH_OUTCOMES.get(finish_reason or "", "replied")).inc()
        self.duration.observe(latency.total_ms / 1000)
        self.ttft.observe(latency.ttft_ms / 1000)
        self.queue.observe(latency.queue_ms / 1000)
        if latency.engine_queue_ms is not None:
            self.engine_queue.observe(latency.engine_queue_ms / 1000)
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.recomputed.observe(max(0, usage.prompt_tokens - usage.cached_tokens))

    def error(self, code: str) -> None:
        self.requests.labels(code if code in OUTCOMES else "other").inc()

    def invalid_topic(self) -> None:
        self.invalid_topics.inc()

    def tool_call(self, tool: str, outcome: str, seconds: float) -> None:
        self.tool_calls.labels(outcome if outcome in TOOL_OUTCOMES else "error").inc()
        self.tool_duration.observe(seconds)


class MetricsEndpoint:
    """The HTTP server (prometheus_client's, on a daemon thread) and the metrics it serves."""

    def __init__(self, metrics: WorkerMetrics, server: WSGIServer, thread: threading.Thread) -> None:
        self.metrics = metrics
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    @classmethod
    def start(cls, config: StatsConfig, metrics: WorkerMetrics | None = None) -> MetricsEndpoint | None:
        """Listen on metrics_host:metrics_port; None when metrics_port is unset (the default).
        Raises OSError when the port cannot be bound."""
        if config.metrics_port is None:
            return None
        metrics = metrics or WorkerMetrics()
        server, thread = start_http_server(config.metrics_port, config.metrics_host, registry=metrics.registry)
        logger.info("Prometheus metrics on http://{}:{}/metrics", config.metrics_host, server.server_port)
        return cls(metrics, server, thread)

    def attach(self, stats: StatsCollector, sources: LiveSources) -> None:
        self.metrics.attach(stats, sources)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
