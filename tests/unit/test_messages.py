from __future__ import annotations

import json
from typing import Any

import pytest

from worker.core.stats import StatsCollector, percentile
from worker.engine.port import EngineStats
from worker.protocol.messages import (
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    ChatReply,
    ErrorCode,
    JsonObjectFormat,
    JsonSchemaFormat,
    Latency,
    RequestError,
    StatsReport,
    Usage,
    best_effort_request_id,
    check_json_schema,
    parse_chat_request,
    parse_control,
    request_key,
)
from worker.protocol.topics import Inbound, InvalidTopic, SessionAddress, Topics, topic_matches


def test_old_script_payload_is_accepted() -> None:
    request = parse_chat_request(b'{"sessionId": "s1", "message": "hi", "maxTokens": 32}', "s1", 1000)
    assert (request.message, request.max_tokens, request.stream) == ("hi", 32, False)


@pytest.mark.parametrize(
    ("payload", "code", "fragment"),
    [
        (b"not json", ErrorCode.BAD_JSON, "not valid JSON"),
        (b"[1, 2]", ErrorCode.BAD_JSON, "JSON object"),
        (b'{"message": "hi", "sessionId": "other"}', ErrorCode.INVALID_REQUEST, "differs"),
        (b'{"message": "hi", "max_tokens": 5}', ErrorCode.INVALID_REQUEST, "unknown field 'max_tokens'"),
        (b'{"message": ""}', ErrorCode.INVALID_REQUEST, "'message'"),
        (b'{"message": "hi", "maxTokens": 0}', ErrorCode.INVALID_REQUEST, "'maxTokens'"),
        (b'{"message": "hi", "temperature": "hot"}', ErrorCode.INVALID_REQUEST, "'temperature'"),
        (b'{"nomessage": 1}', ErrorCode.INVALID_REQUEST, "'message'"),
        (b'{"message": "' + b"x" * 2000 + b'"}', ErrorCode.TOO_LARGE, "limit is 1000"),
    ],
)
def test_bad_requests(payload: bytes, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat_request(payload, "s1", 1000)
    assert err.value.code is code
    assert fragment in err.value.message


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def chat_payload(response_format: object) -> bytes:
    return json.dumps({"message": "hi", "responseFormat": response_format}).encode()


def test_response_format_json_schema_and_json_object() -> None:
    request = parse_chat_request(chat_payload({"type": "json_schema", "schema": PERSON}), "s1", 10000)
    assert isinstance(request.response_format, JsonSchemaFormat)
    assert request.response_format.json_schema == PERSON
    request = parse_chat_request(chat_payload({"type": "json_object"}), "s1", 10000)
    assert isinstance(request.response_format, JsonObjectFormat)
    assert parse_chat_request(b'{"message": "hi"}', "s1", 100).response_format is None


def nested(depth: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("response_format", "code", "fragment"),
    [
        ({"type": "xml"}, ErrorCode.INVALID_REQUEST, "'responseFormat': Input tag 'xml'"),
        ({"schema": PERSON}, ErrorCode.INVALID_REQUEST, "'responseFormat'"),
        ("json", ErrorCode.INVALID_REQUEST, "'responseFormat'"),
        ({"type": "json_schema"}, ErrorCode.INVALID_REQUEST, "'responseFormat.json_schema.schema': Field required"),
        ({"type": "json_schema", "schema": True}, ErrorCode.INVALID_REQUEST, "'responseFormat.json_schema.schema'"),
        ({"type": "json_object", "schema": PERSON}, ErrorCode.INVALID_REQUEST, "unknown field"),
        ({"type": "json_schema", "schema": {"type": "objekt"}}, ErrorCode.INVALID_SCHEMA, "at $.type"),
        (
            {"type": "json_schema", "schema": {"properties": {"a": {"maxLength": -1}}}},
            ErrorCode.INVALID_SCHEMA,
            "at $.properties.a.maxLength: -1 is less than the minimum of 0",
        ),
        ({"type": "json_schema", "schema": {"pattern": "("}}, ErrorCode.INVALID_SCHEMA, "is not a 'regex'"),
        ({"type": "json_schema", "schema": {"required": "name"}}, ErrorCode.INVALID_SCHEMA, "at $.required"),
        (
            {"type": "json_schema", "schema": nested(MAX_SCHEMA_DEPTH)},
            ErrorCode.INVALID_SCHEMA,
            f"deeper than {MAX_SCHEMA_DEPTH} levels",
        ),
        (
            {"type": "json_schema", "schema": {"enum": list(range(MAX_SCHEMA_NODES))}},
            ErrorCode.INVALID_SCHEMA,
            f"more than {MAX_SCHEMA_NODES} values",
        ),
    ],
)
def test_bad_response_formats(response_format: object, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_chat_request(chat_payload(response_format), "s1", 100000)
    assert err.value.code is code
    assert fragment in err.value.message


def test_schema_caps_are_inclusive() -> None:
    deep = nested(MAX_SCHEMA_DEPTH - 1)  # the innermost {"type": "string"} is the last of 32 levels
    wide = {"enum": list(range(MAX_SCHEMA_NODES - 2))}  # the schema object and the list count too
    for schema in (deep, wide):
        assert parse_chat_request(chat_payload({"type": "json_schema", "schema": schema}), "s1", 100000).response_format


def test_deeply_nested_payload_is_bad_json() -> None:
    payload = b'{"message": "hi", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    with pytest.raises(RequestError) as err:
        parse_chat_request(payload, "s1", 1000000)
    assert err.value.code is ErrorCode.BAD_JSON
    assert best_effort_request_id(payload) is None


def test_control_payloads() -> None:
    assert parse_control(b'{"action": "cancel", "requestId": "r1"}', 100).request_id == "r1"
    with pytest.raises(RequestError) as err:
        parse_control(b'{"verb": "reset"}', 100)
    assert err.value.code is ErrorCode.INVALID_REQUEST


def test_request_key() -> None:
    assert request_key("t", b"{}", "client-id") == "client-id"
    key = request_key("chat/u/s/request", b'{"message": "hi"}', None, mid=5)
    assert key == request_key("chat/u/s/request", b'{"message": "hi"}', None, mid=5)  # a redelivery
    assert key != request_key("chat/u/s/request", b'{"message": "hi"}', None, mid=6)  # sent again: a new turn
    assert key != request_key("chat/u/s2/request", b'{"message": "hi"}', None, mid=5)
    assert key != request_key("chat/u/s/request", b'{"message": "hi!"}', None, mid=5)
    # QoS 0 (no packet id): never redelivered, so every message is a new one.
    assert request_key("t", b"{}", None) != request_key("t", b"{}", None)
    assert best_effort_request_id(b'{"requestId": "r9", "bad": true}') == "r9"
    assert best_effort_request_id(b"garbage") is None


def test_reply_wire_format_is_camel_case() -> None:
    reply = ChatReply(
        session_id="s",
        request_id="r",
        reply="hi",
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0),
        latency=Latency(queue_ms=1, ttft_ms=2, total_ms=3),
    )
    data = json.loads(reply.to_json())
    assert data == {
        "sessionId": "s",
        "requestId": "r",
        "reply": "hi",
        "finishReason": "stop",
        "usage": {"promptTokens": 3, "completionTokens": 1, "cachedTokens": 0},
        "latency": {"queueMs": 1.0, "ttftMs": 2.0, "totalMs": 3.0},
    }


def test_topics_parse_and_build() -> None:
    topics = Topics("chat")
    address, kind = topics.parse("chat/alice/s-1.a:b/request")
    assert (address.user, address.session, kind) == ("alice", "s-1.a:b", Inbound.REQUEST)
    assert topics.reply(address) == "chat/alice/s-1.a:b/reply"
    assert topics.stream(address) == "chat/alice/s-1.a:b/stream"
    assert topics.parse("chat/alice/s/control")[1] is Inbound.CONTROL
    assert topics.subscriptions() == ["chat/+/+/request", "chat/+/+/control"]
    assert topics.subscriptions("gpus") == ["$share/gpus/chat/+/+/request", "$share/gpus/chat/+/+/control"]
    assert topics.status("w1") == "chat/_worker/w1/status"
    assert Topics("org/chat").parse("org/chat/u/s/request")[0] == SessionAddress("u", "s")


@pytest.mark.parametrize(
    "topic",
    [
        "chat/_worker/s/request",  # reserved namespace
        "chat/u/" + "s" * 129 + "/request",  # too long
        "chat/u/s p/request",  # invalid character
        "chat/u/s/reply",  # not an inbound kind
        "chat/u/request",  # missing level
        "other/u/s/request",  # other prefix
        "chat/u/s/x/request",
        "chat/alice\n/s1/request",  # a trailing newline ("$" matches before one)
        "chat/alice/s1\n/request",
    ],
)
def test_invalid_topics(topic: str) -> None:
    with pytest.raises(InvalidTopic):
        Topics("chat").parse(topic)


def test_a_part_with_a_trailing_newline_is_invalid() -> None:
    """Checked with fullmatch: "^...$" with match took "alice\n", a namespace apart from
    "alice" whose newline reached topics and log lines."""
    for user, session in (("alice\n", "s1"), ("alice", "s1\n")):
        with pytest.raises(InvalidTopic):
            SessionAddress(user, session)
    with pytest.raises(InvalidTopic):
        Topics("chat").status("gpu-1\n")
    assert Topics("chat").status("gpu-1") == "chat/_worker/gpu-1/status"


def test_topic_filter_matching() -> None:
    assert topic_matches("apps/+/inbox", "apps/a/inbox")
    assert topic_matches("apps/#", "apps/a/b/c")
    assert not topic_matches("apps/+/inbox", "apps/a/b/inbox")
    assert not topic_matches("apps/+", "apps")
    assert topic_matches("apps/#", "apps") and topic_matches("#", "apps/a")
    # A filter that starts with a wildcard leaves the broker's own $ topics alone (MQTT 4.7.2).
    assert not topic_matches("#", "$SYS/broker/load") and not topic_matches("+/x", "$SYS/x")
    assert topic_matches("$SYS/#", "$SYS/broker/load")


def test_stats_report() -> None:
    stats = StatsCollector("w")
    for ms in (100.0, 200.0, 300.0, 400.0):
        stats.record_reply(
            Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4),
            Latency(queue_ms=1, ttft_ms=ms / 10, total_ms=ms),
        )
    stats.record_error("busy")
    engine = EngineStats(
        running=2, waiting=1, max_running=5, kv_cache_usage=0.25, prefix_cache_queries=100, prefix_cache_hits=40
    )
    engine.prompt_tokens_computed, engine.prompt_tokens_gpu_hit, engine.prompt_tokens_host_hit = 60, 30, 10
    engine.kv_offload_gib = 8.0
    report = stats.report(engine, sessions=3, pending=2)
    # Where the prompt tokens' KV came from, and what each turn computed (10 - 4 cached).
    assert (report.gpu_hit_tokens, report.host_hit_tokens, report.computed_prompt_tokens) == (30, 10, 60)
    assert report.avg_recomputed_tokens_per_turn == 6.0 and report.kv_offload_gib == 8.0
    assert "PromptTokens(GPU hit/host hit/computed)=30/10/60, RecomputedPerTurn=6" in report.log_line()
    assert (report.processed, report.errors, report.requests) == (4, 1, 4)
    assert report.avg_latency_ms == 250 and report.p95_latency_ms == 400 and report.p50_latency_ms == 200
    assert report.prefix_cache_hit_rate == 0.4 and report.max_running == 5
    assert "Processed=4, Errors=1" in report.log_line() and "PrefixHit=40.0%" in report.log_line()
    data = json.loads(report.to_json())
    assert data["maxRunning"] == 5 and data["errorsByCode"] == {"busy": 1}
    # The next interval: counters stay cumulative, latencies restart, hit rate is per interval.
    engine.prefix_cache_queries, engine.prefix_cache_hits = 200, 140
    engine.prompt_tokens_computed, engine.prompt_tokens_host_hit = 65, 110  # interval: 5 computed, 100 from host
    second = stats.report(engine, sessions=3, pending=0)
    assert (second.gpu_hit_tokens, second.host_hit_tokens, second.computed_prompt_tokens) == (0, 100, 5)
    assert second.processed == 4 and second.requests == 0
    assert second.prefix_cache_hit_rate == 1.0 and second.prefix_cache_hit_rate_total == 0.7
    # No replies in it: no latencies of 0.00, but no latencies at all, in the log line and on the wire.
    assert second.avg_latency_ms is None and second.p95_ttft_ms is None
    assert second.avg_recomputed_tokens_per_turn is None
    line = second.log_line()
    assert "Processed=4, Errors=1, no requests in the window, PrefixHit=100.0%" in line, line
    assert "Latency" not in line and "TTFT" not in line and "RecomputedPerTurn" not in line, line
    data = json.loads(second.to_json())
    assert data["requests"] == 0 and not {"avgLatencyMs", "p95LatencyMs", "avgTtftMs", "avgQueueMs"} & data.keys()
    assert StatsReport.model_validate(data) == second  # what the chat client reads back
    # Idle, on an engine without a host-memory tier (the CPU backend): no GPU in the line.
    engine.kv_offload_gib = 0.0
    idle = stats.report(engine, sessions=0, pending=0).log_line()
    assert "no requests in the window" in idle and "PrefixHit" not in idle, idle
    assert "GPU" not in idle and "PromptTokens(cache hit/computed)=0/0" in idle, idle
    assert percentile([], 95) == 0.0


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "https://example.com/schema.json"},
        {"type": "object", "properties": {"a": {"$ref": "other.json#/defs/a"}}},
        {"$defs": {"a": {"type": "string"}}, "items": [{"$dynamicRef": "http://x/y#meta"}]},
        {"allOf": [{"$ref": "file:///etc/passwd"}]},
    ],
)
def test_a_schema_referring_to_another_document_is_invalid_and_nothing_is_fetched(schema: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as refused:
        check_json_schema(schema)
    assert refused.value.code is ErrorCode.INVALID_SCHEMA and "local references" in refused.value.message


def test_local_references_and_a_property_named_ref_are_fine() -> None:
    check_json_schema(
        {
            "$defs": {"name": {"type": "string"}},
            "type": "object",
            "properties": {"name": {"$ref": "#/$defs/name"}, "$ref": {"type": "string"}},
        }
    )


def test_a_payload_read_for_its_request_id_is_decoded_once_and_never_served_to_another() -> None:
    from worker.protocol import messages

    payload = json.dumps({"message": "hi", "requestId": "r1"}).encode()
    assert best_effort_request_id(payload, 1000) == "r1"
    kept = messages._kept[0]
    assert kept is not None and kept[0] is payload
    request = parse_chat_request(payload, "s", 1000)  # the kept value, taken once
    assert (request.message, request.request_id) == ("hi", "r1")
    assert messages._kept[0] is None
    other = json.dumps({"message": "other", "requestId": "r1"}).encode()
    assert best_effort_request_id(payload, 1000) == "r1"
    assert parse_chat_request(other, "s", 1000).message == "other"  # equal id, another payload: decoded
