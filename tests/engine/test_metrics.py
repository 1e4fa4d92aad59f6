"""The Prometheus endpoint (worker/system/metrics.py).

Without an engine: the observer and the scrape-time collector on a private registry, the
endpoint's HTTP server, and that it is off by default. End to end: the shared worker (real
mosquitto, vLLM CPU engine, tiny model) runs with --metrics-port; the test scrapes it, sends
requests through the broker, scrapes again and checks that every number moved by exactly what
the replies say."""

from __future__ import annotations

import socket
import threading
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.mqtt_client import Client
from devtools.net import free_port
from devtools.waiting import PATIENCE, eventually
from devtools.worker_process import WorkerProcess
from worker.config.models import StatsConfig, WorkerConfig
from worker.core.stats import StatsCollector
from worker.engine.port import EngineInfo, EngineStats
from worker.protocol.messages import ErrorCode, Latency, Usage
from worker.system.metrics import OUTCOMES, PREFIX, LiveSources, MetricsEndpoint, WorkerMetrics


@dataclass
class Scrape:
    text: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    types: dict[str, str]

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]


def parse(text: str) -> Scrape:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(text, samples, types)


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PATIENCE) as response:
        assert response.status == 200
        return parse(response.read().decode())


def m(name: str) -> str:
    return f"{PREFIX}_{name}"


# -- no engine -----------------------------------------------------------------------------


def test_off_by_default() -> None:
    assert WorkerConfig().stats.metrics_port is None
    assert WorkerConfig().stats.metrics_host == "127.0.0.1"
    threads = threading.active_count()
    assert MetricsEndpoint.start(StatsConfig()) is None
    assert threading.active_count() == threads  # no server thread, no socket


def test_observer_and_scrape_time_values() -> None:
    engine = EngineStats(
        running=3,
        waiting=2,
        max_running=7,
        kv_cache_usage=0.25,
        prefix_cache_queries=400,
        prefix_cache_hits=100,
        prompt_tokens_computed=300,
        prompt_tokens_gpu_hit=70,
        prompt_tokens_host_hit=30,
        kv_offload_gib=2.0,
    )
    reads: list[int] = []

    def engine_stats() -> EngineStats:
        reads.append(1)
        return engine

    metrics = WorkerMetrics()
    stats = StatsCollector("w")
    metrics.attach(stats, LiveSources(engine_stats, sessions=lambda: 5, pending=lambda: 4, info={"version": "x"}))
    latency = Latency(queue_ms=2.0, ttft_ms=40.0, total_ms=1500.0)
    stats.record_reply(Usage(prompt_tokens=100, completion_tokens=10, cached_tokens=64), latency, finish_reason="stop")
    stats.record_reply(Usage(prompt_tokens=50, completion_tokens=20, cached_tokens=0), latency, finish_reason="length")
    stats.record_reply(Usage(prompt_tokens=50, completion_tokens=1, cached_tokens=32), latency, cancelled=True)
    stats.record_reply(
        Usage(prompt_tokens=10, completion_tokens=8, cached_tokens=0), latency, finish_reason="reasoning_budget"
    )
    stats.record_error(ErrorCode.BUSY.value)
    stats.record_error(ErrorCode.BUSY.value)
    stats.record_invalid_topic()
    assert not reads  # nothing is read before a scrape
    from prometheus_client import generate_latest

    got = parse(generate_latest(metrics.registry).decode())
    assert reads == [1]
    # Named as the reply's finishReason: "truncated" is a reply cut to the broker's packet size.
    expected = {"replied": 1, "length": 1, "reasoning_budget": 1, "cancelled": 1, "busy": 2}
    assert "truncated" not in OUTCOMES
    for outcome in OUTCOMES:  # every outcome exists from the start, at 0 when nothing happened
        assert got.value(m("requests_total"), outcome=outcome) == expected.get(outcome, 0), outcome
    assert got.types[m("requests")] == "counter"
    assert got.value(m("prompt_tokens_total")) == 210
    assert got.value(m("prompt_cached_tokens_total")) == 96
    assert got.value(m("completion_tokens_total")) == 39
    assert got.value(m("invalid_topics_total")) == 1
    for histogram in ("request_duration_seconds", "time_to_first_token_seconds", "request_queue_seconds"):
        assert got.types[m(histogram)] == "histogram"
        assert got.value(m(f"{histogram}_count")) == 4
        assert got.value(m(f"{histogram}_bucket"), le="+Inf") == 4
    assert got.value(m("request_duration_seconds_sum")) == pytest.approx(6.0)
    assert got.value(m("request_duration_seconds_bucket"), le="1.0") == 0
    assert got.value(m("request_duration_seconds_bucket"), le="2.0") == 4
    assert got.value(m("time_to_first_token_seconds_sum")) == pytest.approx(0.16)
    assert got.value(m("pending_requests")) == 4
    assert got.value(m("sessions")) == 5
    assert got.value(m("engine_running_requests")) == 3
    assert got.value(m("engine_waiting_requests")) == 2
    assert got.value(m("kv_cache_usage_ratio")) == 0.25
    assert got.value(m("prefix_cache_queries_total")) == 400
    assert got.value(m("prefix_cache_hits_total")) == 100
    assert got.value(m("prefix_cache_hit_ratio")) == 0.25
    assert got.value(m("build_info"), version="x") == 1
    assert got.value(m("engine_prompt_tokens_total"), source="gpu_hit") == 70
    assert got.value(m("engine_prompt_tokens_total"), source="host_hit") == 30
    assert got.value(m("engine_prompt_tokens_total"), source="computed") == 300
    assert got.value(m("kv_offload_bytes")) == 2 * 2**30
    # Per turn, the prompt tokens not found cached: 36, 50 and 18.
    assert got.value(m("recomputed_prompt_tokens_count")) == 4
    assert got.value(m("recomputed_prompt_tokens_sum")) == 114  # 36 + 50 + 18 + 10
    assert got.value(m("recomputed_prompt_tokens_bucket"), le="16.0") == 1
    assert got.value(m("recomputed_prompt_tokens_bucket"), le="64.0") == 4
    assert engine.max_running == 7  # a scrape resets nothing of the stats report
    # The only labels: outcome and source (bounded), le, and the build info.
    labels = {name for (_, pairs) in got.samples for name, _ in pairs}
    assert labels <= {"outcome", "le", "version", "source"}, labels
    # Conventions: prefixed snake_case; counters end in _total (the parser strips it from the family).
    for family, kind in got.types.items():
        assert family.startswith((PREFIX + "_", "process_")) and family == family.lower(), family
        if kind == "counter":
            assert any(name == family + "_total" for name, _ in got.samples), family


def test_peek_stats_resets_nothing() -> None:
    from worker.engine.vllm import VllmEngine

    sink = EngineStats(running=1, max_running=9, extra={"a": 1.0})
    engine = VllmEngine(None, EngineInfo("vllm", "0", "m", 64, 16, True), [], sink)
    peeked = engine.peek_stats()
    assert peeked.max_running == 9 and peeked is not sink and peeked.extra is not sink.extra
    assert sink.max_running == 9
    assert engine.take_stats().max_running == 9 and sink.max_running == 1  # take_stats does reset


def test_endpoint_serves_its_own_registry_and_closes() -> None:
    port = free_port()
    endpoint = MetricsEndpoint.start(StatsConfig(metrics_port=port))
    assert endpoint is not None and endpoint.port == port
    try:
        got = scrape(port)
        assert got.value(m("requests_total"), outcome="replied") == 0
        assert m("pending_requests") not in got.types  # no sources yet: the model is loading
        # The private registry: the process's global one (python_info, python_gc_*, and vLLM's
        # own metrics in a worker) is not on this endpoint.
        assert "python_info" not in got.types and not any(name.startswith("vllm") for name in got.types)
        assert "process_resident_memory_bytes" in got.text
        with pytest.raises(OSError):  # the port is taken: the worker refuses to start
            MetricsEndpoint.start(StatsConfig(metrics_port=port))
    finally:
        endpoint.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


# -- end to end ----------------------------------------------------------------------------


def quiet(port: int) -> Scrape:
    """A scrape once the worker has nothing in flight (earlier tests' requests are answered)."""

    def idle() -> Scrape | None:
        got = scrape(port)
        return got if got.value(m("pending_requests")) == 0 and got.value(m("engine_running_requests")) == 0 else None

    return eventually(idle, "the worker never became idle", interval=0.2)


def reply_of(client: Client, user: str, session: str) -> dict[str, Any]:
    data: dict[str, Any] = client.wait_topic(f"chat/{user}/{session}/reply", 180).json()
    return data


@pytest.mark.e2e
def test_scrape_moves_with_traffic(shared_worker: WorkerProcess, shared_metrics_port: int, client: Client) -> None:
    port = shared_metrics_port
    before = quiet(port)
    user = "metricsuser"
    two_turns, one_turn, cancelled_session, bad = (f"s-{uuid.uuid4().hex[:12]}" for _ in range(4))
    system = "You are a helpful assistant who answers briefly and precisely. " * 4
    replies = []
    client.publish(
        f"chat/{user}/{two_turns}/request",
        {"message": "private-text-one", "maxTokens": 12, "systemPrompt": system},
    )
    replies.append(reply_of(client, user, two_turns))
    client.publish(f"chat/{user}/{two_turns}/request", {"message": "private-text-two", "maxTokens": 12})
    replies.append(reply_of(client, user, two_turns))
    client.publish(f"chat/{user}/{one_turn}/request", {"message": "private-text-three", "maxTokens": 6})
    replies.append(reply_of(client, user, one_turn))
    client.publish(
        f"chat/{user}/{cancelled_session}/request",
        {"message": "go on", "maxTokens": 1000, "stream": True, "requestId": "req-to-cancel"},
    )
    client.wait_topic(f"chat/{user}/{cancelled_session}/stream")  # generating now
    client.publish(f"chat/{user}/{cancelled_session}/control", {"action": "cancel", "requestId": "req-to-cancel"})
    replies.append(reply_of(client, user, cancelled_session))
    client.publish(f"chat/{user}/{bad}/request", b"{not json")
    error = reply_of(client, user, bad)
    assert error["error"]["code"] == "bad_json"
    for reply in replies:
        assert "error" not in reply, reply
    assert replies[1]["usage"]["cachedTokens"] > 0  # the second turn reuses the first's prefix
    assert replies[3]["finishReason"] == "cancelled"

    # Counters and histograms are updated before a reply is published: one scrape suffices.
    # The engine's own counters come from its stat logger, a step later: wait for them.
    def hits_moved() -> Scrape | None:
        got = scrape(port)
        return got if got.value(m("prefix_cache_hits_total")) > before.value(m("prefix_cache_hits_total")) else None

    after = eventually(hits_moved, "vLLM's prefix-cache hits did not move", interval=0.2)

    def moved(name: str, **labels: str) -> float:
        return after.value(m(name), **labels) - before.value(m(name), **labels)

    finishes = [r["finishReason"] for r in replies]
    expected = {
        "replied": finishes.count("stop"),
        "length": finishes.count("length"),
        "cancelled": 1,
        "bad_json": 1,
    }
    for outcome in OUTCOMES:
        assert moved("requests_total", outcome=outcome) == expected.get(outcome, 0), outcome
    assert moved("requests_total", outcome="replied") + moved("requests_total", outcome="length") == 3
    n = len(replies)
    for histogram, field in (
        ("request_duration_seconds", "totalMs"),
        ("time_to_first_token_seconds", "ttftMs"),
        ("request_queue_seconds", "queueMs"),
    ):
        assert moved(f"{histogram}_count") == n
        assert moved(f"{histogram}_bucket", le="+Inf") == n
        assert moved(f"{histogram}_sum") == pytest.approx(sum(r["latency"][field] for r in replies) / 1000, abs=1e-3)
    # vLLM's own queue time: the replies whose engine said (every generated one here; a
    # cancelled generation's stream may end before vLLM's final output).
    said = [r["latency"]["engineQueueMs"] for r in replies if "engineQueueMs" in r["latency"]]
    assert len(said) >= 3
    assert moved("engine_queue_seconds_count") == len(said)
    assert moved("engine_queue_seconds_sum") == pytest.approx(sum(said) / 1000, abs=1e-3)
    for counter, field in (
        ("completion_tokens_total", "completionTokens"),
        ("prompt_tokens_total", "promptTokens"),
        ("prompt_cached_tokens_total", "cachedTokens"),
    ):
        assert moved(counter) == sum(r["usage"][field] for r in replies), counter
    assert moved("prompt_cached_tokens_total") > 0
    assert moved("prefix_cache_queries_total") >= moved("prefix_cache_hits_total") > 0
    assert 0 < after.value(m("prefix_cache_hit_ratio")) <= 1
    assert 0 <= after.value(m("kv_cache_usage_ratio")) <= 1
    assert after.value(m("sessions")) >= before.value(m("sessions")) + 3
    build = [labels for (name, labels) in after.samples if name == m("build_info")]
    assert len(build) == 1 and dict(build[0])["engine"].startswith("vllm")
    # No user, session, request id or message text anywhere on the endpoint.
    for secret in (user, two_turns, one_turn, cancelled_session, bad, "private-text", "req-to-cancel"):
        assert secret not in after.text, secret


def test_tool_calls_are_counted_by_outcome() -> None:
    from prometheus_client import generate_latest

    from worker.system.metrics import TOOL_OUTCOMES

    metrics = WorkerMetrics()
    stats = StatsCollector("w")
    metrics.attach(stats, LiveSources(lambda: EngineStats(), sessions=lambda: 0, pending=lambda: 0, info={}))
    got = parse(generate_latest(metrics.registry).decode())
    for outcome in TOOL_OUTCOMES:  # every series exists from the start
        assert got.value(m("tool_calls_total"), outcome=outcome) == 0, outcome
    stats.record_tool_call("lamp_set", "timeout", 5.0)
    stats.record_tool_call("sensor_read", "ok", 0.01)
    got = parse(generate_latest(metrics.registry).decode())
    assert got.value(m("tool_calls_total"), outcome="timeout") == 1
    assert got.value(m("tool_calls_total"), outcome="ok") == 1
    assert got.value(m("tool_call_duration_seconds_count")) == 2
    assert stats.tool_calls == {"timeout": 1, "ok": 1}
