"""Backpressure (issue 4, point 8), through the real broker: Receive Maximum, the per-session
queue, deadlines and MQTT Message Expiry, and a flood of thousands of requests that all get
exactly one answer while the worker's memory stays bounded."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import psutil
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from devtools.fakes import mentions
from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.waiting import PATIENCE, eventually
from worker.config.models import LimitsConfig
from worker.transport.port import InboundMessage


@pytest.fixture
def frontend(broker: Mosquitto) -> Iterator[Client]:
    client = Client(broker.port, ["+/+/+/reply"])
    yield client
    client.close()


def answers(
    client: Client, live: LiveWorker, session: str, count: int, timeout: float = PATIENCE
) -> list[dict[str, Any]]:
    topic = live.topic("bob", session, "reply")
    return [client.wait_topic(topic, timeout).json() for _ in range(count)]


def code(answer: dict[str, Any]) -> str | None:
    return answer.get("error", {}).get("code")


def held(live: LiveWorker, request_id: str) -> asyncio.Event:
    """An event that ``request_id``'s generation waits for before its first token (release
    it with ``live.call(event.set)``): it runs for as long as the test needs."""
    event = asyncio.Event()
    live.engine.holds[request_id] = event
    return event


def arrival(live: LiveWorker, request_id: str) -> InboundMessage:
    """The request's message once it has reached the worker's loop (its arrival time is set)."""
    return eventually(
        lambda: next(
            (m for m in list(live.transport.received) if json.loads(m.payload)["requestId"] == request_id), None
        ),
        f"{request_id} did not arrive",
    )


def test_pending_requests_are_bounded_by_receive_maximum(broker: Mosquitto, frontend: Client) -> None:
    """The broker holds back requests beyond max_pending_requests (sent as Receive Maximum):
    they wait there, not in the worker, and are served as slots free up instead of being
    refused busy. (One slot: mosquitto 2.0.11 sends up to Receive Maximum more messages per
    PUBACK, so with more slots it overshoots, and the worker's own busy check bounds it.)"""
    live = LiveWorker(broker.port, limits={"max_pending_requests": 1})
    try:
        for i in range(4):
            frontend.publish(live.topic("bob", f"s{i}"), {"message": "x", "maxTokens": 20, "requestId": f"r{i}"})
        replies = [answers(frontend, live, f"s{i}", 1)[0] for i in range(4)]
        assert [code(r) for r in replies] == [None] * 4
        assert live.engine.most_running == 1
    finally:
        live.close()


def test_a_session_queues_at_most_four_turns_and_others_are_served(broker: Mosquitto, frontend: Client) -> None:
    assert LimitsConfig().max_queued_per_session == 4
    live = LiveWorker(broker.port)
    release = held(live, "c0")  # running until the test has its answers to the others
    try:
        for i in range(7):  # one runs, four wait, two are refused at once
            frontend.publish(live.topic("bob", "chatty"), {"message": "x", "maxTokens": 3, "requestId": f"c{i}"})
        frontend.publish(live.topic("bob", "quiet"), {"message": "x", "maxTokens": 1, "requestId": "q"})
        first = answers(frontend, live, "chatty", 2)
        assert [(a["requestId"], code(a)) for a in first] == [("c5", "busy"), ("c6", "busy")]
        assert "queued" in first[0]["error"]["message"]
        assert code(answers(frontend, live, "quiet", 1)[0]) is None  # not behind the chatty session
        live.call(release.set)
        rest = answers(frontend, live, "chatty", 5)
        assert [(a["requestId"], code(a)) for a in rest] == [(f"c{i}", None) for i in range(5)]
    finally:
        live.call(release.set)
        live.close()


def test_a_request_past_its_deadline_is_expired_not_generated(broker: Mosquitto, frontend: Client) -> None:
    """A request that waits behind its session's running turn past request_deadline is
    answered expired, not generated. Load-independent: "slow" is held running until "late"
    has arrived and its deadline has passed, and request_deadline (read as each request
    arrives) is one no loaded machine misses for the requests that do not wait, and a
    millisecond for "late"."""
    live = LiveWorker(broker.port, limits={"request_deadline": PATIENCE})
    release = held(live, "slow")
    try:
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "maxTokens": 2, "requestId": "slow"})
        eventually(lambda: any(mentions(r, "slow") for r in live.engine.started), "slow did not start")
        live.call(lambda: setattr(live.config.limits, "request_deadline", 0.001))
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "maxTokens": 2, "requestId": "late"})
        late_at = arrival(live, "late").received_at
        eventually(lambda: time.monotonic() > late_at + 0.001, "late's deadline did not pass")
        live.call(release.set)
        slow, late = answers(frontend, live, "s1", 2)
        assert (slow["requestId"], code(slow)) == ("slow", None)
        assert (late["requestId"], code(late)) == ("late", "expired") and "waiting" in late["error"]["message"]
        assert not any(mentions(r, "late") for r in live.engine.started)
        live.call(lambda: setattr(live.config.limits, "request_deadline", PATIENCE))
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "maxTokens": 2, "requestId": "on-time"})
        assert code(answers(frontend, live, "s1", 1)[0]) is None
        live.wait_idle()
    finally:
        live.call(release.set)
        live.close()


def test_a_request_whose_message_expiry_passed_is_expired_not_generated(broker: Mosquitto, frontend: Client) -> None:
    """ "brief" (MQTT Message Expiry 1 s, the shortest there is) waits behind "slow", which is
    held running until brief's expiry has passed (load-independent)."""
    live = LiveWorker(broker.port, limits={"request_deadline": 0})
    release = held(live, "slow")
    expiring = Properties(PacketTypes.PUBLISH)
    expiring.MessageExpiryInterval = 1
    try:
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "maxTokens": 2, "requestId": "slow"})
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "requestId": "brief"}, properties=expiring)
        frontend.publish(live.topic("bob", "s1"), {"message": "x", "maxTokens": 2, "requestId": "patient"})
        expires = arrival(live, "brief").expires_at
        assert expires is not None
        eventually(lambda: time.monotonic() > expires, "brief's expiry did not pass", interval=0.1)
        live.call(release.set)
        slow, brief, patient = answers(frontend, live, "s1", 3)
        assert [code(slow), code(patient)] == [None, None]  # no deadline but the message's own
        assert (brief["requestId"], code(brief)) == ("brief", "expired")
        assert not any(mentions(r, "brief") for r in live.engine.started)
    finally:
        live.call(release.set)
        live.close()


class FloodClient:
    """A frontend that publishes without waiting and counts the answers per request."""

    def __init__(self, port: int, subscription: str) -> None:
        self.answers: collections.Counter[tuple[str, str]] = collections.Counter()
        self.codes: collections.Counter[str | None] = collections.Counter()
        self.count = 0
        self._lock = threading.Lock()
        subscribed = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(subscription, qos=1)
        assert subscribed.wait(PATIENCE), "the broker did not acknowledge the subscription"

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        answer = json.loads(message.payload)
        with self._lock:
            self.answers[(answer["sessionId"], answer["requestId"])] += 1
            self.codes[answer.get("error", {}).get("code")] += 1
            self.count += 1

    def wait_for(self, count: int) -> None:
        eventually(lambda: self.count >= count, lambda: f"{self.count} of {count} answered; codes {self.codes}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_flood_gets_one_answer_per_request_and_memory_stays_bounded(broker: Mosquitto) -> None:
    sessions, per_session = 300, 10
    # One user floods: the per-user rate limit (tests/broker/test_ratelimit.py) is off, so that what is
    # measured is the backpressure.
    live = LiveWorker(broker.port, generation={"max_tokens": 2}, limits={"max_requests_per_user_per_minute": 0})
    flood = FloodClient(broker.port, f"{live.prefix}/+/+/reply")
    process = psutil.Process()
    try:

        def send(round_: int) -> None:
            # Session by session: each session's turns arrive back to back, beyond its queue.
            for s in range(sessions):
                for turn in range(per_session):
                    payload = json.dumps({"message": "x", "requestId": f"{round_}-{turn}"}).encode()
                    flood.client.publish(live.topic("bob", f"s{s}"), payload, qos=1)

        send(0)  # warm up: sessions, histories and caches reach their steady size
        flood.wait_for(sessions * per_session)
        live.wait_idle()
        rss_before = process.memory_info().rss
        send(1)
        flood.wait_for(2 * sessions * per_session)
        live.wait_idle()
        rss_growth = process.memory_info().rss - rss_before
        # A marker: the worker publishes its answer after everything it answered before, so a
        # second answer to anything has arrived by the time the marker's has.
        flood.client.publish(live.topic("bob", "marker"), json.dumps({"message": "x", "requestId": "m"}), qos=1)
        eventually(lambda: flood.answers[("marker", "m")], "no answer to the marker")
        with flood._lock:
            del flood.answers[("marker", "m")]
            flood.codes[None] -= 1

        expected = {(f"s{s}", f"{r}-{t}") for r in range(2) for s in range(sessions) for t in range(per_session)}
        assert set(flood.answers) == expected and set(flood.answers.values()) == {1}, flood.codes
        # Replies, and busy for the turns beyond a session's queue: nothing else, nothing lost.
        assert set(flood.codes) == {None, "busy"} and flood.codes[None] >= sessions * 2, flood.codes
        assert len(live.wait_acked(len(expected) + 1)) == len(expected) + 1  # and the marker
        # Nothing is left in flight, and the second round did not make the process grow.
        assert live.call(lambda: (live.service.pending, len(live.service._runtime))) == (0, 0)
        assert rss_growth < 32 * 2**20, rss_growth
    finally:
        flood.close()
        live.close()
