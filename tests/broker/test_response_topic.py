"""No reply redirection (issue 5, point 4), through the real broker: a request's MQTT 5
ResponseTopic is honoured only if it matches mqtt.allowed_response_topics; anything else is
answered on the session's own reply topic, and the attempt is logged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from loguru import logger

from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client, asking
from devtools.waiting import PATIENCE
from worker.config.models import WorkerConfig
from worker.protocol.topics import InvalidTopic, SessionAddress, Topics


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    yield lines
    logger.remove(sink)


def test_another_users_reply_topic_is_not_honoured(broker: Mosquitto, warnings: list[str]) -> None:
    live = LiveWorker(broker.port)
    client = Client(broker.port, [f"{live.prefix}/#"])
    try:
        victim = live.topic("alice", "s1", "reply")
        request = {"message": "x", "maxTokens": 2, "requestId": "r1"}
        client.publish(live.topic("mallory", "s1"), request, properties=asking(victim, b"c1"))
        answer = client.wait_for(lambda m: m.topic.endswith("/reply"), PATIENCE)
        assert answer.topic == live.topic("mallory", "s1", "reply")
        assert answer.json()["requestId"] == "r1" and "error" not in answer.json()
        assert answer.properties.CorrelationData == b"c1"
        # the same for a wildcard, a topic outside the prefix, an empty one
        for wanted in [f"{live.prefix}/alice/#", "elsewhere/alice/s1/reply", ""]:
            client.publish(
                live.topic("mallory", "s1"), request | {"requestId": f"w{wanted}"}, properties=asking(wanted, b"c2")
            )
            again = client.wait_for(lambda m: m.topic.endswith("/reply"), PATIENCE)
            assert again.topic == live.topic("mallory", "s1", "reply")
        live.wait_idle()
        assert not [m for m in client.seen if "/alice/" in m.topic]
        # Named by the session only: the topic asked for is the client's text (DEBUG).
        assert any("A ResponseTopic of mallory/s1 is not allowed" in line for line in warnings)
        assert not any(victim in line for line in warnings)
    finally:
        client.close()
        live.close()


def test_an_allowed_response_topic_is_honoured(broker: Mosquitto, warnings: list[str]) -> None:
    live = LiveWorker(broker.port, mqtt={"allowed_response_topics": ["frontend-replies/+"]})
    client = Client(broker.port, [f"{live.prefix}/#", "frontend-replies/#"])
    try:
        request = {"message": "x", "maxTokens": 2, "requestId": "r1"}
        client.publish(live.topic("bob", "s1"), request, properties=asking("frontend-replies/gw1", b"c1"))
        answer = client.wait_for(lambda m: m.topic.endswith("/reply") or m.topic.startswith("frontend-"), PATIENCE)
        assert answer.topic == "frontend-replies/gw1"
        assert answer.json()["requestId"] == "r1" and answer.properties.CorrelationData == b"c1"
        # a wildcard topic matches the filter but is no topic: not honoured
        wild = request | {"requestId": "r2"}
        client.publish(live.topic("bob", "s1"), wild, properties=asking("frontend-replies/+", b"c2"))
        answer = client.wait_for(lambda m: m.topic.endswith("/reply") or m.topic.startswith("frontend-"), PATIENCE)
        assert answer.topic == live.topic("bob", "s1", "reply") and answer.json()["requestId"] == "r2"
        # one level deeper than the filter: not honoured
        deeper = request | {"requestId": "r3"}
        client.publish(live.topic("bob", "s1"), deeper, properties=asking("frontend-replies/gw1/x", b"c3"))
        answer = client.wait_for(lambda m: m.topic.endswith("/reply") or m.topic.startswith("frontend-"), PATIENCE)
        assert answer.topic == live.topic("bob", "s1", "reply") and answer.json()["requestId"] == "r3"
    finally:
        client.close()
        live.close()


def test_topics_are_built_only_from_validated_parts() -> None:
    topics = Topics(WorkerConfig().mqtt.topic_prefix)
    address = SessionAddress("alice", "s1")
    assert topics.reply(address) == "chat/alice/s1/reply"
    assert topics.stream(address) == "chat/alice/s1/stream"
    for user, session in [("a/b", "s"), ("a", "s/t"), ("+", "s"), ("a", "#"), ("_worker", "s"), ("", "s"), ("a", "")]:
        with pytest.raises(InvalidTopic):
            SessionAddress(user, session)
    with pytest.raises(InvalidTopic):
        topics.status("gpu/1")
    for bad in [
        "chat/a/b/c/request",
        "chat/a/request",
        "chat/_worker/x/request",
        "other/a/b/request",
        "chat/a/b/reply",
    ]:
        with pytest.raises(InvalidTopic):
            topics.parse(bad)
