"""One worker's parts put together: the MQTT transport, the Redis intake in front of it in a
group on the Redis store, the session store and the Service, and the order they start in.

``wire`` builds them and ``Parts.start`` starts them, each close onto an exit stack. The server (worker/server.py), the
in-process worker of the tests (devtools/inproc.py) and the benchmark's simulated workers
(bench/simworkers.py) all build theirs here, so what the tests and the benchmark run is the
worker's own assembly: the intake reads from Redis only as many requests as the service has
room for (``InFlight.room``), the same settings reach the broker, the same start and close order.

Importing this module imports paho (the transport): the server imports it after its broker
check, the other two at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config.models import WorkerConfig
from .core.history import PromptRenderer
from .core.service import InFlight, Service
from .core.turns import ImageDecoder, keep_bytes
from .engine.port import Engine, ToolSupport
from .intake.group import Intake
from .protocol.topics import Topics
from .store.port import HistoryStore
from .tools.mqtt import response_topic_for
from .tools.toolbox import WorkerToolbox, build_toolbox
from .transport.mqtt import MqttSettings, MqttTransport
from .vision.topics import VisionTopics

TOOLS_CONNECT_WAIT = 10.0  # seconds start_tools waits for the broker connection


@dataclass
class Parts:
    """A wired worker: ``service`` reads from ``intake`` where there is one (a group on the Redis
    store), else straight from ``transport``."""

    transport: MqttTransport
    intake: Intake | None
    service: Service
    toolbox: WorkerToolbox | None = None
    vision_topics: VisionTopics | None = None

    async def start(self, resources: contextlib.AsyncExitStack) -> None:
        """``join_group``, ``connect``, then ``start_tools``."""
        await self.join_group(resources)
        self.connect(resources)
        await self.start_tools(resources)

    async def join_group(self, resources: contextlib.AsyncExitStack) -> None:
        """In a group on the Redis store, the intake joins it, before the broker connection:
        requests are routed through Redis from the first one. Its close (it leaves the group)
        goes onto ``resources``. An intake that cannot join closes its Redis connections and
        raises."""
        if self.intake is None:
            return
        try:
            await self.intake.start()
        except BaseException:
            await self.intake.streams.close()  # the connection pool the failed join used
            raise
        resources.push_async_callback(self.intake.close)

    def connect(self, resources: contextlib.AsyncExitStack) -> None:
        """MQTT connects, in the background (paho retries until the broker answers); its close
        (the retained ``offline``, then the disconnect) goes onto ``resources``: closing them
        undoes the start in reverse order, the transport before the intake."""
        self.transport.start()
        resources.push_async_callback(self.transport.close)

    async def start_tools(self, resources: contextlib.AsyncExitStack) -> None:
        """The worker's own tools, once the transport is started: device tools watch their
        response topic, MCP servers are started and listed (a server that is down is retried
        in the background, never a failed start); and the vision topics ([[vision.topics]]),
        where some are configured, are watched for their latest images. Closed before the
        transport."""
        if self.toolbox is None and self.vision_topics is None:
            return
        # Connected first where the broker answers soon: the device tools' response topic and
        # the vision topics are then subscribed at once (else on the connect).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.transport.wait_connected(), TOOLS_CONNECT_WAIT)
        if self.vision_topics is not None:
            vision_topics = self.vision_topics
            resources.callback(vision_topics.close)
            await vision_topics.start()
        if self.toolbox is not None:
            resources.push_async_callback(self.toolbox.close)
            await self.toolbox.start()


def image_decoder(max_pixels: int) -> ImageDecoder:
    """The vision engine's decoder: an image's bytes to its RGB pixels (a PIL image), within
    vision.max_image_pixels (vision/images.py; Pillow is imported only here, for a vision model)."""
    from .vision.images import decode_image

    def decode(data: bytes, where: str) -> Any:
        return decode_image(data, where=where, max_pixels=max_pixels).pixels

    return decode


def wire(
    config: WorkerConfig,
    engine: Engine,
    renderer: PromptRenderer,
    store: HistoryStore,
    stop_requested: Callable[[int], None],
    *,
    tools: ToolSupport | None = None,
    transport_class: type[MqttTransport] = MqttTransport,
    decode_image: ImageDecoder | None = None,
) -> Parts:
    """The parts of one worker on this event loop, not started: the transport from ``config``'s
    [mqtt] section (``transport_class``: a test's subclass that records what it does), the
    intake where ``history.store`` is redis, and the Service on ``store`` (``tools``: how the
    model calls tools; None: it does not). ``stop_requested``:
    how the service and the intake ask the worker to stop (with an exit code). ``decode_image``:
    how an image's bytes become the pixels the engine takes (default: vision/images.py's bounded
    decoder where the engine takes images)."""
    topics = Topics(config.mqtt.topic_prefix)
    worker_id = config.effective_worker_id
    settings = MqttSettings.from_config(config, topics, worker_id)
    transport = transport_class(settings, asyncio.get_running_loop())
    # Made before both: the intake reads the free room of the service it feeds.
    in_flight = InFlight(config.limits.max_pending_requests)
    intake = None
    if config.history.store == "redis":
        instance = f"{worker_id}.{secrets.token_hex(4)}"  # one per start: a restart is a new member
        intake = Intake.for_group(config, transport, topics, instance, stop_requested, in_flight.room)
    # Device tools answer on the worker's own topic; MCP servers on the broker know it by its id.
    toolbox = build_toolbox(config.tools, transport, response_topic_for(topics.prefix, worker_id), worker_id)
    # Watched only where topics are configured (and the model takes images: else every request
    # naming one is refused before its topics are read).
    vision_topics = VisionTopics(config.vision, transport) if config.vision.topics and engine.info.vision else None
    if decode_image is None:
        decode_image = image_decoder(config.vision.max_image_pixels) if engine.info.vision else keep_bytes
    service = Service(
        config,
        engine,
        renderer,
        intake or transport,
        stop_requested,
        store,
        in_flight,
        tools,
        toolbox=toolbox,
        vision_topics=vision_topics,
        decode_image=decode_image,
    )
    return Parts(transport, intake, service, toolbox, vision_topics)
