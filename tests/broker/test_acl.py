"""Topic ACL (issue 5, point 3): mosquitto with passwords and the ACL of docs/security.md (read
from the document, so that the recipe is what is tested), the in-process worker logging in as
its own user, and users alice and bob. alice is answered and sees the worker online; bob can
neither read alice's replies nor reach alice's session; anonymous clients are refused. With the
device tools' block (issue 23): only the worker calls the devices and reads their answers."""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from devtools.acl import PASSWORDS, documented_acl_broker, logged_in_worker
from devtools.devices import SimulatedDevices
from devtools.fakes import mentions
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Received, probe_settings
from devtools.waiting import PATIENCE
from worker.config.models import MqttToolConfig
from worker.tools.mqtt import DeviceTools, response_topic_for
from worker.tools.port import CallContext
from worker.transport.mqtt import MqttTransport

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
        self.connect_reason = self._connected.get(timeout=PATIENCE)

    @property
    def connected(self) -> bool:
        return not self.connect_reason.is_failure

    def subscribe(self, topic: str) -> Any:
        self._client.subscribe(topic, qos=1)
        return self.suback.get(timeout=PATIENCE)[0]

    def publish(self, topic: str, payload: dict[str, Any]) -> Any:
        self._client.publish(topic, json.dumps(payload).encode(), qos=1)
        return self.puback.get(timeout=PATIENCE)

    def next(self, timeout: float = PATIENCE) -> Received | None:
        """The next message, or None once ``timeout`` has passed (0: what has arrived)."""
        try:
            return self.messages.get(timeout=timeout) if timeout else self.messages.get_nowait()
        except queue.Empty:
            return None

    def arrived(self) -> list[Received]:
        """Whatever has arrived and not been taken yet, without waiting."""
        return list(iter(lambda: self.next(0), None))

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
        reply = alice.next()
        assert reply is not None and reply.topic == "chat/alice/s1/reply"
        assert reply.json()["requestId"] == "a1" and "error" not in reply.json()

        # bob's own request is answered to bob, not to alice
        assert bob.publish("chat/bob/s1/request", {"message": "hi", "requestId": "b1", "maxTokens": 3}).value < 0x80
        mine = bob.next()
        while mine is not None and mine.topic == PRESENCE:  # chat/# covers it, and the ACL grants it
            mine = bob.next()
        assert mine is not None and mine.topic == "chat/bob/s1/reply"

        live.wait_idle()
        assert not any(mentions(started, "evil") or mentions(started, "injected") for started in live.engine.started)
        assert len(live.engine.started) == 2
        # alice's history holds her turn only: bob's reset never reached it
        assert live.call(lambda: len(live.service.sessions.get("alice/s1").turns)) == 1
        # Markers: one more turn each. Anything misrouted, published by the worker before
        # their answers, has arrived before them.
        alice.publish("chat/alice/s1/request", {"message": "again", "requestId": "a2", "maxTokens": 3})
        bob.publish("chat/bob/s1/request", {"message": "again", "requestId": "b2", "maxTokens": 3})
        alice_rest, bob_rest = until_reply(alice, "a2"), until_reply(bob, "b2")
        assert alice_rest == [], [m.topic for m in alice_rest]
        # bob's overlapping subscriptions bring copies of his own reply and stream; nothing else
        bob_rest = [m for m in bob_rest if m.topic != PRESENCE]
        assert all(m.topic.startswith("chat/bob/s1/") for m in bob_rest), [m.topic for m in bob_rest]

        # Every user sees the workers' presence (retained), as chat frontends show it.
        assert alice.subscribe("chat/_worker/+/status").value < 0x80
        status = alice.next()
        assert status is not None and (status.topic, status.payload) == (PRESENCE, b"online")
    finally:
        alice.close()
        bob.close()
        live.close()


def until_reply(user: UserClient, request_id: str) -> list[Received]:
    """What the user received before the reply to ``request_id``, which must come."""
    before: list[Received] = []
    while (message := user.next()) is not None:
        if message.topic.endswith("/reply") and message.json().get("requestId") == request_id:
            return before
        before.append(message)
    raise AssertionError(f"no reply to {request_id}; before it: {[m.topic for m in before]}")


def test_anonymous_and_wrong_passwords_are_refused(acl_broker: Mosquitto) -> None:
    for username, password in [(None, None), ("alice", "bob-secret"), ("mallory", "x")]:
        client = UserClient(acl_broker.port, username, password)
        try:
            assert not client.connected, username
        finally:
            client.close()


def test_the_device_tools_recipe_lets_only_the_worker_call_devices_and_read_their_answers(tmp_path: Path) -> None:
    """docs/security.md's device tools block, added to the topic ACL: the worker calls the lamp
    and gets its answer; alice can neither switch the lamp nor read the worker's answers; the
    worker's first block (replies) still holds beside its second."""
    broker = documented_acl_broker(tmp_path, devices=True)
    alice = UserClient(broker.port, "alice", PASSWORDS["alice"])
    devices = SimulatedDevices(port=broker.port, login=("devices", PASSWORDS["devices"]))
    devices.start()
    seen_by_alice: list[Received] = []

    async def run() -> None:
        settings = probe_settings(
            broker.port,
            username="worker",
            password=PASSWORDS["worker"],
            subscriptions=("chat/+/+/request",),
            status_topic=PRESENCE,
        )
        transport = MqttTransport(settings, asyncio.get_running_loop())
        transport.start()
        await asyncio.wait_for(transport.wait_connected(), PATIENCE)
        tools = DeviceTools(
            [MqttToolConfig(name="lamp_set", topic="devices/lamp/set", users=["*"], timeout=PATIENCE)],
            transport,
            response_topic_for("chat", "gpu-1"),
        )
        try:
            await tools.start()
            # alice listens where the answers and the calls go (granted by mosquitto, delivered never)
            for topic in ["chat/_tools/gpu-1/#", "chat/_tools/#", "devices/#"]:
                alice.subscribe(topic)
            assert alice.publish("devices/lamp/set", {"on": True}).is_failure  # not authorized
            assert devices.calls == [] and not devices.lamp_on

            outcome = await tools.call("lamp_set", {"on": True}, CallContext("r1", "c1", "alice/s1"))
            assert outcome.ok and json.loads(outcome.content) == {"on": True}, outcome
            assert [(c["topic"], c["toolCallId"]) for c in devices.calls] == [("devices/lamp/set", "c1")]

            assert alice.subscribe("chat/alice/+/reply").value < 0x80
            await transport.publish("chat/alice/s1/reply", b'{"requestId":"r1"}')
            # The worker published the call before this, and the broker had the lamp's answer
            # before the worker: anything of theirs misrouted to alice came before it.
            reply = alice.next()
            assert reply is not None and reply.topic == "chat/alice/s1/reply", reply
            seen_by_alice.extend(alice.arrived())
        finally:
            await tools.close()
            await transport.close(1)

    try:
        asyncio.run(run())
    finally:
        devices.stop()
        alice.close()
        broker.stop()
    assert seen_by_alice == []
