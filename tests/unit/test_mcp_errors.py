"""One bad call is one bad call (issue 30, points 4, 5 and 7), for [[tools.mcp]] servers
(worker/tools/mcp.py) through the real MCP SDK, against devtools/faulty_mcp.py, a stdio
server that answers what the test asks: a JSON-RPC error of any code (-32000, the code the SDK
also gives a closed connection, included), a code that is not a number, no message, odd data,
a huge message, a lone surrogate escape in a result, a line that is not JSON. Each ends that
call as ``error`` with its message, bounded; the server stays up (same process) and another
call to it, running at the same time, goes on. The SDK's own log lines (it logs a line it
cannot parse at ERROR, the line in the exception) carry no server text above DEBUG.

A server whose tools/list pages without end, through both providers' ToolOffer.list_all, is
offered its first pages. MCP over MQTT (worker/tools/mcp_mqtt.py), against a server the test
plays on a fake Messaging: a result of the wrong shape ends its call as ``error`` saying so; a
message that is not a JSON object or nests too deep is ignored without a traceback, and the
call it answers ends at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loguru import logger

from devtools import REPO
from devtools.faulty_mcp import ERRORS
from devtools.waiting import PATIENCE
from worker.config.models import McpMqttConfig, McpServerConfig
from worker.system.logs import InterceptHandler
from worker.tools import offer
from worker.tools.mcp import McpServerTools
from worker.tools.mcp_mqtt import McpOverMqtt
from worker.tools.offer import ToolOffer
from worker.tools.port import CallContext, ToolOutcome
from worker.transport.port import Delivery


@contextlib.contextmanager
def logged(level: str = "DEBUG", *, levels: bool = True) -> Iterator[list[Any]]:
    """Every log line at ``level`` and above while it is open: (level, text), or the text alone."""
    lines: list[Any] = []
    sink = logger.add(
        lambda m: lines.append((m.record["level"].name, str(m)) if levels else str(m)), level=level, format="{message}"
    )
    try:
        yield lines
    finally:
        logger.remove(sink)


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


def test_a_stdio_server_that_pages_its_tools_without_end_is_offered_the_first_pages(
    log: list[tuple[str, str]],
) -> None:
    """faulty_mcp.py with FAULTY_PAGES=endless answers every tools/list page with a new
    nextCursor: the worker reads offer.MAX_LIST_PAGES pages, offers what they listed, says so
    once, and the server is up and answers calls."""

    async def scenario() -> None:
        tools = McpServerTools(
            McpServerConfig(name="faulty", command=FAULTY, env={"FAULTY_PAGES": "endless"}, allow=["*"], users=["*"]),
            start_wait=PATIENCE,
        )
        await tools.start()
        try:
            names = {tool.name for tool in tools.tools()}
            last = f"faulty_more{offer.MAX_LIST_PAGES - 1}"  # page 1 lists the five tools
            assert {"faulty_pid", "faulty_more1", last} <= names, sorted(names)[:10]
            assert len(names) == 5 + offer.MAX_LIST_PAGES - 1
            assert (await tools.call("faulty_echo", {"text": "hi"}, CTX)) == ToolOutcome("hi", "ok")
        finally:
            await tools.close()

    run(scenario)
    warnings = [text for level, text in log if level == "WARNING"]
    said = f"MCP server faulty: its tools/list still had more after {offer.MAX_LIST_PAGES} pages"
    assert len([text for text in warnings if said in text]) == 1, warnings
    assert not any("is down" in text for text in warnings), warnings


# -- a tools/list without end, both providers' ToolOffer.list_all ---------------------------


def paging(cursors: Callable[[int], Any], per_page: int = 1) -> Callable[[str | None], Awaitable[dict[str, Any]]]:
    """A server's tools/list whose page n (from 1) lists ``per_page`` new tools and answers
    ``cursors(n)`` as its nextCursor."""
    pages = 0

    async def fetch(cursor: str | None) -> dict[str, Any]:
        nonlocal pages
        pages += 1
        tools = [{"name": f"t{pages}_{i}", "inputSchema": {"type": "object"}} for i in range(per_page)]
        return {"tools": tools, "nextCursor": cursors(pages)}

    return fetch


@pytest.mark.parametrize(
    ("cursors", "per_page", "listed", "said"),
    [
        (lambda n: "same", 1, 2, "answered a nextCursor it gave before"),
        (lambda n: "abc"[n % 3], 1, 4, "answered a nextCursor it gave before"),
        (lambda n: f"c{n}", 1, offer.MAX_LIST_PAGES, f"still had more after {offer.MAX_LIST_PAGES} pages"),
        (lambda n: 7, 1, 1, "answered a nextCursor that is not a string"),
        (lambda n: {"next": n}, 1, 1, "answered a nextCursor that is not a string"),
        (lambda n: f"c{n}", 400, offer.MAX_LISTED_TOOLS, f"lists more than {offer.MAX_LISTED_TOOLS} tools"),
        (lambda n: "" if n == 3 else f"c{n}", 1, 3, None),  # an empty cursor ends it as a last page
    ],
)
def test_a_tools_list_that_pages_without_end_is_cut(
    cursors: Callable[[int], Any], per_page: int, listed: int, said: str | None
) -> None:
    """A server that always answers a nextCursor (the same, a cycle, a new one each page, one
    that is not a string, pages past MAX_LISTED_TOOLS) is read no further: what it listed until
    then is offered, with one WARNING naming the server."""

    class Offer:
        allow, users, timeout, confirm = ["*"], ["*"], 5.0, False

    with logged("WARNING", levels=False) as lines:
        allowed, problems = asyncio.run(ToolOffer(Offer(), "MCP server").list_all("calc", paging(cursors, per_page)))
    assert len(allowed) == len(problems) == listed
    assert problems == [None] * listed
    if said is None:
        assert lines == []
    else:
        assert lines == [
            f"MCP server calc: its tools/list {said}; only the {listed} tools listed until then are considered\n"
        ]


# -- MCP over MQTT: messages of any shape ---------------------------------------------------

RPC = "$mcp-rpc/w1/S1/home/x"
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's json parses: RecursionError


class PlayedServer:
    """Messaging on which the test plays one MCP-over-MQTT server, home/x (instance S1): each
    request the provider sends is answered by ``answer(method, params, id)``, the payload the
    server publishes on the RPC topic (None: no answer). Only here: tests/broker has the real
    round trips (tests/broker/test_mcp_mqtt.py); this sends what no real server would."""

    def __init__(self, answer: Callable[[str, dict[str, Any], int], bytes | None]) -> None:
        self.answer = answer
        self.handlers: dict[str, Callable[[Delivery], None]] = {}

    def send(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False, properties: Any = None
    ) -> asyncio.Future[None]:
        message = json.loads(payload)
        if "id" in message and "method" in message:
            reply = self.answer(message["method"], message.get("params") or {}, message["id"])
            if reply is not None:
                asyncio.get_running_loop().call_soon(self.deliver, "rpc", RPC, reply)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def watch(self, topic_filter: str, handler: Callable[[Delivery], None], **_: Any) -> None:
        kind = next(kind for kind in ("presence", "capability", "rpc") if f"{kind}/" in topic_filter)
        self.handlers[kind] = handler

    def unwatch(self, topic_filter: str) -> None:
        pass

    def deliver(self, kind: str, topic: str, payload: bytes) -> None:
        """A message of the server's on a topic the provider watches ("presence", "capability",
        "rpc"), handed over as the transport does (mqtt.py _deliver)."""
        self.handlers[kind](Delivery(topic, payload, False))

    def online(self) -> None:
        online = {"jsonrpc": "2.0", "method": "notifications/server/online", "params": {}}
        self.deliver("presence", "$mcp-server/presence/S1/home/x", json.dumps(online).encode())


def result(request_id: int, value: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": value}).encode()


def played(tools: Callable[[dict[str, Any]], Any], call: Callable[[int], bytes | None]) -> PlayedServer:
    """A server whose tools/list page is ``tools(params)`` and whose every tools/call is
    answered with ``call(id)``."""

    def answer(method: str, params: dict[str, Any], request_id: int) -> bytes | None:
        if method == "initialize":
            return result(request_id, {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}})
        if method == "tools/list":
            return result(request_id, tools(params))
        return call(request_id) if method == "tools/call" else None

    return PlayedServer(answer)


async def discovered(messaging: PlayedServer, timeout: float = PATIENCE) -> McpOverMqtt:
    provider = McpOverMqtt(
        McpMqttConfig(server_filter="home/#", users=["*"], timeout=timeout),
        messaging,  # type: ignore[arg-type]
        "w1",
    )
    await provider.start()
    messaging.online()
    while not provider.tools():
        await asyncio.sleep(0.01)
    return provider


ADD = {"name": "add", "inputSchema": {"type": "object"}}


def test_an_mcp_mqtt_server_that_pages_its_tools_without_end_is_offered_the_first_pages() -> None:
    pages: list[dict[str, Any]] = []

    def tools(params: dict[str, Any]) -> dict[str, Any]:
        pages.append(params)
        return {"tools": [ADD], "nextCursor": "same"}

    async def scenario() -> None:
        provider = await discovered(played(tools, lambda request_id: None))
        assert [tool.name for tool in provider.tools()] == ["home_x_add"]
        await provider.close()

    with logged("WARNING", levels=False) as lines:
        run(scenario)
    assert pages == [{}, {"cursor": "same"}]
    # the second page's add clashes with the first's (logged too): the tools/list line is one
    assert [line for line in lines if "tools/list" in line] == [
        "MCP over MQTT: server home/x: its tools/list answered a nextCursor it gave before;"
        " only the 2 tools listed until then are considered\n"
    ], lines


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"content": "just a string"}, "its content is not a list"),
        ({"content": {"type": "text", "text": "x"}}, "its content is not a list"),
        ({"content": [5]}, "a content item is not a JSON object"),
        ({"content": [{"type": "resource", "resource": "x"}]}, "a resource item's resource is not a JSON object"),
        ({"content": [{"type": "audio", "data": 5}]}, "an audio item's data is not text"),
        ({"content": [{"type": "resource", "resource": {"blob": ["x"]}}]}, "a resource's blob is not text"),
        ("a result that is text", "it is not a JSON object"),
        (None, "it is not a JSON object"),
    ],
)
def test_an_mcp_mqtt_result_of_the_wrong_shape_is_an_error_result(value: Any, said: str) -> None:
    """What a server published as a tools/call result, whatever its shape, ends the call as
    ``error`` saying what is wrong (never the toolbox's "the tool failed" with a traceback);
    the server stays offered."""

    async def scenario() -> None:
        provider = await discovered(played(lambda _: {"tools": [ADD]}, lambda request_id: result(request_id, value)))
        try:
            outcome = await provider.call("home_x_add", {}, CTX)
            assert outcome == ToolOutcome(f"Error: the MCP server's answer is not a valid MCP result: {said}.", "error")
            assert [tool.name for tool in provider.tools()] == ["home_x_add"]
        finally:
            await provider.close()

    with logged() as lines:
        run(scenario)
    assert (
        "WARNING",
        f"MCP over MQTT: home_x_add of home/x answered with a result that is not a valid MCP result ({said})\n",
    ) in lines
    assert not any(level == "ERROR" for level, _ in lines), lines


@pytest.mark.parametrize(
    "answer",
    [
        lambda request_id: f'{{"jsonrpc": "2.0", "id": {request_id}, "result": {DEEP}}}'.encode(),
        lambda request_id: json.dumps([{"jsonrpc": "2.0", "id": request_id, "result": {"content": []}}]).encode(),
        lambda request_id: b'{"jsonrpc": "2.0", "id": %d, "result": {"content": [' % request_id,
    ],
    ids=["nested too deep", "not an object", "not JSON"],
)
def test_an_unreadable_answer_ends_its_call_now(answer: Callable[[int], bytes]) -> None:
    """An answer the provider cannot read as a JSON-RPC message ends the call it names at once,
    as ``error`` (not ``timeout``: the call's timeout is PATIENCE), with a WARNING and no
    traceback; the server stays offered."""

    async def scenario() -> None:
        provider = await discovered(played(lambda _: {"tools": [ADD]}, answer))
        try:
            outcome = await provider.call("home_x_add", {}, CTX)
            said = "Error: the MCP server's answer is not a readable JSON-RPC message"
            assert outcome == ToolOutcome(said, "error")
            assert [tool.name for tool in provider.tools()] == ["home_x_add"]
        finally:
            await provider.close()

    with logged() as lines:
        run(scenario)
    assert ("WARNING", "MCP over MQTT: unreadable message from home/x (S1) ignored\n") in lines
    assert not any(level == "ERROR" for level, _ in lines), lines


@pytest.mark.parametrize("payload", [b"[1]", b"5", b'"text"', DEEP.encode(), b"not json"])
def test_presence_and_capability_messages_of_any_shape_are_ignored(payload: bytes) -> None:
    """A presence or capability message that is not a JSON object (or nests too deep to parse)
    is ignored, logged without a traceback; the server's tools stay offered."""

    async def scenario() -> None:
        messaging = played(lambda _: {"tools": [ADD]}, lambda request_id: result(request_id, {"content": []}))
        provider = await discovered(messaging)
        try:
            messaging.deliver("capability", "$mcp-server/capability/S1/home/x", payload)
            messaging.deliver("presence", "$mcp-server/presence/S2/home/x", payload)
            assert [tool.name for tool in provider.tools()] == ["home_x_add"]
        finally:
            await provider.close()

    with logged() as lines:
        run(scenario)
    assert ("DEBUG", "MCP over MQTT: unreadable capability message from home/x (S1) ignored\n") in lines
    assert ("WARNING", "MCP over MQTT: unreadable presence of home/x (S2) ignored\n") in lines
    assert not any(level == "ERROR" for level, _ in lines), lines
