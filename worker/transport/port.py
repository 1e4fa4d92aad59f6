"""What the service needs of the broker: inbound messages, publishing, acknowledging.

The one declaration of the transport port, with no paho in it: the MQTT adapter
(mqtt.py), the Redis intake (intake/group.py) and the tests' fakes implement it, and the
core (core/service.py, core/turns.py) depends on nothing else of MQTT.

A publish is a future that completes when the broker has taken the message. When it was not
taken, the future fails with a typed error, never a silent success: the service acknowledges a
request only once its answer was taken (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loguru import logger


@dataclass(frozen=True)
class InboundMessage:
    topic: str
    payload: bytes
    qos: int
    mid: int
    retain: bool
    response_topic: str | None
    correlation_data: bytes | None
    received_at: float  # time.monotonic() when paho handed it over
    # time.monotonic() past which the sender no longer wants it: its MQTT 5 Message Expiry
    # Interval is the remaining lifetime (the broker counts down the time it held it).
    expires_at: float | None = None
    # Which broker session delivered it (see MqttTransport._session): packet ids are only
    # meaningful within one.
    session: int = 0
    # The Redis stream entry it was read from (intake/group.py): acknowledged there, not to the broker.
    entry: str | None = None
    # MQTT's DUP flag: the broker delivers this message again (same packet id) because an
    # earlier delivery was not acknowledged. A message sent anew by a client has it clear,
    # even when its text is the same: that is how a repeated message is told from a
    # redelivered one when the client sets no requestId.
    dup: bool = False


class PublishFailed(Exception):
    """A publish the broker did not take."""


class PublishRefused(PublishFailed):
    """Final: the broker answered with a failure reason code (e.g. not authorized), or the
    message cannot fit its Maximum Packet Size. Sending it again would fail again."""


class PublishNotSent(PublishFailed):
    """Not sent by this client (no connection that took it, the client closing, paho's queue
    full): the request it answers is left unacknowledged, and the broker delivers it again
    after a reconnect, when it is answered from the store."""


class Publisher(Protocol):
    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, correlation_data: bytes | None = None
    ) -> asyncio.Future[None]:
        """Queue a publish. QoS 1: the future completes when the broker has taken it (its
        PUBACK) and fails with PublishFailed when it did not. QoS 0 is best effort: the future
        completes once the message is handed to the network."""

    def payload_limit(self, topic: str, *, qos: int = 1, correlation_data: bytes | None = None) -> int | None:
        """The largest payload the broker accepts on topic (None: no limit)."""


class Transport(Publisher, Protocol):
    """Where requests come from and are acknowledged."""

    inbox: asyncio.Queue[InboundMessage]

    def ack(self, message: InboundMessage) -> None:
        """Tell the broker (or the intake's stream) that the message is done with: it is not
        delivered again. Only the service's one acknowledging method calls this."""


def log_publish_failure(done: asyncio.Future[None], what: str) -> None:
    """For a publish nobody awaits (stats, status): its failure is logged, not left in the
    future (where asyncio would report it as never retrieved)."""

    def report(future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.warning("Could not publish {}: {}", what, future.exception())

    done.add_done_callback(report)


# -- messages beyond requests: device tools and MCP over MQTT -----------------------------


@dataclass(frozen=True)
class OutboundProperties:
    """MQTT 5 properties of a message the worker sends to a device or an MCP server."""

    response_topic: str | None = None
    correlation_data: bytes | None = None
    message_expiry: int | None = None  # seconds (MQTT 5 Message Expiry Interval)
    user_properties: tuple[tuple[str, str], ...] = ()
    content_type: str | None = None


@dataclass(frozen=True)
class Delivery:
    """A message on a topic the worker watches (a device's response, an MCP server's presence
    or JSON-RPC message): not a chat request, never acknowledged by the service."""

    topic: str
    payload: bytes
    retain: bool  # as the publisher set it (Retain As Published), on live messages too
    correlation_data: bytes | None = None
    response_topic: str | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    content_type: str | None = None  # its MQTT 5 Content Type (a camera's image/jpeg, ...;base64)
    received_at: float | None = None  # time.monotonic() when paho handed it over


class Messaging(Protocol):
    """Publish-and-watch for the worker's own tools (worker/tools/) and its vision topics
    (worker/vision/topics.py): the MQTT adapter
    implements it on the worker's one broker connection."""

    def send(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: OutboundProperties | None = None,
    ) -> asyncio.Future[None]:
        """Like Publisher.publish, with MQTT 5 properties."""

    async def watch(
        self,
        topic_filter: str,
        handler: Callable[[Delivery], None],
        *,
        qos: int = 1,
        retain_as_published: bool = True,
    ) -> None:
        """Subscribe to ``topic_filter`` (again after every reconnect) and hand each message on
        it to ``handler``, on the event loop. Returns once the broker granted the subscription;
        raises PublishFailed (refused or not sent) otherwise. ``retain_as_published``: a
        Delivery's ``retain`` is the publisher's flag; False: it marks only a retained message
        the broker sent because the filter was subscribed (MQTT 5's default)."""

    def unwatch(self, topic_filter: str) -> None:
        """Stop watching ``topic_filter`` (unsubscribe)."""
