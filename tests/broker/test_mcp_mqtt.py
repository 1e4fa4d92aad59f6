"""MCP over MQTT (worker/tools/mcp_mqtt.py) against the tests' real mosquitto and the tiny
MCP-over-MQTT server (devtools/mcp_mqtt_server.py): mosquitto carries the "$mcp-..." topics,
servers are discovered from their retained presence (the filter decides which), their tools
called, withdrawn when the presence is cleared (a clean stop, or the will of a crash), listed
again on tools/list_changed.

The provider uses only the Messaging port; here a small paho adapter implements it (the
worker's MqttTransport does in production)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from loguru import logger

from devtools.mcp_mqtt_server import McpMqttServer
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client, transport_on
from devtools.net import ConnectionRecorder
from devtools.waiting import PATIENCE
from worker.config.models import McpMqttConfig
from worker.tools.mcp_mqtt import McpOverMqtt
from worker.tools.port import CallContext, ToolOutcome

CTX = CallContext("req-1", "req-1:0:0", "alice/s1")


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), PATIENCE))


async def eventually(check: Callable[[], bool], what: str, limit: float = PATIENCE) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit:g} s: {what}")
        await asyncio.sleep(0.05)


def names(provider: McpOverMqtt) -> set[str]:
    return {tool.name for tool in provider.tools()}


def test_mosquitto_carries_dollar_mcp_topics(broker: Mosquitto) -> None:
    """The finding behind topic_root's default: Debian's mosquitto (2.0.11) lets clients publish
    to "$mcp-..." topics, keeps them retained and delivers them to explicit subscriptions;
    filters that start with a wildcard do not match them (MQTT 5, 4.7.2)."""
    topic = f"$mcp-server/presence/probe-{uuid.uuid4().hex[:6]}/demo/x"
    publisher = Client(broker.port, [])
    publisher.publish(topic, b"online", retain=True)
    explicit = Client(broker.port, ["$mcp-server/presence/+/demo/#"])
    wildcard = Client(broker.port, ["#", "+/presence/#"])
    try:
        got = explicit.wait_topic(topic, timeout=10)
        assert (got.payload, got.retain) == (b"online", True)
        publisher.publish(topic, b"", retain=True)  # cleared, as a server's will does it
        assert explicit.wait_topic(topic, timeout=10).payload == b""
        seen = [m.topic for m in list(wildcard.messages.queue)]
        assert not any(t.startswith("$mcp") for t in seen)
    finally:
        for client in (publisher, explicit, wildcard):
            client.close()


def test_discovery_call_and_withdrawal(broker: Mosquitto) -> None:
    suffix = uuid.uuid4().hex[:6]
    room = McpMqttServer(broker.port, f"home-{suffix}/livingroom/thermostat").start()
    other = McpMqttServer(broker.port, f"office-{suffix}/thermostat").start()  # outside the filter

    async def scenario() -> None:
        async with transport_on(broker.port) as messaging:
            # The offered tools changed: logged at INFO ("... offers: ...", "tools of ... withdrawn").
            changes: list[str] = []
            sink = logger.add(
                lambda m: changes.append(m.record["message"]),
                level="INFO",
                filter=lambda r: (
                    f"home-{suffix}/" in r["message"] and ("offers:" in r["message"] or "withdrawn" in r["message"])
                ),
            )
            config = McpMqttConfig(
                server_filter=f"home-{suffix}/#", allow=["get_temperature", "set_temperature"], users=["alice"]
            )
            provider = McpOverMqtt(config, messaging, f"worker-{suffix}")
            await provider.start()
            prefix = f"home-{suffix}_livingroom_thermostat_"
            try:
                await eventually(lambda: bool(provider.tools()), "the server is discovered and its tools listed")
                assert names(provider) == {prefix + "get_temperature", prefix + "set_temperature"}  # allow: no add
                tool = next(t for t in provider.tools() if t.name == prefix + "set_temperature")
                assert tool.parameters is not None and tool.parameters["required"] == ["celsius"]
                assert (tool.users, tool.source) == (("alice",), f"mcp-mqtt:home-{suffix}/livingroom/thermostat")
                assert len(changes) == 1, changes

                done = await provider.call(prefix + "set_temperature", {"celsius": 23.5}, CTX)
                assert done == ToolOutcome("target set to 23.5 °C", "ok")
                assert await provider.call(prefix + "get_temperature", {}, CTX) == ToolOutcome("23.5 °C", "ok")
                refused = await provider.call(prefix + "set_temperature", {"celsius": 99}, CTX)
                assert refused.outcome == "error" and "out of range" in refused.content
                assert room.calls[0] == ("set_temperature", {"celsius": 23.5})
                assert not other.calls and other.clients == set()

                lists = room.lists
                room.add_tool(
                    {"name": "get_humidity", "description": "Humidity, %.", "inputSchema": {"type": "object"}}
                )
                # not in allow: listed again, nothing changes for the model. The call after the
                # list is answered after it, on the same topic: the list has been read by then.
                await eventually(lambda: room.lists > lists, "not listed again")
                assert await provider.call(prefix + "get_temperature", {}, CTX) == ToolOutcome("23.5 °C", "ok")
                assert names(provider) == {prefix + "get_temperature", prefix + "set_temperature"}

                room.stop()  # clears its presence
                await eventually(lambda: not provider.tools(), "the tools are withdrawn")
                assert len(changes) == 2, changes
                gone = await provider.call(prefix + "get_temperature", {}, CTX)
                assert gone.outcome == "unavailable"
            finally:
                await provider.close()
                other.stop()
                logger.remove(sink)

    run(scenario)


def test_a_crashed_server_is_withdrawn_by_its_will_and_list_changed_is_followed(broker: Mosquitto) -> None:
    suffix = uuid.uuid4().hex[:6]
    name = f"lab-{suffix}/calc"
    server = McpMqttServer(broker.port, name).start()

    async def scenario() -> None:
        async with transport_on(broker.port) as messaging:
            provider = McpOverMqtt(
                McpMqttConfig(server_filter=f"lab-{suffix}/+", users=["*"]), messaging, f"w-{suffix}"
            )
            await provider.start()
            prefix = f"lab-{suffix}_calc_"
            try:
                await eventually(lambda: prefix + "add" in names(provider), "the server is discovered")
                assert await provider.call(prefix + "add", {"a": 2, "b": 3}, CTX) == ToolOutcome("5", "ok")

                server.add_tool({"name": "reset", "description": "Reset.", "inputSchema": {"type": "object"}})
                await eventually(lambda: prefix + "reset" in names(provider), "the new tool is offered")
                assert await provider.call(prefix + "reset", {}, CTX) == ToolOutcome("reset done", "ok")

                server.crash()  # no DISCONNECT: the broker sends the will, which clears the presence
                await eventually(lambda: not provider.tools(), "the crashed server's tools are withdrawn")
            finally:
                await provider.close()

    run(scenario)


def test_a_tool_with_a_remote_ref_is_left_out_once_and_nothing_is_fetched(broker: Mosquitto) -> None:
    """Anyone who may publish a presence is an MCP server to the worker (issue 30, point 2): a
    tool whose input schema names a URL (the recorder's, on loopback) is left out with one
    WARNING naming the server and the tool, however often the server lists again; the other
    tools are offered, a lone surrogate in a description arrives repaired, and nothing ever
    connects to the URL."""
    suffix = uuid.uuid4().hex[:6]
    name = f"evil-{suffix}/probe"
    recorder = ConnectionRecorder()
    server = McpMqttServer(broker.port, name)
    remote = {"type": "object", "properties": {"a": {"$ref": recorder.url()}}, "required": ["a"]}
    server.tools = [
        {"name": "fetch", "description": "Fetches.", "inputSchema": remote},
        {"name": "echo", "description": "Echo \ud800 text.", "inputSchema": {"type": "object"}},
    ]
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(str(m)), level="WARNING", format="{message}")
    server.start()

    async def scenario() -> None:
        async with transport_on(broker.port) as messaging:
            provider = McpOverMqtt(McpMqttConfig(server_filter=f"evil-{suffix}/#", users=["*"]), messaging, "w-evil")
            await provider.start()
            prefix = f"evil-{suffix}_probe_"
            try:
                await eventually(lambda: prefix + "echo" in names(provider), "the server is discovered")
                for count in range(3):  # listed again: no second warning
                    server.add_tool({"name": f"extra{count}", "inputSchema": {"type": "object"}})
                    await eventually(lambda c=count: f"{prefix}extra{c}" in names(provider), "listed again")
                assert prefix + "fetch" not in names(provider)
                echo = next(t for t in provider.tools() if t.name == prefix + "echo")
                assert echo.description == "Echo \ufffd text."
            finally:
                await provider.close()

    try:
        run(scenario)
    finally:
        logger.remove(handler)
        server.stop()
        recorder.close()
    left_out = [line for line in lines if "is not offered" in line]
    assert len(left_out) == 1 and name in left_out[0] and "fetch" in left_out[0], lines
    assert recorder.url() not in "".join(lines)
    assert recorder.connections == 0


def test_no_filter_no_discovery(broker: Mosquitto) -> None:
    async def scenario() -> None:
        async with transport_on(broker.port) as messaging:
            provider = McpOverMqtt(McpMqttConfig(), messaging, "w-none")
            await provider.start()
            assert not messaging._watches and list(provider.tools()) == []  # nothing watched
            await provider.close()

    run(scenario)
