"""Device tools: each ``[[tools.mqtt]]`` is a topic the worker calls with MQTT 5
request/response.

A call publishes the model's arguments (compact JSON) to the tool's configured topic at QoS 1,
with the worker's response topic as ResponseTopic, fresh random CorrelationData, the tool's
timeout as Message Expiry Interval (a device that comes online later must not act on a stale
call), ``requestId`` and ``toolCallId`` as user properties (the device deduplicates on
``toolCallId``: a call repeated after a worker restart must not actuate twice) and Content Type
application/json. The device answers on the ResponseTopic with the same CorrelationData; the
answer's payload (UTF-8; invalid bytes become U+FFFD, and it is cut to max_tool_result_bytes
before it is decoded) is the result the model gets. A user property ``outcome=error`` marks
it a failure. An answer published with the retain flag is refused (the call ends as an error):
the broker would keep it and replay it to every later subscription.

The worker publishes only to configured topics: the model chooses a tool name and arguments,
never a topic. No MQTT library here: the transport's Messaging port (transport/port.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loguru import logger

from ..protocol.images import MEDIA_ALIASES, sniff_media_type
from ..protocol.messages import log_text
from ..protocol.topics import tool_responses_topic
from ..transport.port import Delivery, Messaging, OutboundProperties, PublishFailed, PublishRefused
from .port import CallContext, ToolOutcome, WorkerTool, cut_utf8

# The largest image a device may answer with (a camera's snapshot); larger ones are text.
MAX_IMAGE_ANSWER_BYTES = 4 * 1024 * 1024


def _image_answer(delivery: Delivery) -> tuple[bytes, str] | None:
    """A device's answer that is an image: its MQTT 5 Content Type is image/..., agreeing with
    its bytes (JPEG, PNG, GIF, WebP or BMP). None: the answer is text."""
    declared = (delivery.content_type or "").partition(";")[0].strip().lower()
    if not declared.startswith("image/") or len(delivery.payload) > MAX_IMAGE_ANSWER_BYTES:
        return None
    media_type = sniff_media_type(delivery.payload)
    if media_type is None or MEDIA_ALIASES.get(declared, declared) != media_type:
        return None
    return delivery.payload, media_type


if TYPE_CHECKING:
    from ..config.models import MqttToolConfig

CONTENT_TYPE = "application/json"


def response_topic_for(topic_prefix: str, worker_id: str) -> str:
    """The worker's response topic: ``<prefix>/_tools/<worker_id>/responses``.

    The same at every start: the worker's broker session is persistent, and a topic new at
    each start would leave the last run's subscription in it after a crash (its late answers
    would then arrive as messages nobody watches). An answer to a call of an earlier run is
    never taken for a new call's all the same: each call's CorrelationData is 16 random bytes,
    and an answer whose bytes no pending call has is dropped. The ACL grants the worker
    ``<prefix>/_tools/<worker_id>/#`` (docs/security.md)."""
    return tool_responses_topic(topic_prefix, worker_id)


class ToolsClosed(Exception):
    """The provider closed while a call waited for its answer."""


class DeviceTools:
    """The ToolProvider of the ``[[tools.mqtt]]`` tools, on the worker's broker connection."""

    name = "mqtt"

    def __init__(
        self,
        configs: Sequence[MqttToolConfig],
        messaging: Messaging,
        response_topic: str,
        *,
        max_result_bytes: int = 65536,
    ) -> None:
        self._messaging = messaging
        # An answer is cut to this before it is decoded (tools.max_tool_result_bytes): a 10 MB
        # answer is never decoded whole on the event loop.
        self.max_result_bytes = max_result_bytes
        self.response_topic = response_topic
        self._tools = [
            WorkerTool(
                name=c.name,
                description=c.description,
                parameters=c.parameters,
                users=tuple(c.users),
                confirm=c.confirm,
                timeout=c.timeout,
                source="mqtt",
            )
            for c in configs
        ]
        # The only topics calls go to: from the configuration, never from the model.
        self._topics = {c.name: c.topic for c in configs}
        # Calls waiting for their answer, by correlation data.
        self._pending: dict[bytes, asyncio.Future[Delivery]] = {}
        # Why calls cannot be answered (the broker refused the response topic): None when they can.
        self._unavailable: str | None = None
        self._watching = False

    # -- ToolProvider -----------------------------------------------------------------

    def tools(self) -> Sequence[WorkerTool]:
        return list(self._tools)

    @property
    def pending(self) -> int:
        """Calls waiting for their device now."""
        return len(self._pending)

    async def start(self) -> None:
        """Watch the response topic. Refused by the broker (its ACL): logged, and every call
        answers "unavailable"; never fails the worker's start. Not subscribed now (no
        connection): the transport subscribes it on the next connect, calls go on."""
        if not self._tools or self._watching:
            return
        try:
            await self._messaging.watch(self.response_topic, self._on_response)
        except PublishRefused as exc:
            self._unavailable = "the broker refused the worker's response topic"
            logger.error(
                "Device tools unavailable: the broker refused the subscription to {} ({}); grant the worker "
                "read access to its _tools topics (docs/security.md)",
                self.response_topic,
                exc,
            )
            return
        except PublishFailed as exc:
            logger.warning("Device tools: response topic {} not subscribed yet ({})", self.response_topic, exc)
        self._watching = True
        logger.info("Device tools: {} tool(s), answers on {}", len(self._tools), self.response_topic)

    async def close(self) -> None:
        # Calls still waiting end with a result (not a CancelledError, which their callers
        # would take for their own cancellation).
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(ToolsClosed())
        self._pending.clear()
        if self._watching:
            self._watching = False
            with contextlib.suppress(Exception):
                self._messaging.unwatch(self.response_topic)

    async def call(self, tool: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        topic = self._topics.get(tool)
        config = next((t for t in self._tools if t.name == tool), None)
        if topic is None or config is None:
            return ToolOutcome(f"Error: the tool {tool} is not a device tool.", "unavailable")
        if self._unavailable is not None:
            return ToolOutcome(f"Error: the device tool {tool} is unavailable: {self._unavailable}.", "unavailable")
        try:
            payload = json.dumps(dict(arguments), separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError):
            return ToolOutcome(f"Error: the arguments of {tool} are not JSON.", "error")
        ref = log_text(context.tool_call_id)  # an id the client's requestId is part of: escaped
        logger.debug("Device tool {} call {} to {}: {}", tool, ref, topic, payload[:2000])
        delivery = await self._exchange(config, topic, payload, context, ref)
        if isinstance(delivery, ToolOutcome):
            return delivery
        return self._answer(tool, ref, delivery)

    async def _exchange(
        self, config: WorkerTool, topic: str, payload: bytes, context: CallContext, ref: str
    ) -> Delivery | ToolOutcome:
        """Publish one call and wait for its answer, within the tool's timeout: the answer, or
        the outcome of a call that got none (not sent, timed out, the provider closing)."""
        tool = config.name
        correlation = os.urandom(16)
        properties = OutboundProperties(
            response_topic=self.response_topic,
            correlation_data=correlation,
            message_expiry=max(1, math.ceil(config.timeout)),
            user_properties=(("requestId", context.request_id), ("toolCallId", context.tool_call_id)),
            content_type=CONTENT_TYPE,
        )
        answer: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = answer  # before the publish: an answer may come at once
        taken = False  # by the broker (its PUBACK)
        try:
            # One timer from the publish to the answer. asyncio.timeout, not wait_for: Python
            # 3.11's wait_for swallows a cancellation that comes as the awaited future completes.
            async with asyncio.timeout(config.timeout):
                await self._messaging.send(topic, payload, qos=1, properties=properties)
                taken = True
                return await answer
        except PublishFailed as exc:
            logger.warning("Device tool {} call {}: not sent to {}: {}", tool, ref, topic, exc)
            return ToolOutcome(f"Error: the device tool {tool} is unavailable (the call was not sent).", "unavailable")
        except TimeoutError:
            if taken:
                logger.warning("Device tool {} call {}: no answer within {:g} s", tool, ref, config.timeout)
                return ToolOutcome(f"Error: the device did not answer within {config.timeout:g} s.", "timeout")
            # Not taken by the broker in time (no connection): paho keeps it queued and may
            # still send it after a reconnect; its expiry bounds how late it may act.
            logger.warning("Device tool {} call {}: the broker did not take it in time", tool, ref)
            return ToolOutcome(
                f"Error: the device did not answer within {config.timeout:g} s (the call had not reached the "
                "broker; it may still reach the device).",
                "timeout",
            )
        except ToolsClosed:
            return ToolOutcome(
                f"Error: the device tool {tool} was not answered: the worker is stopping.", "unavailable"
            )
        finally:
            self._pending.pop(correlation, None)

    def _answer(self, tool: str, ref: str, delivery: Delivery) -> ToolOutcome:
        """A device's answer as the call's result."""
        if delivery.retain:
            # A retained answer stays on the broker and is replayed to every later subscription
            # of the response topic: never taken as a result (a replay names no pending call
            # and is dropped; this one, live, ends its call as an error, not a 5 s wait).
            logger.warning("Device tool {} call {}: the answer was published retained; refused", tool, ref)
            return ToolOutcome(
                f"Error: the device's answer was refused: it was published with the retain flag, "
                f"and a device tool's answer must not be retained ({tool}).",
                "error",
            )
        image = _image_answer(delivery)
        if image is not None and ("outcome", "error") not in delivery.user_properties:
            logger.info("Device tool {} call {} answered with an image ({} bytes)", tool, ref, len(image[0]))
            return ToolOutcome(f"[{image[1]}, {len(image[0])} bytes]", "ok", images=(image,))
        # Bytes that are not UTF-8 become U+FFFD; a long answer is cut on a character boundary.
        content, cut = cut_utf8(delivery.payload, self.max_result_bytes)
        size = len(delivery.payload) if cut else None
        logger.debug("Device tool {} call {} answered: {}", tool, ref, content[:2000])
        if ("outcome", "error") in delivery.user_properties:
            logger.info("Device tool {} call {}: the device reported an error", tool, ref)
            return ToolOutcome(content, "error", size)
        logger.info("Device tool {} call {} answered ({} bytes)", tool, ref, len(delivery.payload))
        return ToolOutcome(content, "ok", size)

    # -- the response topic (on the event loop) ---------------------------------------

    def _on_response(self, delivery: Delivery) -> None:
        correlation = delivery.correlation_data
        waiting = self._pending.get(correlation) if correlation is not None else None
        if waiting is None or waiting.done():
            # Late (its call timed out), for another run's call, or no correlation data at all.
            # A retained answer replayed at a (re)subscription lands here too: its call is long gone.
            logger.debug("Dropping a device answer on {} that no call waits for", delivery.topic)
            return
        waiting.set_result(delivery)
