"""Fakes of the worker's ports, for the tests and the benchmarks: engines, a renderer, an
in-memory transport, a slow store, and a Service on them (``Harness``). Where no real part can
show a behaviour: an engine that fails at a chosen request, a transport whose every publish is
taken at once, an engine that costs nothing under load, a store whose calls wait as long as a
test needs (a real lock wait lasts the busy timeout, and is bench/storelock.py's to measure).

``FakeEngine`` (the tests) records every request and generates one token every 10 ms, so that
cancels, concurrency and scripted deltas can be observed; ``ZeroCostEngine`` (bench/scale.py's
simulated workers) records nothing and answers at once, so that a load run measures the
worker, the broker and the store rather than the fake."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from worker.config.models import WorkerConfig
from worker.core.history import Tools
from worker.core.service import Service
from worker.engine.port import (
    EngineInfo,
    EngineStats,
    EngineTimes,
    GenerationRequest,
    GenerationUpdate,
    ToolSupport,
    VisionInfo,
)
from worker.protocol.messages import log_ref
from worker.session import ChatMessage, SessionHistory
from worker.store.memory import MemoryStore
from worker.store.port import HistoryStore
from worker.tools.port import CallContext, Toolbox, ToolOutcome, WorkerTool
from worker.transport.port import InboundMessage

from .waiting import PATIENCE


class WordRenderer:
    """One token per word; enough for the service's bookkeeping."""

    opens_reasoning = False
    stop_token_ids: tuple[int, ...] = ()

    def render_text(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> str:
        return " ".join(str(m.get("content") or "") for m in messages)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool, tools: Tools = None) -> list[int]:
        words = [w for m in messages for w in (m["role"], *str(m.get("content") or "").split())]
        words += [str(call) for m in messages for call in m.get("tool_calls") or ()]
        words += [str(tool) for tool in tools or ()]
        return [1] * (len(words) + (1 if add_generation_prompt else 0))

    def encode(self, text: str) -> list[int]:
        return [1] * len(text.split())

    def count_text(self, text: str) -> int:
        return len(text.split())

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"w{i} " for i in ids)  # the FakeEngine's words: token id i is "w{i} "

    async def prepare(self, messages: Sequence[ChatMessage], tools: Tools = None) -> None:
        pass

    def remember_reply(self, text: str, ids: Sequence[int]) -> None:
        pass


def mentions(engine_request_id: str, text: str) -> bool:
    """Whether an engine request id names this request key (by its log_ref) or topic part."""
    return text in engine_request_id or log_ref(text) in engine_request_id


def names(key: str, request: GenerationRequest) -> bool:
    """Whether the engine request serves the request with this key (the service puts its
    log_ref in the engine's request id)."""
    return log_ref(key) in request.request_id or key in request.request_id


IMAGE_TOKENS = 64  # what the FakeEngine counts for an image
FAKE_VISION = VisionInfo(image_token_id=7, placeholder=(7,), max_images=8, max_pixels=None)


class FakeEngine:
    """Generates ``w0 w1 ...`` up to the request's max_tokens, a token every 10 ms, ending
    "cancelled" once aborted; raises what ``fail`` names for a request; plays the deltas of
    ``script`` for the request it names. Records what it started and the most it ran at once."""

    def __init__(self, vision: VisionInfo | None = None) -> None:
        # vision: takes images (each placeholder one token, each image IMAGE_TOKENS tokens)
        self.info = EngineInfo(
            "fake", "0", "fake", max_model_len=4096, block_size=16, prefix_caching=True, vision=vision
        )
        self.fail: dict[str, Exception] = {}  # message text -> what generate raises
        self.running = 0
        self.most_running = 0
        self.aborted: set[str] = set()
        self.started: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.script: dict[str, list[str]] = {}  # request id part -> the deltas to produce
        self.script_ids: dict[str, list[int]] = {}  # request id part -> the ids its last delta carries
        # request id part -> the texts of its generations in turn (a tool loop generates again)
        self.rounds: dict[str, list[str]] = {}
        self.before_step: Callable[[str, int], None] | None = None  # called before a scripted delta
        # Tokens per update (with their ids when over 1): vLLM hands a reader that lags behind
        # the engine several steps' tokens in one output.
        self.tokens_per_update = 1
        # request key -> an event its generation waits for before its first token (set it on
        # the worker's loop): a test holds a request running until it has seen what it needs
        # happen meanwhile, instead of counting on the request taking long enough.
        self.holds: dict[str, asyncio.Event] = {}
        # As vLLM with output_kind FINAL_ONLY: a request that is not incremental gets one update
        # at its end (the whole text and ids, an abort's too) with the first token's time.
        self.final_only = False
        # As vLLM with its request stats: the final update of a generation says where its first
        # token waited in the engine (None: the engine says nothing, as without stats).
        self.engine_times: EngineTimes | None = None
        self._aborts: dict[str, asyncio.Event] = {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        updates = self._updates(request)
        if not self.final_only or request.incremental:
            async for update in updates:
                yield update
            return
        texts: list[str] = []
        ids: list[int] = []
        first_token_at: float | None = None
        async for update in updates:
            texts.append(update.delta)
            ids.extend(update.token_ids)
            if first_token_at is None and update.completion_tokens:
                first_token_at = time.monotonic()
            if update.finished:
                yield dataclasses.replace(
                    update, delta="".join(texts), token_ids=tuple(ids), first_token_at=first_token_at
                )

    async def _updates(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        self.started.append(request.request_id)
        self.requests.append(request)
        for text, exc in self.fail.items():
            if names(text, request):
                raise exc
        for text, texts in self.rounds.items():
            if names(text, request) and texts:
                whole = texts.pop(0)
                self.script[text] = [whole[i : i + 7] for i in range(0, len(whole), 7)] or [""]
        for text, deltas in self.script.items():
            if names(text, request):
                for i, delta in enumerate(deltas):
                    if self.before_step:
                        self.before_step(text, i)
                    done = i + 1 == len(deltas)
                    ids = tuple(self.script_ids.get(text, ())) if done else ()
                    yield GenerationUpdate(
                        delta, i + 1, len(request.prompt_token_ids), 0, done, "stop" if done else None, token_ids=ids
                    )
                return
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            for key, hold in self.holds.items():
                if names(key, request):
                    await self._held(hold, request.request_id)
            step, limit = self.tokens_per_update, request.sampling.max_tokens
            for start in range(0, limit, step):
                await asyncio.sleep(0.01)
                if request.request_id in self.aborted:
                    yield GenerationUpdate("", start, len(request.prompt_token_ids), 0, True, "cancelled")
                    return
                ids = tuple(range(start, min(start + step, limit)))
                done = ids[-1] + 1 == limit
                yield GenerationUpdate(
                    "".join(f"w{i} " for i in ids),
                    ids[-1] + 1,
                    len(request.prompt_token_ids) + IMAGE_TOKENS * len(request.images),
                    0,
                    done,
                    "length" if done else None,
                    token_ids=ids if step > 1 else (),
                    image_tokens=IMAGE_TOKENS * len(request.images),
                    engine_times=self.engine_times if done else None,
                )
        finally:
            self.running -= 1

    async def _held(self, hold: asyncio.Event, request_id: str) -> None:
        """Wait for ``hold``, or for the request's abort (a worker that stops aborts what it
        still runs, held or not, as the real engine ends an aborted request at once)."""
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        waits = [asyncio.ensure_future(hold.wait()), asyncio.ensure_future(aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self._aborts.setdefault(request_id, asyncio.Event()).set()

    def take_stats(self) -> EngineStats:
        return EngineStats(max_running=self.most_running)

    def is_alive(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass


class FakeServedEngine(FakeEngine):
    """A FakeEngine with the server's part of the port (warm-up, live stats), for the engine's
    own process (engine/remote.py's tests: ``start_fake_engine``). Its stats' ``extra`` count
    the aborts and warm-ups it took, which a test reads from the worker's side."""

    def __init__(self) -> None:
        super().__init__()
        self.final_only = True
        self.warm_ups = 0
        self.stopped = False

    async def warm_up(self, plan: Any) -> object:
        self.warm_ups += 1
        return {"plan": plan.mode, "warm_ups": self.warm_ups}

    def take_stats(self) -> EngineStats:
        stats = self.peek_stats()
        self.most_running = self.running
        return stats

    def peek_stats(self) -> EngineStats:
        extra = {"aborted": float(len(self.aborted)), "warm_ups": float(self.warm_ups)}
        return EngineStats(running=self.running, max_running=self.most_running, extra=extra)

    async def shutdown(self) -> None:
        self.stopped = True


async def start_fake_engine(fail_start: str | None = None, fail: Sequence[str] = ()) -> FakeServedEngine:
    """An ``EngineStarter`` for engine/remote.py's child (``devtools.fakes:start_fake_engine``):
    ``fail_start`` raises that text as the start's error; a request whose id names one of
    ``fail`` fails with EngineError; one whose id names "die" ends the process at once
    (``os._exit``, as a crashed engine's would)."""
    from worker.engine.port import EngineError

    if fail_start is not None:
        raise RuntimeError(fail_start)
    engine = FakeServedEngine()
    engine.fail = {text: EngineError(f"failed on purpose: {text}") for text in fail}
    generate = engine.generate

    async def generate_or_die(request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        if "die" in request.request_id:
            import os

            os._exit(3)
        async for update in generate(request):
            yield update

    engine.generate = generate_or_die  # type: ignore[method-assign]
    return engine


class MemoryTransport:
    """The transport without a broker: every publish is taken at once and recorded; messages
    are handed in with ``deliver``."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[InboundMessage] = asyncio.Queue()
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.acked: list[int] = []
        self._mid = 0

    def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, correlation_data: bytes | None = None
    ) -> asyncio.Future[None]:
        self.published.append((topic, json.loads(payload)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)  # no broker: taken at once
        return done

    def ack(self, message: InboundMessage) -> None:
        self.acked.append(message.mid)

    def payload_limit(self, topic: str, *, qos: int = 1, correlation_data: bytes | None = None) -> int | None:
        return None  # no broker, no Maximum Packet Size

    def deliver(self, topic: str, payload: Any, mid: int | None = None, *, dup: bool = False) -> int:
        """Hand in a message as the broker would: a new packet id, unless mid is given (with
        dup, a redelivery of that message)."""
        if mid is None:
            self._mid += 1
            mid = self._mid
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.inbox.put_nowait(InboundMessage(topic, data, 1, mid, False, None, None, time.monotonic(), dup=dup))
        return mid

    def replies(self, session: str) -> list[dict[str, Any]]:
        return [p for t, p in self.published if t.endswith(f"/{session}/reply")]


class SlowStore(MemoryStore):
    """The memory store, whose calls for the sessions in ``slow`` hold their thread for
    ``seconds`` first (``time.sleep``: a store waiting for a lock another process holds).
    Records each call (``calls``: method and session, as it starts) and the threads they ran
    on."""

    waits = True  # it does: on the store's thread, as SQLite's calls

    def __init__(self, seconds: float = 1.0) -> None:
        super().__init__()
        self.seconds = seconds
        self.slow: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()
        # Set by a test that holds the slow calls itself: each waits until it is set (or
        # ``seconds`` have passed: a store wrongly on the event loop would hold the test's
        # own loop, which could then never set it). ``waiting``: a slow call is held now.
        self.gate: threading.Event | None = None
        self.waiting = False

    def _enter(self, method: str, session: str) -> None:
        held = session in self.slow and self.gate is not None
        self.waiting = held  # before the call is on record: a test that sees one sees both
        self.calls.append((method, session))
        self.threads.add(threading.get_ident())
        if session in self.slow:
            if self.gate is None:
                time.sleep(self.seconds)
                return
            try:
                self.gate.wait(self.seconds)
            finally:
                self.waiting = False

    def load(self, session: str) -> SessionHistory | None:
        self._enter("load", session)
        return super().load(session)

    def save(self, session: str, history: SessionHistory, key: str, payload: bytes | None) -> bytes | None:
        self._enter("save", session)
        return super().save(session, history, key, payload)

    def reset(self, session: str) -> None:
        self._enter("reset", session)
        super().reset(session)

    def count_delivery(self, session: str, key: str) -> int:
        self._enter("count_delivery", session)
        return super().count_delivery(session, key)

    def uncount_delivery(self, session: str, key: str) -> None:
        self._enter("uncount_delivery", session)
        super().uncount_delivery(session, key)

    def expire(self, idle_seconds: float) -> list[str]:
        self._enter("expire", "")
        return super().expire(idle_seconds)


class Sent:
    """A stand-in for ChatClient.send: records each request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def send(self, message: str | None = None, **fields: Any) -> str:
        self.requests.append({"message": message, **fields})
        return f"r{len(self.requests)}"


class FakeToolbox:
    """The worker's tools without devices: ``tools`` as configured; each call is recorded and
    answered by ``answer`` (a function of name and arguments: its text, or a ToolOutcome),
    after ``delay`` seconds."""

    def __init__(self, *tools: WorkerTool, delay: float = 0.0) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.delay = delay
        self.calls: list[tuple[str, dict[str, Any], CallContext]] = []
        self.running = 0
        self.most_running = 0
        self.answer: Callable[[str, Mapping[str, Any]], str | ToolOutcome] = lambda name, args: f"{name} done"

    def available(self, user: str) -> dict[str, WorkerTool]:
        return {name: tool for name, tool in self.tools.items() if tool.allows(user)}

    def known(self, name: str) -> WorkerTool | None:
        return self.tools.get(name)

    async def call(self, name: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        self.calls.append((name, dict(arguments), context))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        answer = self.answer(name, arguments)
        return answer if isinstance(answer, ToolOutcome) else ToolOutcome(answer)


class Harness:
    """A Service on the FakeEngine, a WordRenderer and a MemoryTransport; ``limits`` as keyword
    arguments; ``toolbox`` and ``tools_section`` ([tools]) for the worker's own tools."""

    def __init__(
        self,
        generation: dict[str, Any] | None = None,
        *,
        store: HistoryStore | None = None,
        history: dict[str, Any] | None = None,
        tools: ToolSupport | None = None,
        toolbox: Toolbox | None = None,
        tools_section: dict[str, Any] | None = None,
        vision: dict[str, Any] | None = None,
        vision_engine: bool = False,
        **limits: Any,
    ) -> None:
        config = WorkerConfig.model_validate(
            {
                "engine": {"model": "fake"},
                "limits": limits,
                "mqtt": {"worker_id": "t"},
                "generation": generation or {},
                "history": history or {},
                "tools": tools_section or {},
                "vision": vision or {},
            }
        )
        self.engine = FakeEngine(FAKE_VISION if vision_engine else None)
        self.transport = MemoryTransport()
        self.stop_codes: list[int] = []
        self.service = Service(
            config,
            self.engine,
            WordRenderer(),
            self.transport,
            self.stop_codes.append,
            store or MemoryStore(),
            tools=tools,
            toolbox=toolbox,
        )

    async def run_until(self, condition: Any, timeout: float = PATIENCE) -> None:
        consumer = asyncio.ensure_future(self.service.consume())
        deadline = time.monotonic() + timeout
        try:
            while not condition():
                assert time.monotonic() < deadline, f"timed out; published: {self.transport.published}"
                await asyncio.sleep(0.01)
        finally:
            consumer.cancel()


class ZeroCostEngine:
    """Answers every request at once: ``reply_tokens`` tokens in ``deltas`` updates, spread
    over ``gen_s`` seconds (0: only yielding to the event loop between updates)."""

    def __init__(self, reply_tokens: int, deltas: int, gen_s: float) -> None:
        self.info = EngineInfo("zero-cost", "0", "zero-cost", max_model_len=1 << 20, block_size=16, prefix_caching=True)
        self.reply_tokens, self.deltas, self.gen_s = reply_tokens, max(1, deltas), gen_s

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        total = min(self.reply_tokens, request.sampling.max_tokens)
        prompt = len(request.prompt_token_ids)
        done_tokens = 0
        for step in range(self.deltas):
            await asyncio.sleep(self.gen_s / self.deltas)
            count = total * (step + 1) // self.deltas - done_tokens
            done_tokens += count
            last = step + 1 == self.deltas
            yield GenerationUpdate("w " * count, done_tokens, prompt, 0, last, "length" if last else None)

    async def abort(self, request_id: str) -> None:
        pass

    def take_stats(self) -> EngineStats:
        return EngineStats()

    def is_alive(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass
