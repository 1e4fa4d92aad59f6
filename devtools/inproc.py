"""An in-process worker on a real broker: the worker's own parts (worker/wiring.py: the real
MqttTransport, in a group on Redis the intake, the store and the Service) on an asyncio loop in
a thread of the test, generating with devtools.fakes' FakeEngine. For what the broker decides
(delivery, acknowledgements, Receive Maximum, packet sizes, message expiry), where a vLLM
engine would add only minutes of start-up. Where the model matters (what reaches its prompt),
a real engine started by the test on a loop of its own, which the worker then shares."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic

from typing_extensions import TypeVar

from worker.config.models import WorkerConfig
from worker.core.history import PromptRenderer
from worker.engine.port import Engine, ToolSupport
from worker.store import open_store
from worker.transport.mqtt import MqttSettings, MqttTransport
from worker.transport.port import InboundMessage
from worker.wiring import wire

from .fakes import FakeEngine, WordRenderer, mentions
from .mqtt_client import Client, Received
from .waiting import PATIENCE, eventually

T = TypeVar("T")
# The worker's engine: the fake one unless a test gives a real one.
E = TypeVar("E", bound=Engine, default=FakeEngine)
_ids = itertools.count()


class RecordingInbox(asyncio.Queue[InboundMessage]):
    """The transport's inbox, keeping a list of every message put in it: what reached the
    worker's loop, in order, each with its arrival time."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[InboundMessage] = []

    def put_nowait(self, item: InboundMessage) -> None:
        self.received.append(item)
        super().put_nowait(item)


class RecordingTransport(MqttTransport):
    """The real transport, counting connects and recording which messages were acknowledged."""

    def __init__(self, settings: MqttSettings, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(settings, loop)
        self.connects = 0
        self.acked: list[InboundMessage] = []
        self.subscribed = threading.Event()
        self.subacks = 0  # one a connect: the broker has the subscriptions again
        self.inbox = RecordingInbox()
        self.received = self.inbox.received

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connects += 1
        super()._on_connect(client, userdata, flags, reason, properties)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        super()._on_subscribe(client, userdata, mid, reasons, properties)
        self.subacks += 1
        self.subscribed.set()

    def ack(self, message: InboundMessage) -> None:
        self.acked.append(message)
        super().ack(message)


class LiveWorker(Generic[E]):
    """``LiveWorker(port, limits={...})``: config sections as keyword arguments. Its topic
        prefix is its own, so workers sharing a broker never see each other's requests. Its
        sessions are in memory unless a test names another store (``history={"store": "redis"}``:
        a member of a group on the shared Redis, with its intake, as a real worker). ``tool_support``: how
        the model calls tools (worker.engine.vllm.tool_support; the fake engine writes the calls'
        markup), for the tool loop with its [tools] section. ``renderer``: the prompt renderer (the
        model's ChatTokenizer where a test measures what tokenizing costs or the model renders
        the prompt; one token a word else). ``loop``: an event loop running in a thread of the
        test, for a real ``engine`` started on it (vLLM's AsyncLLM stays on the loop it
        started on), which the worker then runs on and leaves running when it closes; None: a
    loop of its own."""

    def __init__(
        self,
        port: int,
        *,
        engine: E | None = None,
        tool_support: ToolSupport | None = None,
        renderer: PromptRenderer | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        **sections: dict[str, Any],
    ) -> None:
        n = next(_ids)
        mqtt = {"port": port, "topic_prefix": f"live{n}", "worker_id": f"live-worker-{n}", "session_expiry": 0}
        self.config = WorkerConfig.model_validate(
            {
                "engine": {"model": "fake"},
                "stats": {"interval": 0},
                **sections,
                "mqtt": mqtt | sections.get("mqtt", {}),
                "history": {"store": "memory"} | sections.get("history", {}),
            }
        )
        self.prefix = self.config.mqtt.topic_prefix  # the service's, where a test gives its own
        self.engine: E = engine if engine is not None else FakeEngine()  # type: ignore[assignment]
        self.tool_support = tool_support  # how the model calls tools (None: it does not)
        self.renderer = renderer or WordRenderer()  # the model's tokenizer, where its cost matters
        self.stop_codes: list[int] = []
        self._own_loop = loop is None
        self.loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        if self._own_loop:
            self._thread.start()
        self._resources = contextlib.AsyncExitStack()
        self.closed = False
        self.call(self._start())

    async def _start(self) -> None:
        config = self.config
        store = open_store(config.history, config.redis, self.prefix)
        self._resources.callback(store.close)
        parts = wire(
            config,
            self.engine,
            self.renderer,
            store,
            self.stop_codes.append,
            tools=self.tool_support,
            transport_class=RecordingTransport,
        )
        assert isinstance(parts.transport, RecordingTransport)
        self.transport, self.intake, self.service = parts.transport, parts.intake, parts.service
        await parts.start(self._resources)
        await asyncio.wait_for(self.transport.wait_connected(), PATIENCE)
        await asyncio.to_thread(self.transport.subscribed.wait, PATIENCE)
        self._consumer = asyncio.ensure_future(self.service.consume())

    def call(self, work: Coroutine[Any, Any, T] | Callable[[], T], timeout: float = PATIENCE) -> T:
        """Run work (a coroutine, or a function) on the worker's loop; its result. Once the
        worker on a loop of its own is closed, that loop has stopped and its state is final: a
        function runs here."""
        if not asyncio.iscoroutine(work):
            function = work
            if self.closed and self._own_loop:
                return function()  # type: ignore[operator]

            async def as_coroutine() -> Any:
                return function()  # type: ignore[operator]

            work = as_coroutine()
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def topic(self, user: str, session: str, kind: str = "request") -> str:
        return f"{self.prefix}/{user}/{session}/{kind}"

    def idle(self) -> bool:
        """Nothing in flight: no task, no session runtime, nothing waiting in the inbox (the
        broker's, and in a group the intake's)."""

        def idle() -> bool:
            inboxes = [self.transport.inbox, *([self.intake.inbox] if self.intake is not None else [])]
            return not self.service._tasks and not self.service._runtime and all(i.empty() for i in inboxes)

        return self.call(idle)

    def wait_idle(self, timeout: float = PATIENCE) -> None:
        eventually(self.idle, "the worker did not become idle", timeout)

    def wait_acked(self, count: int, timeout: float = PATIENCE) -> list[InboundMessage]:
        """The acknowledged messages once there are count of them (a request is acknowledged
        after its answer's PUBACK, so slightly after the client has the answer)."""
        acked: list[InboundMessage] = []

        def enough() -> bool:
            acked[:] = self.call(lambda: list(self.transport.acked))
            return len(acked) >= count

        eventually(enough, lambda: f"{len(acked)} of {count} acknowledged", timeout, interval=0.02)
        return acked

    def close(self) -> None:
        """Stopped as the server stops: a group's member unsubscribes, running turns finish
        (up to a second), then the transport closes (offline) and the intake leaves. Once: a
        second call does nothing."""
        if self.closed:
            return
        self.closed = True

        async def stop() -> None:
            self._consumer.cancel()
            if self.intake is not None:
                self.transport.unsubscribe()
            await self.service.drain(1)
            await self._resources.aclose()

        try:
            self.call(stop())
        finally:
            if self._own_loop:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(5)


def settle(
    frontend: Client,
    workers: Sequence[LiveWorker],
    topic: Callable[[str], str],
    *,
    also: Callable[[], bool] = lambda: True,
) -> list[Received]:
    """Stop the workers of a share group once each has handled everything published before,
    and every answer they ever published has reached ``frontend``; the answers it has not
    taken yet (``frontend.received``: none, where each request was answered once and the test
    took each). For "nothing was answered twice" without a pause (the test cannot pick which
    member the broker hands a message to):

    1. Markers (requests in sessions of their own, on ``topic(session)``) one at a time,
       each taken as answered, until every worker has generated one: the broker hands a
       member one publisher's messages in order, and a worker takes its inbox in order (in a
       group on Redis, routes each message before the next), so each has taken in what was
       published before its marker.
    2. Every worker idle, and ``also()`` (in a group on Redis: every stream empty, each entry
       deleted once answered): whatever was taken in has been answered.
    3. Each worker closed: its offline status, the last thing it publishes, reaches
       ``frontend`` (subscribed to ``<prefix>/_worker/+/status``) after everything it
       published before.
    """
    markers: list[str] = []

    def marked(worker: LiveWorker) -> bool:
        return any(mentions(started, marker) for started in list(worker.engine.started) for marker in markers)

    while not all(marked(w) for w in workers):
        assert len(markers) < 50, f"the broker handed {len(markers)} markers to some members only"
        marker = f"m{len(markers):03d}settle"  # none a prefix of another
        markers.append(marker)
        frontend.publish(topic(marker), {"message": "marker", "maxTokens": 1, "requestId": marker})
        frontend.wait_for(lambda m: m.topic.endswith("/reply") and m.json().get("requestId") == marker)  # noqa: B023 (called at once)
    eventually(lambda: all(w.idle() for w in workers) and also(), "the workers did not finish their work")
    for worker in workers:
        status = worker.transport.settings.status_topic
        worker.close()
        frontend.wait_for(lambda m: m.topic == status and m.payload == b"offline")  # noqa: B023 (called at once)
    return frontend.received(lambda m: m.topic.endswith("/reply"))
