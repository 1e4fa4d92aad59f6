"""A server's tool list as it is offered (MCP servers, MCP over MQTT): each tool checked at
the boundary, before the model or the grammar backend sees it. No I/O but the log.

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
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from loguru import logger

from ..protocol.messages import log_text
from ..schemacheck import SchemaUnusable, check_parameters, is_valid_text, valid_text

__all__ = ["OfferWarnings", "SchemaUnusable", "description", "schema_problem", "screen"]

# How many (server, tool, schema) warnings are remembered: a server that changes its schemas
# without end must not grow the worker's memory without end either.
MAX_WARNED = 10_000


def _schema_text(schema: Any) -> str | None:
    try:
        return json.dumps(schema, sort_keys=True, ensure_ascii=True)
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
        key = (server, tool, hashlib.sha256(text.encode()).hexdigest())
        if key in self._warned:
            return
        if len(self._warned) >= MAX_WARNED:
            self._warned.clear()
        self._warned.add(key)
        subject = "its name" if problem.reason.startswith("has a name") else "its input schema"
        reason = problem.reason.removeprefix("has a name that ") if subject == "its name" else problem.reason
        logger.warning("{} {}: tool {} is not offered: {} {}", self.what, server, log_text(tool), subject, reason)
        logger.debug("{} {}: tool {}: {}", self.what, server, log_text(tool), problem.message)
