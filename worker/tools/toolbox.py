"""The worker's tools put together: the providers the config names, which tools a namespace
may use, and calls that always end in a result.

Names: a device tool is offered under its configured name, an MCP server's tool as
``<server>_<tool>``. Two providers offering the same name: the first configured wins (device
tools, then [[tools.mcp]] in order, then servers discovered over MQTT), and the clash is
logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from loguru import logger

from ..config.models import ToolsConfig
from ..transport.port import Messaging
from .port import CallContext, ToolOutcome, ToolProvider, WorkerTool

# How much longer than a tool's own timeout the toolbox waits for a provider that should
# have answered by then: a provider bug must not hang a turn.
GUARD_SECONDS = 5.0


class WorkerToolbox:
    def __init__(self, providers: Sequence[ToolProvider]) -> None:
        self.providers = list(providers)
        # No change listeners: the tools are read from the providers at every request, so a
        # server's new list is offered from the next one.
        self._clashes: set[str] = set()

    async def start(self) -> None:
        """Start every provider at once; one that fails is logged, never fatal (an MCP server
        that is down is retried by its provider)."""
        results = await asyncio.gather(*(p.start() for p in self.providers), return_exceptions=True)
        for provider, result in zip(self.providers, results, strict=True):
            if isinstance(result, BaseException):
                logger.opt(exception=result).error("Tools of {} could not start", provider.name)
        names = sorted(self._by_name())
        if self.providers:
            logger.info("Worker tools: {} ({})", len(names), ", ".join(names)[:400] or "none yet")

    async def close(self) -> None:
        for provider in reversed(self.providers):
            with contextlib.suppress(Exception):
                await provider.close()

    def _by_name(self) -> dict[str, tuple[WorkerTool, ToolProvider]]:
        out: dict[str, tuple[WorkerTool, ToolProvider]] = {}
        for provider in self.providers:
            for tool in provider.tools():
                if tool.name in out:
                    if tool.name not in self._clashes:
                        self._clashes.add(tool.name)
                        logger.warning(
                            "Two tools are named {}: {}'s is offered, {}'s is not",
                            tool.name,
                            out[tool.name][1].name,
                            provider.name,
                        )
                    continue
                out[tool.name] = (tool, provider)
        return out

    def available(self, user: str) -> dict[str, WorkerTool]:
        return {name: tool for name, (tool, _) in self._by_name().items() if tool.allows(user)}

    def known(self, name: str) -> WorkerTool | None:
        found = self._by_name().get(name)
        return found[0] if found else None

    async def call(self, name: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        found = self._by_name().get(name)
        if found is None:
            return ToolOutcome(f"Error: the tool {name} is not available now.", "unavailable")
        tool, provider = found
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives as the call ends (a stop would then not stop the turn).
            async with asyncio.timeout(tool.timeout + GUARD_SECONDS):
                return await provider.call(name, arguments, context)
        except TimeoutError:
            logger.error("Tool {} of {} did not end within its timeout", name, provider.name)
            return ToolOutcome(f"Error: the tool {name} did not answer within {tool.timeout:g} s.", "timeout")
        except Exception:  # a provider's bug: the turn goes on with an error result
            logger.exception("Tool {} of {} failed", name, provider.name)
            return ToolOutcome(f"Error: the tool {name} failed.", "error")


def build_toolbox(
    config: ToolsConfig, messaging: Messaging, response_topic: str, client_id: str
) -> WorkerToolbox | None:
    """The toolbox of the [tools] section, not started (None: no tools configured). Device tools
    answer on ``response_topic``; ``client_id`` names the worker to MCP servers over MQTT."""
    providers: list[ToolProvider] = []
    if config.mqtt:
        from .mqtt import DeviceTools

        providers.append(
            DeviceTools(config.mqtt, messaging, response_topic, max_result_bytes=config.max_tool_result_bytes)
        )
    if config.mcp:
        from .mcp import McpServerTools

        providers.extend(McpServerTools(server) for server in config.mcp)
    if config.mcp_mqtt.server_filter is not None:
        from .mcp_mqtt import McpOverMqtt

        # A message is read up to 16 results' worth (at least 1 MiB): its JSON is parsed whole.
        largest = max(1 << 20, 16 * config.max_tool_result_bytes)
        providers.append(McpOverMqtt(config.mcp_mqtt, messaging, client_id, max_message_bytes=largest))
    return WorkerToolbox(providers) if providers else None
