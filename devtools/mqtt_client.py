"""The MQTT clients of the tests and the benchmark: ``connect`` starts a plain paho MQTT v5
client, subscribed once the broker has said so; ``Client`` is one that publishes, as a chat
frontend, and records everything it receives. The benchmark's clients (bench/mqtt_driver.py,
bench/scale.py) are ``connect``'s with their own ``on_message``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from worker.transport.mqtt import MqttSettings, MqttTransport, set_tcp_nodelay

# How long ``connect`` waits for the CONNACK and the SUBACK: a broker on this machine answers
# in milliseconds.
ANSWER_TIMEOUT = 10.0


def connect(
    port: int,
    subscriptions: Sequence[str | tuple[str, int]] = (),
    *,
    on_message: Callable[[mqtt.MQTTMessage], None] | None = None,
    client_id: str = "",
    login: tuple[str, str] | None = None,
    host: str = "127.0.0.1",
    keepalive: int = 30,
    max_inflight: int | None = None,
) -> mqtt.Client:
    """A paho MQTT v5 client connected to ``host:port`` (the broker accepted it: else
    ConnectionError), its network loop running, subscribed to ``subscriptions`` (QoS 1, or
    ``(topic, qos)``) once the broker has acknowledged them, so that whatever is published from
    then on reaches it. ``on_message`` runs on paho's thread. Nagle's algorithm is off, as on
    the worker's own connection (without it each round trip waits for a delayed ACK:
    set_tcp_nodelay). ``max_inflight``: QoS 1 messages on their way at once (0: no limit;
    paho's default of 20 paces a client that sends at a fixed rate)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    if login is not None:
        client.username_pw_set(*login)
    if max_inflight is not None:
        client.max_inflight_messages_set(max_inflight)
    if on_message is not None:
        client.on_message = lambda c, u, message: on_message(message)
    connack: list[Any] = []  # the CONNACK's reason code
    acknowledged: set[int] = set()  # the SUBSCRIBE packets the broker answered
    answered = threading.Condition()

    def on_connect(c: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        with answered:
            connack.append(reason)
            answered.notify_all()

    def on_subscribe(c: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        with answered:
            acknowledged.add(mid)
            answered.notify_all()

    client.on_connect, client.on_subscribe = on_connect, on_subscribe
    client.connect(host, port, keepalive=keepalive)
    set_tcp_nodelay(client)
    client.loop_start()
    mid = None
    if subscriptions:
        topics = [(t, 1) if isinstance(t, str) else t for t in subscriptions]
        result, mid = client.subscribe([(topic, SubscribeOptions(qos=qos)) for topic, qos in topics])
        assert result == mqtt.MQTT_ERR_SUCCESS

    def answered_all() -> bool:  # a refused login gets no SUBACK: its CONNACK is the answer
        return bool(connack) and (connack[0].is_failure or mid is None or mid in acknowledged)

    with answered:
        done = answered.wait_for(answered_all, ANSWER_TIMEOUT)
    if not done or connack[0].is_failure:
        client.disconnect()
        client.loop_stop()
        what = f"refused the connection: {connack[0]}" if connack else "did not answer"
        raise ConnectionError(f"the MQTT broker at {host}:{port} {what} (within {ANSWER_TIMEOUT:g} s)")
    return client


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool
    properties: Any
    at: float = field(default_factory=time.perf_counter)  # when it arrived (paho's thread)

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
        self._client = connect(
            port,
            subscriptions,
            on_message=lambda m: self.messages.put(Received(m.topic, bytes(m.payload), bool(m.retain), m.properties)),
            client_id=client_id,
            login=login,
        )

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

    def received(self, predicate: Callable[[Received], bool]) -> list[Received]:
        """What has arrived so far that satisfies predicate, without waiting: for "nothing
        else came" once a later message (a marker, a status) has been waited for. The broker
        forwards one publisher's messages in the order it got them, so whatever the worker
        published before that message is here."""
        while True:
            try:
                self.seen.append(self.messages.get_nowait())
            except queue.Empty:
                return [m for m in self.seen if predicate(m)]

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


@contextlib.asynccontextmanager
async def transport_on(port: int, **settings: Any) -> AsyncIterator[MqttTransport]:
    """The worker's own MqttTransport on a test broker (probe_settings, subscribed to requests),
    connected, on the running loop; closed after: for what uses its Messaging side (device tools,
    MCP over MQTT)."""
    settings = {"subscriptions": ("chat/+/+/request",)} | settings
    transport = MqttTransport(probe_settings(port, **settings), asyncio.get_running_loop())
    transport.start()
    await asyncio.wait_for(transport.wait_connected(), 10)
    try:
        yield transport
    finally:
        await transport.close(1)


@contextlib.contextmanager
def pretend_worker(port: int, prefix: str, *also: str) -> Iterator[Client]:
    """A worker that only says it is ``online`` (a retained status under ``prefix``, removed
    after) so that the chat clients send, and a client that sees what they send: the requests
    under ``prefix`` and the ``also`` kinds of message (``control``)."""
    watch = Client(port, [f"{prefix}/+/+/request", *(f"{prefix}/+/+/{kind}" for kind in also)])
    watch.publish(f"{prefix}/_worker/pretend/status", b"online", retain=True)
    try:
        yield watch
    finally:
        watch.publish(f"{prefix}/_worker/pretend/status", b"", retain=True)
        watch.close()
