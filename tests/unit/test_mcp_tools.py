"""MCP servers as worker tools (worker/tools/mcp.py) against the real calculator server
(devtools/calc_mcp.py), over stdio and streamable HTTP, through the real MCP SDK: listing,
the allow list, results and errors, timeouts, a server killed and restarted, a command that
does not exist, tools/list_changed, and no child process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import pytest
from loguru import logger

from devtools import REPO
from devtools.net import free_port
from devtools.waiting import PATIENCE
from worker.config.models import McpServerConfig
from worker.tools.mcp import McpSdkMissing, McpServerTools
from worker.tools.port import CallContext, ToolOutcome

CALC = [sys.executable, str(REPO / "devtools" / "calc_mcp.py")]
CTX = CallContext("req-1", "req-1:0:0", "alice/s1")


def config(**overrides: Any) -> McpServerConfig:
    base: dict[str, Any] = {"name": "calc", "command": CALC, "allow": ["*"], "users": ["*"]}
    return McpServerConfig(**(base | overrides))


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), PATIENCE))


async def eventually(check: Callable[[], Awaitable[bool]], what: str, limit: float = PATIENCE) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {limit:g} s: {what}")
        await asyncio.sleep(0.1)


def server_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "calc_mcp.py" in " ".join(p.cmdline())]


def test_stdio_listing_call_and_results() -> None:
    async def scenario() -> None:
        tools = McpServerTools(config(users=["alice"], confirm=True, timeout=7))
        await tools.start()
        try:
            offered = {tool.name: tool for tool in tools.tools()}
            assert {"calc_add", "calc_subtract", "calc_multiply", "calc_divide", "calc_slow"} <= set(offered)
            add = offered["calc_add"]
            assert add.description == "Add two numbers."
            assert add.parameters is not None and set(add.parameters["properties"]) == {"a", "b"}
            assert (add.users, add.confirm, add.timeout, add.source) == (("alice",), True, 7.0, "mcp:calc")
            assert await tools.call("calc_add", {"a": 2, "b": 3}, CTX) == ToolOutcome("5", "ok")
            assert await tools.call("calc_multiply", {"a": 2.5, "b": 2}, CTX) == ToolOutcome("5", "ok")
            error = await tools.call("calc_divide", {"a": 1, "b": 0}, CTX)
            assert error.outcome == "error" and "division by zero" in error.content
        finally:
            await tools.close()

    run(scenario)


def test_allow_list_offers_only_those_tools() -> None:
    async def scenario() -> None:
        tools = McpServerTools(config(allow=["add", "divide"]))
        await tools.start()
        try:
            assert sorted(tool.name for tool in tools.tools()) == ["calc_add", "calc_divide"]
            refused = await tools.call("calc_subtract", {"a": 2, "b": 1}, CTX)
            assert refused.outcome == "unavailable"
        finally:
            await tools.close()

    run(scenario)


def test_a_call_past_its_timeout_ends_and_the_server_stays_usable() -> None:
    async def scenario() -> None:
        tools = McpServerTools(config(timeout=1))
        await tools.start()
        try:
            late = await tools.call("calc_slow", {"seconds": 30}, CTX)
            assert late.outcome == "timeout" and "1 s" in late.content
            assert await tools.call("calc_add", {"a": 1, "b": 1}, CTX) == ToolOutcome("2", "ok")
        finally:
            await tools.close()

    run(scenario)


def offers_logged() -> tuple[list[str], int]:
    """The "MCP server ... offers: ..." lines (logged when the offered tools change), and the
    loguru sink that collects them."""
    lines: list[str] = []
    sink = logger.add(
        lambda m: lines.append(m.record["message"]), level="INFO", filter=lambda r: " offers: " in r["message"]
    )
    return lines, sink


def test_a_killed_server_is_unavailable_then_restarted() -> None:
    async def scenario() -> None:
        changes, sink = offers_logged()
        tools = McpServerTools(config(), backoff=(0.2, 1.0), health_interval=0.5)
        await tools.start()
        assert len(changes) == 1 and "calc_add" in changes[0]  # the first listing
        changes.clear()
        try:
            first = await tools.call("calc_pid", {}, CTX)
            assert first.ok
            os.kill(int(first.content), signal.SIGKILL)
            # The next call finds the connection closed (or the ping did first): never a hang.
            down = await asyncio.wait_for(tools.call("calc_add", {"a": 1, "b": 2}, CTX), 20)
            assert down == ToolOutcome("Error: the MCP server calc is not available.", "unavailable")
            assert "calc_add" in {tool.name for tool in tools.tools()}  # what it offered last stays listed

            async def restarted() -> bool:
                again = await tools.call("calc_pid", {}, CTX)
                return again.ok and again.content != first.content

            await eventually(restarted, "the server is started again")
            assert await tools.call("calc_add", {"a": 1, "b": 2}, CTX) == ToolOutcome("3", "ok")
            assert not changes  # the same tools came back: no change to announce
        finally:
            await tools.close()
            logger.remove(sink)

    run(scenario)


def test_a_command_that_does_not_exist_does_not_hold_the_start() -> None:
    async def scenario() -> None:
        # start_wait far above the test's own limit: start() returns at the first failure.
        tools = McpServerTools(config(command=["/nonexistent/mcp-server"]), start_wait=600, backoff=(0.2, 0.5))
        await asyncio.wait_for(tools.start(), 60)
        try:
            assert list(tools.tools()) == []
            missing = await tools.call("calc_add", {"a": 1, "b": 2}, CTX)
            assert missing.outcome == "unavailable"
        finally:
            await tools.close()

    run(scenario)


def test_close_leaves_no_server_process() -> None:
    async def scenario() -> None:
        tools = McpServerTools(config())
        await tools.start()
        pid = int((await tools.call("calc_pid", {}, CTX)).content)
        assert pid in [p.pid for p in server_children()]
        await tools.close()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert server_children() == []
        closed = await tools.call("calc_add", {"a": 1, "b": 2}, CTX)
        assert closed.outcome == "unavailable"

    run(scenario)


def test_tools_list_changed_offers_the_new_tool() -> None:
    async def scenario() -> None:
        tools = McpServerTools(config())
        await tools.start()
        try:
            assert "calc_power" not in {tool.name for tool in tools.tools()}
            assert (await tools.call("calc_enable_extra", {}, CTX)).ok

            async def offered() -> bool:
                return "calc_power" in {tool.name for tool in tools.tools()}

            await eventually(offered, "the new tool is offered", 30)
            assert await tools.call("calc_power", {"a": 2, "b": 10}, CTX) == ToolOutcome("1024", "ok")
        finally:
            await tools.close()

    run(scenario)


@pytest.fixture
def http_server() -> Any:
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([*CALC, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    yield port, start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_streamable_http_round_trip_and_reconnect(http_server: Any) -> None:
    port, start = http_server

    async def scenario() -> None:
        server = start()
        tools = McpServerTools(
            config(command=None, url=f"http://127.0.0.1:{port}/mcp"), backoff=(0.2, 1.0), health_interval=0.5
        )

        async def listed() -> bool:
            return "calc_add" in {tool.name for tool in tools.tools()}

        await tools.start()  # the server may still be starting: the supervisor keeps trying
        try:
            await eventually(listed, "the HTTP server's tools are listed")
            assert await tools.call("calc_add", {"a": 2, "b": 3}, CTX) == ToolOutcome("5", "ok")
            server.kill()
            server.wait(10)

            async def unavailable() -> bool:
                return (await tools.call("calc_add", {"a": 2, "b": 3}, CTX)).outcome == "unavailable"

            await eventually(unavailable, "the stopped HTTP server is unavailable")
            start()

            async def back() -> bool:
                return (await tools.call("calc_add", {"a": 2, "b": 3}, CTX)).ok

            await eventually(back, "the restarted HTTP server is used again")
        finally:
            await tools.close()

    run(scenario)


def test_without_the_sdk_a_configured_server_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an environment without the extra has: ImportError
    with pytest.raises(McpSdkMissing, match=r"pip install -e '\.\[mcp\]'"):
        McpServerTools(config())
