"""One bad call is one bad call (issue 30, points 4, 5 and 8) for MCP over MQTT
(worker/tools/mcp_mqtt.py), against the tests' mosquitto and the tiny MCP-over-MQTT server
(devtools/mcp_mqtt_server.py) with its on-demand tools ``fail`` (answers the JSON-RPC error
member it is given) and ``raw`` (publishes the payload it is given): a JSON-RPC error of any
code, a code that is not a number (which used to make the call wait out its timeout, with a
traceback at ERROR), no message, odd data, a huge message, an error that is not an object,
each ends that call as ``error`` with its message, bounded; a healthy call of another session
at the same moment goes on, and the server's tools stay offered. A result with a lone
surrogate escape reaches the model repaired (tests/unit/test_tool_results.py: the turn)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from loguru import logger

from devtools.faulty_mcp import ERRORS
from devtools.mcp_mqtt_server import McpMqttServer
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import transport_on
from devtools.waiting import PATIENCE
from worker.config.models import McpMqttConfig
from worker.tools.mcp_mqtt import McpOverMqtt
from worker.tools.port import CallContext, ToolOutcome

CTX = CallContext("req-1", "req-1:0:0", "alice/s1")
OBJECT = {"type": "object"}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), PATIENCE))


async def eventually(check: Callable[[], bool], what: str, limit: float = PATIENCE) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit:g} s: {what}")
        await asyncio.sleep(0.05)


def test_json_rpc_errors_of_any_shape_end_that_call_only(broker: Mosquitto) -> None:
    suffix = uuid.uuid4().hex[:6]
    server = McpMqttServer(broker.port, f"faulty-{suffix}/box")
    server.tools += [{"name": name, "description": name, "inputSchema": OBJECT} for name in ("fail", "raw")]
    server.start()
    lines: list[tuple[str, str]] = []
    sink = logger.add(lambda m: lines.append((m.record["level"].name, str(m))), level="DEBUG")

    async def scenario() -> None:
        async with transport_on(broker.port) as messaging:
            provider = McpOverMqtt(
                McpMqttConfig(server_filter=f"faulty-{suffix}/#", users=["*"], timeout=20), messaging, f"w-{suffix}"
            )
            await provider.start()
            prefix = f"faulty-{suffix}_box_"
            try:
                await eventually(lambda: any(t.name == prefix + "fail" for t in provider.tools()), "discovered")
                for error, said in ERRORS:
                    # "error", not "timeout": the call ended on its answer, not on its 20 s timeout.
                    outcome = await provider.call(prefix + "fail", {"error": error}, CTX)
                    assert outcome.outcome == "error", (error, outcome)
                    assert said in outcome.content and len(outcome.content) <= 1010, (error, outcome.content[:200])
                # A healthy call at the same moment as a -32000: both end as their own.
                healthy, busy = await asyncio.gather(
                    provider.call(prefix + "add", {"a": 2, "b": 3}, CTX),
                    provider.call(prefix + "fail", {"error": {"code": -32000, "message": "busy"}}, CTX),
                )
                assert (healthy, busy) == (ToolOutcome("5", "ok"), ToolOutcome("Error: busy", "error"))
                # A lone surrogate escape in a result: parsed (Python's json takes it), and the
                # result reaches the turn, which repairs it.
                raw = '{"jsonrpc": "2.0", "id": @ID@, "result": {"content": [{"type": "text", "text": "21 \\ud800C"}]}}'
                surrogate = await provider.call(prefix + "raw", {"payload": raw}, CTX)
                assert surrogate == ToolOutcome("21 \ud800C", "ok")
                # An answer over max_message_bytes (1 MiB here) is not parsed: its call ends now.
                huge = raw.replace("21 \\ud800C", "x" * 2_000_000)
                too_large = await provider.call(prefix + "raw", {"payload": huge}, CTX)
                assert too_large.outcome == "error", too_large.content[:300]  # not its timeout
                assert "over the 1048576 this worker reads" in too_large.content
                assert prefix + "add" in {t.name for t in provider.tools()}  # still offered
                assert await provider.call(prefix + "add", {"a": 1, "b": 1}, CTX) == ToolOutcome("2", "ok")
            finally:
                await provider.close()

    try:
        run(scenario)
    finally:
        logger.remove(sink)
        server.stop()
    above_debug = "\n".join(text for level, text in lines if level != "DEBUG")
    assert "Traceback" not in above_debug and "ERROR" not in above_debug, above_debug[-3000:]
    assert "busy" not in above_debug and "xxxxxxxx" not in above_debug and "a code that is" not in above_debug
