"""The MQTT side of the chat client (``python -m worker.chat``): one session's topics, on
paho-mqtt 2 (MQTT v5).

paho runs its own network thread. Its callbacks only hand what happened over to a queue
(``queue.SimpleQueue``: its ``put`` is safe even from a signal handler, so the terminal side
posts Ctrl-C there too); the caller reads it with ``next_event()``, where payloads are parsed
into the worker's own wire models (``worker.messages``, ``worker.stats``). Topics are built
by ``worker.topics`` from validated parts.
"""

from __future__ import annotations

import base64
import json
import queue
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from pydantic import BaseModel, ValidationError

from ..protocol.messages import (
    ChatReply,
    ChatRequest,
    ControlReply,
    ControlRequest,
    ErrorReply,
    StatsReport,
    StreamDelta,
)
from ..protocol.topics import WORKER_NAMESPACE, SessionAddress, Topics
from ..transport.mqtt import set_tcp_nodelay, use_credentials_and_tls

# How long the broker keeps this client's subscriptions and queued replies while it is
# disconnected (a dropped connection, a broker restart with persistence): replies published
# meanwhile arrive after the reconnect. A clean exit ends the session at once.
SESSION_EXPIRY_S = 300


@dataclass(frozen=True)
class ClientSettings:
    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    topic_prefix: str = "chat"
    keepalive: int = 30
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_insecure_skip_hostname_check: bool = False
    reconnect_min_delay: int = 1
    reconnect_max_delay: int = 8


class Event:
    """Something for the terminal side: from the broker, or posted by the caller."""


@dataclass(frozen=True)
class Connected(Event):
    first: bool  # the first connection of this client (later ones are reconnects)
    resumed: bool  # the broker still had this client's session (subscriptions, queued replies)


@dataclass(frozen=True)
class Ready(Event):
    """The broker acknowledged the subscriptions: requests sent now get their replies."""


@dataclass(frozen=True)
class Refused(Event):
    reason: str  # CONNACK or SUBACK failure (bad credentials, not authorised)


@dataclass(frozen=True)
class ConnectFailed(Event):
    error: str  # TCP or TLS failure; paho retries with backoff


@dataclass(frozen=True)
class Disconnected(Event):
    reason: str


@dataclass(frozen=True)
class Delta(Event):
    delta: StreamDelta


@dataclass(frozen=True)
class Answer(Event):
    reply: ChatReply


@dataclass(frozen=True)
class Failed(Event):
    error: ErrorReply


@dataclass(frozen=True)
class ResetDone(Event):
    reply: ControlReply


@dataclass(frozen=True)
class Stats(Event):
    report: StatsReport
    retained: bool


@dataclass(frozen=True)
class WorkerStatus(Event):
    worker_id: str
    online: bool
    changed: bool  # not what this client knew of it (or the first it hears of it)


@dataclass(frozen=True)
class Unreadable(Event):
    topic: str
    text: str  # a payload that is none of the contract's (shown as it came)


@dataclass(frozen=True)
class _Raw(Event):
    topic: str
    payload: bytes
    retain: bool


Model = TypeVar("Model", bound=BaseModel)


def _lenient(model: type[Model], data: dict[str, Any]) -> Model:
    """Validate data as model, ignoring fields this client does not know (a newer worker's)."""
    known = {info.alias or name for name, info in model.model_fields.items()}
    return model.model_validate({key: value for key, value in data.items() if key in known})


class ChatClient:
    """One chat session's MQTT connection: publishes requests and controls, delivers replies,
    stream deltas, and the workers' status and stats as events."""

    def __init__(self, settings: ClientSettings, address: SessionAddress) -> None:
        self.settings = settings
        self.address = address
        self.topics = Topics(settings.topic_prefix)
        self.reply_topic = self.topics.reply(address)
        self.stream_topic = self.topics.stream(address)
        self._workers = f"{settings.topic_prefix}/{WORKER_NAMESPACE}/"
        self._subscriptions = [(self.reply_topic, 1), (self.stream_topic, 0)]
        self.status_filter = f"{self._workers}+/status"  # every worker's retained online/offline
        self._subscriptions += [(self.status_filter, 1), (f"{self._workers}+/stats", 1)]
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.latest_stats: dict[str, StatsReport] = {}
        self.workers_online: dict[str, bool] = {}
        self._connections = 0
        self._subscribe_mid: int | None = None
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"chat-{uuid.uuid4().hex[:16]}", protocol=mqtt.MQTTv5
        )
        client.suppress_exceptions = True
        use_credentials_and_tls(client, settings)
        client.reconnect_delay_set(settings.reconnect_min_delay, settings.reconnect_max_delay)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        self._client = client

    # -- paho's network thread: hand over and return ----------------------------------

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        if reason.is_failure:
            self.events.put(Refused(f"connection refused: {reason}"))
            return
        set_tcp_nodelay(client)
        # Here, not in the caller's thread, so that every reconnect subscribes again at once.
        _, self._subscribe_mid = client.subscribe(self._subscriptions)
        self._connections += 1
        resumed = bool(getattr(flags, "session_present", False))
        self.events.put(Connected(first=self._connections == 1, resumed=resumed))

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        error = sys.exc_info()[1]  # paho calls this inside its ``except OSError``
        self.events.put(ConnectFailed(str(error) if error is not None else "unknown error"))

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        self.events.put(Disconnected(str(reason)))

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: list[ReasonCode], properties: Properties | None
    ) -> None:
        refused = [str(r) for r in reasons if r.is_failure]
        if refused:
            self.events.put(Refused(f"subscription refused: {', '.join(refused)}"))
        elif mid == self._subscribe_mid:
            self.events.put(Ready())

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.events.put(_Raw(message.topic, bytes(message.payload), bool(message.retain)))

    # -- the caller's thread ----------------------------------------------------------

    def start(self) -> None:
        """Connect in the background; paho reconnects by itself whenever the broker drops."""
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = SESSION_EXPIRY_S
        self._client.connect_async(
            self.settings.host,
            self.settings.port,
            self.settings.keepalive,
            # The client id is new, so there is no old session to resume on the first connect;
            # mosquitto (2.0.11) persists only the sessions of clients that connected with
            # clean_start false, so this is what makes one survive a broker restart.
            clean_start=False,
            properties=props,
        )
        self._client.loop_start()

    def post(self, event: Event) -> None:
        """Add an event of the caller's own (typed input, Ctrl-C) to the queue."""
        self.events.put(event)

    def next_event(self, timeout: float) -> Event | None:
        """The next event, its payload parsed; None when nothing came within timeout."""
        try:
            event = self.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        return self._interpret(event) if isinstance(event, _Raw) else event

    def _interpret(self, raw: _Raw) -> Event:
        text = raw.payload.decode("utf-8", errors="replace")
        if raw.topic.startswith(self._workers) and raw.topic.endswith("/status"):
            worker_id = raw.topic[len(self._workers) :].split("/")[0]
            online = raw.payload == b"online"
            changed = self.workers_online.get(worker_id) != online
            self.workers_online[worker_id] = online
            return WorkerStatus(worker_id, online, changed)
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if raw.topic == self.stream_topic:
                return Delta(_lenient(StreamDelta, data))
            if raw.topic == self.reply_topic:
                if "error" in data:
                    return Failed(_lenient(ErrorReply, data))
                if "action" in data:
                    return ResetDone(_lenient(ControlReply, data))
                return Answer(_lenient(ChatReply, data))
            report = StatsReport.model_validate(data)
            self.latest_stats[report.worker_id] = report
            return Stats(report, raw.retain)
        except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
            return Unreadable(raw.topic, text)

    def send(
        self,
        message: str | None = None,
        *,
        tool_results: Sequence[tuple[str, str | bool]] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        worker_tools: Sequence[str] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        system_prompt: str | None = None,
        stream: bool = True,
        include_reasoning: bool = False,
        images: Sequence[bytes] = (),
    ) -> str:
        """Publish a request (QoS 1; kept and sent after a reconnect); its requestId. It carries
        the message, or the results of the session's pending tool calls ((toolCallId, content)
        pairs; a bool instead of content approves or declines a call with needsConfirmation);
        ``tools`` replaces the session's tools, ``worker_tools`` the session's choice of the
        worker's own tools (names, or ["*"]), ``tool_choice`` is for this request; ``images``
        (the files' bytes) go with the message. ValueError when a value is not one the
        contract allows."""
        request = self.request(
            message,
            tool_results=tool_results,
            tools=tools,
            tool_choice=tool_choice,
            worker_tools=worker_tools,
            max_tokens=max_tokens,
            temperature=temperature,
            system_prompt=system_prompt,
            stream=stream,
            include_reasoning=include_reasoning,
            images=images,
        )
        self.publish(request)
        assert request.request_id is not None
        return request.request_id

    def publish(self, request: ChatRequest) -> None:
        self._client.publish(self.topics.request(self.address), request.to_json(), qos=1)

    def request(
        self,
        message: str | None = None,
        *,
        tool_results: Sequence[tuple[str, str | bool]] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        worker_tools: Sequence[str] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        system_prompt: str | None = None,
        stream: bool = True,
        include_reasoning: bool = False,
        images: Sequence[bytes] = (),
    ) -> ChatRequest:
        """A request with a fresh requestId, not sent (see send). ValueError when a value is not
        one the contract allows."""
        request_id = f"c-{uuid.uuid4().hex[:20]}"
        fields: dict[str, Any] = {"requestId": request_id, "stream": stream}
        if message is not None:
            fields["message"] = message
        if tool_results is not None:
            # A bool answers a worker call that asked for confirmation (needsConfirmation).
            fields["toolResults"] = [
                {"toolCallId": call_id, "approved" if isinstance(answer, bool) else "content": answer}
                for call_id, answer in tool_results
            ]
        if include_reasoning:
            fields["includeReasoning"] = True
        if images:  # Ollama's shape: base64, before the text (docs/protocol.md#images)
            fields["images"] = [base64.b64encode(data).decode("ascii") for data in images]
        for key, value in (
            ("maxTokens", max_tokens),
            ("temperature", temperature),
            ("systemPrompt", system_prompt),
            ("tools", None if tools is None else list(tools)),
            ("toolChoice", tool_choice),
            ("workerTools", None if worker_tools is None else list(worker_tools)),
        ):
            if value is not None:
                fields[key] = value
        try:
            return ChatRequest.model_validate(fields)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(problems) from None

    def cancel(self, request_id: str) -> None:
        control = ControlRequest.model_validate({"action": "cancel", "requestId": request_id})
        self._client.publish(self.topics.control(self.address), control.to_json(), qos=1)

    def reset(self) -> None:
        control = ControlRequest.model_validate({"action": "reset"})
        self._client.publish(self.topics.control(self.address), control.to_json(), qos=1)

    def any_worker_online(self) -> bool:
        return any(self.workers_online.values())

    def close(self) -> None:
        """Disconnect, ending the broker's session for this client (expiry 0)."""
        props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 0
        self._client.disconnect(properties=props)
        self._client.loop_stop()
