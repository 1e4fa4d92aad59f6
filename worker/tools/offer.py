"""A server's tool list as it is offered (MCP servers, MCP over MQTT): each tool checked at
the boundary, before the model or the grammar backend sees it. No I/O but the log.
``ToolOffer`` is what both MCP providers share: every page of a tools/list, the ``allow`` list,
the checks below, and the name the model calls (``<prefix><tool>``).

- The input schema must be usable as a client tool's parameters are
  (worker/schemacheck.py: valid, only local references that resolve, within the size caps,
  valid Unicode, a JSON object): a tool whose schema is not is left out, with one WARNING
  that names the server and the tool (never the schema, which is the server's text), once
  per server, tool and schema: a server that lists again does not repeat it.
- A name that is not valid Unicode is left out the same way (a call could not name it back).
- A description has its lone surrogates repaired (U+FFFD): it is only shown to the model.

Checking a schema grows with its size, and a server may list thousands of tools: ``screen``
runs in a worker thread (``asyncio.to_thread``), and the verdicts are cached by the schema's
text, so listing again costs a hash.

A tools/list is paged while the server answers a ``nextCursor``, up to MAX_LIST_PAGES pages
and MAX_LISTED_TOOLS tools, and never to a cursor it gave before: a server that pages without
end is offered what it listed until then, with one WARNING that names it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from loguru import logger

from ..protocol.messages import log_text
from ..schemacheck import SchemaUnusable, check_parameters, is_valid_text, valid_text
from .port import WorkerTool

__all__ = [
    "OfferWarnings",
    "Offered",
    "SchemaUnusable",
    "ToolOffer",
    "description",
    "name_part",
    "schema_problem",
    "screen",
]

# How many (server, tool, schema) warnings are remembered: a server that changes its schemas
# without end must not grow the worker's memory without end either.
MAX_WARNED = 10_000
# The longest tool name offered to the model (OpenAI's function names: 64 of [A-Za-z0-9_-]).
MAX_NAME = 64
# How much of a server's tools/list is read: a server that always answers a nextCursor (the
# same one, or a new one each page) would otherwise be paged forever, its tools piling up in
# memory and the server never offered. A request names at most 128 tools (protocol/messages.py
# MAX_TOOLS, OpenAI's limit) and each tool offered is text in every prompt that opts in, so
# 1000 tools of one server is far more than a model can use; 100 pages reads them in pages of
# 10, and each page has its own timeout, so the whole listing is bounded in memory and time.
MAX_LIST_PAGES = 100
MAX_LISTED_TOOLS = 1000

_NOT_NAME = re.compile(r"[^A-Za-z0-9_-]")

# The offered tools of one server: the name the model calls -> (the tool, the server's own name).
Offered = dict[str, tuple[WorkerTool, str]]


def _schema_text(schema: Any) -> str | None:
    # Not ensure_ascii: its escapes would join two lone surrogates ("\ud800" then "\udc00",
    # which a str can hold apart) into one valid character when the verdict reads the text
    # back, and the schema offered as listed would still hold them (found by the property
    # test of any text in a tool list: the chat template's text then failed to encode).
    try:
        return json.dumps(schema, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None


@functools.lru_cache(maxsize=4096)
def _verdict(text: str) -> SchemaUnusable | None:
    try:
        check_parameters(json.loads(text))
    except SchemaUnusable as exc:
        return exc
    except RecursionError:
        return SchemaUnusable("nests too deep")
    return None


def schema_problem(schema: Any) -> SchemaUnusable | None:
    """Why a server's ``inputSchema`` cannot be a tool's parameters (None: it can; a tool
    without one takes no arguments)."""
    if schema is None:
        return None
    if not isinstance(schema, dict):
        return SchemaUnusable("is not a JSON object")
    text = _schema_text(schema)
    if text is None:
        return SchemaUnusable("cannot be read as JSON")
    if not is_valid_text(text):
        return SchemaUnusable("has text that is not valid Unicode")
    return _verdict(text)


def name_problem(name: str) -> SchemaUnusable | None:
    return None if is_valid_text(name) else SchemaUnusable("has a name that is not valid Unicode")


def screen(listed: Sequence[dict[str, Any]]) -> list[SchemaUnusable | None]:
    """Each listed tool's problem (None: it can be offered): its name, then its inputSchema.
    Run off the event loop (asyncio.to_thread): it grows with the schemas' size."""
    return [name_problem(str(item.get("name", ""))) or schema_problem(item.get("inputSchema")) for item in listed]


def description(value: Any) -> str | None:
    """A server's description as the model gets it: text, lone surrogates repaired."""
    return valid_text(value) if isinstance(value, str) else None


class OfferWarnings:
    """One WARNING per server, tool and schema left out."""

    def __init__(self, what: str) -> None:
        self.what = what  # how the log names the servers: "MCP server", "MCP over MQTT: server"
        self._warned: set[tuple[str, str, str]] = set()

    def left_out(self, server: str, tool: str, schema: Any, problem: SchemaUnusable) -> None:
        text = _schema_text(schema) or ""
        key = (server, tool, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
        if key in self._warned:
            return
        if len(self._warned) >= MAX_WARNED:
            self._warned.clear()
        self._warned.add(key)
        subject = "its name" if problem.reason.startswith("has a name") else "its input schema"
        reason = problem.reason.removeprefix("has a name that ") if subject == "its name" else problem.reason
        logger.warning("{} {}: tool {} is not offered: {} {}", self.what, server, log_text(tool), subject, reason)
        logger.debug("{} {}: tool {}: {}", self.what, server, log_text(tool), problem.message)


def name_part(text: str) -> str:
    """``text`` as part of a name the model calls: each character but [A-Za-z0-9_-] is "_"."""
    return _NOT_NAME.sub("_", text)


class OfferConfig(Protocol):
    """What a provider's configuration says about its servers' tools ([[tools.mcp]],
    [tools.mcp_mqtt])."""

    @property
    def allow(self) -> Sequence[str]: ...
    @property
    def users(self) -> Sequence[str]: ...
    @property
    def timeout(self) -> float: ...
    @property
    def confirm(self) -> bool: ...


class ToolOffer:
    """How one MCP provider turns a server's tools/list into the tools it offers: the tools
    ``allow`` names, whose name and schema can be used (``screen``), named ``<prefix><tool>``
    with at most MAX_NAME characters of [A-Za-z0-9_-], no two alike. ``what`` names the
    servers in the log ("MCP server", "MCP over MQTT: server")."""

    def __init__(self, config: OfferConfig, what: str) -> None:
        self.config = config
        self.what = what
        self.warnings = OfferWarnings(what)

    def allowed(self, item: dict[str, Any]) -> bool:
        real = str(item.get("name", ""))
        return bool(real) and ("*" in self.config.allow or real in self.config.allow)

    async def list_all(
        self, server: str, fetch: Callable[[str | None], Awaitable[Any]]
    ) -> tuple[list[dict[str, Any]], list[SchemaUnusable | None]]:
        """Every page of ``server``'s tools/list (``fetch(cursor)``: a page's result as its wire
        JSON; None for the first), within MAX_LIST_PAGES and MAX_LISTED_TOOLS, then the tools
        ``allow`` names and screen's verdicts on them (in a worker thread: it grows with the
        schemas). ValueError: a page that is not a JSON object, or whose tools are not a list."""
        listed: list[dict[str, Any]] = []
        seen: set[bytes] = set()  # the cursors given, hashed: a cursor may be long
        cursor: str | None = None
        pages = 0
        while True:
            page = await fetch(cursor)
            pages += 1
            if not isinstance(page, dict):
                raise ValueError("a tools/list result that is not an object")
            tools = page.get("tools") or []
            if not isinstance(tools, list):
                raise ValueError("a tools/list result whose tools are not a list")
            room = MAX_LISTED_TOOLS - len(listed)
            listed.extend(item for item in tools[:room] if isinstance(item, dict))
            following = page.get("nextCursor")
            key = (
                hashlib.sha256(following.encode("utf-8", "surrogatepass")).digest()
                if isinstance(following, str)
                else b""
            )
            if len(tools) > room:
                stop = f"lists more than {MAX_LISTED_TOOLS} tools"
            elif following is None or following == "":
                break
            elif not isinstance(following, str):
                stop = "answered a nextCursor that is not a string"
            elif key in seen:
                stop = "answered a nextCursor it gave before"
            elif pages >= MAX_LIST_PAGES:
                stop = f"still had more after {MAX_LIST_PAGES} pages"
            else:
                seen.add(key)
                cursor = following
                continue
            # Every page read was a valid answer: what it listed is offered, as after a last
            # page. A failed listing (a page that is not an object, one past its timeout) raises
            # instead, and the provider handles it as a server that cannot be listed (mcp.py
            # connects again; mcp_mqtt.py drops the instance, or keeps the last listing's
            # tools); this server would answer the same pages again: restarted or dropped
            # forever, never offered.
            logger.warning(
                "{} {}: its tools/list {}; only the {} tools listed until then are considered",
                self.what,
                server,
                stop,
                len(listed),
            )
            break
        allowed = [item for item in listed if self.allowed(item)]
        return allowed, await asyncio.to_thread(screen, allowed)

    def offered(
        self,
        server: str,
        prefix: str,
        source: str,
        listed: list[dict[str, Any]],
        problems: list[SchemaUnusable | None] | None = None,
    ) -> Offered:
        """The listed tools that ``allow`` names and whose name and schema can be used, by the
        name the model calls (``problems``: screen's verdicts, computed here, on the allowed
        tools, when not given). ``source``: the tools' WorkerTool.source."""
        config = self.config
        listed = [item for item in listed if self.allowed(item)] if problems is None else listed
        problems = screen(listed) if problems is None else problems
        offered: Offered = {}
        for item, problem in zip(listed, problems, strict=True):
            real = str(item.get("name", ""))
            schema = item.get("inputSchema")
            if problem is not None:
                self.warnings.left_out(server, real, schema, problem)
                continue
            name = prefix + name_part(real)
            if len(name) > MAX_NAME or name in offered:
                logger.warning(
                    "{} {}: tool {} is not offered (name too long or clashing)", self.what, server, log_text(real)
                )
                continue
            offered[name] = (
                WorkerTool(
                    name=name,
                    description=description(item.get("description")),
                    parameters=schema,
                    users=tuple(config.users),
                    confirm=config.confirm,
                    timeout=config.timeout,
                    source=source,
                ),
                real,
            )
        return offered
