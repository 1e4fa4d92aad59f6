"""What the core needs of the worker's own tools: which tools a user namespace may use, and a
call that always ends in a result. No I/O here.

A provider (device tools, one MCP server, MCP over MQTT) lists its tools and runs their calls;
the toolbox (toolbox.py) puts the providers together. A call never raises for the tool's own
failure (a timeout, a server that is down, an error the tool reports): the model gets a result
that says so, and the turn goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..session import ToolSpec

# ok; error (the tool said so); timeout; unavailable (not reachable, not listed); and, set by
# the core: declined (the user did not approve), unknown (maybe sent before the worker
# stopped: not sent again), skipped (a limit: calls per round, tool time).
Outcome = Literal["ok", "error", "timeout", "unavailable", "declined", "unknown", "skipped"]


@dataclass(frozen=True)
class WorkerTool:
    """A tool the worker runs itself, as offered to the model."""

    name: str  # the name the model calls (an MCP server's tools: <server>_<tool>)
    description: str | None
    parameters: dict[str, Any] | None  # JSON Schema of the arguments; None: no arguments
    users: tuple[str, ...]  # user namespaces that may use it; "*": all
    confirm: bool = False  # the client approves each call first
    timeout: float = 30.0  # seconds one call may take
    source: str = ""  # where it runs, for logs and metrics: "mqtt", "mcp:<server>", "mcp-mqtt:<server>"

    def allows(self, user: str) -> bool:
        return "*" in self.users or user in self.users

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)


@dataclass(frozen=True)
class CallContext:
    """Who a call is for: the devices get the ids as MQTT 5 user properties."""

    request_id: str  # the request key (the client's requestId, or the worker's h-... key)
    tool_call_id: str  # derived from the request key, the round and the index: a dedup key
    session: str  # "<user>/<session>"


@dataclass(frozen=True)
class ToolOutcome:
    """A call's result as the model gets it, and how it ended."""

    content: str
    outcome: Outcome = "ok"

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


class ToolProvider(Protocol):
    """One source of worker tools."""

    name: str  # for logs: "mqtt", "mcp:calc", ...

    def tools(self) -> Sequence[WorkerTool]:
        """The tools it offers now (an MCP server that is down offers what it offered last, or
        nothing if it never answered)."""

    async def call(self, tool: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        """Run one call, within the tool's timeout; never raises but CancelledError."""

    async def start(self) -> None:
        """Connect, list the tools. A server that is down is logged and retried in the
        background: it never stops the worker from starting."""

    async def close(self) -> None: ...

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) whenever the tool list changed."""


class Toolbox(Protocol):
    """The worker's tools as the core uses them (toolbox.py; tests use a fake)."""

    def available(self, user: str) -> dict[str, WorkerTool]:
        """The tools this user namespace may use, by name."""

    def known(self, name: str) -> WorkerTool | None:
        """Any configured or discovered tool of this name, whoever may use it."""

    async def call(self, name: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        """Run one call; never raises but CancelledError. An unknown tool, a tool that
        vanished, or a provider that failed: an error result."""
