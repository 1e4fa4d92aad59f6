"""An in-process worker on a real broker: the Service and the real MqttTransport on an asyncio
loop in a thread of the test, generating with devtools.fakes' FakeEngine. For what the broker
decides (delivery, acknowledgements, Receive Maximum, packet sizes, message expiry), where a
vLLM engine would add only minutes of start-up."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from worker.config.models import WorkerConfig
from worker.core.service import Service
from worker.intake.group import Intake
from worker.intake.streams import RedisStreams
from worker.protocol.topics import Topics
from worker.store import open_store
from worker.store.port import HistoryStore
from worker.transport.mqtt import MqttSettings, MqttTransport
from worker.transport.port import InboundMessage

from .fakes import FakeEngine, WordRenderer

T = TypeVar("T")
_ids = itertools.count()


class RecordingTransport(MqttTransport):
    """The real transport, counting connects and recording which messages were acknowledged."""

    def __init__(self, settings: MqttSettings, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(settings, loop)
        self.connects = 0
        self.acked: list[InboundMessage] = []
        self.subscribed = threading.Event()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connects += 1
        super()._on_connect(client, userdata, flags, reason, properties)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        super()._on_subscribe(client, userdata, mid, reasons, properties)
        self.subscribed.set()

    def ack(self, message: InboundMessage) -> None:
        self.acked.append(message)
        super().ack(message)


class LiveWorker:
    """``LiveWorker(port, limits={...})``: config sections as keyword arguments. Its topic
    prefix is its own, so workers sharing a broker never see each other's requests."""

    def __init__(self, port: int, *, engine: FakeEngine | None = None, **sections: dict[str, Any]) -> None:
        n = next(_ids)
        self.prefix = f"live{n}"
        mqtt = {"port": port, "topic_prefix": self.prefix, "worker_id": f"live-worker-{n}", "session_expiry": 0}
        self.config = WorkerConfig.model_validate(
            {"engine": {"model": "fake"}, "stats": {"interval": 0}, **sections, "mqtt": mqtt | sections.get("mqtt", {})}
        )
        self.prefix = self.config.mqtt.topic_prefix  # the service's, where a test gives its own
        self.engine = engine or FakeEngine()
        self.stop_codes: list[int] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self._start())

    async def _start(self) -> None:
        topics = Topics(self.prefix)
        settings = MqttSettings.from_config(self.config, topics, self.config.effective_worker_id)
        self.transport = RecordingTransport(settings, self.loop)
        self.intake: Intake | None = None
        store: HistoryStore | None = None
        if self.config.history.store == "redis":  # a group member on the shared store, as worker/server.py
            redis = self.config.redis
            store = open_store(self.config.history, redis, self.prefix)
            instance = f"{self.config.effective_worker_id}.{next(_ids)}"
            streams = RedisStreams(
                redis.url, self.prefix, instance, worker_lease=redis.worker_lease, owner_lease=redis.owner_lease
            )
            self.intake = Intake(
                streams,
                self.transport,
                topics,
                worker_lease=redis.worker_lease,
                route_to_owner=redis.route_to_owner,
                stop_requested=self.stop_codes.append,
            )
        self.service = Service(
            self.config, self.engine, WordRenderer(), self.intake or self.transport, self.stop_codes.append, store
        )
        if self.intake is not None:
            await self.intake.start()
        self.transport.start()
        await asyncio.wait_for(self.transport.wait_connected(), 10)
        await asyncio.to_thread(self.transport.subscribed.wait, 10)
        self._consumer = asyncio.ensure_future(self.service.consume())

    def call(self, work: Coroutine[Any, Any, T] | Callable[[], T], timeout: float = 30) -> T:
        """Run work (a coroutine, or a function) on the worker's loop; its result."""
        if not asyncio.iscoroutine(work):
            function = work

            async def as_coroutine() -> Any:
                return function()  # type: ignore[operator]

            work = as_coroutine()
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def topic(self, user: str, session: str, kind: str = "request") -> str:
        return f"{self.prefix}/{user}/{session}/{kind}"

    def idle(self) -> bool:
        """Nothing in flight: no task, no session runtime, nothing waiting in the inbox."""
        return self.call(lambda: not self.service._tasks and not self.service._runtime and self.transport.inbox.empty())

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.idle():
            assert time.monotonic() < deadline, "the worker did not become idle"
            time.sleep(0.05)

    def wait_acked(self, count: int, timeout: float = 15) -> list[InboundMessage]:
        """The acknowledged messages once there are count of them (a request is acknowledged
        after its answer's PUBACK, so slightly after the client has the answer)."""
        deadline = time.monotonic() + timeout
        while len(acked := self.call(lambda: list(self.transport.acked))) < count:
            assert time.monotonic() < deadline, f"{len(acked)} of {count} acknowledged"
            time.sleep(0.02)
        return acked

    def close(self) -> None:
        async def stop() -> None:
            self._consumer.cancel()
            if self.intake is not None:
                self.transport.unsubscribe()
            await self.service.drain(1)
            if self.intake is not None:
                await self.intake.close()
            await self.transport.close(2)

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
