"""MCP over MQTT on the official SDK's ClientSession, as far as bench.mcp_mqtt needs it: the
measurement behind worker/tools/mcp_mqtt.py keeping its own JSON-RPC.

    python -m bench.mcp_mqtt --provider bench.mcp_mqtt_sdk:SdkMcpOverMqtt

The worker's provider with its discovery as it is, and initialize, tools/list and tools/call
through one ClientSession per server instance, over a pair of anyio memory streams: the RPC
topic's messages go into the read stream (validated as the SDK's transports do), a writer
task publishes what the session writes (initialize on the server's control topic, the rest on
the RPC topic, a tools/call with its Message Expiry). Not a provider to ship: no relisting, no
error shapes repaired, no oversize answers refused, no instance handover.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import anyio
from mcp import ClientSession, types
from mcp.shared.message import SessionMessage

from worker.tools import mcp_mqtt
from worker.tools.mcp import _dump, result_outcome
from worker.tools.port import CallContext, ToolOutcome


class SdkMcpOverMqtt(mcp_mqtt.McpOverMqtt):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._links: dict[tuple[str, str], Any] = {}
        self._sessions: dict[str, ClientSession] = {}

    def _on_rpc(self, delivery: Any) -> None:
        parts = delivery.topic.split("/", 3)
        if len(parts) != 4 or mcp_mqtt._from_client(delivery):
            return
        link = self._links.get((parts[3], parts[2]))
        if link is None:
            return
        try:
            message = types.jsonrpc_message_adapter.validate_json(delivery.payload)
        except ValueError:
            return
        link.send_nowait(SessionMessage(message))

    async def _initialize(self, server: Any, instance: str) -> None:
        read_send, read_recv = anyio.create_memory_object_stream[Any](math.inf)
        write_send, write_recv = anyio.create_memory_object_stream[Any](math.inf)
        self._links[(server.name, instance)] = read_send
        control = f"{self._server_root}/{instance}/{server.name}"
        rpc = self._rpc_topic(instance, server.name)

        async def writer() -> None:
            async for item in write_recv:
                data = item.message.model_dump(by_alias=True, mode="json", exclude_unset=True)
                method = data.get("method")
                topic = control if method == "initialize" else rpc
                expiry = self.config.timeout if method == "tools/call" else None
                self._send(topic, data, expiry=expiry)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(writer)
            async with ClientSession(read_recv, write_send) as session:
                await asyncio.wait_for(session.initialize(), mcp_mqtt.INIT_TIMEOUT)
                server.ready = True
                self._sessions[server.name] = session
                await self._list_sdk(server, session)
                await asyncio.Event().wait()

    async def _list_sdk(self, server: Any, session: ClientSession) -> None:
        listed: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = _dump(await asyncio.wait_for(session.list_tools(params=params), mcp_mqtt.LIST_TIMEOUT))
            listed.extend(page.get("tools") or [])
            cursor = page.get("nextCursor")
            if not cursor:
                break
        self._offer(server, listed)

    async def call(self, tool: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        for server in self._servers.values():
            if tool in server.tools:
                break
        else:
            return ToolOutcome("Error: no such tool", "unavailable")
        session = self._sessions[server.name]
        result = await asyncio.wait_for(session.call_tool(server.tools[tool][1], dict(arguments)), self.config.timeout)
        return result_outcome(_dump(result))
