"""A calculator MCP server for the tests and the demo (the MCP SDK's MCPServer, FastMCP in
SDK 1.x): tools add, subtract, multiply, divide (a division by zero is a tool error), slow
(sleeps, for timeouts), pid (its process id, for the restart tests) and enable_extra (adds the
tool power and tells the client so: notifications/tools/list_changed).

    python devtools/calc_mcp.py              # stdio
    python devtools/calc_mcp.py --http PORT  # streamable HTTP on http://127.0.0.1:PORT/mcp

Standalone (no import of the worker): a stdio server gets only the environment the SDK passes
on (PATH, HOME, ... and the config's env), no PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

try:  # SDK 2.x
    from mcp.server.mcpserver import Context
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # SDK 1.x
    from mcp.server.fastmcp import Context  # type: ignore
    from mcp.server.fastmcp import FastMCP as Server  # type: ignore
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore


def build() -> Any:
    # WARNING: not a log line per request on the worker's stderr (where a stdio server's goes).
    server = Server("calc", log_level="WARNING")

    @server.tool(description="Add two numbers.")
    def add(a: float, b: float) -> str:
        return _number(a + b)

    @server.tool(description="Subtract b from a.")
    def subtract(a: float, b: float) -> str:
        return _number(a - b)

    @server.tool(description="Multiply two numbers.")
    def multiply(a: float, b: float) -> str:
        return _number(a * b)

    @server.tool(description="Divide a by b.")
    def divide(a: float, b: float) -> str:
        if b == 0:
            raise ToolError("division by zero")  # the client gets it as the result, isError set
        return _number(a / b)

    @server.tool(description="Wait this many seconds, then answer 'done'.")
    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    @server.tool(description="This server's process id.")
    def pid() -> str:
        return str(os.getpid())

    @server.tool(description="Offer one more tool (power) from now on.")
    async def enable_extra(ctx: Context) -> str:  # type: ignore[type-arg]
        def power(a: float, b: float) -> str:
            """a to the power of b."""
            return _number(a**b)

        server.add_tool(power, name="power", description="a to the power of b.")
        await ctx.session.send_tool_list_changed()
        return "power enabled"

    return server


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    args = parser.parse_args()
    server = build()
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
