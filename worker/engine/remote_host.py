"""The child's side of engine/remote.py: the process that runs the engine adapter for the worker
and serves the port over the socket it was handed (the protocol is described there).

One event loop, as in the worker: vLLM's output handler, a task per request reading the
adapter's ``generate``, and the socket. Items of every request go out together, one write per
pass of the loop (``_flush``), so that a step of 1,000 running requests costs one message, not
1,000. The process's entry (server.engine_process) ties its life to the worker's first
(``die_with_parent``): the engine core it starts dies with it in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
from typing import Any

from loguru import logger

from .port import EngineError, GenerationRequest, GenerationUpdate, ServedEngine, describe
from .remote import STATS_INTERVAL, frame, read_frame


def portable(exc: BaseException) -> EngineError:
    """An error as the worker can take it: the port's own errors as they are (they carry only
    their text), any other as an EngineError naming it."""
    return exc if isinstance(exc, EngineError) else EngineError(describe(exc))


async def serve(sock: Any, starter: str, args: tuple[Any, ...]) -> None:
    """On ``sock`` (the child's end of engine/remote.py's socket pair): start the engine
    (``starter``: ``module:function``, an EngineStarter called with
    ``args``), say so to the worker (``ready``, or ``failed`` with the reason), then serve it
    until the worker closes its end."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        module, _, name = starter.partition(":")
        engine: ServedEngine = await getattr(importlib.import_module(module), name)(*args)
    except Exception as exc:
        logger.opt(exception=exc).error("The engine did not start")
        writer.write(frame(("failed", f"the engine did not start: {describe(exc)}")))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        return
    writer.write(frame(("ready", engine.info)))
    await EngineHost(engine, writer).serve(reader)


class EngineHost:
    def __init__(self, engine: ServedEngine, writer: asyncio.StreamWriter) -> None:
        self._engine = engine
        self._writer = writer
        self._outbox: list[tuple[str, GenerationUpdate | EngineError | None]] = []
        self._stats_due = True
        self._stopped = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader) -> None:
        """Until the worker closes its end: after the stop call, or because it died."""
        reporting = asyncio.create_task(self._report_forever(), name="engine stats")
        try:
            while (message := await read_frame(reader)) is not None:
                kind = message[0]
                if kind == "generate":
                    self._spawn(self._generate(message[1]))
                elif kind == "abort":
                    self._spawn(self._engine.abort(message[1]))
                elif kind == "call":
                    self._spawn(self._call(*message[1:]))
        finally:
            reporting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporting
        if not self._stopped:  # the worker is gone without stopping the engine
            logger.warning("The worker closed its connection to the engine's process: stopping the engine")
            await self._engine.shutdown()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _generate(self, request: GenerationRequest) -> None:
        rid = request.request_id
        try:
            async for update in self._engine.generate(request):
                self._emit(rid, update)
        except Exception as exc:
            self._emit(rid, portable(exc))
        else:
            self._emit(rid, None)
        self._stats_due = True  # the request's counters (tokens, cache hits) go with its end

    def _emit(self, rid: str, item: GenerationUpdate | EngineError | None) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((rid, item))

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self._writer.write(frame(("updates", items)))
        if self._stats_due:
            self._send_stats()

    def _send_stats(self) -> None:
        self._stats_due = False
        self._writer.write(frame(("stats", self._engine.take_stats())))

    async def _report_forever(self) -> None:
        while self._engine.is_alive():
            self._send_stats()
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
            await asyncio.sleep(STATS_INTERVAL)
        if not self._stopped:
            self._writer.write(frame(("dead", "the engine died")))

    async def _call(self, call: int, name: str, args: tuple[Any, ...]) -> None:
        value: object = None
        try:
            if name == "warm_up":
                value = await self._engine.warm_up(*args)
                # What the start left is this process's heap for good: out of the collector's
                # reach, as the worker's own (server.freeze_startup_heap).
                gc.collect()
                gc.freeze()
            elif name == "shutdown":
                self._stopped = True
                await self._engine.shutdown()
            else:
                raise EngineError(f"no such call: {name}")
        except Exception as exc:
            self._writer.write(frame(("result", call, False, portable(exc))))
        else:
            self._writer.write(frame(("result", call, True, value)))
