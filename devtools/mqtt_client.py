"""A plain paho MQTT v5 client, as a chat frontend or an observer: publishes, and records
everything it receives."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from worker.transport.mqtt import MqttSettings, set_tcp_nodelay


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    properties: Any

    def json(self) -> Any:
        return json.loads(self.payload)


class Client:
    """A chat frontend: publishes requests, records everything it receives."""

    def __init__(
        self,
        port: int,
        subscriptions: Sequence[str] = ("chat/#",),
        client_id: str = "",
        login: tuple[str, str] | None = None,
    ) -> None:
        self.messages: queue.Queue[Received] = queue.Queue()
        self.seen: list[Received] = []
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if login is not None:
            self._client.username_pw_set(*login)
        self._client.on_message = lambda c, u, m: self.messages.put(
            Received(m.topic, bytes(m.payload), bool(m.retain), m.properties)
        )
        self._client.connect("127.0.0.1", port, keepalive=30)
        set_tcp_nodelay(self._client)
        self._client.loop_start()
        for topic in subscriptions:
            result, _ = self._client.subscribe(topic, qos=1)
            assert result == mqtt.MQTT_ERR_SUCCESS
        time.sleep(0.2)  # let the SUBACKs arrive before the first publish

    def publish(self, topic: str, payload: Any, *, qos: int = 1, properties: Any = None, retain: bool = False) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        info = self._client.publish(topic, data, qos=qos, properties=properties, retain=retain)
        info.wait_for_publish(5)

    def wait_for(self, predicate: Callable[[Received], bool], timeout: float = 120) -> Received:
        """The first message (already seen or arriving) that satisfies predicate."""
        for message in self.seen:
            if predicate(message):
                self.seen.remove(message)
                return message
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no matching message within {timeout}s; unmatched: "
                    f"{[(m.topic, m.payload[:200]) for m in self.seen][-10:]}"
                )
            try:
                message = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            if predicate(message):
                return message
            self.seen.append(message)

    def wait_topic(self, topic: str, timeout: float = 120) -> Received:
        return self.wait_for(lambda m: m.topic == topic, timeout)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


def asking(response_topic: str, correlation: bytes) -> Properties:
    """A PUBLISH's properties that ask for the answer on ``response_topic``, with this
    correlation data."""
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ResponseTopic = response_topic
    props.CorrelationData = correlation
    return props


def probe_settings(port: int, **overrides: Any) -> MqttSettings:
    """The worker's MQTT settings for a short-lived probe of a test broker (a login check, a
    TLS handshake): its own client id, no session kept, subscribed to probe/#."""
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "client_id": f"probe-{time.monotonic_ns()}",
        "username": None,
        "password": None,
        "keepalive": 30,
        "reconnect_min_delay": 1,
        "reconnect_max_delay": 1,
        "session_expiry": 0,
        "subscriptions": ("probe/#",),
        "status_topic": "probe/status",
    }
    return MqttSettings(**(base | overrides))
