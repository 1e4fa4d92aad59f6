"""Topic ACL (issue 5, point 3): mosquitto with passwords and the ACL of docs/security.md (read
from the document, so that the recipe is what is tested), the in-process worker logging in as
its own user, and users alice and bob. alice is answered and sees the worker online; bob can
neither read alice's replies nor reach alice's session; anonymous clients are refused."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from devtools.acl import PASSWORDS, documented_acl_broker, logged_in_worker
from devtools.fakes import mentions
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Received

PRESENCE = "chat/_worker/gpu-1/status"


class UserClient:
    """An MQTT 5 client logged in as a user; records what it receives and its SUBACK/PUBACK codes."""

    def __init__(self, port: int, username: str | None, password: str | None = None) -> None:
        self.messages: queue.Queue[Received] = queue.Queue()
        self.connect_reason: Any = None
        self.suback: queue.Queue[list[Any]] = queue.Queue()
        self.puback: queue.Queue[Any] = queue.Queue()
        self._connected = queue.Queue[Any]()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        if username is not None:
            self._client.username_pw_set(username, password)
        self._client.on_connect = lambda c, u, f, reason, p: self._connected.put(reason)
        self._client.on_message = lambda c, u, m: self.messages.put(
            Received(m.topic, bytes(m.payload), bool(m.retain), m.properties)
        )
        self._client.on_subscribe = lambda c, u, mid, reasons, p: self.suback.put(list(reasons))
        self._client.on_publish = lambda c, u, mid, reason, p: self.puback.put(reason)
        self._client.connect("127.0.0.1", port, keepalive=30)
        self._client.loop_start()
        self.connect_reason = self._connected.get(timeout=10)

    @property
    def connected(self) -> bool:
        return not self.connect_reason.is_failure

    def subscribe(self, topic: str) -> Any:
        self._client.subscribe(topic, qos=1)
        return self.suback.get(timeout=5)[0]

    def publish(self, topic: str, payload: dict[str, Any]) -> Any:
        self._client.publish(topic, json.dumps(payload).encode(), qos=1)
        return self.puback.get(timeout=5)

    def next(self, timeout: float) -> Received | None:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@pytest.fixture
def acl_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = documented_acl_broker(tmp_path)
    yield broker
    broker.stop()


def test_each_user_reaches_only_its_own_namespace(acl_broker: Mosquitto) -> None:
    live = logged_in_worker(acl_broker.port)
    alice = UserClient(acl_broker.port, "alice", PASSWORDS["alice"])
    bob = UserClient(acl_broker.port, "bob", PASSWORDS["bob"])
    try:
        assert alice.connected and bob.connected
        assert alice.subscribe("chat/alice/+/reply").value < 0x80
        # bob asks for alice's replies. mosquitto 2.0.11 grants the subscription and checks the
        # ACL on each message it would deliver: nothing of alice's ever reaches him.
        for topic in ["chat/alice/+/reply", "chat/alice/+/stream", "chat/+/+/reply", "chat/#"]:
            bob.subscribe(topic)

        # bob injects into alice's session: the broker refuses it; the worker never sees it
        assert bob.publish("chat/alice/s1/request", {"message": "injected", "requestId": "evil"}).is_failure
        assert bob.publish("chat/alice/s1/control", {"action": "reset"}).is_failure

        assert (
            alice.publish("chat/alice/s1/request", {"message": "hello", "requestId": "a1", "maxTokens": 3}).value < 0x80
        )
        reply = alice.next(15)
        assert reply is not None and reply.topic == "chat/alice/s1/reply"
        assert reply.json()["requestId"] == "a1" and "error" not in reply.json()

        # bob's own request is answered to bob, not to alice
        assert bob.publish("chat/bob/s1/request", {"message": "hi", "requestId": "b1", "maxTokens": 3}).value < 0x80
        mine = bob.next(15)
        while mine is not None and mine.topic == PRESENCE:  # chat/# covers it, and the ACL grants it
            mine = bob.next(15)
        assert mine is not None and mine.topic == "chat/bob/s1/reply"

        live.wait_idle()
        time.sleep(0.5)  # anything misrouted would have arrived by now
        bob_rest = [m for m in iter(lambda: bob.next(0.1), None) if m.topic != PRESENCE]
        assert list(iter(lambda: alice.next(0.1), None)) == []
        # bob's overlapping subscriptions bring copies of his own reply and stream; nothing else
        assert all(m.topic.startswith("chat/bob/s1/") for m in bob_rest), [m.topic for m in bob_rest]
        assert not any(mentions(started, "evil") or mentions(started, "injected") for started in live.engine.started)
        assert len(live.engine.started) == 2
        # alice's history holds her turn only: bob's reset never reached it
        assert live.call(lambda: len(live.service.sessions.get("alice/s1").turns)) == 1

        # Every user sees the workers' presence (retained), as chat frontends show it.
        assert alice.subscribe("chat/_worker/+/status").value < 0x80
        status = alice.next(5)
        assert status is not None and (status.topic, status.payload) == (PRESENCE, b"online")
    finally:
        alice.close()
        bob.close()
        live.close()


def test_anonymous_and_wrong_passwords_are_refused(acl_broker: Mosquitto) -> None:
    for username, password in [(None, None), ("alice", "bob-secret"), ("mallory", "x")]:
        client = UserClient(acl_broker.port, username, password)
        try:
            assert not client.connected, username
        finally:
            client.close()
