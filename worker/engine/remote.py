"""The engine in a process of its own: the port (engine/port.py) over a socket to a child
process that runs the real adapter (engine/remote_host.py), for ``engine.frontend_process``.

Why: vLLM's frontend (``AsyncLLM``: each request's input processing in ``add_request``, the
output handler that decodes the engine core's outputs, detokenizes and hands them to each
request, the stat loggers) runs on the event loop of the process that created it. In the
worker that is the loop that also takes requests in (MQTT, the session, the chat template,
the tokenizer, admission). The two costs add up on one interpreter instead of overlapping: on
one H200 the worker's intake alone took 320 requests in within 0.14-0.18 s, raw AsyncLLM's
``add_request`` alone 0.08-0.13 s, and in a real 320-session burst the worker's requests were
all in vLLM after 0.29-0.39 s, about the sum (docs/performance.md, "Admission"). With the
frontend in a child process the two run on two interpreters, as ``vllm serve`` runs its API
servers apart from the engine core.

The protocol: length-prefixed pickles over a socket pair, between two processes of one
worker (never a network). The worker sends ``generate``, ``abort``, ``call`` (warm-up, stop);
the child sends ``ready``/``failed`` once, then ``updates`` (every request's items since the
last write, one write per pass of its loop: a ``GenerationUpdate``, an ``EngineError``, or
``None`` for the end of a stream), ``stats`` (with updates that end a request, and every
``STATS_INTERVAL`` s), ``result`` (a call's) and ``dead`` (its engine can serve nothing more).
The child dies with the worker (system/children.py); the worker takes the child's end of the
socket, or its exit, as the engine's death: every stream in flight fails with ``EngineDead``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import pickle
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from loguru import logger

from .port import EngineDead, EngineError, EngineInfo, EngineStats, GenerationRequest, GenerationUpdate, WarmupPlan

HEADER = struct.Struct("!I")
# How often the child sends its engine's statistics besides the updates that end a request:
# the gauges (running, waiting, KV cache use) of /metrics and stats are this old at most.
STATS_INTERVAL = 0.25
# How long the worker waits for the child to end after its engine stopped, before it kills it.
EXIT_TIMEOUT = 10.0
# The stop's own bound: vLLM's engine stop (engine/vllm.py ENGINE_STOP_TIMEOUT) and some.
STOP_TIMEOUT = 45.0


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; None at the end of the stream (the other process closed or died)."""
    try:
        size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def merge_stats(latest: EngineStats, max_running: int) -> EngineStats:
    return EngineStats(**{**vars(latest), "max_running": max(max_running, latest.max_running)})


def exit_words(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class EngineProcessFailed(RuntimeError):
    """The engine's process could not start its engine (the child's error, as its text)."""


class RemoteEngine:
    """The port, served by an engine in a child process (``start``)."""

    def __init__(
        self,
        process: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: EngineInfo,
    ) -> None:
        self.info = info
        self._process = process
        self._reader = reader
        self._writer = writer
        self._streams: dict[str, asyncio.Queue[GenerationUpdate | BaseException | None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._stats = EngineStats()
        self._max_running = 0
        self._dead: str | None = None
        self._stopping = False
        self._reading = asyncio.create_task(self._read_forever(), name="engine process reader")

    @classmethod
    async def start(cls, target: Callable[..., None], *args: Any) -> RemoteEngine:
        """Spawn the child, which runs ``target(sock, *args)`` (a function of a module, which
        serves the port on ``sock``: remote_host.serve, as server.engine_process runs it), and
        wait for its engine. Cancelled (a signal during the start), the child is killed; a child
        whose start failed raises ``EngineProcessFailed`` with its reason."""
        ours, theirs = socket.socketpair()
        # From the event loop's thread, never another: the child's death signal comes when the
        # thread that started it exits (system/children.py).
        process = multiprocessing.get_context("spawn").Process(
            target=target, args=(theirs, *args), name="EngineFrontend", daemon=False
        )
        try:
            process.start()
        finally:
            theirs.close()
        logger.info("vLLM's frontend runs in process {} (engine.frontend_process)", process.pid)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            ours.close()
            await _end(process, 0)
            raise
        try:
            first = await read_frame(reader)
        except BaseException:  # cancelled: the start is abandoned
            writer.close()
            await _end(process, 0)
            raise
        if first is None or first[0] != "ready":
            writer.close()
            await _end(process, EXIT_TIMEOUT)
            why = first[1] if first is not None else f"the engine's process ended ({exit_words(process.exitcode)})"
            raise EngineProcessFailed(why)
        return cls(process, reader, writer, first[1])

    # -- the port ----------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        if self._dead is not None:
            raise EngineDead(self._dead)
        rid = request.request_id
        if rid in self._streams:
            raise EngineError(f"request {rid} is running already")
        try:
            message = frame(("generate", request))
        except Exception as exc:  # something in it that cannot cross (pickle): this request only
            raise EngineError(f"the request cannot be handed to the engine's process: {exc}") from exc
        queue: asyncio.Queue[GenerationUpdate | BaseException | None] = asyncio.Queue()
        self._streams[rid] = queue
        self._writer.write(message)
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is None:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
        finally:
            self._streams.pop(rid, None)
            if not ended and self._dead is None:  # the reader stopped early or was cancelled
                self._send(("abort", rid))

    async def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(("abort", request_id))

    def take_stats(self) -> EngineStats:
        snapshot = merge_stats(self._stats, self._max_running)
        self._max_running = self._stats.running
        return snapshot

    def peek_stats(self) -> EngineStats:
        return merge_stats(self._stats, self._max_running)

    def is_alive(self) -> bool:
        return self._dead is None and bool(self._process.is_alive())

    async def warm_up(self, plan: WarmupPlan) -> object:
        return await self._call("warm_up", plan)

    async def shutdown(self) -> None:
        started = time.monotonic()
        self._stopping = True
        if self._dead is None:
            try:
                await asyncio.wait_for(self._call("shutdown"), STOP_TIMEOUT)
            except (EngineError, TimeoutError) as exc:
                logger.warning("The engine's process did not stop its engine ({}): ending it", exc)
        self._writer.close()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        await _end(self._process, EXIT_TIMEOUT)
        self._fail_all("the engine was stopped")
        logger.debug("Engine process ended {:.1f} s after the stop began", time.monotonic() - started)

    # -- the socket ----------------------------------------------------------------------

    def _send(self, message: object) -> None:
        self._writer.write(frame(message))

    async def _call(self, name: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDead(self._dead)
        self._next_call += 1
        call = self._next_call
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        self._send(("call", call, name, args))
        try:
            return await future
        finally:
            self._calls.pop(call, None)

    async def _read_forever(self) -> None:
        while (message := await read_frame(self._reader)) is not None:
            kind = message[0]
            if kind == "updates":
                streams = self._streams
                for rid, item in message[1]:
                    queue = streams.get(rid)
                    if queue is not None:  # else its reader has gone (aborted)
                        queue.put_nowait(item)
            elif kind == "stats":
                self._take(message[1])
            elif kind == "result":
                future = self._calls.get(message[1])
                if future is not None and not future.done():
                    if message[2]:
                        future.set_result(message[3])
                    else:
                        future.set_exception(message[3])
            elif kind == "dead":
                self._die(message[1])
                return
        await asyncio.to_thread(self._process.join, EXIT_TIMEOUT)  # reaped: its exit status
        self._die(f"the engine's process ended ({exit_words(self._process.exitcode)})")

    def _take(self, stats: EngineStats) -> None:
        self._max_running = max(self._max_running, stats.max_running)
        self._stats = stats

    def _die(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            if not self._stopping:
                logger.error("Engine process: {}", why)
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        for queue in self._streams.values():
            queue.put_nowait(EngineDead(why))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(why))


async def _end(process: Any, timeout: float) -> None:
    """Wait up to ``timeout`` for the child to exit, then kill it (and reap it)."""
    await asyncio.to_thread(process.join, timeout)
    if process.is_alive():
        process.kill()
        await asyncio.to_thread(process.join, 5)
