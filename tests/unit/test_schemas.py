"""The published JSON Schemas (docs/schemas) are current and agree with the wire models.

Fast: no engine, no broker. Payloads are built by the models themselves (to_json), and
request examples must pass or fail the schema and the worker's own parser alike.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devtools import REPO
from worker.core.stats import StatsCollector
from worker.engine.port import EngineStats
from worker.protocol.messages import (
    ChatReply,
    ControlReply,
    ErrorBody,
    ErrorCode,
    ErrorReply,
    Latency,
    RequestError,
    StreamDelta,
    Usage,
    parse_chat_request,
    parse_control,
)
from worker.protocol.schemas import PAYLOADS, SUFFIX, main, rendered, schema_for
from worker.protocol.topics import SessionAddress, Topics

SCHEMAS = REPO / "docs" / "schemas"
BY_NAME = {payload.name: payload for payload in PAYLOADS}


@functools.cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / (name + SUFFIX)).read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def schema_accepts(name: str, payload: bytes) -> bool:
    return validator(name).is_valid(json.loads(payload))


def test_committed_schemas_are_current() -> None:
    committed = {path.name: path.read_text(encoding="utf-8") for path in SCHEMAS.glob("*" + SUFFIX)}
    assert committed == rendered(), "regenerate: python -m worker.protocol.schemas docs/schemas"


def test_command_writes_the_same_files(tmp_path: Path) -> None:
    (tmp_path / ("gone" + SUFFIX)).write_text("{}")  # a payload no longer in the contract
    assert main([str(tmp_path)]) == 0
    assert {path.name: path.read_text(encoding="utf-8") for path in tmp_path.iterdir()} == rendered()
    assert main([]) == 2


def test_protocol_links_every_schema() -> None:
    protocol = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    for name in rendered():
        assert f"(schemas/{name})" in protocol, name


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda payload: payload.name)
def test_schema_is_valid_draft_2020_12(payload: Any) -> None:
    schema = schema_for(payload)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$id"] == payload.name + SUFFIX
    assert schema["title"] and payload.topic in schema["description"]
    if payload.inbound:  # the worker refuses unknown fields, everywhere in the payload
        objects = [schema, *(node for node in schema.get("$defs", {}).values() if node.get("type") == "object")]
        assert all(node["additionalProperties"] is False for node in objects)
    else:  # a client should ignore fields a newer worker adds
        assert '"additionalProperties": false' not in json.dumps(schema)


def test_topics_are_the_workers() -> None:
    """The topics named in the descriptions are those worker/protocol/topics.py builds."""
    topics, address = Topics("chat"), SessionAddress("alice", "s1")
    built = {
        "request": topics.request(address),
        "control": topics.control(address),
        "reply": topics.reply(address),
        "error": topics.reply(address),
        "control-reply": topics.reply(address),
        "stream-delta": topics.stream(address),
        "stats": topics.stats("gpu0"),
    }
    assert set(built) == set(BY_NAME)
    for name, topic in built.items():
        template = BY_NAME[name].topic
        filled = template.replace("<prefix>", "chat").replace("<user>", "alice").replace("<session>", "s1")
        assert filled.replace("<workerId>", "gpu0") == topic, name


# Outbound: every payload as the worker builds it validates against its schema.


def _reply() -> ChatReply:
    return ChatReply(
        session_id="s1",
        request_id="r-1",
        reply="Hi! How can I help?",
        finish_reason="stop",
        usage=Usage(prompt_tokens=53, completion_tokens=9, cached_tokens=32),
        latency=Latency(queue_ms=0.4, ttft_ms=21.3, total_ms=140.2),
    )


def _stats_json() -> bytes:
    collector = StatsCollector("gpu-host-gpu2")
    usage = Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=0)
    collector.record_reply(usage, Latency(queue_ms=1.0, ttft_ms=20.0, total_ms=90.0))
    collector.record_error(ErrorCode.BUSY.value)
    collector.record_invalid_topic()
    engine = EngineStats(prefix_cache_queries=10, prefix_cache_hits=4, kv_cache_usage=0.1, running=1, waiting=0)
    return collector.report(engine, sessions=1, pending=0).to_json()


OUTBOUND = [
    ("reply", _reply().to_json()),
    ("reply", _reply().model_copy(update={"reply": "", "finish_reason": "truncated"}).to_json()),
    (
        "error",
        ErrorReply(session_id="s1", request_id="r-1", error=ErrorBody(code=ErrorCode.BUSY, message="")).to_json(),
    ),
    ("error", ErrorReply(session_id="s1", error=ErrorBody(code=ErrorCode.BAD_JSON, message="not JSON")).to_json()),
    ("control-reply", ControlReply(session_id="s1", action="reset").to_json()),
    ("stream-delta", StreamDelta(request_id="r-1", seq=0, delta="Hi").to_json()),
    ("stats", _stats_json()),
]


@pytest.mark.parametrize(("name", "payload"), OUTBOUND, ids=[name for name, _ in OUTBOUND])
def test_worker_payloads_validate(name: str, payload: bytes) -> None:
    validator(name).validate(json.loads(payload))


def test_outbound_schemas_are_exact() -> None:
    """Required: what to_json() always sends; a field left out when unset is optional, never null."""
    error = json.loads(OUTBOUND[3][1])
    assert "requestId" not in error
    assert not schema_accepts("error", json.dumps({**error, "requestId": None}).encode())
    assert not schema_accepts("error", json.dumps({**error, "error": {"code": "nope", "message": "x"}}).encode())
    for name, payload in OUTBOUND:
        data = json.loads(payload)
        required = set(validator(name).schema["required"])
        assert required <= set(data), name
        for field in required:
            assert not validator(name).is_valid({k: v for k, v in data.items() if k != field}), (name, field)
    # a newer worker's extra field does not break a client validating with this schema
    assert schema_accepts("reply", json.dumps({**json.loads(OUTBOUND[0][1]), "reasoning": "..."}).encode())


# Inbound: the schema and the worker's parser agree on valid and invalid requests.


def worker_accepts_request(payload: bytes) -> bool:
    try:
        parse_chat_request(payload, "s1", 65536)
    except RequestError as exc:
        assert exc.code is ErrorCode.INVALID_REQUEST, exc.message
        return False
    return True


def worker_accepts_control(payload: bytes) -> bool:
    try:
        parse_control(payload, 65536)
    except RequestError as exc:
        assert exc.code is ErrorCode.INVALID_REQUEST, exc.message
        return False
    return True


VALID_REQUESTS = [
    {"message": "Hello!"},
    {"sessionId": "s1", "message": "Hello!", "maxTokens": 64},  # the script this worker replaces
    {
        "message": "Hi",
        "sessionId": "s1",
        "maxTokens": 64,
        "temperature": 0.7,
        "topP": 0.95,
        "systemPrompt": "Be brief.",
        "requestId": "r-1",
        "stream": True,
    },
    {"message": "Hi", "temperature": 0, "topP": 1},  # integers are numbers
    {"message": "Hi", "maxTokens": None, "temperature": None, "requestId": None},  # null: the default
    {"message": "Hi", "responseFormat": {"type": "json_object"}},
    {"message": "Hi", "responseFormat": {"type": "json_schema", "schema": {"type": "object"}}},
    {"message": "Hi", "requestId": "r" * 128},
]

INVALID_REQUESTS = [
    {},  # no message
    {"message": ""},
    {"message": "Hi", "max_tokens": 5},  # unknown field (snake_case typo)
    {"message": "Hi", "extra": 1},
    {"message": 5},  # wrong types
    {"message": "Hi", "maxTokens": "5"},
    {"message": "Hi", "maxTokens": True},
    {"message": "Hi", "stream": 1},
    {"message": "Hi", "stream": "yes"},
    {"message": "Hi", "temperature": "0.7"},
    {"message": "Hi", "temperature": False},
    {"message": "Hi", "maxTokens": 0},  # out of range
    {"message": "Hi", "temperature": 2.5},
    {"message": "Hi", "topP": 0},
    {"message": "Hi", "requestId": ""},
    {"message": "Hi", "requestId": "r" * 129},
    {"message": "Hi", "responseFormat": {"type": "text"}},
    {"message": "Hi", "responseFormat": {"type": "json_schema"}},
    {"message": "Hi", "responseFormat": {"type": "json_object", "schema": {}}},
    {"message": "Hi", "responseFormat": {"type": "json_schema", "schema": []}},
]


@pytest.mark.parametrize("data", VALID_REQUESTS, ids=range(len(VALID_REQUESTS)))
def test_valid_requests_pass_schema_and_worker(data: dict[str, Any]) -> None:
    payload = json.dumps(data).encode()
    assert schema_accepts("request", payload)
    assert worker_accepts_request(payload)


@pytest.mark.parametrize("data", INVALID_REQUESTS, ids=range(len(INVALID_REQUESTS)))
def test_invalid_requests_fail_schema_and_worker(data: dict[str, Any]) -> None:
    payload = json.dumps(data).encode()
    assert not schema_accepts("request", payload)
    assert not worker_accepts_request(payload)


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=3) | st.just("r" * 129)
_VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-2, 3)
    | st.floats(-1, 3, allow_nan=False)
    | _TEXT
    | st.just([])
    | st.just({})
    | st.sampled_from(
        [
            {"type": "json_object"},
            {"type": "json_schema", "schema": {"type": "object"}},
            {"type": "json_schema", "schema": {}},
            {"type": "json_schema"},
            {"type": "text"},
        ]
    )
)


def _mostly(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Three times in four a value of the right type, else any value (one_of would flatten)."""
    return st.integers(0, 3).flatmap(lambda pick: right if pick else _VALUES)


_RIGHT = {
    "sessionId": _TEXT,
    "maxTokens": st.integers(-1, 3000),
    "temperature": st.floats(-1, 3, allow_nan=False) | st.integers(-1, 3),
    "topP": st.floats(-0.5, 1.5, allow_nan=False) | st.integers(-1, 2),
    "systemPrompt": _TEXT,
    "requestId": _TEXT,
    "stream": st.booleans(),
    "responseFormat": _VALUES,
}
# Each field of the right type or of any type; now and then a field the worker does not know.
_REQUESTS = st.builds(
    lambda known, unknown: {**known, **unknown},
    st.fixed_dictionaries(
        {"message": _mostly(_TEXT.filter(bool))}, optional={key: _mostly(right) for key, right in _RIGHT.items()}
    ),
    st.dictionaries(st.sampled_from(["max_tokens", "session_id", "other", "Message"]), _VALUES, max_size=1),
)


@settings(max_examples=400, deadline=None)
@given(_REQUESTS)
def test_schema_and_worker_agree_on_any_request(data: dict[str, Any]) -> None:
    """Random requests, right and wrong: the schema accepts exactly those the parser accepts,
    but for the rules it cannot express (described): integral floats as integers, sessionId
    against the topic (here the topic's session is made equal to it)."""
    max_tokens = data.get("maxTokens")
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        return  # 2.0: an integer to JSON Schema, a float to the strict parser
    session = data.get("sessionId")
    payload = json.dumps(data).encode()
    try:
        parse_chat_request(payload, session if isinstance(session, str) else "s1", 65536)
        accepted = True
    except RequestError as exc:
        assert exc.code is ErrorCode.INVALID_REQUEST, exc.message
        accepted = False
    assert schema_accepts("request", payload) is accepted, data


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b'{"message": "Hi", "maxTokens": 2.0}', "strict types: JSON Schema counts 2.0 as an integer"),
        (b'{"message": "Hi", "sessionId": "other"}', "must equal the topic's session"),
        (b'{"message": "Hi", "responseFormat": {"type": "json_schema", "schema": {"type": 5}}}', "invalid schema"),
    ],
)
def test_what_the_schema_cannot_express_is_described(payload: bytes, why: str) -> None:
    """Refused by the worker though the schema allows it: each case is in the description."""
    assert schema_accepts("request", payload), why
    with pytest.raises(RequestError):
        parse_chat_request(payload, "s1", 65536)
    description = validator("request").schema["description"]
    for phrase in ("`2.0`", "`sessionId`, if given, equals the topic's", "`max_tokens_limit`", "`invalid_schema`"):
        assert phrase in description


@pytest.mark.parametrize(
    ("data", "valid"),
    [
        ({"action": "reset"}, True),
        ({"action": "cancel", "requestId": "r-1"}, True),
        ({"action": "anything"}, True),  # unsupported_action, answered later: still a valid payload
        ({}, False),
        ({"action": 1}, False),
        ({"action": "cancel", "request_id": "r-1"}, False),
        ({"action": "cancel", "requestId": ""}, False),
    ],
)
def test_control_schema_agrees_with_worker(data: dict[str, Any], valid: bool) -> None:
    payload = json.dumps(data).encode()
    assert schema_accepts("control", payload) is valid
    assert worker_accepts_control(payload) is valid
