"""What the core needs of the worker's own tools: which tools a user namespace may use, and a
call that always ends in a result. No I/O here.

A provider (device tools, one MCP server, MCP over MQTT) lists its tools and runs their calls;
the toolbox (toolbox.py) puts the providers together. A call never raises for the tool's own
failure (a timeout, a server that is down, an error the tool reports): the model gets a result
that says so, and the turn goes on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..config.models import namespace_allowed
from ..session import ToolSpec

# How a worker tool's call ended: ok; error (the tool said so); timeout; unavailable (not
# reachable, not listed); and, set by the core: declined (the user did not approve), unknown
# (maybe sent before the worker stopped: not sent again), skipped (a limit: calls per round,
# tool time).
CallStatus = Literal["ok", "error", "timeout", "unavailable", "declined", "unknown", "skipped"]


# A JSON-RPC error's message as the model gets it, at most (a server's words: bounded like any
# result, and no larger than a reply can list).
MAX_ERROR_CHARS = 1000

_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: str) -> str:
    """Text that encodes as UTF-8: lone surrogates (what a JSON ``"\\ud800"`` escape decodes
    to) become U+FFFD. Any other str is valid Unicode already. The text itself when it has
    none (no copy)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def safe_json(value: Any) -> Any:
    """A parsed JSON value with every string (keys too) made safe_text."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_text(str(k)): safe_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [safe_json(v) for v in value]
    return value


def error_message(message: Any, fallback: str) -> str:
    """A JSON-RPC error's ``message`` as the model may get it: a string, repaired, at most
    MAX_ERROR_CHARS characters; ``fallback`` where it is missing, empty or not a string."""
    if not isinstance(message, str) or not message.strip():
        return fallback
    text = safe_text(message[: MAX_ERROR_CHARS + 1])
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "…"


def cut_utf8(data: str | bytes, limit: int) -> tuple[str, bool]:
    """The longest start of ``data`` that is at most ``limit`` bytes of UTF-8, cut on a
    character boundary, as safe_text; and whether anything was cut. Bytes are decoded with
    invalid sequences as U+FFFD. Costs O(limit), whatever the size of ``data``: a 10 MB
    result is never encoded or decoded whole (each of those holds the GIL for up to 0.2 s
    on a busy CPU)."""
    if isinstance(data, bytes):
        head = data[: limit + 1]
        # A character cut at the limit is left out whole, not turned into U+FFFD.
        text = head[:limit].decode("utf-8", errors="replace") if len(head) <= limit else _cut_bytes(head[:limit])
        return text, len(head) > limit
    # A character is at least one byte: the first ``limit`` characters hold the cut.
    head_text = safe_text(data[:limit])
    encoded = head_text.encode("utf-8")
    if len(encoded) <= limit and len(head_text) == len(data):
        return head_text, False
    return _cut_bytes(encoded[:limit]), True


def _cut_bytes(data: bytes) -> str:
    """UTF-8 bytes cut anywhere, decoded without the character cut at the end (invalid
    sequences elsewhere: U+FFFD)."""
    end = len(data)
    # A cut character: its lead byte within the last 3, and fewer continuation bytes after it than it needs.
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 2 if byte >= 0xC0 else 1
            need = 3 if byte >= 0xE0 else need
            need = 4 if byte >= 0xF0 else need
            if back < need:
                data = data[: end - back]
            break
    return data.decode("utf-8", errors="replace")


def utf8_size(text: str) -> int:
    """How many bytes ``text`` is as UTF-8 (a lone surrogate as U+FFFD's 3), in slices, so a
    thread that counts a large text gives the event loop the GIL in between."""
    if text.isascii():
        return len(text)
    step = 1 << 16
    return sum(len(text[i : i + step].encode("utf-8", errors="surrogatepass")) for i in range(0, len(text), step))


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
        return namespace_allowed(self.users, user)

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
    outcome: CallStatus = "ok"
    # The result's size in bytes where its provider already cut it to max_tool_result_bytes
    # (a device's answer is cut before it is decoded); None: ``content`` is all of it.
    size: int | None = None

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


class Toolbox(Protocol):
    """The worker's tools as the core uses them (toolbox.py; tests use a fake)."""

    def available(self, user: str) -> dict[str, WorkerTool]:
        """The tools this user namespace may use, by name."""

    def known(self, name: str) -> WorkerTool | None:
        """Any configured or discovered tool of this name, whoever may use it."""

    async def call(self, name: str, arguments: Mapping[str, Any], context: CallContext) -> ToolOutcome:
        """Run one call; never raises but CancelledError. An unknown tool, a tool that
        vanished, or a provider that failed: an error result."""
