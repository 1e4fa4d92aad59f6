"""One bad call is one bad call (issue 30, points 4, 5 and 7), for [[tools.mcp]] servers
(worker/tools/mcp.py) through the real MCP SDK, against devtools/faulty_mcp.py, a stdio
server that answers what the test asks: a JSON-RPC error of any code (-32000, the code the SDK
also gives a closed connection, included), a code that is not a number, no message, odd data,
a huge message, a lone surrogate escape in a result, a line that is not JSON. Each ends that
call as ``error`` with its message, bounded; the server stays up (same process) and another
call to it, running at the same time, goes on. The SDK's own log lines (it logs a line it
cannot parse at ERROR, the line in the exception) carry no server text above DEBUG."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from devtools import REPO
from devtools.faulty_mcp import ERRORS
from worker.config.models import McpServerConfig
from worker.system.logs import InterceptHandler
from worker.tools.mcp import McpServerTools
from worker.tools.port import CallContext, ToolOutcome

FAULTY = [sys.executable, str(REPO / "devtools" / "faulty_mcp.py")]
CTX = CallContext("req-1", "req-1:0:0", "alice/s1")

# (the JSON-RPC error member the server answers, what the model's result must say)


def run(scenario: Any) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 180))


@pytest.fixture
def log() -> Iterator[list[tuple[str, str]]]:
    """(level, text) of every loguru line, the MCP SDK's std logging routed as the worker does."""
    lines: list[tuple[str, str]] = []
    sink = logger.add(
        lambda m: lines.append((m.record["level"].name, f"{m.record['extra'].get('name')}: {m}")), level="DEBUG"
    )
    handler = InterceptHandler()
    saved = {}
    for name in ("mcp", "client"):
        std = logging.getLogger(name)
        saved[name] = (std.handlers, std.propagate, std.level)
        std.handlers, std.propagate = [handler], False
        std.setLevel(logging.DEBUG)
    yield lines
    for name, (handlers, propagate, level) in saved.items():
        std = logging.getLogger(name)
        std.handlers, std.propagate = handlers, propagate
        std.setLevel(level)
    logger.remove(sink)


def test_json_rpc_errors_of_any_shape_end_that_call_only(log: list[tuple[str, str]], tmp_path: Path) -> None:
    async def scenario() -> None:
        tools = McpServerTools(
            McpServerConfig(name="faulty", command=FAULTY, allow=["*"], users=["*"], timeout=20), start_wait=30
        )
        await tools.start()
        try:
            pid = (await tools.call("faulty_pid", {}, CTX)).content
            assert pid.isdigit()
            for error, said in ERRORS:
                # "error", not "timeout": the call ended on its answer, not on its 20 s timeout.
                outcome = await tools.call("faulty_fail", {"error": error}, CTX)
                assert outcome.outcome == "error", (error, outcome)
                assert said in outcome.content and len(outcome.content) <= 1010, (error, outcome.content[:200])
            # A healthy call of another session, running while a call gets -32000: it goes on.
            # The server holds it until the test has its answer to the other.
            started, until = tmp_path / "started", tmp_path / "until"
            slow = asyncio.ensure_future(tools.call("faulty_slow", {"started": str(started), "until": str(until)}, CTX))
            while not started.exists():
                await asyncio.sleep(0.02)
            busy = await tools.call("faulty_fail", {"error": {"code": -32000, "message": "busy"}}, CTX)
            assert busy == ToolOutcome("Error: busy", "error")
            assert not slow.done()
            until.touch()
            assert await slow == ToolOutcome("done", "ok")
            # A lone surrogate escape in a result (pydantic refuses the line; Python's json takes it).
            line = '{"jsonrpc": "2.0", "id": @ID@, "result": {"content": [{"type": "text", "text": "21 \\ud800C"}]}}'
            assert await tools.call("faulty_raw", {"line": line}, CTX) == ToolOutcome("21 \ufffdC", "ok")
            # A line that is no JSON (the server's output, with a marker), then the answer.
            noise = "not json: server-output-7f3a\n" + line
            assert (await tools.call("faulty_raw", {"line": noise}, CTX)).ok
            # The server was never taken for down: the same process answers.
            assert await tools.call("faulty_pid", {}, CTX) == ToolOutcome(pid, "ok")
        finally:
            await tools.close()

    run(scenario)
    above_debug = "\n".join(text for level, text in log if level != "DEBUG")
    assert "is down" not in above_debug
    # The SDK logged the unparsable line (ERROR), without its text; the text only at DEBUG.
    assert any("mcp.client.stdio" in text and level == "ERROR" for level, text in log), above_debug[-3000:]
    assert "server-output-7f3a" not in above_debug and "busy" not in above_debug and "xxxxxxxx" not in above_debug
    assert any("server-output-7f3a" in text for level, text in log if level == "DEBUG")
