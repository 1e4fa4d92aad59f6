"""The engine in a process of its own (engine/remote.py): the port served by a real child
process, with a fake engine in it (devtools.fakes:start_fake_engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import pytest
from PIL import Image

from devtools.fakes import IMAGE_TOKENS
from devtools.waiting import PATIENCE
from worker.config.models import WorkerConfig
from worker.engine.port import (
    EngineDead,
    EngineError,
    EngineImage,
    GenerationRequest,
    GenerationUpdate,
    SamplingOptions,
    StructuredOutput,
    WarmupPlan,
)
from worker.engine.remote import EngineProcessFailed, RemoteEngine
from worker.server import ENGINE_PROCESS_TITLE, engine_process, frontend_apart

STARTER = "devtools.fakes:start_fake_engine"


async def start(*args: Any) -> RemoteEngine:
    """The child as the server starts it (server.engine_process), with a fake engine in it."""
    return await RemoteEngine.start(engine_process, STARTER, args, "INFO", False)


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll on the loop (the engine's reader runs on it) until ``condition`` holds."""
    deadline = asyncio.get_running_loop().time() + PATIENCE
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def request(rid: str, tokens: int = 5, *, incremental: bool = True) -> GenerationRequest:
    sampling = SamplingOptions(max_tokens=tokens, temperature=0.0, top_p=1.0)
    return GenerationRequest(rid, [1, 2, 3], sampling, incremental=incremental)


async def collect(engine: RemoteEngine, req: GenerationRequest) -> list[GenerationUpdate]:
    return [update async for update in engine.generate(req)]


def with_engine(test: Callable[[RemoteEngine], Awaitable[None]], *args: Any) -> None:
    async def main() -> None:
        engine = await start(*args)
        try:
            await test(engine)
        finally:
            await engine.shutdown()
        assert not engine.is_alive()

    asyncio.run(main())


def test_streams_come_back_whole_and_at_once() -> None:
    async def check(engine: RemoteEngine) -> None:
        assert engine.info.name == "fake" and engine.is_alive()
        streamed, final = await asyncio.gather(
            collect(engine, request("a", 5)), collect(engine, request("b", 4, incremental=False))
        )
        assert "".join(u.delta for u in streamed) == "w0 w1 w2 w3 w4 "
        assert [u.finished for u in streamed] == [False] * 4 + [True]
        assert streamed[-1].finish_reason == "length" and streamed[-1].completion_tokens == 5
        # Not incremental: one update at the end, with the first token's time from the engine.
        assert len(final) == 1 and final[0].delta == "w0 w1 w2 w3 " and final[0].first_token_at is not None
        assert engine.take_stats().max_running == 2  # the most at once, from the child's counts
        await wait_until(lambda: engine.take_stats().max_running == 0)  # once the child's window moved on

    with_engine(check)


def test_abort_ends_the_stream_cancelled_and_a_dropped_reader_aborts() -> None:
    async def check(engine: RemoteEngine) -> None:
        updates: list[GenerationUpdate] = []
        async for update in engine.generate(request("long", 10_000)):
            updates.append(update)
            if len(updates) == 3:
                await engine.abort("long")
        assert updates[-1].finished and updates[-1].finish_reason == "cancelled"
        assert len(updates) < 100
        stream = engine.generate(request("dropped", 10_000))
        await anext(stream)
        await stream.aclose()  # the service stopped reading: the child's engine is told
        await wait_until(lambda: engine.peek_stats().extra.get("aborted") == 2.0)
        assert (await collect(engine, request("after", 2)))[-1].finish_reason == "length"

    with_engine(check)


def test_a_request_with_images_and_a_schema_crosses_whole() -> None:
    async def check(engine: RemoteEngine) -> None:
        pixels = Image.new("RGB", (48, 32), (200, 10, 10))
        sampling = SamplingOptions(
            max_tokens=3, temperature=0.5, top_p=0.9, stop=("END",), structured=StructuredOutput({"type": "object"})
        )
        req = GenerationRequest("pic", [1, 7, 2], sampling, images=(EngineImage(pixels, "sha"),))
        (final,) = [u async for u in engine.generate(dataclasses.replace(req, incremental=False))]
        assert final.image_tokens == IMAGE_TOKENS and final.prompt_tokens == 3 + IMAGE_TOKENS
        assert final.completion_tokens == 3

    with_engine(check)


def test_a_request_that_cannot_cross_fails_alone() -> None:
    async def check(engine: RemoteEngine) -> None:
        sampling = SamplingOptions(max_tokens=3, temperature=0.5, top_p=0.9)
        req = GenerationRequest("odd", [1, 7, 2], sampling, images=(EngineImage(lambda: None, "sha"),))
        with pytest.raises(EngineError, match="cannot be handed to the engine's process"):
            await collect(engine, req)
        assert (await collect(engine, request("odd", 2)))[-1].finished  # the same id, free again

    with_engine(check)


def test_an_engine_error_reaches_the_reader_and_others_go_on() -> None:
    async def check(engine: RemoteEngine) -> None:
        with pytest.raises(EngineError, match="failed on purpose: bad"):
            await collect(engine, request("bad-1"))
        assert (await collect(engine, request("good", 2)))[-1].finished
        assert engine.is_alive()

    with_engine(check, None, ["bad"])


def test_calls_run_in_the_child() -> None:
    async def check(engine: RemoteEngine) -> None:
        result = await engine.warm_up(WarmupPlan(mode="on", temperature=0.7, top_p=0.9))
        assert result == {"plan": "on", "warm_ups": 1}
        await wait_until(lambda: engine.peek_stats().extra.get("warm_ups") == 1.0)

    with_engine(check)


def test_a_start_that_fails_says_why() -> None:
    async def main() -> None:
        with pytest.raises(EngineProcessFailed, match="no model here"):
            await start("no model here")

    asyncio.run(main())


async def start_with_a_long_request() -> tuple[RemoteEngine, asyncio.Future[list[GenerationUpdate]]]:
    """A child whose engine runs one long request (the child's own count says so)."""
    engine = await start()
    running = asyncio.ensure_future(collect(engine, request("running", 10_000)))
    await wait_until(lambda: engine.peek_stats().running == 1)
    return engine, running


def test_a_dead_engine_process_fails_every_stream_and_the_next() -> None:
    async def main() -> None:
        engine, running = await start_with_a_long_request()
        with pytest.raises(EngineDead):
            await collect(engine, request("die-now"))
        with pytest.raises(EngineDead):
            await running
        assert not engine.is_alive()
        with pytest.raises(EngineDead):
            await collect(engine, request("later"))
        await engine.shutdown()  # after the death: ends quietly

    asyncio.run(main())


def test_a_killed_engine_process_is_noticed() -> None:
    async def main() -> None:
        engine, running = await start_with_a_long_request()
        pid = engine._process.pid
        assert pid is not None
        assert psutil.Process(pid).name() == ENGINE_PROCESS_TITLE  # what ps shows
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="killed by SIGKILL"):
            await running
        assert not engine.is_alive()
        await engine.shutdown()

    asyncio.run(main())


def test_a_cancelled_start_leaves_no_process() -> None:
    async def main() -> None:
        started = asyncio.ensure_future(start())
        await asyncio.sleep(0.05)  # the child spawned, not ready yet
        started.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started

    asyncio.run(main())
    assert not multiprocessing.active_children()


def test_the_frontend_runs_apart_with_a_gpu_unless_told() -> None:
    def config(choice: str) -> WorkerConfig:
        return WorkerConfig.model_validate({"engine": {"model": "m", "frontend_process": choice}})

    assert frontend_apart(config("auto"), gpu=True)
    assert not frontend_apart(config("auto"), gpu=False)
    assert frontend_apart(config("on"), gpu=False)
    assert not frontend_apart(config("off"), gpu=True)
