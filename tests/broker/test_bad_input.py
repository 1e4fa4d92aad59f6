"""Bad input never hurts (issue 4, point 9): through the real broker, every kind of bad request
gets one error reply with a stable code, is acknowledged, reaches no engine, and the worker
goes on serving; an exception while handling a message never stops the MQTT network loop."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import worker.transport.mqtt
from devtools.fakes import Harness
from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.waiting import PATIENCE
from worker.engine.port import EngineInfo
from worker.protocol.messages import log_ref

PAYLOAD_LIMIT = 120_000


def as_bytes(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("malformed", b'{"message": "x",', "bad_json"),
    ("not-utf8", b'{"message": "\xff\xfe"}', "bad_json"),
    ("utf16", '{"message": "x"}'.encode("utf-16"), "bad_json"),
    ("lone-surrogate", b'{"message": "x", "requestId": "\\ud800"}', "bad_json"),
    ("huge-int", b'{"message": "x", "maxTokens": ' + b"9" * 5000 + b"}", "bad_json"),
    ("deep", b"[" * 100_000, "bad_json"),
    ("array", [1, 2], "bad_json"),
    ("string", "hello", "bad_json"),
    ("null", None, "bad_json"),
    ("empty-payload", b"", "bad_json"),
    ("message-int", {"message": 5}, "invalid_request"),
    ("message-null", {"message": None}, "invalid_request"),
    ("stream-string", {"message": "x", "stream": "yes"}, "invalid_request"),
    ("stream-int", {"message": "x", "stream": 1}, "invalid_request"),
    ("request-id-int", {"message": "x", "requestId": 5}, "invalid_request"),
    ("system-prompt-list", {"message": "x", "systemPrompt": ["a"]}, "invalid_request"),
    ("response-format-string", {"message": "x", "responseFormat": "json"}, "invalid_request"),
    ("response-format-unknown", {"message": "x", "responseFormat": {"type": "xml"}}, "invalid_request"),
    ("missing-message", {"maxTokens": 3}, "invalid_request"),
    ("empty-message", {"message": ""}, "invalid_request"),
    ("max-tokens-zero", {"message": "x", "maxTokens": 0}, "invalid_request"),
    ("max-tokens-negative", {"message": "x", "maxTokens": -3}, "invalid_request"),
    ("max-tokens-huge", {"message": "x", "maxTokens": 10**12}, "invalid_request"),
    ("max-tokens-float", {"message": "x", "maxTokens": 2.5}, "invalid_request"),
    ("max-tokens-whole-float", {"message": "x", "maxTokens": 2.0}, "invalid_request"),
    ("max-tokens-string", {"message": "x", "maxTokens": "3"}, "invalid_request"),
    ("max-tokens-bool", {"message": "x", "maxTokens": True}, "invalid_request"),
    ("temperature-negative", {"message": "x", "temperature": -0.1}, "invalid_request"),
    ("temperature-high", {"message": "x", "temperature": 2.5}, "invalid_request"),
    ("temperature-nan", b'{"message": "x", "temperature": NaN}', "invalid_request"),
    ("temperature-string", {"message": "x", "temperature": "0.5"}, "invalid_request"),
    ("top-p-zero", {"message": "x", "topP": 0}, "invalid_request"),
    ("top-p-high", {"message": "x", "topP": 1.5}, "invalid_request"),
    ("top-p-infinite", b'{"message": "x", "topP": Infinity}', "invalid_request"),
    ("unknown-field", {"message": "x", "max_tokens": 3}, "invalid_request"),
    ("other-session", {"message": "x", "sessionId": "someone-else"}, "invalid_request"),
    ("message-over-limit", {"message": "w " * 60}, "too_long"),  # max_message_tokens 50
    ("prompt-over-context", {"message": "w " * 40, "maxTokens": 30}, "too_long"),  # context 64
    ("too-large", {"message": "x" * PAYLOAD_LIMIT}, "too_large"),
    (
        "invalid-schema",
        {"message": "x", "responseFormat": {"type": "json_schema", "schema": {"type": 5}}},
        "invalid_schema",
    ),
]

BAD_CONTROLS: list[tuple[str, Any, str]] = [
    ("control-unknown-action", {"action": "explode"}, "unsupported_action"),
    ("control-malformed", b"{", "bad_json"),
    ("control-action-int", {"action": 5}, "invalid_request"),
    ("control-unknown-field", {"action": "reset", "force": True}, "invalid_request"),
    ("control-too-large", {"action": "reset", "requestId": "r", "x": "y" * PAYLOAD_LIMIT}, "too_large"),
]


@pytest.fixture
def live(broker: Mosquitto) -> Iterator[LiveWorker]:
    worker = LiveWorker(
        broker.port,
        limits={"max_payload_bytes": PAYLOAD_LIMIT, "max_message_tokens": 50},
        generation={"max_tokens": 3, "max_tokens_limit": 32},
    )
    # A small context, so that a short message plus maxTokens can exceed it.
    worker.engine.info = EngineInfo("fake", "0", "fake", max_model_len=64, block_size=16, prefix_caching=True)
    yield worker
    worker.close()


@pytest.fixture
def frontend(broker: Mosquitto, live: LiveWorker) -> Iterator[Client]:
    client = Client(broker.port, [f"{live.prefix}/#"])
    yield client
    client.close()


def answers(client: Client, live: LiveWorker, session: str) -> list[dict[str, Any]]:
    reply_topic = live.topic("eve", session, "reply")
    return [m.json() for m in client.seen if m.topic == reply_topic]


def test_every_bad_request_gets_one_error_is_acked_and_generates_nothing(live: LiveWorker, frontend: Client) -> None:
    for name, payload, _ in BAD_REQUESTS:
        frontend.publish(live.topic("eve", name), as_bytes(payload))
    for name, payload, _ in BAD_CONTROLS:
        frontend.publish(live.topic("eve", name, "control"), as_bytes(payload))
    # The worker handles messages in order: once this is answered, so is everything before it.
    frontend.publish(live.topic("eve", "good"), {"message": "hello", "requestId": "after"})
    good = frontend.wait_topic(live.topic("eve", "good", "reply")).json()
    assert good["requestId"] == "after" and good["finishReason"] == "length"
    for name, _, code in BAD_REQUESTS + BAD_CONTROLS:
        replies = answers(frontend, live, name)
        assert len(replies) == 1, (name, replies)
        error = replies[0]["error"]
        assert (error["code"], replies[0]["sessionId"]) == (code, name), (name, replies[0])
        assert 10 <= len(error["message"]) <= 1000, (name, error)
    # Each was acknowledged, and only the good request reached the engine.
    acked_topics = [m.topic for m in live.call(lambda: list(live.transport.acked))]
    for name, _, _ in BAD_REQUESTS:
        assert acked_topics.count(live.topic("eve", name)) == 1, name
    for name, _, _ in BAD_CONTROLS:
        assert acked_topics.count(live.topic("eve", name, "control")) == 1, name
    assert [r.request_id.split("/")[-2] for r in live.engine.requests] == [log_ref("after")]
    assert sum(live.call(lambda: dict(live.service.stats.errors_by_code)).values()) == len(BAD_REQUESTS + BAD_CONTROLS)
    live.wait_idle()


def test_invalid_topics_are_acked_and_counted_without_reply(live: LiveWorker, frontend: Client) -> None:
    topics = [
        f"{live.prefix}/$eve/s1/request",
        f"{live.prefix}/eve/{'s' * 129}/request",
        f"{live.prefix}/_worker/s1/request",
        f"{live.prefix}/eve/s%201/control",
        f"{live.prefix}/eve/s1/extra/request",  # not subscribed: never delivered
    ]
    for topic in topics:
        frontend.publish(topic, {"message": "x"})
    frontend.publish(live.topic("eve", "good"), {"message": "hello"})
    frontend.wait_topic(live.topic("eve", "good", "reply"))
    assert [m.topic for m in frontend.seen if m.topic.endswith(("/reply", "/stream"))] == []
    assert live.call(lambda: live.service.stats.invalid_topics) == 4
    # The good request is acknowledged once its reply's PUBACK is back: right after the client
    # has the reply, so waited for.
    assert len(live.wait_acked(5)) == 5
    assert len(live.engine.requests) == 1


@pytest.mark.parametrize(
    "topic",
    [
        "chat/+/s1/request",
        "chat/u/#/request",
        "chat/u/s+1/request",
        "chat/$u/s1/request",
        "chat/u/s\x001/request",
        "chat/u/" + "s" * 129 + "/request",
        "chat/u\x00/s1/control",
    ],
)
def test_topics_no_broker_would_deliver_are_refused_too(topic: str) -> None:
    """Wildcards and NUL cannot be in a PUBLISH topic (paho refuses them, mosquitto drops the
    client): should a broker pass them on anyway, they are invalid topics."""
    import asyncio

    async def scenario() -> None:
        h = Harness()
        h.transport.deliver(topic, {"message": "x"})
        await h.run_until(lambda: h.transport.acked)
        assert h.transport.published == [] and h.service.stats.invalid_topics == 1 and h.engine.started == []

    asyncio.run(scenario())


def test_an_exception_in_the_message_callback_does_not_stop_the_network_loop(
    broker: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Receive Maximum 1: the failed message must also be acknowledged, or it would hold the
    # only slot and the broker would send nothing more.
    live = LiveWorker(broker.port, limits={"max_pending_requests": 1}, generation={"max_tokens": 2})
    client = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    real = worker.transport.mqtt.InboundMessage

    def failing(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("payload") == b'"boom"':
            raise RuntimeError("a bug in the callback")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.transport.mqtt, "InboundMessage", failing)
    try:
        client.publish(live.topic("eve", "s1"), "boom")
        client.publish(live.topic("eve", "s1"), {"message": "still there?", "requestId": "r1"})
        assert client.wait_topic(live.topic("eve", "s1", "reply"), timeout=PATIENCE).json()["requestId"] == "r1"
        assert live.transport.connects == 1
    finally:
        client.close()
        live.close()


def test_an_exception_while_dispatching_does_not_stop_the_worker(broker: Mosquitto) -> None:
    live = LiveWorker(broker.port, limits={"max_pending_requests": 1}, generation={"max_tokens": 2})
    client = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    dispatch = live.service.dispatch

    async def failing(message: Any) -> None:
        if b"boom" in message.payload:
            raise RuntimeError("a bug in dispatch")
        await dispatch(message)

    live.service.dispatch = failing  # type: ignore[method-assign]
    try:
        client.publish(live.topic("eve", "s1"), {"message": "boom", "requestId": "r0"})
        client.publish(live.topic("eve", "s1"), {"message": "still there?", "requestId": "r1"})
        # The failed message is answered (never acknowledged in silence), and the next one runs.
        failed = client.wait_topic(live.topic("eve", "s1", "reply"), timeout=PATIENCE).json()
        assert (failed["requestId"], failed["error"]["code"]) == ("r0", "internal_error")
        answer = client.wait_topic(live.topic("eve", "s1", "reply"), timeout=PATIENCE).json()
        assert answer["requestId"] == "r1" and "reply" in answer, answer
        assert len(live.wait_acked(2)) == 2
    finally:
        client.close()
        live.close()


def test_a_message_whose_properties_cannot_be_read_is_still_answered(
    broker: Mosquitto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handed over without its properties (here: the ResponseTopic): answered on the session's
    own reply topic, not dropped."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    live = LiveWorker(broker.port, generation={"max_tokens": 2})
    client = Client(broker.port, [f"{live.prefix}/+/+/reply"])
    real = worker.transport.mqtt.InboundMessage

    def failing(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("response_topic") is not None:
            raise RuntimeError("a bug reading the properties")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.transport.mqtt, "InboundMessage", failing)
    try:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = live.topic("eve", "s2", "reply")
        client.publish(live.topic("eve", "s2"), {"message": "hi", "requestId": "p1"}, properties=props)
        assert client.wait_topic(live.topic("eve", "s2", "reply"), timeout=PATIENCE).json()["requestId"] == "p1"
        assert len(live.wait_acked(1)) == 1
    finally:
        client.close()
        live.close()
