"""Durable intake through Redis for workers of one share group (history.store = "redis").

Why: in a share group the broker's persistent session cannot hold a worker's work. mosquitto
(2.0.11, measured) drops a dead member's unacknowledged messages when its session ends, and
while the session persists it keeps routing about half of the group's new messages to it. So
a request is acknowledged to the broker once it is in Redis, where the group can see it:

1. The worker that receives a request or control message from the broker appends it to the
   stream of the session's owner (one Lua script: read the owner lease, claim it for this
   worker when there is none, XADD), then acknowledges it (PUBACK).
2. Each worker instance reads its own stream through a consumer group, in order, and hands
   the entries to the service as if they came from the broker: a session's turns run in
   order on one worker, whose prefix cache holds its conversation. The service acknowledges
   an entry (XACK, XDEL) where it would have acknowledged the MQTT message: once the answer
   is stored and the broker has it.
3. Each instance renews a heartbeat key (worker_lease). Every worker looks for instances
   whose heartbeat expired and moves what is left in their streams (running and unread
   entries) to the end of its own, in order, linking the dead instance to itself so that
   its sessions follow (another Lua script: only one worker can win it). A moved request is
   answered once: its answer is stored by request key in Redis and looked up before
   generating; a worker taken for dead that was only slow finds the answer of the worker that
   took over (the first stored answer stands) and stops at its next heartbeat.

Messages whose topic is invalid, and retained ones, go straight to the service (it answers
or drops them without Redis).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from loguru import logger

from ..config.models import WorkerConfig
from ..protocol.topics import InvalidTopic, Topics
from ..transport.port import InboundMessage
from ..transport.port import Transport as Broker

READ_BATCH = 64
READ_BLOCK_MS = 1000
RETRY_DELAY = 1.0


class Streams(Protocol):
    """What the intake needs from Redis (redisstore.RedisStreams)."""

    instance: str

    async def register(self) -> None: ...
    async def heartbeat(self) -> bool: ...
    async def leave(self) -> None: ...
    async def route(self, session: str, fields: dict[str, bytes]) -> tuple[str, str]: ...
    async def append(self, fields: dict[str, bytes]) -> str: ...
    async def read(self, count: int, block_ms: int) -> list[tuple[str, dict[str, bytes]]]: ...
    async def ack(self, entry_id: str) -> None: ...
    async def dead_instances(self) -> list[str]: ...
    async def take_over(self, dead: str) -> int: ...
    async def close(self) -> None: ...


def encode(message: InboundMessage) -> dict[str, bytes]:
    """A stream entry's fields: what the service needs of the MQTT message. Times as wall
    clock (another host's monotonic clock means nothing here)."""
    now_wall, now = time.time(), time.monotonic()
    fields = {"topic": message.topic.encode(), "payload": message.payload}
    # The packet id and DUP flag make a request's idempotency key (messages.request_key).
    fields["mid"] = str(message.mid).encode()
    if message.dup:
        fields["dup"] = b"1"
    fields["received"] = repr(now_wall - (now - message.received_at)).encode()
    if message.response_topic is not None:
        fields["response_topic"] = message.response_topic.encode()
    if message.correlation_data is not None:
        fields["correlation_data"] = message.correlation_data
    if message.expires_at is not None:
        fields["expires"] = repr(now_wall + (message.expires_at - now)).encode()
    return fields


def decode(entry_id: str, fields: dict[str, bytes]) -> InboundMessage:
    now_wall, now = time.time(), time.monotonic()
    received = now - max(0.0, now_wall - float(fields["received"]))
    expires = fields.get("expires")
    response_topic = fields.get("response_topic")
    return InboundMessage(
        topic=fields["topic"].decode(),
        payload=fields["payload"],
        qos=1,
        mid=int(fields.get("mid", b"0")),
        retain=False,
        response_topic=response_topic.decode() if response_topic is not None else None,
        correlation_data=fields.get("correlation_data"),
        received_at=received,
        expires_at=now + (float(expires) - now_wall) if expires is not None else None,
        entry=entry_id,
        dup=fields.get("dup") == b"1",
    )


class Intake:
    """Between the broker and the service: the service's transport (inbox, publish, ack)."""

    def __init__(
        self,
        streams: Streams,
        broker: Broker,
        topics: Topics,
        *,
        worker_lease: float,
        route_to_owner: bool,
        stop_requested: Callable[[int], None],
        room: Callable[[], int] | None = None,
    ) -> None:
        self.streams = streams
        self.broker = broker
        self.topics = topics
        self.inbox: asyncio.Queue[InboundMessage] = asyncio.Queue()
        self._heartbeat_interval = worker_lease / 3
        self._route_to_owner = route_to_owner
        self._stop_requested = stop_requested
        self._acks: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        # How many more messages the service takes now (its free pending slots: the worker
        # passes service.InFlight.room). Entries beyond it wait in this worker's stream, as they
        # would in the broker behind Receive Maximum, instead of being refused busy.
        self.room: Callable[[], int] = room or (lambda: READ_BATCH)

    @classmethod
    def for_group(
        cls,
        config: WorkerConfig,
        broker: Broker,
        topics: Topics,
        instance: str,
        stop_requested: Callable[[int], None],
        room: Callable[[], int] | None = None,
    ) -> Intake:
        """The intake of a worker instance, on the Redis of ``config`` (redis is imported here
        only: a worker without the Redis store never loads it)."""
        from .streams import RedisStreams

        redis = config.redis
        streams = RedisStreams(
            redis.url,
            config.mqtt.topic_prefix,
            instance,
            worker_lease=redis.worker_lease,
            owner_lease=redis.owner_lease,
        )
        return cls(
            streams,
            broker,
            topics,
            worker_lease=redis.worker_lease,
            route_to_owner=redis.route_to_owner,
            stop_requested=stop_requested,
            room=room,
        )

    async def start(self) -> None:
        await self.streams.register()
        logger.info(
            "Intake: instance {} joined; requests go to {}",
            self.streams.instance,
            "their session's owner" if self._route_to_owner else "the worker that receives them",
        )
        self._tasks = [
            asyncio.ensure_future(self._route_forever()),
            asyncio.ensure_future(self._consume_forever()),
            asyncio.ensure_future(self._heartbeat_forever()),
        ]

    # -- the service's transport ------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, correlation_data: bytes | None = None
    ) -> asyncio.Future[None]:
        return self.broker.publish(topic, payload, qos=qos, retain=retain, correlation_data=correlation_data)

    def payload_limit(self, topic: str, *, qos: int = 1, correlation_data: bytes | None = None) -> int | None:
        return self.broker.payload_limit(topic, qos=qos, correlation_data=correlation_data)

    def ack(self, message: InboundMessage) -> None:
        if message.entry is None:  # came straight from the broker
            self.broker.ack(message)
            return
        task = asyncio.ensure_future(self._ack_entry(message.entry))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _ack_entry(self, entry: str) -> None:
        while True:
            try:
                await self.streams.ack(entry)
                return
            except Exception as exc:  # Redis away: the entry stays open until it is back
                logger.warning("Intake: cannot acknowledge entry {} ({}); retrying", entry, exc)
                await asyncio.sleep(RETRY_DELAY)

    # -- loops ------------------------------------------------------------------------

    async def _route_forever(self) -> None:
        while True:
            message = await self.broker.inbox.get()
            try:
                address, _ = self.topics.parse(message.topic)
            except InvalidTopic:
                self.inbox.put_nowait(message)  # the service logs, counts and acknowledges it
                continue
            if message.retain:
                self.inbox.put_nowait(message)
                continue
            fields = encode(message)
            while True:
                try:
                    if self._route_to_owner:
                        await self.streams.route(str(address), fields)
                    else:
                        await self.streams.append(fields)
                    break
                except Exception as exc:  # held unacknowledged until Redis takes it
                    logger.warning("Intake: cannot queue a message of {} in Redis ({}); retrying", address, exc)
                    await asyncio.sleep(RETRY_DELAY)
            self.broker.ack(message)

    async def _consume_forever(self) -> None:
        while True:
            room = min(READ_BATCH, self.room() - self.inbox.qsize())
            if room <= 0:
                await asyncio.sleep(0.05)
                continue
            try:
                entries = await self.streams.read(room, READ_BLOCK_MS)
            except Exception as exc:
                logger.warning("Intake: cannot read the stream ({}); retrying", exc)
                await asyncio.sleep(RETRY_DELAY)
                continue
            for entry_id, fields in entries:
                try:
                    self.inbox.put_nowait(decode(entry_id, fields))
                except Exception:  # not ours to answer: drop it from the stream
                    logger.exception("Intake: unreadable entry {} dropped", entry_id)
                    await self.streams.ack(entry_id)

    async def _heartbeat_forever(self) -> None:
        renewed_before = False
        while True:
            renewed = False
            try:
                if not await self.streams.heartbeat():
                    logger.error(
                        "Intake: instance {} was taken for dead and its requests moved to another worker; stopping",
                        self.streams.instance,
                    )
                    self._stop_requested(1)
                    return
                renewed = True
                # Only after two heartbeats in a row: after a Redis outage every member's key
                # may have expired, and the others need one interval to renew theirs before a
                # missing key means a dead worker.
                if renewed_before:
                    for dead in await self.streams.dead_instances():
                        moved = await self.streams.take_over(dead)
                        if moved >= 0:
                            logger.warning("Intake: took over instance {} (dead): {} open message(s)", dead, moved)
            except Exception as exc:
                logger.warning("Intake: heartbeat failed ({})", exc)
            renewed_before = renewed
            await asyncio.sleep(self._heartbeat_interval)

    # -- stop -------------------------------------------------------------------------

    async def close(self) -> None:
        """After the service drained: stop routing, finish the acknowledgements, stop the
        heartbeat; what is left in the stream is moved to another worker (or this worker's
        next start) by the next sweep. (The broker was told to send nothing more when the
        stop began, transport.unsubscribe(): what it had sent until then was routed.)"""
        for task in self._tasks:
            task.cancel()
        if self._acks:
            await asyncio.wait(set(self._acks), timeout=5)
        try:
            await self.streams.leave()
        except Exception as exc:
            logger.warning("Intake: could not leave ({}); the heartbeat expires by itself", exc)
        await self.streams.close()
