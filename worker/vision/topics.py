"""Images from MQTT topics (``imageTopics``, ``[[vision.topics]]``): the latest image a camera
published, for a user namespace the configuration lets read it. On the Messaging port: no
paho here.

The worker subscribes to every configured filter when it starts and keeps each topic's
latest message with the time it arrived, so that a request is answered at once from a camera
that published recently, and waits (up to the topic's timeout) only where it did not. MQTT
does not say when a message was published: a retained message the broker sends because the
worker subscribed (its ``retain`` flag, which the subscription leaves unset on live messages)
has no known age, and is taken only where the topic allows any age (``max_age = 0``).

A topic the configuration does not list and one it lists for other users are refused in the
same words, so that a client cannot learn which topics exist.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loguru import logger

from ..config.models import VisionConfig, VisionTopicConfig
from ..protocol.images import ImageError, ImageInput, decode_base64, image_from_bytes, sniff_media_type
from ..protocol.messages import ErrorCode, RequestError, log_text
from ..protocol.topics import topic_matches
from ..transport.port import Delivery, Messaging, PublishFailed, PublishRefused

# The latest messages kept, all topics together: a filter such as frigate/+/+/snapshot may
# match many topics. The least recently published go first.
MAX_KEPT_TOPICS = 1024
MAX_KEPT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Latest:
    """A topic's latest message, as it arrived."""

    payload: bytes | None  # None: it was larger than the limit (``size`` says how large)
    size: int
    content_type: str | None
    received_at: float  # the clock's time when the worker received it
    age_known: bool  # False: a retained message the broker held when the worker subscribed

    def fresh(self, max_age: float, now: float) -> bool:
        if max_age == 0:
            return True
        return self.age_known and now - self.received_at <= max_age


def unknown_topic(where: str, topic: str) -> RequestError:
    """One answer for a topic not configured and one configured for other user namespaces."""
    return RequestError(
        ErrorCode.INVALID_REQUEST,
        f"'{where}': no image topic {topic[:200]!r} (the worker reads only the topics its configuration "
        "lists for this user)",
    )


def image_of(latest: Latest, where: str, topic: str, limit: int) -> ImageInput:
    """The image in a topic's message: its bytes, or their base64 (the MQTT 5 Content Type says
    ``;base64``, or the payload is base64 text, as Home Assistant's MQTT image may send it).
    A Content Type that names an image type must agree with the bytes."""
    if latest.payload is None:
        raise RequestError(
            ErrorCode.INVALID_REQUEST, f"'{where}': the image on the topic is {latest.size} bytes; the limit is {limit}"
        )
    content_type = (latest.content_type or "").strip().lower()
    media, _, params = content_type.partition(";")
    declared = media.strip() if media.strip().startswith("image/") else None
    payload = latest.payload
    try:
        if "base64" in params or media.strip() in ("base64", "application/base64"):
            data = decode_base64(payload.strip().decode("ascii", "replace"), where)
        elif sniff_media_type(payload) is None and payload[:5] != b"data:":
            # Not an image's bytes: base64 text, if it decodes (else "not an image", below).
            try:
                data = decode_base64(payload.strip().decode("ascii"), where)
            except (ImageError, UnicodeDecodeError):
                data = payload
        else:
            data = payload
        if data[:5] == b"data:":
            raise ImageError(f"'{where}' is a data: URL; a topic carries an image's bytes or their base64")
        return image_from_bytes(data, "topic", where, declared=declared, topic=topic)
    except ImageError as exc:
        raise RequestError(ErrorCode.INVALID_REQUEST, str(exc)) from None


class VisionTopics:
    """The configured vision topics, watched on the worker's broker connection."""

    def __init__(
        self,
        config: VisionConfig,
        messaging: Messaging,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_kept_bytes: int = MAX_KEPT_BYTES,
    ) -> None:
        self.config = config
        self.messaging = messaging
        self.clock = clock
        self.max_kept_bytes = max_kept_bytes
        self._latest: OrderedDict[str, Latest] = OrderedDict()
        self._kept_bytes = 0
        self._waiters: dict[str, list[tuple[asyncio.Future[Latest], float]]] = {}
        self._watched: list[str] = []
        self._refused: dict[str, str] = {}  # filter -> why the broker refused it

    @property
    def filters(self) -> list[str]:
        return list(dict.fromkeys(entry.topic for entry in self.config.topics))

    async def start(self) -> None:
        """Subscribe to every configured filter. One the broker refuses (its ACL) is logged and
        its topics answered as unreadable; one not subscribed now (no connection) is
        subscribed on the next connect: neither stops the worker."""
        if not self.config.topics:
            return
        results = await asyncio.gather(
            *(self.messaging.watch(f, self._on_message, qos=1, retain_as_published=False) for f in self.filters),
            return_exceptions=True,
        )
        for topic_filter, result in zip(self.filters, results, strict=True):
            if isinstance(result, PublishFailed):
                logger.warning("Vision topic {}: {}", log_text(topic_filter, 200), result)
                if isinstance(result, PublishRefused):  # refused again on every reconnect
                    self._refused[topic_filter] = str(result)
                    continue
            elif isinstance(result, BaseException):
                raise result
            self._watched.append(topic_filter)
        logger.info("Watching {} vision topic filter(s) for images", len(self._watched))

    def close(self) -> None:
        for topic_filter in self._watched:
            self.messaging.unwatch(topic_filter)
        self._watched.clear()
        for waiters in self._waiters.values():
            for future, _ in waiters:
                future.cancel()
        self._waiters.clear()

    def entry_for(self, user: str, topic: str) -> VisionTopicConfig | None:
        """The first entry whose filter matches ``topic`` and which lets ``user`` read it."""
        for entry in self.config.topics:
            if topic_matches(entry.topic, topic) and entry.allows(user):
                return entry
        return None

    async def images(self, user: str, topics: Sequence[str]) -> list[ImageInput]:
        """The latest image of each topic, in order (``imageTopics.<i>`` in errors). Raises
        RequestError (invalid_request) for a topic the user may not read, one without an image
        within its timeout, or one whose image is refused; before waiting on any, when a topic
        is not readable at all."""
        entries = []
        for index, topic in enumerate(topics):
            entry = self.entry_for(user, topic)
            if entry is None:
                raise unknown_topic(f"imageTopics.{index}", topic)
            entries.append(entry)
        tasks = [
            asyncio.ensure_future(self._image(entry, topic, f"imageTopics.{index}"))
            for index, (entry, topic) in enumerate(zip(entries, topics, strict=True))
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _image(self, entry: VisionTopicConfig, topic: str, where: str) -> ImageInput:
        if entry.topic in self._refused:
            raise RequestError(
                ErrorCode.INVALID_REQUEST, f"'{where}': the broker does not let the worker read {topic[:200]!r}"
            )
        latest = self._latest.get(topic)
        if latest is None or not latest.fresh(entry.max_age, self.clock()):
            latest = await self._next(entry, topic, where)
        logger.debug("Image of {} bytes from vision topic {} ({})", latest.size, log_text(topic, 200), entry.name)
        return image_of(latest, where, topic, self.config.max_request_bytes)

    async def _next(self, entry: VisionTopicConfig, topic: str, where: str) -> Latest:
        future: asyncio.Future[Latest] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(topic, [])
        waiters.append((future, entry.max_age))
        try:
            return await asyncio.wait_for(future, entry.timeout)
        except TimeoutError:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                f"'{where}': no image on {topic[:200]!r} within {entry.timeout:g} s"
                + (f" (none newer than {entry.max_age:g} s)" if entry.max_age else ""),
            ) from None
        finally:
            if (future, entry.max_age) in waiters:
                waiters.remove((future, entry.max_age))
            if not waiters:
                self._waiters.pop(topic, None)

    def _on_message(self, delivery: Delivery) -> None:
        """A message on a watched filter (on the event loop): kept as the topic's latest, and
        handed to the requests waiting for it."""
        topic = delivery.topic
        previous = self._latest.get(topic)
        if delivery.retain and previous is not None and previous.payload == delivery.payload:
            return  # the broker's copy, sent again on a resubscription: the one already kept
        size = len(delivery.payload)
        kept = delivery.payload if size <= self.config.max_request_bytes else None
        received = delivery.received_at if delivery.received_at is not None else self.clock()
        latest = Latest(kept, size, delivery.content_type, received, age_known=not delivery.retain)
        self._keep(topic, latest)
        for future, max_age in list(self._waiters.get(topic, ())):
            if not future.done() and latest.fresh(max_age, self.clock()):
                future.set_result(latest)

    def _keep(self, topic: str, latest: Latest) -> None:
        old = self._latest.pop(topic, None)
        if old is not None and old.payload is not None:
            self._kept_bytes -= len(old.payload)
        self._latest[topic] = latest
        self._kept_bytes += len(latest.payload or b"")
        while len(self._latest) > MAX_KEPT_TOPICS or (self._kept_bytes > self.max_kept_bytes and len(self._latest) > 1):
            _, dropped = self._latest.popitem(last=False)
            self._kept_bytes -= len(dropped.payload or b"")
